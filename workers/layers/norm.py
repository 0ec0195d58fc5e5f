import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """RMSNorm computed in float32, as HF Llama does; with `residual` it first adds it and returns
    the sum as the next residual (the fused add+norm of a pre-norm block)."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)

    def norm(self, x: torch.Tensor) -> torch.Tensor:
        """torch's fused kernel computes exactly HF's formula in float32; in 16 bits HF rounds the
        normalized row to the activations' dtype before the weight scales it."""
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        return self.weight * F.rms_norm(x.float(), self.weight.shape, None, self.eps).to(x.dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return self.norm(x)
        x = x + residual
        return self.norm(x), x

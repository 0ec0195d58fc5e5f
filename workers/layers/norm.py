import torch
import torch.nn.functional as F
from torch import nn

from kernels import cpu_ops


class RMSNorm(nn.Module):
    """RMSNorm computed in float32, as HF Llama does; with `residual` it first adds it and returns
    the sum as the next residual (the fused add+norm of a pre-norm block)."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)

    def norm(self, x: torch.Tensor) -> torch.Tensor:
        """torch's fused kernel: exactly HF's formula in float32; in 16 bits it computes in float32
        and rounds once, where HF rounds the normalized row before the weight scales it (one op
        instead of four, and closer to float32)."""
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if cpu_ops.takes(x, x.shape[-1]) and self.weight.dtype == torch.bfloat16:   # one native pass: torch's
                                                       # steps, a sum in another order (kernels/cpu_ops.py)
            y, s = cpu_ops.add_rms_norm(x, self.weight, self.eps, residual)
            return y if residual is None else (y, s)
        if residual is None:
            return self.norm(x)
        x = x + residual
        return self.norm(x), x

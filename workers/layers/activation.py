import torch

from kernels import cpu_ops


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """The SwiGLU gate: silu(gate) * up, for x = [gate | up] along the last dimension. Spelled with
    exp, which torch's vector and scalar loops compute alike: F.silu's two loops differ in the last
    bit, and which elements take which depends on the row count and the thread count. In 16 bits the
    SiLU is computed in float32 and rounded once, as torch's (and so HF's) F.silu does."""
    if cpu_ops.takes(x, x.shape[-1] // 2):          # these steps in one native pass (kernels/cpu_ops.py)
        return cpu_ops.silu_mul(x)
    gate, up = x.chunk(2, dim=-1)
    if x.dtype == torch.float32:
        return gate / (1 + torch.exp(-gate)) * up
    gate = gate.float()
    return (gate / (1 + torch.exp(-gate))).to(x.dtype) * up

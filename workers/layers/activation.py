import torch


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """The SwiGLU gate: silu(gate) * up, for x = [gate | up] along the last dimension. Spelled with
    exp, which torch's vector and scalar loops compute alike: F.silu's two loops differ in the last
    bit, and which elements take which depends on the row count and the thread count."""
    gate, up = x.chunk(2, dim=-1)
    return gate / (1 + torch.exp(-gate)) * up

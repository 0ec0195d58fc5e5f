"""The tensor-parallel group every layer is built with.

A size-1 group needs no torch.distributed at all: its collectives are the identity. Larger groups
(NCCL on CUDA, gloo on CPU) come with the tensor-parallel issue; the layers already shard by
`rank`/`size` and call these collectives, so nothing in them changes then.
"""
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True, slots=True)
class TPGroup:
    rank: int = 0
    size: int = 1
    group: object = None  # a torch.distributed ProcessGroup when size > 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenates every rank's shard of the last dimension (on every rank)."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


SINGLE = TPGroup()

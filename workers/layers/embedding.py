"""Vocabulary-parallel embedding and LM head: each rank holds a contiguous slice of the rows."""
import torch
import torch.nn.functional as F
from torch import nn

from kernels import bf16_linear
from workers.distributed import TPGroup
from workers.layers.linear import linear


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, tp: TPGroup):
        super().__init__()
        self.tp, self.vocab_size = tp, vocab_size
        self.rows = -(-vocab_size // tp.size)  # padded so every rank holds the same count
        self.start = tp.rank * self.rows
        self.weight = nn.Parameter(torch.zeros(self.rows, hidden_size), requires_grad=False)
        self.weight.weight_loader = self.load_rows

    def load_rows(self, param: nn.Parameter, loaded, shard_id=None) -> None:
        end = min(self.start + self.rows, self.vocab_size)
        param.data[:end - self.start].copy_(loaded[self.start:end])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.rows)
        y = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(y.masked_fill(outside.unsqueeze(-1), 0))


class ParallelLMHead(VocabParallelEmbedding):
    """Logits for the vocabulary; shares the embedding's weight when the model ties them."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TPGroup):
        super().__init__(vocab_size, hidden_size, tp)
        self.packed_weight = None

    def loader_of(self, unit: int):
        """A quantized weight's parameters split by rows too, whatever their columns hold."""
        return self.load_rows

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """The logits on rank 0 (the sampler's rank); None on the other ranks."""
        if isinstance(self.packed_weight, bf16_linear.Packed):   # float32 logits: their sums, not rounded to
            logits = bf16_linear.linear(hidden, self.packed_weight, dtype=torch.float32)   # bf16's 8 bits
        else:
            logits = linear(hidden, self.weight, None, self.packed_weight)
        logits = self.tp.gather_to_first(logits)
        return None if logits is None else logits[..., :self.vocab_size]

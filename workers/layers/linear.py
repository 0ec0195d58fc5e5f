"""Megatron-style linear layers whose weights load shard by shard.

A weight loader gets `loaded`, anything sliceable with a shape: a torch tensor, or a safetensors
slice that reads from disk only the rows or columns it is asked for, so a rank never holds the
full tensor of a sharded weight.
"""
import torch
import torch.nn.functional as F
from torch import nn

from kernels import bf16_linear
from workers.distributed import TPGroup
from workers.layers import quant


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed) -> torch.Tensor:
    if packed is None:
        return F.linear(x, weight, bias)
    if isinstance(packed, quant.Int8Weight | quant.Int4Weight):
        return quant.linear(x, packed, bias)
    if isinstance(packed, bf16_linear.Packed):
        return bf16_linear.linear(x, packed, bias)
    if x.dtype != torch.float32:
        return in_fixed_calls(x, packed, bias)
    if x.shape[0] == 1:  # oneDNN sums a single row in another order (seen from 2048 inputs): take the 2-row path
        return onednn(x.expand(2, -1), packed, bias)[:1]
    return onednn(x, packed, bias)


def onednn(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


ROWS_PER_CALL = 32


def in_fixed_calls(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """A 16-bit linear as calls of exactly ROWS_PER_CALL rows, the last padded with zeros. oneDNN's
    AMX kernels choose their blocking, and with several threads whether to split the sum over the
    inputs, from the row count: at a fixed count a row's result depends neither on the other rows
    nor on its place among them, nor (1-8 threads, tests/workers/test_batch_invariance.py) on the
    thread count."""
    n = x.shape[0]
    if n % ROWS_PER_CALL:
        x = F.pad(x, (0, 0, 0, -n % ROWS_PER_CALL))
    if len(x) == ROWS_PER_CALL:
        return onednn(x, packed, bias)[:n]
    return torch.cat([onednn(part, packed, bias) for part in x.split(ROWS_PER_CALL)])[:n]


def prepack_for_cpu(model: nn.Module) -> bool:
    """Repacks every linear weight into oneDNN's blocked layout, once, after loading. On CPU this
    is 10-40% faster than MKL's sgemm at the batch sizes the engine runs, and batch-invariant
    (a row's result depends neither on the other rows, nor on its place among them, nor on the
    thread count, once a lone row is doubled: tests/workers/test_batch_invariance.py), which
    sgemm is not. bfloat16 weights go to the AMX kernel (kernels.amx_linear) where the CPU has
    AMX. The plain weights stay
    (a tied embedding reads them), so CPU linear weights take twice their memory. False, changing
    nothing, where oneDNN cannot take a weight. Quantized weights go to their own kernel
    (workers.layers.quant.pack_for_cpu)."""
    quant.pack_for_cpu(model)
    layers = [m for m in model.modules()
              if hasattr(m, "packed_weight") and not isinstance(m.packed_weight, quant.Int8Weight | quant.Int4Weight)]
    if layers and all(m.weight.dtype == torch.bfloat16 for m in layers) and bf16_linear.available():
        for m in layers:
            m.packed_weight = bf16_linear.pack(m.weight)
        return True
    try:
        packed = [torch.ops.mkldnn._reorder_linear_weight(m.weight.detach(), pack_hint(m.weight.dtype))
                  for m in layers]
    except (RuntimeError, AttributeError):
        return False
    for m, p in zip(layers, packed):
        m.packed_weight = p
    return True


PACK_BATCH_HINT = 64


def pack_hint(dtype: torch.dtype) -> int:
    """The row count oneDNN lays the weight out for: the engine's typical batch, or the fixed call size."""
    return PACK_BATCH_HINT if dtype == torch.float32 else ROWS_PER_CALL


def copy_weight(param: torch.Tensor, loaded) -> None:
    """Copies a whole (unsharded) weight, checking its shape."""
    src = loaded if isinstance(loaded, torch.Tensor) else loaded[:]
    assert param.shape == src.shape, f"shape {tuple(src.shape)} where {tuple(param.shape)} was expected"
    param.data.copy_(src)


class ColumnParallelLinear(nn.Module):
    """y = x W^T (+ b), W's rows split across ranks. Packed projections (q/k/v, gate/up) are
    several shards stacked in one weight: `shards` maps a shard id to (rows held by this rank,
    first row of this rank's part in the checkpoint tensor)."""

    def __init__(self, in_features: int, shards: dict, bias: bool, tp: TPGroup):
        super().__init__()
        self.shards, self.tp = shards, tp
        self.offsets, rows = {}, 0
        for shard_id, (n, _) in shards.items():
            self.offsets[shard_id] = rows
            rows += n
        self.weight = nn.Parameter(torch.empty(rows, in_features), requires_grad=False)
        self.weight.weight_loader = self.load_rows
        self.packed_weight = None
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(rows), requires_grad=False)
            self.bias.weight_loader = self.load_rows

    @classmethod
    def split(cls, in_features: int, out_features: int, bias: bool, tp: TPGroup, parts: int = 1):
        """`parts` equal projections of `out_features` rows each, every one split evenly."""
        assert out_features % tp.size == 0, f"{out_features} rows do not split over {tp.size} ranks"
        n = out_features // tp.size
        shards = {i if parts > 1 else None: (n, tp.rank * n) for i in range(parts)}
        return cls(in_features, shards, bias, tp)

    def load_rows(self, param: nn.Parameter, loaded, shard_id=None) -> None:
        n, start = self.shards[shard_id]
        offset = self.offsets[shard_id]
        param.data[offset:offset + n].copy_(loaded[start:start + n])

    def loader_of(self, unit: int):
        """A quantized weight's parameters split by rows too, whatever their columns hold."""
        return self.load_rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.packed_weight)


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_r W_r^T) + b: W's columns split across ranks, bias added once."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup):
        super().__init__()
        assert in_features % tp.size == 0, f"{in_features} columns do not split over {tp.size} ranks"
        self.tp, self.cols = tp, in_features // tp.size
        self.weight = nn.Parameter(torch.empty(out_features, self.cols), requires_grad=False)
        self.weight.weight_loader = self.load_cols
        self.packed_weight = None
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            self.bias.weight_loader = lambda param, loaded, shard_id=None: copy_weight(param, loaded)

    def load_cols(self, param: nn.Parameter, loaded, shard_id=None) -> None:
        start = self.tp.rank * self.cols
        param.data.copy_(loaded[:, start:start + self.cols])

    def loader_of(self, unit: int):
        """The weight loader of a quantized weight's parameter that holds a column per `unit` inputs
        (two 4-bit codes a byte, a scale per group): a rank's inputs must be whole units."""
        if self.cols % unit:
            raise ValueError(f"quantization: tensor_parallel_size={self.tp.size} leaves each rank {self.cols} of "
                             f"a row-parallel layer's inputs, which cuts its groups of {unit} (a group is never split)")

        def load(param: nn.Parameter, loaded, shard_id=None) -> None:
            start = self.tp.rank * self.cols // unit
            param.data.copy_(loaded[:, start:start + self.cols // unit])
        return load

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = linear(x, self.weight, self.bias if self.tp.rank == 0 else None, self.packed_weight)
        return self.tp.all_reduce(y)

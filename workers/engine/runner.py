"""Runs one step's batch through the model: flattens every scheduled token into one varlen batch
(positions, slot mapping, block tables, cu_seqlens), runs the model once, computes logits only
for the requests that sample this step, and samples them."""
import itertools
import os
import time
from dataclasses import dataclass
from types import ModuleType

import torch

import kernels.cpu
import kernels.reference
from workers.distributed import SINGLE, STEP, TPGroup
from workers.engine.request import TokenLogprobs
from workers.engine.sampler import Sampler
from workers.engine.scheduler import Batch
from workers.layers.attention import AttentionMetadata
from workers.layers.linear import prepack_for_cpu
from workers.models.config import ModelConfig
from workers.models.llama import CausalLM
from workers.models.loader import load_weights


def attention_kernels(device: torch.device) -> ModuleType:
    """Triton kernels on CUDA; on CPU the native paged attention, unless TOKENBUS_CPU_ATTENTION is
    `reference` or it cannot be built (logged); the PyTorch reference otherwise."""
    if device.type == "cuda":
        try:
            import kernels.triton as triton_kernels
            return triton_kernels
        except ImportError:
            pass
    if device.type == "cpu" and os.environ.get("TOKENBUS_CPU_ATTENTION") != "reference" and kernels.cpu.available():
        return kernels.cpu
    return kernels.reference


class ModelRunner:
    def __init__(self, model_dir: str, cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
                 block_size: int, tp: TPGroup = SINGLE, kv_cache_dtype: str = "auto"):
        self.tp = tp
        self.cfg, self.dtype, self.device, self.block_size = cfg, dtype, device, block_size
        self.kv_dtype = kernels.reference.KV_CACHE_DTYPES.get(kv_cache_dtype, dtype)  # the pool's element
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            with torch.device(device):
                self.model = CausalLM(cfg, tp).eval()
        finally:
            torch.set_default_dtype(default_dtype)
        load_weights(self.model, model_dir)
        if device.type == "cpu":
            prepack_for_cpu(self.model)
        self.kernels = attention_kernels(device)
        attn = self.model.attention_layers()[0]
        self.heads = attn.num_heads, attn.num_kv_heads    # this rank's: the attention plan's tiles follow them
        self.sampler = Sampler()
        self.kv_pool = torch.empty(0)
        self.num_blocks = 0
        self.rank_bytes: list[list[int]] = []  # [parameter bytes, KV pool bytes] of every rank, in rank order
        self.forward_seconds = 0.0  # time inside the model forward and logits, for the benchmark

    def block_bytes(self) -> int:
        """Bytes of KV one block takes on this rank, over all layers."""
        attn = self.model.attention_layers()[0]
        per_token = 2 * attn.num_kv_heads * self.kv_row() * self.kv_dtype.itemsize
        return per_token * self.block_size * self.cfg.num_layers

    def kv_row(self) -> int:
        """Elements of one token's K (or V) under one KV head: the head dim, and a quantized row's scale."""
        head_dim = self.model.attention_layers()[0].head_dim
        return head_dim + kernels.reference.SCALE_SIZE if self.kv_dtype in kernels.reference.QMAX else head_dim

    def parameter_bytes(self) -> int:
        return sum(p.nbytes for p in self.model.parameters())

    def allocate_kv(self, num_blocks: int) -> None:
        """One preallocated tensor [2, layers, blocks, block_size, Hkv, D] (D + 2 for a quantized pool: each
        row ends with its scale, see kernels.reference.quantize_kv); each layer gets views."""
        layers = self.model.attention_layers()
        shape = (2, len(layers), num_blocks, self.block_size, layers[0].num_kv_heads, self.kv_row())
        self.kv_pool = torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
        self.num_blocks = num_blocks
        for i, attn in enumerate(layers):
            attn.kernels, attn.k_cache, attn.v_cache = self.kernels, self.kv_pool[0, i], self.kv_pool[1, i]

    def read_blocks(self, block_ids: list[int], layers: range) -> torch.Tensor:
        """The KV of these blocks for these layers, [2, layers, blocks, block_size, Hkv, D], contiguous on the CPU,
        in the pool's dtype; a quantized pool's rows carry their scales (D + 2)."""
        ids = torch.tensor(block_ids, dtype=torch.long, device=self.kv_pool.device)
        return self.kv_pool[:, layers.start:layers.stop].index_select(2, ids).cpu().contiguous()

    def write_blocks(self, block_ids: list[int], layers: range, kv: torch.Tensor) -> None:
        """Writes KV read by read_blocks (on another worker) into these blocks."""
        if kv.dtype != self.kv_pool.dtype or kv.shape[3:] != self.kv_pool.shape[3:]:
            raise ValueError(f"KV of {kv.dtype} {list(kv.shape[3:])} does not fit this pool's "
                             f"{self.kv_pool.dtype} {list(self.kv_pool.shape[3:])}")
        ids = torch.tensor(block_ids, dtype=torch.long, device=self.kv_pool.device)
        pool = kernels.reference.as_bytes(self.kv_pool)
        pool[:, layers.start:layers.stop].index_copy_(2, ids, kernels.reference.as_bytes(kv).to(pool.device))

    def prepare(self, batch: Batch, block_tables: list[list[int]]) -> "StepInputs":
        """The flattened batch, on the CPU."""
        input_ids, q_lens, starts = [], batch.num_new_tokens, []
        for req, n, drafts in zip(batch.requests, q_lens, batch.drafts):
            start = req.num_computed_tokens
            input_ids.extend(req.token_ids[start:start + n - len(drafts)])
            input_ids.extend(drafts)
            starts.append(start)
        width = max(map(len, block_tables))
        tables = torch.tensor([t + [0] * (width - len(t)) for t in block_tables], dtype=torch.int32)
        q_lens_t = torch.tensor(q_lens, dtype=torch.int32)
        cu = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
        torch.cumsum(q_lens_t, 0, out=cu[1:])
        row = torch.repeat_interleave(torch.arange(len(q_lens)), q_lens_t)
        positions = torch.arange(len(input_ids)) - cu[row] + torch.tensor(starts)[row]
        slots = tables[row, positions // self.block_size].long() * self.block_size + positions % self.block_size
        seq_lens = q_lens_t + torch.tensor(starts, dtype=torch.int32)
        ends = itertools.accumulate(q_lens)   # each sampling request's last token, and each of its drafts:
        logit_rows = torch.tensor([row for end, samples, drafts in zip(ends, batch.samples, batch.drafts) if samples
                                   for row in range(end - 1 - len(drafts), end)], dtype=torch.long)
        copies = torch.tensor(batch.block_copies, dtype=torch.long).view(-1, 2)
        return StepInputs(torch.tensor(input_ids), positions, slots, cu, seq_lens, tables, logit_rows, copies)

    @torch.inference_mode()
    def run(self, batch: Batch, block_tables: list[list[int]]
            ) -> tuple[list[list[int]], list[list[TokenLogprobs | None]]]:
        """Rank 0: for each request of the batch that samples this step, its tokens (and logprobs): the
        one after its last token and, when it verifies drafts, the one after each draft, each sampled
        as if the drafts before it were the request's own tokens."""
        inputs = self.prepare(batch, block_tables)
        if self.tp.size > 1:
            self.tp.send_step(inputs.header(), inputs.pack())
        logits = self.execute(inputs)
        if logits is None:
            return [], []
        rows, sizes = [], []
        for req, samples, drafts in zip(batch.requests, batch.samples, batch.drafts):
            if samples:
                rows += [req] + [Ahead(req, drafts[:j]) for j in range(1, len(drafts) + 1)]
                sizes.append(len(drafts) + 1)
        tokens, logprobs = self.sampler(logits, rows)
        return split(tokens, sizes), split(logprobs, sizes)

    @torch.inference_mode()
    def execute(self, inputs: "StepInputs") -> torch.Tensor | None:
        """Every rank: the model over one step's inputs. Returns the sampling rows' logits on rank 0
        (None when no request samples, and on the other ranks)."""
        to = self.device
        if inputs.block_copies.numel():           # forked requests' partial blocks, before anything writes them
            src, dst = inputs.block_copies.to(to).unbind(1)
            pool = kernels.reference.as_bytes(self.kv_pool)   # a quantized row's scale travels with it
            pool[:, :, dst] = pool[:, :, src]
        plan = self.kernels.plan_attention(inputs.cu_seqlens_q, inputs.seq_lens, inputs.block_tables, self.block_size,
                                           *self.heads)
        meta = AttentionMetadata(inputs.slot_mapping, inputs.cu_seqlens_q, inputs.seq_lens, inputs.block_tables,
                                 plan).to(to)
        start = time.perf_counter()
        hidden = self.model(inputs.input_ids.to(to, non_blocking=True), inputs.positions.to(to, non_blocking=True),
                            meta)
        logits = None
        if inputs.logit_rows.numel():
            logits = self.model.compute_logits(hidden[inputs.logit_rows.to(to, non_blocking=True)])
        if to.type == "cuda":
            torch.cuda.synchronize()
        self.forward_seconds += time.perf_counter() - start
        return logits

    def follow(self) -> None:
        """A follower's life: run every step rank 0 sends, until it says stop."""
        while (step := self.tp.recv_step()) is not None:
            self.execute(StepInputs.unpack(*step))


class Ahead:
    """A request as it would be with `extra` tokens after its own (a draft's row of a verify step): what
    the sampler reads, so the row is sampled exactly as the request would be once they are its own."""
    __slots__ = ("extra", "req")

    def __init__(self, req, extra: list[int]):
        self.req, self.extra = req, extra

    @property
    def params(self):
        return self.req.params

    @property
    def seed(self) -> int:
        return self.req.seed

    @property
    def matcher(self):
        return self.req.matcher

    @property
    def num_output_tokens(self) -> int:
        return self.req.num_output_tokens + len(self.extra)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.req.prompt_token_ids

    @property
    def output_token_ids(self) -> list[int]:
        return self.req.output_token_ids + self.extra


def split(items: list, sizes: list[int]) -> list[list]:
    out, start = [], 0
    for n in sizes:
        out.append(items[start:start + n])
        start += n
    return out


@dataclass(slots=True)
class StepInputs:
    """One step's model inputs: what rank 0 computes from its schedule and sends its followers,
    as one int64 tensor behind a header of sizes (no pickled objects)."""
    input_ids: torch.Tensor      # int64 [T]
    positions: torch.Tensor      # int64 [T]
    slot_mapping: torch.Tensor   # int64 [T]
    cu_seqlens_q: torch.Tensor   # int32 [B+1]
    seq_lens: torch.Tensor       # int32 [B]
    block_tables: torch.Tensor   # int32 [B, W]
    logit_rows: torch.Tensor     # int64 [R]
    block_copies: torch.Tensor   # int64 [C, 2]: (source, destination) KV blocks copied first

    def header(self) -> list[int]:
        return [STEP, len(self.input_ids), *self.block_tables.shape, len(self.logit_rows), len(self.block_copies)]

    def pack(self) -> torch.Tensor:
        parts = (self.input_ids, self.positions, self.slot_mapping, self.cu_seqlens_q, self.seq_lens,
                 self.block_tables.flatten(), self.logit_rows, self.block_copies.flatten())
        return torch.cat([p.long() for p in parts])

    @classmethod
    def unpack(cls, header: list[int], flat: torch.Tensor) -> "StepInputs":
        t, b, w, r, c = header[1:]
        ids, pos, slots, cu, lens, tables, rows, copies = flat.split([t, t, t, b + 1, b, b * w, r, 2 * c])
        i32 = torch.int32
        return cls(ids, pos, slots, cu.to(i32), lens.to(i32), tables.to(i32).view(b, w), rows, copies.view(c, 2))

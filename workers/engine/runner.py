"""Runs one step's batch through the model: flattens every scheduled token into one varlen batch
(positions, slot mapping, block tables, cu_seqlens), runs the model once, computes logits only
for the requests that sample this step, and samples them."""
import time
from types import ModuleType

import torch

import kernels.reference
from workers.distributed import SINGLE, TPGroup
from workers.engine.request import TokenLogprobs
from workers.engine.sampler import Sampler
from workers.engine.scheduler import Batch
from workers.layers.attention import AttentionMetadata
from workers.layers.linear import prepack_for_cpu
from workers.models.config import ModelConfig
from workers.models.llama import CausalLM
from workers.models.loader import load_weights


def attention_kernels(device: torch.device) -> ModuleType:
    """Triton kernels on CUDA once they exist (their own issue); the PyTorch reference otherwise."""
    if device.type == "cuda":
        try:
            import kernels.triton as triton_kernels
            return triton_kernels
        except ImportError:
            pass
    return kernels.reference


class ModelRunner:
    def __init__(self, model_dir: str, cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
                 block_size: int, tp: TPGroup = SINGLE):
        self.cfg, self.dtype, self.device, self.block_size = cfg, dtype, device, block_size
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
        self.sampler = Sampler()
        self.kv_pool = torch.empty(0)
        self.forward_seconds = 0.0  # time inside the model forward and logits, for the benchmark

    def block_bytes(self) -> int:
        """Bytes of KV one block takes on this rank, over all layers."""
        attn = self.model.attention_layers()[0]
        per_token = 2 * attn.num_kv_heads * attn.head_dim * self.dtype.itemsize
        return per_token * self.block_size * self.cfg.num_layers

    def allocate_kv(self, num_blocks: int) -> None:
        """One preallocated tensor [2, layers, blocks, block_size, Hkv, D]; each layer gets views."""
        layers = self.model.attention_layers()
        shape = (2, len(layers), num_blocks, self.block_size, layers[0].num_kv_heads, layers[0].head_dim)
        self.kv_pool = torch.zeros(shape, dtype=self.dtype, device=self.device)
        for i, attn in enumerate(layers):
            attn.kernels, attn.k_cache, attn.v_cache = self.kernels, self.kv_pool[0, i], self.kv_pool[1, i]

    def prepare(self, batch: Batch, block_tables: list[list[int]]):
        """Input ids, positions and attention metadata of the flattened batch, on the CPU."""
        input_ids, q_lens, starts = [], batch.num_new_tokens, []
        for req, n in zip(batch.requests, q_lens):
            start = req.num_computed_tokens
            input_ids.extend(req.token_ids[start:start + n])
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
        plan = self.kernels.plan_attention(cu, seq_lens, tables, self.block_size)
        meta = AttentionMetadata(slot_mapping=slots, cu_seqlens_q=cu, seq_lens=seq_lens, block_tables=tables, plan=plan)
        return torch.tensor(input_ids), positions, meta

    @torch.inference_mode()
    def run(self, batch: Batch, block_tables: list[list[int]]) -> tuple[list[int], list[TokenLogprobs | None]]:
        """Token (and logprobs) for each request of the batch that samples this step."""
        rows = [i for i, samples in enumerate(batch.samples) if samples]
        input_ids, positions, meta = self.prepare(batch, block_tables)
        to = self.device
        meta = meta.to(to)
        start = time.perf_counter()
        hidden = self.model(input_ids.to(to, non_blocking=True), positions.to(to, non_blocking=True), meta)
        if not rows:
            self.forward_seconds += time.perf_counter() - start
            return [], []
        last = meta.cu_seqlens_q[1:][rows].long() - 1
        logits = self.model.compute_logits(hidden[last])
        if to.type == "cuda":
            torch.cuda.synchronize()
        self.forward_seconds += time.perf_counter() - start
        return self.sampler(logits, [batch.requests[i] for i in rows])

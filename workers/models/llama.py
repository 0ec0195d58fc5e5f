"""One decoder for the Llama family: Llama (incl. Llama 3 rope scaling), Mistral, Qwen2 (qkv
bias) and Qwen3 (per-head q/k RMSNorm, explicit head_dim). Module names follow HF's so that
checkpoint names map one to one, apart from the packed q/k/v and gate/up projections."""
import torch
from torch import nn

from workers.distributed import TPGroup
from workers.layers.activation import silu_and_mul
from workers.layers.attention import Attention, AttentionMetadata
from workers.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from workers.layers.linear import ColumnParallelLinear, RowParallelLinear
from workers.layers.norm import RMSNorm
from workers.layers.rotary import RotaryEmbedding, rotate
from workers.models.config import ModelConfig


def kv_heads_on_rank(cfg: ModelConfig, tp: TPGroup) -> tuple[int, int]:
    """(kv heads this rank holds, index of its first): split when there are at least as many heads
    as ranks, else each head replicated on size / num_kv_heads ranks."""
    n = cfg.num_kv_heads
    if n >= tp.size:
        if n % tp.size:
            raise ValueError(f"num_key_value_heads={n} must divide by tensor_parallel_size={tp.size}")
        return n // tp.size, tp.rank * (n // tp.size)
    if tp.size % n:
        raise ValueError(f"tensor_parallel_size={tp.size} must be a multiple of num_key_value_heads={n}")
    return 1, tp.rank * n // tp.size


class SelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup):
        super().__init__()
        d = cfg.head_dim
        self.num_heads = cfg.num_heads // tp.size
        self.num_kv_heads, kv_start = kv_heads_on_rank(cfg, tp)
        self.q_size, self.kv_size = self.num_heads * d, self.num_kv_heads * d
        self.qkv_proj = ColumnParallelLinear(cfg.hidden_size, {
            "q": (self.q_size, tp.rank * self.q_size),
            "k": (self.kv_size, kv_start * d),
            "v": (self.kv_size, kv_start * d),
        }, cfg.qkv_bias, tp)
        self.o_proj = RowParallelLinear(cfg.num_heads * d, cfg.hidden_size, cfg.o_bias, tp)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.attn = Attention(self.num_heads, self.num_kv_heads, d, d ** -0.5)

    def forward(self, rope, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        d, heads = self.attn.head_dim, self.num_heads
        qkv = self.qkv_proj(x)
        qk = qkv[:, :self.q_size + self.kv_size].view(-1, heads + self.num_kv_heads, d)
        if self.q_norm is not None:
            qk = torch.cat((self.q_norm(qk[:, :heads]), self.k_norm(qk[:, heads:])), dim=1)
        qk = rotate(qk, *rope)  # q and k side by side: one rotation
        v = qkv[:, self.q_size + self.kv_size:].reshape(-1, self.num_kv_heads, d)
        o = self.attn(qk[:, :heads], qk[:, heads:], v, meta)
        return self.o_proj(o.flatten(1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup):
        super().__init__()
        self.gate_up_proj = ColumnParallelLinear.split(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias, tp,
                                                       parts=2)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, cfg.mlp_bias, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup):
        super().__init__()
        self.self_attn = SelfAttention(cfg, tp)
        self.mlp = MLP(cfg, tp)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, rope, hidden, residual, meta: AttentionMetadata):
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(rope, hidden, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(DecoderLayer(cfg, tp) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_model_len, cfg.rope_theta, cfg.rope_scaling)

    def forward(self, input_ids, positions, meta: AttentionMetadata) -> torch.Tensor:
        hidden, residual = self.embed_tokens(input_ids), None
        rope = self.rotary(positions, hidden.dtype)
        for layer in self.layers:
            hidden, residual = layer(rope, hidden, residual, meta)
        return self.norm(hidden, residual)[0]


class CausalLM(nn.Module):
    # checkpoint projection name -> (our packed parameter, shard id)
    packed_modules = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
              "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def __init__(self, cfg: ModelConfig, tp: TPGroup):
        super().__init__()
        self.check_tensor_parallel(cfg, tp.size)
        self.cfg = cfg
        self.model = Backbone(cfg, tp)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @staticmethod
    def check_tensor_parallel(cfg: ModelConfig, size: int) -> None:
        """Raises ValueError naming the constraint when the model cannot split over `size` ranks."""
        for name, n in (("num_attention_heads", cfg.num_heads), ("intermediate_size", cfg.intermediate_size)):
            if n % size:
                raise ValueError(f"{name}={n} must divide by tensor_parallel_size={size}")
        kv_heads_on_rank(cfg, TPGroup(0, size))

    def forward(self, input_ids, positions, meta: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers]

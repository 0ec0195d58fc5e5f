"""The model facts the engine needs, read from an HF checkpoint's config.json (or a GGUF's metadata)."""
import json
from dataclasses import dataclass, field, replace
from pathlib import Path

SUPPORTED = ("llama", "mistral", "qwen2", "qwen3")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_model_len: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    eos_token_ids: tuple[int, ...]
    dtype: str  # the checkpoint's torch dtype name, e.g. "bfloat16"
    quantization: str | None = None  # the linear weights': None, "int8" (made at load), "w4a16" (the checkpoint's)
    #                                  or "gguf" (a GGUF's Q8_0/Q4_0 weights kept as they are)
    quant_group_size: int | None = None   # w4a16: inputs per scale
    quant_symmetric: bool = True          # w4a16: False where each group has a zero too
    gguf: bool = field(default=False, compare=False)   # read from a GGUF file (the same model as its source's)

    @classmethod
    def load(cls, model_dir: str | Path) -> "ModelConfig":
        model_dir = Path(model_dir)
        if model_dir.is_file():
            from workers.models import gguf
            cfg = cls.from_hf(gguf.hf_config(model_dir), as_ids(gguf.generation_config(model_dir).get("eos_token_id")))
            return replace(cfg, gguf=True)
        path = model_dir / "config.json"
        if not path.is_file():
            raise ValueError(f"model: {model_dir} has no config.json (an HF checkpoint directory or a GGUF file "
                             "is expected)")
        config = json.loads(path.read_text())
        try:
            return cls.from_hf(config, read_generation_eos(model_dir))
        except KeyError as e:
            raise ValueError(f"model: {path} lacks the field {e.args[0]!r}") from None

    def quantized(self, asked: str | None) -> "ModelConfig":
        """This config with the quantization asked for (EngineConfig.quantization): None or "none" keeps
        the checkpoint's; a quantized checkpoint is served as it is, and nothing else is asked of it."""
        if asked in (None, "none") or asked == self.quantization:
            return self
        if self.quantization is not None:
            raise ValueError(f"quantization={asked!r}: the checkpoint is quantized already ({self.quantization})")
        if asked == "gguf" and not self.gguf:
            raise ValueError("quantization='gguf' keeps a GGUF file's Q8_0/Q4_0 weights; this model is not a GGUF file")
        if asked not in ("int8", "gguf"):
            raise ValueError(f"quantization={asked!r} is read from a checkpoint, not made at load (made at load: int8; "
                             "kept from a GGUF file: gguf)")
        return replace(self, quantization=asked)

    def matmul_params(self) -> int:
        """Weights of the decoder layers' matmuls: the parameters every token multiplies through
        (the embedding is a lookup, the norms are vectors)."""
        d, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return self.num_layers * (d * (q + 2 * kv) + q * d + 3 * d * self.intermediate_size)

    def request_flops(self, prompt_len: int, output_len: int) -> int:
        """FLOPs (2 per multiply-add) of a whole request, no prefix cache: every position run (the
        prompt and every output token but the last, which is sampled, never run) through the
        decoder's matmuls; the attention's scores and weighted sum for every (query, earlier or own
        key) pair; the LM head for each of the output_len sampled tokens."""
        positions = prompt_len + output_len - 1
        pairs = positions * (positions + 1) // 2              # causal: position i sees i + 1 keys
        attention = 4 * self.num_layers * self.num_heads * self.head_dim * pairs
        return 2 * self.matmul_params() * positions + attention + 2 * self.hidden_size * self.vocab_size * output_len

    @classmethod
    def from_hf(cls, c: dict, generation_eos: tuple[int, ...] = ()) -> "ModelConfig":
        kind = c.get("model_type")
        if kind not in SUPPORTED:
            raise ValueError(f"model_type {kind!r} is not supported (supported: {', '.join(SUPPORTED)})")
        heads = c["num_attention_heads"]
        theta, scaling = rope_settings(c)
        max_len = c.get("max_position_embeddings", 4096)
        if c.get("sliding_window") and c.get("use_sliding_window", kind == "mistral"):
            max_len = min(max_len, c["sliding_window"])  # no sliding-window attention: stay inside one window
        bias = bool(c.get("attention_bias", False))
        return cls(**compressed_tensors(c.get("quantization_config")),
            model_type=kind,
            vocab_size=c["vocab_size"],
            hidden_size=c["hidden_size"],
            intermediate_size=c["intermediate_size"],
            num_layers=c["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=c.get("num_key_value_heads") or heads,
            head_dim=c.get("head_dim") or c["hidden_size"] // heads,
            rms_norm_eps=c.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            max_model_len=max_len,
            tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
            qkv_bias=bias or kind == "qwen2",
            o_bias=bias,
            mlp_bias=bool(c.get("mlp_bias", False)),
            qk_norm=kind == "qwen3",
            eos_token_ids=generation_eos or as_ids(c.get("eos_token_id")),
            dtype=c.get("dtype") or c.get("torch_dtype") or "float32",
        )


def compressed_tensors(config: dict | None) -> dict:
    """ModelConfig's quantization fields from config.json's `quantization_config` ({} when there is none):
    a compressed-tensors W4A16 checkpoint (workers.models.compressed reads its tensors); ValueError naming
    the field for a scheme tokenbus does not serve."""
    if not config:
        return {}
    method = config.get("quant_method")
    if method != "compressed-tensors":
        raise ValueError(f"model: quantization_config.quant_method={method!r} is not served (tokenbus reads "
                         "'compressed-tensors' W4A16 checkpoints)")
    groups = list((config.get("config_groups") or {}).items())
    if len(groups) != 1:
        raise ValueError(f"model: quantization_config.config_groups has {len(groups)} groups; tokenbus reads one")
    name, group = groups[0]
    weights = group.get("weights") or {}
    where = f"quantization_config.config_groups.{name}"
    wanted = {"num_bits": 4, "type": "int", "strategy": "group", "dynamic": False}
    for key, value in wanted.items():
        if weights.get(key, value) != value:
            raise ValueError(f"model: {where}.weights.{key}={weights.get(key)!r}; tokenbus serves "
                             f"{key}={value!r} (W4A16, a scale per group)")
    for key in ("input_activations", "output_activations"):
        if group.get(key):
            raise ValueError(f"model: {where}.{key} is set; tokenbus serves weight-only (W4A16) schemes")
    fmt = group.get("format") or config.get("format")
    if fmt != "pack-quantized":
        raise ValueError(f"model: quantization_config format {fmt!r}; tokenbus reads 'pack-quantized'")
    if not weights.get("group_size") or weights["group_size"] % 2:
        raise ValueError(f"model: {where}.weights.group_size={weights.get('group_size')!r} must be even and set")
    return {"quantization": "w4a16", "quant_group_size": int(weights["group_size"]),
            "quant_symmetric": bool(weights.get("symmetric", True))}


def rope_settings(c: dict) -> tuple[float, dict | None]:
    """(theta, scaling) from either layout: transformers 5's `rope_parameters` or the older
    `rope_theta` + `rope_scaling`."""
    params = dict(c.get("rope_parameters") or c.get("rope_scaling") or {})
    theta = params.pop("rope_theta", c.get("rope_theta", 10000.0))
    if "type" in params:
        params.setdefault("rope_type", params.pop("type"))
    if params.get("rope_type", "default") == "default":
        return theta, None
    return theta, params


def as_ids(value) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (value,)


def read_generation_eos(model_dir: Path) -> tuple[int, ...]:
    path = model_dir / "generation_config.json"
    return as_ids(json.loads(path.read_text()).get("eos_token_id")) if path.is_file() else ()

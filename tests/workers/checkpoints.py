"""Small random HF checkpoints of every supported architecture, made in the test."""
from pathlib import Path

import torch
import transformers

BASE = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512, "rms_norm_eps": 1e-6,
        "eos_token_id": 2, "bos_token_id": 1,
        "initializer_range": 0.2}  # large weights: sharp attention, so position handling matters

ARCHS = {
    "llama": (transformers.LlamaConfig, {}),
    "llama3-rope-scaling": (transformers.LlamaConfig, {"rope_parameters": {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}),
    "llama-tied-mha-bias": (transformers.LlamaConfig, {"tie_word_embeddings": True, "num_key_value_heads": 4,
                                                       "attention_bias": True}),
    "mistral": (transformers.MistralConfig, {"sliding_window": None}),
    "qwen2": (transformers.Qwen2Config, {"tie_word_embeddings": True}),
    "qwen3": (transformers.Qwen3Config, {"head_dim": 32, "num_key_value_heads": 1}),
}


def make_checkpoint(root: Path, arch: str, seed: int = 0) -> Path:
    config_cls, extra = ARCHS[arch]
    path = root / arch
    if (path / "config.json").exists():
        return path
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config_cls(**{**BASE, **extra}))
    model.save_pretrained(path)
    return path

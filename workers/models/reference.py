"""HF transformers' own loading of a checkpoint: the reference the engine is measured and tested
against (bench-engine, eval ppl), never used to serve."""
from pathlib import Path

import torch


def hf_model(model: str | Path, dtype: torch.dtype = torch.float32):
    """transformers' AutoModelForCausalLM for an HF checkpoint directory, or for a GGUF file through
    transformers' own GGUF loader (which dequantizes it itself)."""
    from transformers import AutoModelForCausalLM

    path = Path(model)
    if path.is_file():
        return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype).eval()
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()

"""Loads checkpoint weights (safetensors, or a GGUF file) into the engine's own layers, shard by shard."""
from pathlib import Path

from safetensors import safe_open
from torch import nn

from workers.layers import quant
from workers.layers.linear import copy_weight


def target_of(name: str, packed: dict) -> tuple[str, object]:
    """Our parameter name and shard id for a checkpoint tensor name."""
    for source, (target, shard) in packed.items():
        if f".{source}." in name:
            return name.replace(f".{source}.", f".{target}."), shard
    return name, None


def checkpoint_tensors(model_path: str | Path):
    """(HF name, slice) of every tensor: lazy slices that read (and dequantize) only what is indexed."""
    if Path(model_path).is_file():
        from workers.models import gguf
        yield from gguf.tensors(model_path)
        return
    files = sorted(Path(model_path).glob("*.safetensors"))
    if not files:
        raise ValueError(f"model: no *.safetensors files in {model_path}")
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not iterable
                yield name, f.get_slice(name)


def load_weights(model: nn.Module, model_path: str | Path) -> None:
    params = dict(model.named_parameters())
    tied = model.cfg.tie_word_embeddings
    loaded = set()
    for name, tensor in checkpoint_tensors(model_path):
        if "rotary_emb.inv_freq" in name or (tied and name == "lm_head.weight"):
            continue
        target, shard = target_of(name, model.packed_modules)
        param = params.get(target)
        if param is None:
            raise ValueError(f"model: checkpoint tensor {name!r} has no place in {model.cfg.model_type}")
        loader = getattr(param, "weight_loader", None)
        if loader is None:
            copy_weight(param, tensor)
        else:
            loader(param, tensor, shard)
        loaded.add(target)
    missing = sorted(params.keys() - loaded)
    if missing:
        raise ValueError(f"model: checkpoint {model_path} lacks weights for {', '.join(missing[:5])}")
    if model.cfg.quantization == "int8":
        quant.quantize_model(model, "int8")

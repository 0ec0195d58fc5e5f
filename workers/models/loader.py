"""Loads checkpoint weights (safetensors, or a GGUF file) into the engine's own layers, shard by shard.

A quantized checkpoint's codes (compressed-tensors W4A16; a GGUF's Q8_0/Q4_0 with quantization
"gguf") load as they are stored: the layers that hold them swap their float weight for the codes'
parameters first (workers.layers.quant.hold_quantized), which then load through the same sharded
weight loaders."""
from pathlib import Path

from safetensors import safe_open
from torch import nn

from workers.layers import quant
from workers.layers.linear import copy_weight

KEPT = ("w4a16", "gguf")   # quantizations whose codes come from the checkpoint


def target_of(name: str, packed: dict) -> tuple[str, object]:
    """Our parameter name and shard id for a checkpoint tensor name."""
    for source, (target, shard) in packed.items():
        if f".{source}." in name:
            return name.replace(f".{source}.", f".{target}."), shard
    return name, None


def safetensors_files(model_path: str | Path) -> list[Path]:
    files = sorted(Path(model_path).glob("*.safetensors"))
    if not files:
        raise ValueError(f"model: no *.safetensors files in {model_path}")
    return files


def checkpoint_tensors(model_path: str | Path, quantization: str | None = None):
    """(HF name, slice) of every tensor: lazy slices that read (and dequantize) only what is indexed. With a
    kept quantization, a quantized layer's tensors are its codes' (weight_packed, weight_scale, ...)."""
    if Path(model_path).is_file():
        from workers.models import gguf
        yield from gguf.tensors(model_path, keep=quantization == "gguf")
        return
    if quantization == "w4a16":
        from workers.models import compressed
    for file in safetensors_files(model_path):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not iterable
                tensor = f.get_slice(name)
                if quantization == "w4a16":
                    tensor = compressed.adapt(name, tensor)
                    if tensor is None:
                        continue
                yield name, tensor


def quantized_layouts(model_path: str | Path, cfg) -> dict[str, quant.Layout]:
    """The checkpoint's layers (HF names, e.g. model.layers.0.mlp.up_proj) whose codes are kept, and how."""
    if cfg.quantization == "gguf":
        from workers.models import gguf
        return gguf.kept_layers(model_path)
    from workers.models import compressed
    names = set()
    for file in safetensors_files(model_path):
        with safe_open(file, framework="pt") as f:
            names.update(f.keys())
    return dict.fromkeys(compressed.quantized_layers(names), compressed.layout(cfg))


def hold_quantized(model: nn.Module, layouts: dict[str, quant.Layout]) -> None:
    """Readies each layer that a quantized checkpoint tensor loads into; the parts of a packed layer
    (q/k/v, gate/up) must be quantized alike."""
    modules, chosen = dict(model.named_modules()), {}
    for layer, layout in sorted(layouts.items()):
        target = target_of(f"{layer}.weight", model.packed_modules)[0].removesuffix(".weight")
        module = modules.get(target)
        if not hasattr(module, "loader_of") or (model.cfg.tie_word_embeddings and module is model.lm_head):
            raise ValueError(f"model: quantized tensor {layer!r} has no linear layer to load into")
        if chosen.setdefault(target, layout) != layout:
            raise ValueError(f"model: {layer!r} is quantized unlike the other parts of {target!r} ({layout} vs "
                             f"{chosen[target]}); a packed layer holds one layout")
    for target, layout in chosen.items():
        module = modules[target]
        quant.hold_quantized(module, layout, module.loader_of)


def load_weights(model: nn.Module, model_path: str | Path) -> None:
    quantization = model.cfg.quantization
    if quantization in KEPT:
        hold_quantized(model, quantized_layouts(model_path, model.cfg))
    params = dict(model.named_parameters())
    tied = model.cfg.tie_word_embeddings
    loaded = set()
    for name, tensor in checkpoint_tensors(model_path, quantization):
        if "rotary_emb.inv_freq" in name or (tied and name == "lm_head.weight"):
            continue
        target, shard = target_of(name, model.packed_modules)
        param = params.get(target)
        if param is None:
            raise ValueError(f"model: checkpoint tensor {name!r} has no place in {model.cfg.model_type}"
                             + (" (a packed layer's parts are all quantized or none)" if quantization in KEPT else ""))
        loader = getattr(param, "weight_loader", None)
        if loader is None:
            copy_weight(param, tensor)
        else:
            loader(param, tensor, shard)
        loaded.add(target)
    missing = sorted(params.keys() - loaded)
    if missing:
        raise ValueError(f"model: checkpoint {model_path} lacks weights for {', '.join(missing[:5])}")
    if quantization == "int8":
        quant.quantize_model(model, "int8")
    elif quantization in KEPT:
        quant.finish_quantized(model)

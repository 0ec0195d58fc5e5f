"""compressed-tensors checkpoints (what llm-compressor writes for AWQ and GPTQ) with W4A16 weights in
its `pack-quantized` format, read as they are stored.

config.json's `quantization_config` names the scheme; each quantized linear `X` has, beside no
`X.weight`:

- `X.weight_packed`: int32 [N, K/8], eight 4-bit codes a word, input i at bits 4*(i % 8): on a
  little-endian host its bytes are the codes two a byte, the lower input in the low nibble (the layout
  workers.layers.quant.Int4Weight keeps), each code the signed value + 8;
- `X.weight_scale`: [N, K/g] in the model's float dtype;
- `X.weight_zero_point` (asymmetric only): int32 [N/8, K/g], the zeros packed the same way down the
  outputs;
- `X.weight_shape`: [N, K].

W = (value - zero) * scale = (code - zero code) * scale. Layers listed in `ignore` (the LM head,
usually) keep a float `X.weight`. config.json's part is read by workers.models.config.compressed_tensors."""
import sys

import torch

from workers.layers.quant import Layout, unpack_nibbles


def layout(cfg) -> Layout:
    return Layout(4, cfg.quant_group_size, cfg.quant_symmetric)


def quantized_layers(names) -> set[str]:
    """The layers (checkpoint names, e.g. model.layers.0.self_attn.q_proj) that hold codes."""
    return {name.removesuffix(".weight_packed") for name in names if name.endswith(".weight_packed")}


def adapt(name: str, tensor):
    """A checkpoint tensor as the loader hands it to a quantized layer's parameter (None: skip it)."""
    if name.endswith(".weight_packed"):
        return Nibbles(tensor)
    if name.endswith(".weight_zero_point"):
        return unpack_rows(tensor[:])
    if name.endswith(".weight_shape"):
        return None   # the parameters' own shapes are checked as they are copied
    return tensor


class Nibbles:
    """An int32 [N, K/8] slice as uint8 [N, K/2] codes two a byte, sliced like a safetensors slice:
    only the rows and words asked for are read."""

    def __init__(self, words):
        assert sys.byteorder == "little", "the packed codes are read as the bytes of little-endian words"
        self.words = words
        rows, cols = words.get_shape() if hasattr(words, "get_shape") else words.shape
        self.shape = (rows, cols * 4)

    def __getitem__(self, index) -> torch.Tensor:
        rows, cols = index if isinstance(index, tuple) else (index, slice(None))
        start, stop, _ = cols.indices(self.shape[1])
        words = self.words[rows, start // 4:-(-stop // 4)]
        return words.contiguous().view(torch.uint8)[:, start % 4:start % 4 + stop - start]


def unpack_rows(words: torch.Tensor) -> torch.Tensor:
    """int32 [N/8, G] zeros packed down the outputs -> uint8 codes [N, G]."""
    return unpack_nibbles(words.t().contiguous().view(torch.uint8)).t().contiguous()   # [G, N/2] -> [N, G]

"""GGUF checkpoints (llama.cpp's one-file format), read with the `gguf` library.

A GGUF holds what an HF checkpoint directory spreads over several files: the hyper-parameters and
the tokenizer as metadata, the tensors (often quantized) under llama.cpp's names. Here each becomes
its HF form, which the rest of tokenbus reads:

- `write_files`: config.json, generation_config.json and the tokenizer files, from the metadata;
- `tensors`: (HF name, slice) pairs, dequantized when sliced, rows first, so that a tensor-parallel
  rank dequantizes only its own rows; with `keep` (quantization "gguf"), a linear weight in Q8_0 or
  Q4_0 as its codes and scales instead (`Kept`, `kept_layers`), which the layers hold as they are;
- `hf_dir`: for a GGUF loaded directly, those files written once under $TOKENBUS_HOME/gguf (the
  tokenizer service and the gateway read a directory);
- `convert`: a whole HF checkpoint directory, safetensors included (`tokenbus model pull`).

Read: the Llama architecture with a byte-level BPE tokenizer (SmolLM, SmolLM2); docs/models.md
lists what else is refused, and why.
"""
import functools
import hashlib
import re
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, TokenType
from gguf.quants import dequantize
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
from tqdm import tqdm

from workers.layers.quant import Layout, pack_nibbles
from workers.models.builder import build_once, save_weights, tokenbus_home, write_json

Q = GGMLQuantizationType
TYPES = (Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q5_0, Q.Q5_1, Q.Q4_0, Q.Q4_1)  # the tensor types dequantized
ARCHITECTURES = ("llama",)

# llama.cpp's tensor names -> HF's; a layer's are blk.<i>.<name>.{weight,bias}
GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
LAYER = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
         "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
         "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}


def byte_level() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.ByteLevel(add_prefix_space=False)  # GPT-2's split, then bytes as characters


# tokenizer.ggml.pre (llama.cpp's name for how text is cut before BPE) -> the same cut in `tokenizers`
PRE_TOKENIZERS = {
    "gpt2": byte_level,
    "smollm": lambda: pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level()]),
}
ROLES = {"bos_token": "bos_token_id", "eos_token": "eos_token_id", "unk_token": "unknown_token_id",
         "pad_token": "padding_token_id"}
MISSING = object()


def read(path: str | Path) -> GGUFReader:
    """The parsed file (kept for the next caller in this process); ValueError naming the file when it
    is not a whole GGUF."""
    stat = Path(path).stat()
    return read_cached(str(Path(path).resolve()), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=2)
def read_cached(path: str, size: int, mtime_ns: int) -> GGUFReader:
    try:
        return GGUFReader(path)
    except OSError:
        raise
    except Exception as e:  # the reader's own complaints about a truncated or corrupt file, whatever their type
        raise ValueError(f"model: {path} is not a readable GGUF file (truncated or corrupt?): {e}") from None


def meta(path, key: str, default=MISSING):
    field = read(path).get_field(key)
    if field is not None:
        return field.contents()
    if default is MISSING:
        raise ValueError(f"model: {path} lacks the GGUF metadata {key!r}")
    return default


def f32(x: float) -> float:
    """A float32 from the file as the shortest decimal that is that float32 (1e-05, not 9.99999974e-06)."""
    return float(str(np.float32(x)))


# -- metadata -> HF's files ---------------------------------------------------------------------

def hf_config(path, dtype: str | None = None) -> dict:
    """config.json's fields; `dtype` (default: the type of the file's unquantized weights) is the
    checkpoint's dtype."""
    arch = meta(path, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"model: {path} is a {arch!r} GGUF; tokenbus reads {', '.join(ARCHITECTURES)}")

    def hp(key, default=MISSING):
        return meta(path, f"{arch}.{key}", default)

    scaling = hp("rope.scaling.type", "none")
    if scaling != "none":
        raise ValueError(f"model: {path}: rope scaling {scaling!r} is not supported")
    shapes = {t.name: [int(n) for n in t.shape] for t in read(path).tensors}
    hidden, heads = hp("embedding_length"), hp("attention.head_count")
    head_dim = hp("attention.key_length", hidden // heads)
    if hp("rope.dimension_count", head_dim) != head_dim:
        raise ValueError(f"model: {path}: a rotary embedding over part of a head is not supported")
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": shapes["token_embd.weight"][1],
        "hidden_size": hidden,
        "intermediate_size": hp("feed_forward_length"),
        "num_hidden_layers": hp("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": hp("attention.head_count_kv", heads),
        "head_dim": head_dim,
        "max_position_embeddings": hp("context_length"),
        "rms_norm_eps": f32(hp("attention.layer_norm_rms_epsilon")),
        "rope_theta": f32(hp("rope.freq_base", 10000.0)),
        "attention_bias": "blk.0.attn_q.bias" in shapes,
        "mlp_bias": "blk.0.ffn_up.bias" in shapes,
        "tie_word_embeddings": "output.weight" not in shapes,
        "dtype": dtype or stored_dtype(path),
        **special_ids(path),
    }


def stored_dtype(path) -> str:
    kinds = {t.tensor_type for t in read(path).tensors}
    return "bfloat16" if Q.BF16 in kinds else "float16" if Q.F16 in kinds else "float32"


def special_ids(path) -> dict:
    ids = {"bos_token_id": meta(path, "tokenizer.ggml.bos_token_id", None),
           "eos_token_id": meta(path, "tokenizer.ggml.eos_token_id", None),
           "pad_token_id": meta(path, "tokenizer.ggml.padding_token_id", None)}
    return {k: v for k, v in ids.items() if v is not None}


def generation_config(path) -> dict:
    """Generation ends at EOS and at the end-of-turn token, where the file names one apart."""
    ids = special_ids(path)
    eot = meta(path, "tokenizer.ggml.eot_token_id", None)
    if eot is not None and eot != ids.get("eos_token_id"):
        ids["eos_token_id"] = [ids["eos_token_id"], eot] if "eos_token_id" in ids else eot
    return ids


def tokenizer(path) -> Tokenizer:
    """The byte-level BPE the metadata spells out: vocabulary, merges, pre-tokenizer; control tokens
    as special tokens, user-defined ones as added tokens (both matched whole in text)."""
    kind, pre = meta(path, "tokenizer.ggml.model"), meta(path, "tokenizer.ggml.pre", "default")
    if kind != "gpt2" or pre not in PRE_TOKENIZERS:
        raise ValueError(f"model: {path}: its tokenizer ({kind!r} with pre-tokenizer {pre!r}) is not one tokenbus "
                         f"reads: byte-level BPE ('gpt2') with pre-tokenizer {' or '.join(map(repr, PRE_TOKENIZERS))}")
    tokens = meta(path, "tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ")) for m in meta(path, "tokenizer.ggml.merges")]
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges))
    tok.pre_tokenizer = PRE_TOKENIZERS[pre]()
    tok.decoder = decoders.ByteLevel()
    types = meta(path, "tokenizer.ggml.token_type", [])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, k in zip(tokens, types) if k == TokenType.CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, k in zip(tokens, types) if k == TokenType.USER_DEFINED])
    bos = meta(path, "tokenizer.ggml.bos_token_id", None)
    if meta(path, "tokenizer.ggml.add_bos_token", False) and bos is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{tokens[bos]} $A", pair=f"{tokens[bos]} $A {tokens[bos]} $B", special_tokens=[(tokens[bos], bos)])
    return tok


def special_tokens(path) -> dict:
    tokens = meta(path, "tokenizer.ggml.tokens")
    ids = {role: meta(path, f"tokenizer.ggml.{key}", None) for role, key in ROLES.items()}
    return {role: tokens[i] for role, i in ids.items() if i is not None}


def tokenizer_config(path) -> dict:
    config = special_tokens(path) | {
        "clean_up_tokenization_spaces": False,
        "model_max_length": hf_config(path)["max_position_embeddings"],
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    template = meta(path, "tokenizer.chat_template", None)
    return config | {"chat_template": template} if template else config


def write_files(path, out: Path, dtype: str | None = None) -> None:
    """config.json, generation_config.json, tokenizer.json, tokenizer_config.json (with the chat
    template) and special_tokens_map.json of the GGUF at `path`, into `out`."""
    write_json(out / "config.json", hf_config(path, dtype))
    write_json(out / "generation_config.json", generation_config(path))
    tokenizer(path).save(str(out / "tokenizer.json"))
    write_json(out / "tokenizer_config.json", tokenizer_config(path))
    write_json(out / "special_tokens_map.json", special_tokens(path))


def hf_dir(model: str | Path) -> str:
    """The directory with `model`'s config and tokenizer files: `model` itself, or for a GGUF file those
    files made from its metadata, written once under $TOKENBUS_HOME/gguf in a directory named as the
    file (its name is the served model's name)."""
    path = Path(model)
    if not path.is_file():  # a model given as a file is a GGUF; an HF checkpoint is a directory
        return str(model)
    stat = path.stat()
    key = f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}:{version()}"
    final = tokenbus_home() / "gguf" / hashlib.sha256(key.encode()).hexdigest()[:16] / path.name
    return str(build_once(final, lambda d: (d / "config.json").is_file(), lambda tmp: write_files(path, tmp)))


def version() -> str:
    """Changes with this file, so that files converted by an older version are made again."""
    return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]


# -- tensors ------------------------------------------------------------------------------------

class Slice:
    """One GGUF tensor as its HF counterpart, sliced like a safetensors slice (`[:]`, `[rows]`,
    `[:, cols]`) into a float32 tensor. Rows are cut before dequantizing (a quantized block never
    spans rows), columns after."""

    def __init__(self, tensor, head_dim: int | None):
        self.tensor, self.head_dim = tensor, head_dim
        self.shape = tuple(int(n) for n in reversed(tensor.shape))  # GGUF lists the fastest dimension first

    def __getitem__(self, index) -> torch.Tensor:
        rows, cols = index if isinstance(index, tuple) else (index, slice(None))
        start, stop, step = rows.indices(self.shape[0])
        assert step == 1, "rows are read in one run"
        t = self.tensor
        if len(self.shape) == 1:   # norms and biases: never quantized, read whole
            data = dequantize(t.data, t.tensor_type).reshape(-1)[start:stop]
        else:
            data = dequantize(t.data[start:stop], t.tensor_type).reshape(stop - start, -1)[:, cols]
        if self.head_dim:
            assert start % self.head_dim == 0 == stop % self.head_dim, "q/k rows are read in whole heads"
            data = unpermute(data, self.head_dim)
        return torch.from_numpy(np.array(data, dtype=np.float32))  # a copy: the file is mapped read-only


def unpermute(rows: np.ndarray, head_dim: int) -> np.ndarray:
    """Undoes llama.cpp's convert, which interleaves the two halves of each head's q/k rows (its rotary
    embedding pairs neighbours; HF's pairs row i with row i + head_dim/2)."""
    heads = rows.shape[0] // head_dim
    return rows.reshape(heads, head_dim // 2, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def hf_name(name: str) -> str | None:
    base, _, kind = name.rpartition(".")
    if base in GLOBAL:
        return f"{GLOBAL[base]}.{kind}"
    layer = re.fullmatch(r"blk\.(\d+)\.(\w+)", base)
    if layer and layer[2] in LAYER:
        return f"model.layers.{layer[1]}.{LAYER[layer[2]]}.{kind}"
    return None


def tensors(path, keep: bool = False) -> list[tuple[str, Slice]]:
    """Every tensor under its HF name; ValueError naming the tensor for a type not dequantized here or
    a name with no place in the model. With `keep`, a kept linear weight X.weight (`kept_layers`) comes
    as X.weight_packed and X.weight_scale."""
    reader, config = read(path), hf_config(path)
    kept = kept_layers(path) if keep else {}
    out = []
    for t in reader.tensors:
        if t.tensor_type not in TYPES:
            raise ValueError(f"model: {path}: tensor {t.name!r} is of type {t.tensor_type.name}, which tokenbus does "
                             f"not dequantize (it reads {', '.join(k.name for k in TYPES)})")
        name = hf_name(t.name)
        if name is None:
            raise ValueError(f"model: {path}: tensor {t.name!r} has no place in a {config['model_type']} model")
        rotated = ".q_proj." in name or ".k_proj." in name
        head_dim = config["head_dim"] if rotated else None
        layer = name.removesuffix(".weight")
        if layer in kept:
            out += [(f"{layer}.weight_packed", Kept(t, head_dim, "codes")), (f"{layer}.weight_scale",
                                                                            Kept(t, head_dim, "scale"))]
        else:
            out.append((name, Slice(t, head_dim)))
    return out


KEPT_TYPES = {Q.Q4_0: Layout(4, 32), Q.Q8_0: Layout(8, 32)}   # W = d * (q - 8), q 0..15; W = d * q, q int8
LINEARS = tuple(LAYER[k] for k in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"))


def kept_layers(path) -> dict[str, Layout]:
    """The linear layers (HF names) whose weights are Q4_0 or Q8_0: all but the embedding, which is looked
    up, not multiplied (a tied LM head shares it, so stays float too)."""
    kept = {}
    for t in read(path).tensors:
        name = hf_name(t.name)
        if t.tensor_type in KEPT_TYPES and name and (name == "lm_head.weight" or name.endswith(
                tuple(f".{n}.weight" for n in LINEARS))):
            kept[name.removesuffix(".weight")] = KEPT_TYPES[t.tensor_type]
    return kept


class Kept:
    """A Q4_0 or Q8_0 tensor's `codes` (Q4_0: uint8 [N, K/2], two codes 0..15 a byte, input 2j in the low
    nibble; Q8_0: int8 [N, K]) or `scale` (float32 [N, K/32], each block's float16 d widened), sliced like
    `Slice`: rows cut before decoding, q/k rows un-interleaved, columns (whole blocks) cut after."""

    def __init__(self, tensor, head_dim: int | None, part: str):
        self.tensor, self.head_dim, self.part = tensor, head_dim, part
        n, k = (int(d) for d in reversed(tensor.shape))
        per_row = k // 2 if tensor.tensor_type == Q.Q4_0 and part == "codes" else k
        self.shape = (n, per_row if part == "codes" else k // 32)

    def __getitem__(self, index) -> torch.Tensor:
        rows, cols = index if isinstance(index, tuple) else (index, slice(None))
        start, stop, step = rows.indices(self.shape[0])
        assert step == 1, "rows are read in one run"
        blocks = torch.from_numpy(np.array(self.tensor.data[start:stop])).view(stop - start, -1, 34 if self.q8 else 18)
        data = self.decode(blocks)
        if self.head_dim:
            assert start % self.head_dim == 0 == stop % self.head_dim, "q/k rows are read in whole heads"
            data = torch.from_numpy(unpermute(data.numpy(), self.head_dim).copy())
        return data[:, cols]

    @property
    def q8(self) -> bool:
        return self.tensor.tensor_type == Q.Q8_0

    def decode(self, blocks: torch.Tensor) -> torch.Tensor:
        """[rows, blocks, bytes] -> this part [rows, ...]: a block is float16 d, then 32 int8 (Q8_0) or
        16 bytes of codes (Q4_0: input j in byte j's low nibble, j + 16 in its high)."""
        rows = blocks.shape[0]
        if self.part == "scale":
            return blocks[..., :2].contiguous().view(torch.float16).float().view(rows, -1)
        if self.q8:
            return blocks[..., 2:].contiguous().view(torch.int8).reshape(rows, -1)
        qs = blocks[..., 2:]
        return pack_nibbles(torch.cat((qs & 0xF, qs >> 4), dim=-1).reshape(rows, -1))


def convert(path, out: Path, dtype: str, progress: bool = True) -> None:
    """An HF checkpoint directory in `out`: `write_files`, and model.safetensors in `dtype` (a torch
    dtype name)."""
    write_files(path, out, dtype)
    weights = {name: t[:].to(getattr(torch, dtype))
               for name, t in tqdm(tensors(path), desc=f"converting {Path(path).name}", unit="tensor",
                                   disable=not progress)}
    save_weights(weights, out / "model.safetensors")

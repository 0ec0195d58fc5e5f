"""GGUF files written in the test the way llama.cpp's convert_hf_to_gguf.py writes them: its tensor
names (gguf-py's own map), its q/k row interleave, its tokenizer metadata (gguf-py's SpecialVocab),
2-D weights in the type asked, norms in F32. None of tokenbus's GGUF code is used."""
import json
from pathlib import Path

import gguf
import numpy as np
from safetensors.numpy import load_file
from transformers import AutoTokenizer

Q = gguf.GGMLQuantizationType


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute: each head's two rotary halves interleaved row by row."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(src: Path, out: Path, qtype: Q = Q.F32, extra=None) -> Path:
    """`src` (an HF checkpoint directory) as a GGUF at `out`; `extra(writer)` may add to it."""
    c = json.loads((src / "config.json").read_text())
    heads, kv_heads = c["num_attention_heads"], c["num_key_value_heads"]
    w = gguf.GGUFWriter(str(out), "llama")
    w.add_block_count(c["num_hidden_layers"])
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(c.get("rope_theta") or c["rope_parameters"]["rope_theta"])
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    w.add_rope_dimension_count(c["hidden_size"] // heads)
    if (src / "tokenizer.json").exists():
        add_tokenizer(w, src)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, c["num_hidden_layers"])
    for name, data in load_file(src / "model.safetensors").items():
        data = data.astype(np.float32)
        if name.endswith(("q_proj.weight", "q_proj.bias")):
            data = permute(data, heads)
        elif name.endswith(("k_proj.weight", "k_proj.bias")):
            data = permute(data, kv_heads)
        target = names.get_name(name, try_suffixes=(".weight", ".bias"))
        kind = qtype if data.ndim == 2 else Q.F32
        w.add_tensor(target, gguf.quants.quantize(data, kind), raw_dtype=kind)
    if extra:
        extra(w)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def add_tokenizer(w: gguf.GGUFWriter, src: Path) -> None:
    """As convert_hf_to_gguf.py's get_vocab_base: tokens by id, added special tokens as CONTROL."""
    tok = AutoTokenizer.from_pretrained(src)
    by_id = {i: t for t, i in tok.get_vocab().items()}
    added = tok.added_tokens_decoder
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt2")
    w.add_token_list([by_id[i] for i in range(len(by_id))])
    w.add_token_types([gguf.TokenType.CONTROL if i in added and added[i].special else
                       gguf.TokenType.USER_DEFINED if i in added else gguf.TokenType.NORMAL
                       for i in range(len(by_id))])
    gguf.SpecialVocab(src, load_merges=True).add_to_gguf(w, quiet=True)

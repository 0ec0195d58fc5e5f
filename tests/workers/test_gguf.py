"""GGUF checkpoints load directly: tensors of every supported type equal the source checkpoint's
(exactly, or within one step of the format), in HF's layout (transformers' own GGUF loader agrees),
sharded per tensor-parallel rank; the engine's greedy tokens equal those from the safetensors
directory; the tokenizer and chat template from the metadata work as the source's; a truncated,
corrupt or unsupported file is a clear error naming the file (and the tensor)."""
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.workers.checkpoints import make_checkpoint
from tests.workers.gguf_files import Q, write_gguf
from tests.workers.test_tp_sharding import load_rank
from workers import LLM, SamplingParams
from workers.models import gguf
from workers.models.config import ModelConfig

BLOCK = 32
# per-block quantization step of each format, from the block's values: an element may be off by one step
STEP = {
    Q.Q8_0: lambda b: np.abs(b).max(-1) / 127,
    Q.Q5_0: lambda b: np.abs(b).max(-1) / 16,
    Q.Q5_1: lambda b: (b.max(-1) - b.min(-1)) / 31,
    Q.Q4_0: lambda b: np.abs(b).max(-1) / 8,
    Q.Q4_1: lambda b: (b.max(-1) - b.min(-1)) / 15,
}
TEXTS = ["Hello, world!", "  two spaces, then\nnew lines\n\n and tabs\t", "numbers 12345 and 3.14",
         "<|im_start|>user\nhi<|im_end|>", "naïve café, 日本語, emoji 🎉"]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a token?"},
        {"role": "assistant", "content": "A piece of text."}, {"role": "user", "content": "And a block?"}]


@pytest.fixture(scope="module", autouse=True)
def home(tmp_path_factory):
    """$TOKENBUS_HOME for the files hf_dir writes."""
    with pytest.MonkeyPatch.context() as mp:
        path = tmp_path_factory.mktemp("home")
        mp.setenv("TOKENBUS_HOME", str(path))
        yield path


@pytest.fixture(scope="module")
def files(tiny_model, tmp_path_factory):
    """The tiny checkpoint as a GGUF of each type."""
    root = tmp_path_factory.mktemp("gguf")
    return {q: write_gguf(Path(tiny_model), root / f"tiny-{q.name}.gguf", q) for q in gguf.TYPES}


def source(model_dir) -> dict[str, torch.Tensor]:
    return load_file(Path(model_dir) / "model.safetensors")


def assert_loads_as_source(path: Path, src: Path, qtype) -> None:
    """Every tensor of the GGUF at `path` equals `src`'s: exactly in F32 (norms always are, as
    llama.cpp keeps them), exactly the source rounded in F16/BF16, else off by at most one
    quantization step of its block."""
    want = source(src)
    got = dict(gguf.tensors(path))
    assert got.keys() == want.keys()
    for name, expected in want.items():
        actual = got[name][:]
        assert actual.shape == expected.shape, name
        if qtype == Q.F32 or expected.ndim == 1:
            assert torch.equal(actual, expected), name
        elif qtype in (Q.F16, Q.BF16):
            assert torch.equal(actual, expected.to(torch.float16 if qtype == Q.F16 else torch.bfloat16).float()), name
        else:
            blocks = expected.numpy().reshape(expected.shape[0], -1, BLOCK)
            error = np.abs(actual.numpy().reshape(blocks.shape) - blocks).max(-1)
            assert (error <= STEP[qtype](blocks) * 1.01 + 1e-7).all(), name


@pytest.mark.parametrize("qtype", gguf.TYPES, ids=lambda q: q.name)
def test_each_tensor_type_loads_equal_to_the_source_within_its_format(files, tiny_model, qtype):
    assert_loads_as_source(files[qtype], Path(tiny_model), qtype)


@pytest.mark.parametrize("qtype", [Q.F32, Q.Q4_1], ids=lambda q: q.name)
def test_tensors_equal_what_transformers_loads_from_the_same_gguf(files, qtype):
    """transformers' own GGUF loader (its name map, its q/k un-interleave, its dequantizer) is the
    reference for the layout."""
    path = files[qtype]
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).state_dict()
    ours = {name: t[:] for name, t in gguf.tensors(path)}
    assert ours.keys() == hf.keys()
    for name, t in ours.items():
        assert torch.equal(t, hf[name]), name


@pytest.mark.parametrize("qtype", [Q.F32, Q.Q4_1], ids=lambda q: q.name)
def test_tied_embeddings_and_permuted_q_k_biases_load(tmp_path, qtype):
    src = make_checkpoint(tmp_path, "llama-tied-mha-bias")
    path = write_gguf(src, tmp_path / "tied.gguf", qtype)
    config = ModelConfig.load(path)
    assert config.tie_word_embeddings and config.qkv_bias and config.o_bias
    assert_loads_as_source(path, src, qtype)


def test_model_config_comes_from_the_metadata(files, tiny_model):
    assert ModelConfig.load(files[Q.Q8_0]) == ModelConfig.load(tiny_model)


@pytest.mark.parametrize("qtype", [Q.F32, Q.Q4_1], ids=lambda q: q.name)
def test_two_tensor_parallel_ranks_hold_the_halves_of_the_one_rank_weights(files, qtype):
    """Each rank dequantizes its own rows (whole heads of q/k) and columns: together they are the
    single-rank model."""
    one = load_rank(files[qtype], 0, 1)
    ranks = [load_rank(files[qtype], r, 2) for r in range(2)]
    attn, mlp = "model.layers.1.self_attn", "model.layers.1.mlp"
    q_rows, kv_rows = 4 * 64, 2 * 64   # the tiny model: 4 heads, 2 kv heads, head_dim 64
    for r, params in enumerate(ranks):
        full, mine = one[f"{attn}.qkv_proj.weight"], params[f"{attn}.qkv_proj.weight"]
        half_q, half_kv = q_rows // 2, kv_rows // 2
        assert torch.equal(mine[:half_q], full[r * half_q:(r + 1) * half_q])
        assert torch.equal(mine[half_q:half_q + half_kv], full[q_rows + r * half_kv:q_rows + (r + 1) * half_kv])
    assert torch.equal(torch.cat([p[f"{attn}.o_proj.weight"] for p in ranks], dim=1), one[f"{attn}.o_proj.weight"])
    assert torch.equal(torch.cat([p[f"{mlp}.down_proj.weight"] for p in ranks], dim=1), one[f"{mlp}.down_proj.weight"])
    assert torch.equal(torch.cat([p["model.embed_tokens.weight"] for p in ranks]), one["model.embed_tokens.weight"])


def test_greedy_tokens_from_the_f32_gguf_equal_those_from_the_safetensors_dir(files, tiny_model):
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    prompts = ["Once upon a time", "The engine schedules", "1 2 3"]
    with LLM(tiny_model, num_kv_blocks=64) as llm:
        want = [o.token_ids for o in llm.generate(prompts, params)]
        chat_want = llm.chat(CHAT, params)[0].token_ids
    with LLM(str(files[Q.F32]), num_kv_blocks=64) as llm:
        assert [o.token_ids for o in llm.generate(prompts, params)] == want
        assert llm.chat(CHAT, params)[0].token_ids == chat_want


def test_tokenizer_and_chat_template_from_the_metadata_work_as_the_source(files, tiny_model):
    path = files[Q.Q4_0]
    ours = AutoTokenizer.from_pretrained(gguf.hf_dir(path))
    theirs = AutoTokenizer.from_pretrained(tiny_model)
    hf_gguf = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)   # transformers' converter
    for text in TEXTS:
        ids = theirs.encode(text)
        assert ours.encode(text) == ids == hf_gguf.encode(text), text
        assert ours.decode(ids, skip_special_tokens=True) == theirs.decode(ids, skip_special_tokens=True)
    for generation_prompt in (True, False):
        text = theirs.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=generation_prompt)
        assert ours.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=generation_prompt) == text
    assert (ours.bos_token, ours.eos_token, ours.pad_token) == (theirs.bos_token, theirs.eos_token, theirs.pad_token)


def test_hf_dir_writes_the_files_once_in_a_dir_named_as_the_gguf(files, tiny_model, home):
    path = files[Q.Q8_0]
    first = Path(gguf.hf_dir(path))
    assert first.name == path.name and first.is_relative_to(home / "gguf")
    assert gguf.hf_dir(path) == str(first)
    assert {p.name for p in first.iterdir()} == {"config.json", "generation_config.json", "tokenizer.json",
                                                 "tokenizer_config.json", "special_tokens_map.json"}
    assert json.loads((first / "generation_config.json").read_text()) == \
        {k: v for k, v in json.loads((Path(tiny_model) / "generation_config.json").read_text()).items()
         if k.endswith("_token_id")}
    assert gguf.hf_dir(tiny_model) == tiny_model   # a directory is its own


# -- bad files ------------------------------------------------------------------------------------

def copy_cut(path: Path, tmp_path: Path, keep: int) -> Path:
    cut = tmp_path / f"cut-{keep}.gguf"
    cut.write_bytes(path.read_bytes()[:keep])
    return cut


@pytest.mark.parametrize("fraction", [0.0001, 0.01, 0.5, 0.999])
def test_a_truncated_gguf_is_a_clear_error_naming_the_file(files, tmp_path, fraction):
    """Cut in the header, the metadata, the first tensors and the last bytes."""
    size = files[Q.Q8_0].stat().st_size
    cut = copy_cut(files[Q.Q8_0], tmp_path, int(size * fraction))
    with pytest.raises(ValueError, match=f"{re.escape(str(cut))}.*truncated or corrupt"):
        LLM(str(cut), num_kv_blocks=16)


@pytest.mark.parametrize("at", ["magic", "metadata"])
def test_a_corrupt_gguf_is_a_clear_error_naming_the_file(files, tmp_path, at):
    data = bytearray(files[Q.Q8_0].read_bytes())
    start = 0 if at == "magic" else 24      # after magic, version and the two counts: the first key's length
    data[start:start + 8] = b"\xff" * 8
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=f"{re.escape(str(bad))}.*truncated or corrupt"):
        ModelConfig.load(bad)


def test_a_tensor_type_not_read_is_a_clear_error_naming_it_and_the_tensor(tmp_path):
    src = make_checkpoint(tmp_path, "llama")
    path = write_gguf(src, tmp_path / "k.gguf", extra=lambda w: w.add_tensor(
        "blk.0.extra.weight", np.zeros((4, 84), np.uint8), raw_dtype=Q.Q2_K))  # one row of 256 in Q2_K
    with pytest.raises(ValueError, match=re.escape(f"{path}: tensor 'blk.0.extra.weight' is of type Q2_K")):
        LLM(str(path), tokenizer=object(), num_kv_blocks=16)


def test_an_architecture_or_tokenizer_not_read_is_a_clear_error(tmp_path):
    src = make_checkpoint(tmp_path, "llama")
    other = tmp_path / "other.gguf"
    shutil.copy(write_gguf(src, tmp_path / "a.gguf"), other)
    data = other.read_bytes().replace(b"llama", b"gemm2", 1)   # general.architecture's value
    other.write_bytes(data)
    with pytest.raises(ValueError, match=re.escape(f"{other} is a 'gemm2' GGUF; tokenbus reads llama")):
        ModelConfig.load(other)
    no_tokenizer = write_gguf(src, tmp_path / "b.gguf")
    with pytest.raises(ValueError, match=re.escape("lacks the GGUF metadata 'tokenizer.ggml.model'")):
        gguf.hf_dir(no_tokenizer)

import json
import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LlamaConfig

from workers.models import builder as model_builder
from workers.models.builder import BOS, EOS, IM_END, IM_START, PAD, build_tiny_model, default_model_dir

FILES = {"config.json", "generation_config.json", "model.safetensors",
         "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def tokenizer(tiny_dir):
    return AutoTokenizer.from_pretrained(tiny_dir, local_files_only=True)


@pytest.fixture(scope="module")
def config(tiny_dir):
    return json.loads((tiny_dir / "config.json").read_text())


def param_count(model_dir) -> int:
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)
    return sum(p.numel() for p in model.parameters())


def test_two_builds_write_byte_identical_files(tiny_dir, tmp_path):
    again = build_tiny_model(tmp_path / "again")
    assert {p.name for p in tiny_dir.iterdir()} == FILES
    assert {p.name for p in again.iterdir()} == FILES
    for name in sorted(FILES):
        assert (tiny_dir / name).read_bytes() == (again / name).read_bytes(), name


def test_other_seed_gives_other_weights_same_tokenizer(tiny_dir, tmp_path):
    other = build_tiny_model(tmp_path / "seed1", seed=1)
    assert (other / "model.safetensors").read_bytes() != (tiny_dir / "model.safetensors").read_bytes()
    assert (other / "tokenizer.json").read_bytes() == (tiny_dir / "tokenizer.json").read_bytes()


def test_build_leaves_global_torch_rng_alone(tmp_path):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_tiny_model(tmp_path)
    assert torch.equal(torch.rand(3), expected)


def test_tiny_config_is_the_specified_gqa_llama(config):
    assert config["model_type"] == "llama"
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["dtype"] == "float32"
    dims = {k: config[k] for k in model_builder.SIZES["tiny"]}
    assert dims == {"vocab_size": 4096, "hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4,
                    "num_key_value_heads": 2, "intermediate_size": 704}
    assert config["tie_word_embeddings"] is False
    assert config["max_position_embeddings"] == 4096
    assert LlamaConfig.from_dict(config).rope_parameters["rope_theta"] == 10000.0


def test_tiny_loads_offline_and_runs_a_forward_pass(tiny_dir, tokenizer, config):
    model = AutoModelForCausalLM.from_pretrained(tiny_dir, local_files_only=True)
    assert model.dtype == torch.float32
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()  # untied
    ids = torch.tensor([tokenizer.encode("def main():\n    return 0")])
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], config["vocab_size"])
    assert torch.isfinite(logits).all()


def test_tiny_has_4_to_10_million_parameters(tiny_dir):
    assert 4_000_000 <= param_count(tiny_dir) <= 10_000_000


def test_small_builds_with_40_to_60_million_parameters(tmp_path):
    small = build_tiny_model(tmp_path, size="small")
    config = json.loads((small / "config.json").read_text())
    assert (config["vocab_size"], config["num_hidden_layers"], config["num_key_value_heads"]) == (8192, 12, 4)
    assert len(AutoTokenizer.from_pretrained(small, local_files_only=True)) == 8192
    assert 40_000_000 <= param_count(small) <= 60_000_000


def test_unknown_size_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="huge"):
        build_tiny_model(tmp_path, size="huge")


def test_vocab_size_matches_config_and_embeddings(tokenizer, config):
    assert len(tokenizer) == config["vocab_size"] == 4096
    assert tokenizer.backend_tokenizer.get_vocab_size() == 4096


def test_tokenizer_pads_with_reserved_tokens_when_training_falls_short():
    tok = model_builder.train_tokenizer(20_000)  # the corpus yields fewer than 20k merges
    assert tok.get_vocab_size() == 20_000
    assert tok.token_to_id("<|reserved_0|>") is not None


def test_special_token_ids_match_config(tiny_dir, tokenizer, config):
    gen = GenerationConfig.from_pretrained(tiny_dir, local_files_only=True)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in (BOS, PAD, IM_START, IM_END)}
    assert len(set(ids.values())) == 4
    assert EOS == IM_END
    assert tokenizer.bos_token_id == ids[BOS] == config["bos_token_id"] == gen.bos_token_id
    assert tokenizer.eos_token_id == ids[IM_END] == config["eos_token_id"] == gen.eos_token_id
    assert tokenizer.pad_token_id == ids[PAD] == config["pad_token_id"] == gen.pad_token_id
    assert tokenizer.encode(IM_START + IM_END) == [ids[IM_START], ids[IM_END]]  # each one token


@pytest.mark.parametrize("text", [
    "héllo wörld — 你好 🙂",
    "a , b . c ' d n't",  # would change if the decoder "cleaned up" spaces
    "  leading and trailing  \n\ttabs\r\n",
    "def f(x):\n    return x ** 2  # 平方\n",
    "",
])
def test_tokenizer_roundtrips_text_exactly(tokenizer, text):
    assert tokenizer.decode(tokenizer.encode(text)) == text


@settings(max_examples=200, deadline=None)
@given(text=st.text())
def test_tokenizer_roundtrips_any_text(tokenizer, text):
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_chat_template_renders_chatml_turns(tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi, 你好"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n"
                    "<|im_start|>user\nHi, 你好<|im_end|>\n"
                    "<|im_start|>assistant\n")
    closed = tokenizer.apply_chat_template(messages, tokenize=False)
    assert closed == text.removesuffix("<|im_start|>assistant\n")


def test_chat_template_tokenizes_markers_as_special_ids(tokenizer):
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                        return_dict=False)
    im_start, im_end = tokenizer.convert_tokens_to_ids([IM_START, IM_END])
    assert ids[0] == im_start
    assert ids.count(im_start) == 2 and ids.count(im_end) == 1
    assert tokenizer.decode(ids) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENBUS_HOME", str(tmp_path))
    builds = []
    real = model_builder.build_tiny_model

    def counted(out_dir, size="tiny", seed=0):
        builds.append(size)
        return real(out_dir, size, seed)

    monkeypatch.setattr(model_builder, "build_tiny_model", counted)
    return tmp_path, builds


def test_default_model_dir_builds_once_then_reuses(home):
    root, builds = home
    first = default_model_dir()
    assert first == root / "models" / "tiny"
    assert {p.name for p in first.iterdir()} > FILES
    assert default_model_dir() == first
    assert len(builds) == 1
    assert sorted(p.name for p in (root / "models").iterdir()) == ["tiny", "tiny.lock"]  # no temp dirs left


def test_default_model_dir_rebuilds_when_builder_version_changes(home, monkeypatch):
    root, builds = home
    default_model_dir()
    monkeypatch.setattr(model_builder, "builder_version", lambda: "changed")
    path = default_model_dir()
    stamp = json.loads((path / model_builder.MARKER).read_text())
    assert stamp["tokenbus_builder_version"] == "changed"
    assert len(builds) == 2
    assert sorted(p.name for p in (root / "models").iterdir()) == ["tiny", "tiny.lock"]


def test_default_model_dir_ignores_a_half_built_dir(home):
    root, builds = home
    (root / "models" / "tiny").mkdir(parents=True)
    (root / "models" / "tiny" / "config.json").write_text("{}")  # no marker: an interrupted copy
    path = default_model_dir()
    assert len(builds) == 1
    assert {p.name for p in path.iterdir()} > FILES


def test_concurrent_callers_build_once(home):
    root, builds = home
    results = []
    threads = [threading.Thread(target=lambda: results.append(default_model_dir())) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [root / "models" / "tiny"] * 3
    assert len(builds) == 1


def test_failed_build_leaves_no_temp_dir(home, monkeypatch):
    root, _ = home

    def broken(out_dir, size="tiny", seed=0):
        (out_dir / "config.json").write_text("{}")
        raise RuntimeError("disk full")

    monkeypatch.setattr(model_builder, "build_tiny_model", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        default_model_dir()
    assert [p.name for p in (root / "models").iterdir()] == ["tiny.lock"]

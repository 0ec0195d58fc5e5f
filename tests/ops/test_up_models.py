"""`tokenbus up --model A --model B` and `--models FILE`: the flags, a models file's refusals, and the workers
and served models the stack starts with, without starting any process."""
import json

import pytest

from ops import up
from ops.cli import parser as tokenbus
from schemas import served


def up_args(*argv: str):
    return tokenbus().parse_args(["up", *argv])


def started(monkeypatch, stack: up.Stack) -> dict[str, list[str]]:
    """The arguments of every child the stack spawns, by name (nothing is started)."""
    children = {}
    monkeypatch.setattr(up.procs, "start_nats", lambda *a, **k: None)
    monkeypatch.setattr(up, "prepare", lambda url, credentials=None, partitions=None, storage=None: done())
    monkeypatch.setattr(up.Stack, "spawn", lambda self, name, module, *args, **kw: children.setdefault(name, [*args]))
    stack.start()
    return children


async def done():
    return None


def test_each_model_gets_its_workers_and_the_tokenizer_and_gateway_every_model(monkeypatch, tmp_path, tiny_model):
    other = tmp_path / "other"
    other.symlink_to(tiny_model)
    entries = up.model_entries(up_args("--model", tiny_model, "--model", str(other), "--workers", "2"))
    children = started(monkeypatch, up.Stack(tiny_model, 8000, tmp_path, workers=2, models=entries))
    names = {w: a[a.index("--served-model-name") + 1] for w, a in children.items() if w.startswith("w")}
    first = entries[0].served_name
    assert names == {"w0": first, "w1": first, "w2": "other", "w3": "other"}
    models = served.load(tmp_path / "served-models.json")
    assert [m.name for m in models] == [entries[0].served_name, "other"]
    assert models[0].revision == models[1].revision != ""           # the same weights: the same revision
    for child in ("tokenizer", "gateway"):
        assert children[child][children[child].index("--models") + 1] == str(tmp_path / "served-models.json")


def test_a_models_file_names_models_their_workers_and_a_canary(monkeypatch, tmp_path, tiny_model):
    (tmp_path / "models.json").write_text(json.dumps({"models": [
        {"model": tiny_model, "name": "chat", "workers": 1},
        {"model": tiny_model, "name": "code", "workers": 0},
        {"model": tiny_model, "name": "code2", "workers": 2}]}))
    entries = up.model_entries(up_args("--models", str(tmp_path / "models.json")))
    stack = up.Stack(tiny_model, 8000, tmp_path, models=entries)
    assert {w: e.served_name for w, (_, e) in stack.worker_plan.items()} == {"w0": "chat", "w1": "code2",
                                                                              "w2": "code2"}


@pytest.mark.parametrize(("models", "message"), [
    ({"models": [{"name": "x"}]}, "models[0].model: required"),
    ({"models": [{"model": "M", "wrkers": 1}]}, "models[0].wrkers: unknown key"),
    ({"models": [{"model": "M", "workers": -1}]}, "models[0].workers: expected a whole number from 0"),
    ({"models": [{"model": "M", "share": 1}]}, "models[0].share: 1 must be a number in (0, 1)"),
    ({"models": []}, '"models" must be a non-empty list'),
    ([1, 2], "not a models file"),
])
def test_a_bad_models_file_is_refused_naming_the_entry_and_the_key(tmp_path, tiny_model, models, message):
    (tmp_path / "m.json").write_text(json.dumps(models).replace('"M"', json.dumps(tiny_model)))
    with pytest.raises(ValueError) as e:
        up.read_models(str(tmp_path / "m.json"))
    assert message in str(e.value) and "m.json" in str(e.value)


def test_the_same_weights_twice_under_one_name_are_refused_before_anything_starts(tmp_path, tiny_model):
    (tmp_path / "m.json").write_text(json.dumps({"models": [{"model": tiny_model, "name": "a"},
                                                            {"model": tiny_model, "name": "a"}]}))
    stack = up.Stack(tiny_model, 8000, tmp_path, models=up.model_entries(up_args("--models", str(tmp_path / "m.json"))))
    with pytest.raises(ValueError, match=r"models\[1\]: a@[0-9a-f]{12} is served twice"):
        stack.plan()


@pytest.mark.parametrize(("argv", "message"), [
    (["--models", "f.json", "--model", "tiny"], "--models FILE names every model"),
    (["--model", "a", "--model", "b", "--served-model-name", "x"], "--served-model-name names one model"),
])
def test_flags_that_do_not_go_together_are_refused_naming_them(argv, message):
    with pytest.raises(ValueError, match=message):
        up.model_entries(up_args(*argv))


def test_disaggregated_workers_with_two_models_are_refused(tiny_model):
    with pytest.raises(ValueError, match="--prefill-workers and --decode-workers serve one model"):
        up.model_entries(up_args("--model", tiny_model, "--model", tiny_model, "--prefill-workers", "1",
                                 "--decode-workers", "1"))


def test_up_gives_every_gateway_its_generation_config_and_refuses_a_bad_one_before_starting(monkeypatch, tmp_path,
                                                                                          tiny_model):
    bad, good = tmp_path / "bad.json", tmp_path / "good.json"
    bad.write_text('{"temperature": -1}')
    good.write_text('{"top_k": 5}')
    monkeypatch.setattr(up.Stack, "start", lambda self: pytest.fail("started"))
    with pytest.raises(ValueError, match=f"generation config {bad}: temperature must be"):
        up.main(up_args("--model", tiny_model, "--generation-config", str(bad), "--data-dir", str(tmp_path)))
    gateways = []

    def start(stack):
        gateways.append(stack.gateway_args)
        raise KeyboardInterrupt                      # what Ctrl-C does: up stops what it started, exits 0

    monkeypatch.setattr(up.Stack, "start", start)
    monkeypatch.setattr(up.signal, "signal", lambda *a: None)
    with pytest.raises(SystemExit, match="0"):
        up.main(up_args("--model", tiny_model, "--generation-config", str(good), "--data-dir", str(tmp_path)))
    assert gateways == [["--generation-config", str(good)]]

"""`tokenbus bench-spec`: its driver on the tiny model runs every configuration on both workloads and
finds the outputs identical to speculation off; a difference fails the run; its workloads are what
they say; the command parses."""
from argparse import Namespace

import orjson
import pytest
import torch

from lab.benchmarks import spec as bs
from ops.cli import parser


def bench_args(model: str, **kw) -> Namespace:
    defaults = {"model": model, "dtype": None, "k": 4, "draft": None, "workloads": ["single", "concurrent"],
                "requests": 2, "concurrency": 4, "input_len": 32, "output_len": 12, "seed": 0, "threads": 1,
                "json": None, "plot": None}
    return Namespace(**{**defaults, **kw})


@pytest.fixture
def torch_threads():
    """The run sets torch's threads (one here: quicker on a shared machine); the next tests get theirs back."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_every_configuration_runs_both_workloads_with_outputs_identical_to_off(tiny_model, tmp_path, capsys,
                                                                                  torch_threads):
    path, png = tmp_path / "r.json", tmp_path / "r.png"
    assert bs.main(bench_args(tiny_model, json=str(path), plot=str(png))) == 0
    assert png.read_bytes().startswith(b"\x89PNG")
    report = orjson.loads(path.read_bytes())
    assert list(report["workloads"]) == ["single", "concurrent"]
    for wname, w in report["workloads"].items():
        n = 2 if wname == "single" else 4
        assert list(w["configs"]) == ["off", "ngram-k4", "ngram-adaptive"]
        for name, r in w["configs"].items():
            assert r["identical"] is True and r["requests_differing"] == 0, (wname, name)
            assert r["output_tokens"] == r["output_tokens_asked"] == 12 * n and len(r["outputs"]) == n
            assert r["output_tokens_per_s"] > 0 and r["tpot_ms"]["p50"] > 0 and r["vs_off_output_tokens_per_s"] > 0
            if name == "off":
                assert r["acceptance_rate"] is None and r["k"] is None and r["speedup_tpot_p50"] == 1.0
                continue
            assert r["draft_tokens"] > 0 and 0 <= r["accepted_tokens"] <= r["draft_tokens"]   # it did speculate
            assert 0 <= r["acceptance_rate"] <= 1 and 0 <= r["mean_acceptance_length"] <= 4
            assert 1 <= len(r["acceptance_per_position"]) <= 4
            assert all(0 <= a <= 1 for a in r["acceptance_per_position"])
            assert r["k"] == r["k_last"] and 0 <= r["k_last"] <= 4 and 0 <= r["mean_k"] <= 4   # the last choice
        assert w["configs"]["ngram-k4"]["mean_k"] > 0                 # a fixed k drafts whenever there is room
    assert [(g["workload"], g["config"]) for g in report["goals"]] == [
        ("single", "ngram-k4"), ("single", "ngram-adaptive"), ("concurrent", "ngram-adaptive")]
    out = capsys.readouterr().out
    assert out.count("   yes ") == 6 and "goal, concurrent: ngram-adaptive output tok/s ≥ 0.97× off's" in out


def test_an_output_that_differs_from_off_is_named_and_fails_the_run():
    assert bs.identity([[1, 2, 3], [4, 5]], [[1, 2, 3], [4, 5]]) == {"identical": True, "requests_differing": 0}
    differ = bs.identity([[1, 2, 3], [4, 5, 6], [7]], [[1, 2, 3], [4, 9, 6], [8]])
    assert differ == {"identical": False, "requests_differing": 2, "first_difference": {"request": 1, "position": 1}}
    report = {"workloads": {"single": {"configs": {"off": {"identical": True}, "ngram-k4": differ,
                                                   "draft-adaptive": {"error": "ImportError: no module\nmore"}}}}}
    assert bs.failures(report) == [
        "single/ngram-k4: OUTPUTS DIFFER from speculation off in 2 request(s), first at request 1, token 1 (a bug)",
        "single/draft-adaptive did not run: ImportError: no module"]


def test_the_grounded_workload_asks_each_task_of_distinct_passages(tiny_tokenizer):
    w, tasks = bs.grounded(tiny_tokenizer, 8, 32)
    assert tasks == list(bs.TASKS) * 2 and w.concurrency == 1 and all(t.max_tokens == 32 for t in w.turns)
    assert len({tuple(t.prompt) for t in w.turns}) == 8
    text = tiny_tokenizer.decode(w.turns[0].prompt)
    assert "Repeat the following text exactly" in text and bs.PASSAGES[0].text in text       # in the chat template
    assert all(p.old in p.text.split() for p in bs.PASSAGES)            # the word to replace is there to replace
    wrong = bs.misspell(bs.PASSAGES[1].text)
    assert wrong != bs.PASSAGES[1].text and len(wrong) == len(bs.PASSAGES[1].text)
    assert f'replacing "{bs.PASSAGES[2].old}" with "{bs.PASSAGES[2].new}"' in bs.ask("replace", bs.PASSAGES[2])


def test_the_command_parses_with_its_defaults_and_refuses_a_bad_k():
    args = parser().parse_args(["bench-spec"])
    assert (args.model, args.k, args.requests, args.concurrency, args.output_len, args.workloads, args.draft) == (
        "smollm2-135m-instruct", 4, 8, 64, 128, ["single", "concurrent"], None)
    args = parser().parse_args(["bench-spec", "--workloads", "concurrent", "--draft", "d", "--json", "r.json"])
    assert args.workloads == ["concurrent"] and list(bs.configurations(args)) == [
        "off", "ngram-k4", "ngram-adaptive", "draft-adaptive"]
    with pytest.raises(ValueError, match="num_speculative_tokens must be in"):
        bs.configurations(parser().parse_args(["bench-spec", "--k", "0"]))

"""`tokenbus eval ppl` and `tokenbus eval longctx` on the tiny model: the KL divergence and top-1 agreement
against the unquantized float32 model (0 and 1 when the model is compared with itself, llama.cpp's
`--kl-divergence` figures otherwise), the flags of quantization refused by name where the engine has no such
option, and the long-context check's answers beside the unquantized model's."""
import argparse
import json
from pathlib import Path

import pytest
import torch

from ops.cli import main
from workers import eval as ev


def run(capsys, *argv) -> dict:
    main(["eval", *argv, "--json"])
    return json.loads(capsys.readouterr().out)


def test_eval_ppl_json_has_kld_0_and_top1_agreement_1_when_the_model_is_compared_with_itself(tiny_model, capsys):
    r = run(capsys, "ppl", "--model", tiny_model, "--max-tokens", "300")
    assert r["kld"] == 0.0 and r["top1_agreement"] == 1.0 and r["kld_max"] == 0.0
    assert r["predicted"] == 299 and r["reference"]["dtype"] == "float32" and r["reference"]["model"] == tiny_model
    assert (r["kv_cache_dtype"], r["quantization"]) == ("auto", "none")
    assert r["engine"]["mean_logprob"] == r["reference"]["mean_logprob"] and r["ppl_ratio"] == 1.0
    assert set(r["kld_quantiles"]) == {"99.9", "99", "95", "90", "50", "10", "5", "1"}
    assert r["delta_p"] == {"mean": 0.0, "rms": 0.0, "max": 0.0, "min": 0.0}
    assert r["relative_difference"] < 1e-5          # HF transformers' perplexity is still beside it


def test_eval_ppl_in_bfloat16_diverges_from_the_float32_model(tiny_model, capsys):
    r = run(capsys, "ppl", "--model", tiny_model, "--max-tokens", "300", "--dtype", "bfloat16")
    assert r["kld"] > 0 and r["kld_max"] >= r["kld_quantiles"]["99"] >= r["kld_quantiles"]["50"] > 0
    assert 0.5 < r["top1_agreement"] <= 1 and r["ppl_ratio"] != 1.0
    assert r["reference"]["dtype"] == "float32" and r["dtype"] == "bfloat16"


def test_a_reference_with_another_vocabulary_is_refused_naming_the_flag(tiny_model, tmp_path):
    config = json.loads((Path(tiny_model) / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config | {"vocab_size": config["vocab_size"] + 1}))
    with pytest.raises(ValueError, match=f"--reference {tmp_path}: its vocabulary has 4097 tokens, --model's 4096"):
        ev.reference_model(argparse.Namespace(reference=str(tmp_path)), tiny_model)
    assert ev.reference_model(argparse.Namespace(reference=None), tiny_model) == tiny_model


def test_kl_is_the_divergence_of_ours_from_the_reference_in_nats():
    reference, ours = torch.tensor([[0.5, 0.5], [0.9, 0.1]]).log(), torch.tensor([[0.9, 0.1], [0.9, 0.1]]).log()
    want = 0.5 * torch.log(torch.tensor(0.5 / 0.9)) + 0.5 * torch.log(torch.tensor(0.5 / 0.1))
    assert torch.allclose(ev.kl(reference, ours), torch.stack([want, torch.tensor(0.0)]))
    assert torch.allclose(ev.kl(reference, ours), torch.nn.functional.kl_div(ours, reference, log_target=True,
                                                                            reduction="none").sum(-1))


def test_a_quantization_flag_the_engine_has_no_option_for_is_refused_naming_the_flag():
    args = argparse.Namespace(kv_cache_dtype="int8", quantization="none")
    with pytest.raises(ValueError, match="--kv-cache-dtype int8: this engine has no kv_cache_dtype option"):
        ev.quantized(args, fields={"dtype"})
    assert ev.quantized(args, fields={"kv_cache_dtype"}) == {"kv_cache_dtype": "int8"}
    args = argparse.Namespace(kv_cache_dtype="auto", quantization="int8")
    with pytest.raises(ValueError, match="--quantization int8: this engine has no quantization option"):
        ev.quantized(args, fields={"kv_cache_dtype"})
    assert ev.quantized(args, fields={"quantization"}) == {"quantization": "int8"}
    assert ev.quantized(argparse.Namespace(kv_cache_dtype="auto", quantization="none"), fields=set()) == {}


def test_answers_diverge_at_their_first_different_token():
    assert ev.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert ev.first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert ev.first_difference([1, 2], [1, 2, 3]) == 2          # one answer stopped first


def test_prompt_lengths_take_counts_k_and_full_and_cap_them_at_full():
    assert ev.prompt_lengths("1k,4k,full", 8176) == [1024, 4096, 8176]
    assert ev.prompt_lengths("1k,4k,full", 4080) == [1024, 4080]        # 4k does not fit a 4096 context
    assert ev.prompt_lengths("300, 100", 4080) == [100, 300]
    with pytest.raises(ValueError, match="--lengths 1k,lots: 'lots'"):
        ev.prompt_lengths("1k,lots", 4080)


def test_the_needle_prompt_is_the_fact_then_filler_then_the_question_at_the_length_asked(tiny_tokenizer):
    head, tail = ev.framing(tiny_tokenizer)
    ids = ev.needle_prompt(head, tail, [7, 8, 9], 100)
    assert len(ids) == 100 and ids[:len(head)] == head and ids[-len(tail):] == tail
    assert ids[len(head):len(head) + 4] == [7, 8, 9, 7]
    text = tiny_tokenizer.decode(ids)
    assert text.index(ev.FACT) < text.index(ev.QUESTION)
    with pytest.raises(ValueError, match="no room for filler"):
        ev.needle_prompt(head, tail, [7], len(head) + len(tail))


def test_eval_longctx_answers_as_the_model_itself_at_every_length(tiny_model, capsys):
    r = run(capsys, "longctx", "--model", tiny_model, "--lengths", "96,200", "--answer-tokens", "4")
    assert r["context"] == 4096 and r["expected"] == "7431" and r["all_same_answers"] is True
    assert [c["prompt_tokens"] for c in r["checks"]] == [96, 200]
    for c in r["checks"]:
        assert c["same_answer"] is True and c["diverges_at"] is None and c["answer"] == c["reference_answer"]
        assert c["same_recall"] is True and c["seconds"] > 0 and c["reference_seconds"] > 0
    assert r["all_same_recall"] is True
    assert r["reference"] == {"model": tiny_model, "dtype": "float32", "kv_cache_dtype": "auto",
                              "quantization": "none"}

"""The mock engine (EngineConfig(engine="mock"), `--engine mock`): the real scheduler and KV cache, each step held
for the roofline's time of its shape, tokens a hash of (seed, position)."""
import json
import statistics

import pytest

from schemas.sampling import SamplingParams
from workers.engine.engine import EngineConfig, LLMEngine
from workers.engine.mock import mock_token
from workers.engine.roofline import GPUS, Efficiency, Roofline, RooflineCost, StepShape

SMOLLM2 = {"model_type": "llama", "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536,
           "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
           "max_position_embeddings": 8192, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
           "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "eos_token_id": 2}
LLAMA_70B = {**SMOLLM2, "vocab_size": 128256, "hidden_size": 8192, "intermediate_size": 28672,
             "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
             "tie_word_embeddings": False}


def config_dir(tmp_path, hf: dict, name: str) -> str:
    """A model directory with its config.json alone: all the mock reads."""
    path = tmp_path / name
    path.mkdir()
    (path / "config.json").write_text(json.dumps(hf))
    return str(path)


def run(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]], **add) -> dict[str, list[int]]:
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params, **add)
    out = {}
    while engine.has_unfinished():
        for req in engine.step():
            if req.finished:
                out[req.request_id] = req.output_token_ids
    return out


def params(n: int, seed: int | None = 7, **more) -> SamplingParams:
    return SamplingParams(max_tokens=n, seed=seed, **more)


@pytest.mark.serial            # it times steps: alone, or a neighbour's work is counted as Python's
def test_step_times_follow_the_roofline_for_decode_prefill_and_mixed_steps(tmp_path):
    """On an L4 preset a SmolLM2-sized decode step is ~1.3 ms of weight reads and a 1024-token prefill chunk
    ~3.6 ms of FLOPs: each traced step lasts at least its roofline's time, and only Python's few ms more."""
    model = config_dir(tmp_path, SMOLLM2, "smollm2")
    engine = LLMEngine(model, EngineConfig(engine="mock", mock_gpu="l4", max_num_batched_tokens=1024))
    cost = RooflineCost(Roofline(engine.model_cfg, GPUS["l4"], 1, Efficiency(), 2))
    engine.trace = []
    for i in range(6):                               # prefill chunks, then a decode batch of 6
        engine.add_request(f"d{i}", [100 + i] * 300, params(12))
    for _ in range(6):
        engine.step()
    engine.add_request("p", list(range(3, 2003)), params(4))   # prefill chunks among the decodes: mixed steps
    while engine.has_unfinished():
        engine.step()
    kinds = {"decode": [], "prefill": [], "mixed": []}
    for t in engine.trace:
        shape = StepShape(t.num_tokens, t.num_requests, t.num_sampled, t.attention, t.kv_read)
        predicted = cost.seconds(shape)
        assert t.seconds >= predicted, (shape, t.seconds, predicted)
        if t.num_tokens == t.num_requests:
            kind = "decode"
        elif t.num_sampled == 0 or t.num_requests == 1 or (t.num_tokens >= 1024 and t.num_requests <= 4):
            kind = "prefill"
        else:
            kind = "mixed"
        kinds[kind].append((t.seconds - predicted, predicted))
    for kind, steps in kinds.items():
        assert steps, f"no {kind} step"
        assert statistics.median(over for over, _ in steps) < 0.004, (kind, steps)
    decode = statistics.median(p for _, p in kinds["decode"])
    prefill = max(p for _, p in kinds["prefill"])
    assert 1e-3 < decode < 2e-3 and prefill > 2 * decode      # weight reads vs a compute-bound 1024-token chunk
    assert engine.runner.roofline_seconds == pytest.approx(
        sum(cost.seconds(StepShape(t.num_tokens, t.num_requests, t.num_sampled, t.attention, t.kv_read))
            for t in engine.trace))


def test_tokens_are_a_function_of_seed_and_position_and_a_moved_request_continues_them(tiny_model):
    engine = LLMEngine(tiny_model, EngineConfig(engine="mock", num_kv_blocks=256))
    vocab, eos = engine.model_cfg.vocab_size, set(engine.model_cfg.eos_token_ids)
    prompt = [5, 6, 7, 8, 9]
    alone = run(engine, {"a": (prompt, params(24))})["a"]
    assert alone == [mock_token(7, len(prompt) + i, vocab, frozenset(eos)) for i in range(24)]
    assert not eos & set(alone)
    others = {f"o{i}": ([1 + i] * (20 + i), params(10 + i, seed=i)) for i in range(5)}
    batched = run(engine, {"b": (prompt, params(24)), **others})
    assert batched["b"] == alone                     # the same in a batch, with other seeds around it
    assert run(engine, {"c": (prompt, params(24, seed=8))})["c"] != alone
    moved = run(engine, {"m": (prompt, params(24))}, output_token_ids=alone[:10])["m"]
    assert moved == alone                            # migration: prompt + the tokens the client has, then the rest
    appended = run(engine, {"r": (prompt + alone[:10], params(14))})["r"]
    assert appended == alone[10:]                    # sent again with its output in the prompt: the same tokens
    with_logprobs = LLMEngine(tiny_model, EngineConfig(engine="mock", num_kv_blocks=256))
    with_logprobs.add_request("l", prompt, params(6, logprobs=3))
    while with_logprobs.has_unfinished():
        done = [r for r in with_logprobs.step() if r.finished]
    assert done[0].output_token_ids == alone[:6]
    lp = done[0].logprobs
    assert len(lp) == 6 and all(x.top[0] == (t, x.logprob) and len(x.top) == 3 and x.logprob < 0
                                for x, t in zip(lp, alone))


def test_stop_token_ids_and_min_tokens_hold_as_in_the_real_engine(tiny_model):
    engine = LLMEngine(tiny_model, EngineConfig(engine="mock", num_kv_blocks=256))
    first = run(engine, {"a": ([3, 4], params(30))})["a"]
    stop = first[5]
    at = first.index(stop)
    assert run(engine, {"s": ([3, 4], params(30, stop_token_ids=[stop]))})["s"] == first[:at + 1]
    held = run(engine, {"m": ([3, 4], params(30, stop_token_ids=[stop], min_tokens=at + 1))})["m"]
    assert held[:at] == first[:at] and held[at] != stop    # banned until min_tokens: the hash is drawn again


def test_preemption_and_the_prefix_cache_run_as_in_the_real_engine(tiny_model):
    engine = LLMEngine(tiny_model, EngineConfig(engine="mock", num_kv_blocks=14, block_size=16))
    solo = LLMEngine(tiny_model, EngineConfig(engine="mock", num_kv_blocks=256))
    requests = {f"r{i}": ([10 + i] * 40, params(60, seed=i)) for i in range(4)}
    squeezed = run(engine, requests)
    assert engine.stats()["preemptions"] > 0         # 4 × 100 tokens do not fit 14 blocks of 16 at once
    assert squeezed == run(solo, requests)           # preempted requests recompute and go on with the same tokens
    head = list(range(1, 65))                        # 4 full blocks
    solo.kv.prefix_queries = solo.kv.prefix_hits = 0
    run(solo, {"x": (head + [70, 71], params(3))})
    second = solo.add_request("y", head + [80, 81, 82], params(3))
    run(solo, {})
    assert second.num_cached_tokens == 64 and solo.stats()["prefix_cache_hits"] > 0


def test_the_kv_pool_is_the_gpu_presets_memory_less_the_weights(tmp_path):
    model = config_dir(tmp_path, LLAMA_70B, "llama70b")
    engine = LLMEngine(model, EngineConfig(engine="mock", mock_gpu="h100-sxm", mock_tp=8))
    r = Roofline(engine.model_cfg, GPUS["h100-sxm"], 8, Efficiency(), 2)
    assert r.kv_bytes_per_token() == 320 * 1024                     # 80 layers × 8 KV heads × 128 × 2 × 2 bytes
    assert engine.kv.num_blocks == int((8 * 80e9 * 0.9 - r.weight_bytes()) // (320 * 1024 * 16))
    assert 70_000 < engine.kv.num_blocks < 90_000                    # ~1.3M tokens, docs/architecture.md's node
    assert engine.runner.cost.fixed == pytest.approx(2 * 80 * 10e-6)  # two all-reduces a layer at TP 8
    with pytest.raises(ValueError, match="raise mock_tp"):
        LLMEngine(model, EngineConfig(engine="mock", mock_gpu="l4", mock_tp=1))
    assert LLMEngine(model, EngineConfig(engine="mock", num_kv_blocks=100)).kv.num_blocks == 100


def test_what_the_mock_does_not_do_is_refused_naming_the_option(tiny_model):
    for fields, name in (({"tensor_parallel_size": 2}, "tensor_parallel_size"),
                         ({"kv_host_memory": 1 << 20}, "kv_host_memory"),
                         ({"quantization": "int8"}, "quantization"),
                         ({"speculative": f"draft:{tiny_model}:2"}, "speculative"),
                         ({"mock_gpu": "tpu"}, "mock_gpu"), ({"mock_tp": 0}, "mock_tp")):
        with pytest.raises(ValueError, match=name):
            EngineConfig(engine="mock", **fields)
    with pytest.raises(ValueError, match="engine"):
        EngineConfig(engine="fake")
    engine = LLMEngine(tiny_model, EngineConfig(engine="mock", num_kv_blocks=64))
    with pytest.raises(ValueError, match="mock engine"):
        engine.add_request("j", [1, 2, 3], SamplingParams(max_tokens=4, json_object=True))
    layers = range(engine.model_cfg.num_layers)
    kv = engine.runner.read_blocks([1, 2], layers)        # disaggregation's KV: a stand-in that travels
    engine.runner.write_blocks([3, 4], layers, kv)
    assert kv.numel() * kv.element_size() == 2 * engine.runner.block_bytes()


def test_ngram_speculation_and_the_offline_llm_run_on_the_mock(tiny_model):
    from workers import LLM

    llm = LLM(tiny_model, engine="mock", num_kv_blocks=128)
    out = llm.generate([[4, 5, 6]], SamplingParams(max_tokens=12, seed=3, ignore_eos=True))[0]
    vocab, eos = llm.engine.model_cfg.vocab_size, frozenset(llm.engine.model_cfg.eos_token_ids)
    assert out.token_ids == [mock_token(3, 3 + i, vocab, eos) for i in range(12)]
    spec = LLMEngine(tiny_model, EngineConfig(engine="mock", num_kv_blocks=128, speculative="ngram:2"))
    assert run(spec, {"s": ([4, 5, 6] * 8, params(12, seed=3))})["s"] == \
        [mock_token(3, 24 + i, vocab, eos) for i in range(12)]


def test_the_worker_and_up_take_the_mock_flags():
    from ops.cli import parser as tokenbus
    from ops.up import check_roles, worker_args
    from workers.service import engine_config
    from workers.service import parser as worker

    argv = worker_args(tokenbus().parse_args(["up", "--engine", "mock", "--mock-gpu", "h200", "--tp", "8"]))
    assert argv == ["--tp", "8", "--engine", "mock", "--mock-gpu", "h200"]
    cfg = engine_config(worker().parse_args(["--model", "m", *argv]))     # --tp is the simulated size: no ranks
    assert (cfg.engine, cfg.mock_gpu, cfg.mock_tp, cfg.tensor_parallel_size) == ("mock", "h200", 8, 1)
    assert engine_config(worker().parse_args(["--model", "m", "--tp", "2"])).tensor_parallel_size == 2
    assert worker_args(tokenbus().parse_args(["up"])) == []
    assert engine_config(worker().parse_args(["--model", "m"])).engine == "model"
    check_roles(tokenbus().parse_args(["up", "--engine", "mock", "--tp", "8"]))
    with pytest.raises(SystemExit):
        worker().parse_args(["--model", "m", "--mock-gpu", "tpu"])

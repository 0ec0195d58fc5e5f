"""The offline API contract: LLM(model_dir).generate(prompts, params), outputs, stop handling,
clear errors for bad input, stats."""
import pytest

from workers import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_model):
    return LLM(tiny_model, num_kv_blocks=200)


GREEDY = {"temperature": 0, "ignore_eos": True}


def test_generate_takes_strings_and_token_ids_and_returns_text_tokens_and_finish_reason(llm):
    ids = llm.tokenizer.encode("The engine")
    by_text, by_ids = llm.generate(["The engine", ids], SamplingParams(max_tokens=12, **GREEDY))
    assert by_text.token_ids == by_ids.token_ids and len(by_text.token_ids) == 12
    assert by_text.prompt_token_ids == ids
    assert by_text.finish_reason == "length" and by_text.stop_reason is None
    assert by_text.text == llm.tokenizer.decode(by_text.token_ids, skip_special_tokens=True)


def test_one_params_per_prompt_and_a_count_mismatch_is_an_error(llm):
    a, b = llm.generate(["x", "y"], [SamplingParams(max_tokens=3, **GREEDY), SamplingParams(max_tokens=5, **GREEDY)])
    assert (len(a.token_ids), len(b.token_ids)) == (3, 5)
    with pytest.raises(ValueError, match="params"):
        llm.generate(["x", "y"], [SamplingParams()])


def test_a_stop_string_cuts_the_text_before_it_and_ends_with_stop(llm):
    free = llm.generate("Once upon a time", SamplingParams(max_tokens=40, **GREEDY))[0]
    stop = free.text[10:13]
    assert stop and len(free.text) > 13
    out = llm.generate("Once upon a time", SamplingParams(max_tokens=40, stop=[stop], **GREEDY))[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == free.text[:free.text.index(stop)]
    assert free.token_ids[:len(out.token_ids)] == out.token_ids and len(out.token_ids) < 40


def test_a_stop_token_id_ends_the_request_after_that_token(llm):
    free = llm.generate("Once upon a time", SamplingParams(max_tokens=30, **GREEDY))[0]
    stop_id = free.token_ids[4]
    first = free.token_ids.index(stop_id)
    out = llm.generate("Once upon a time", SamplingParams(max_tokens=30, stop_token_ids=[stop_id], **GREEDY))[0]
    assert out.token_ids == free.token_ids[:first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id


def test_logprobs_come_with_each_token_when_asked(llm):
    out = llm.generate("abc", SamplingParams(max_tokens=5, logprobs=3, **GREEDY))[0]
    assert len(out.logprobs) == 5
    for token, lp in zip(out.token_ids, out.logprobs):
        assert len(lp.top) == 3 and lp.top[0][0] == token and lp.logprob == pytest.approx(lp.top[0][1])
    assert llm.generate("abc", SamplingParams(max_tokens=2))[0].logprobs is None


def test_chat_applies_the_chat_template(llm):
    messages = [{"role": "user", "content": "hi"}]
    out = llm.chat(messages, SamplingParams(max_tokens=4, **GREEDY))[0]
    assert out.prompt_token_ids == llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                                     tokenize=True, return_dict=False)


def test_stats_count_prefix_cache_hits_in_tokens(llm):
    prompt = list(range(100, 180))
    before = llm.stats()
    llm.generate([prompt], SamplingParams(max_tokens=2, **GREEDY))
    llm.generate([prompt], SamplingParams(max_tokens=2, **GREEDY))
    after = llm.stats()
    assert after["prefix_cache_queries"] - before["prefix_cache_queries"] == 160
    assert after["prefix_cache_hits"] - before["prefix_cache_hits"] == 64   # 4 full blocks; the 80th token recomputed
    assert after["kv_blocks_free"] == after["kv_blocks_total"] == 200
    assert after["steps"] > before["steps"] and after["preemptions"] == 0


@pytest.mark.parametrize("prompt, params, message", [
    ([], SamplingParams(), "prompt is empty"),
    ("", SamplingParams(), "prompt is empty"),
    ([1, 2, 4096], SamplingParams(), r"token id 4096 is outside the vocabulary \[0, 4096\)"),
    ([1, -1], SamplingParams(), "token id -1"),
    ([1] * 4096, SamplingParams(), "prompt has 4096 tokens; max_model_len=4096"),
    ([1] * 100, SamplingParams(max_tokens=4000), r"needs 256 KV blocks .*num_kv_blocks=200"),
])
def test_bad_requests_are_refused_with_the_field_and_limit_named_and_nothing_half_added(llm, prompt, params, message):
    with pytest.raises(ValueError, match=r"prompts\[1\]: .*" + message):
        llm.generate([[5, 6, 7], prompt], [SamplingParams(), params])
    assert not llm.engine.has_unfinished() and not llm.engine.requests
    assert llm.stats()["kv_blocks_free"] == 200
    assert len(llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2))[0].token_ids) == 2


@pytest.mark.parametrize("field, value, message", [
    ("max_tokens", 0, r"max_tokens must be in \[1, 1048576\]"),
    ("temperature", -0.5, r"temperature must be 0 \(greedy\) or in \[1e-05, 100.0\]"),
    ("top_p", 0.0, r"top_p must be in \(0, 1\]"),
    ("top_p", 1.5, r"top_p must be in \(0, 1\]"),
    ("top_k", -2, "top_k"),
    ("min_p", 2.0, "min_p"),
    ("repetition_penalty", 0.0, "repetition_penalty"),
    ("logprobs", 50, "logprobs"),
    ("stop", ["ok", ""], "stop must not contain an empty string"),
])
def test_sampling_params_name_the_field_and_limit(field, value, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**{field: value})


def test_the_tiny_model_named_is_built_offline_on_first_use(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENBUS_HOME", str(tmp_path))
    out = LLM("tiny", num_kv_blocks=32).generate("hello", SamplingParams(max_tokens=3, **GREEDY))[0]
    assert len(out.token_ids) == 3 and (tmp_path / "models" / "tiny" / "config.json").is_file()


def test_an_interrupted_generate_leaves_nothing_in_the_engine(llm, monkeypatch):
    real_step, calls = llm.engine.step, []

    def failing_step():
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real_step()

    monkeypatch.setattr(llm.engine, "step", failing_step)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(["a", "b"], SamplingParams(max_tokens=20, **GREEDY))
    assert not llm.engine.has_unfinished() and not llm.engine.requests
    assert llm.stats()["kv_blocks_free"] == 200


@pytest.mark.parametrize("option, value, message", [
    ("max_num_batched_tokens", 0, "max_num_batched_tokens must be at least 1"),
    ("num_kv_blocks", 0, "num_kv_blocks must be at least 1"),
    ("block_size", -16, "block_size must be at least 1"),
    ("gpu_memory_utilization", 1.5, r"gpu_memory_utilization must be in \(0, 1\]"),
])
def test_engine_options_name_the_option_and_limit(tiny_model, option, value, message):
    with pytest.raises(ValueError, match=message):
        LLM(tiny_model, **{option: value})


def test_without_chunked_prefill_a_request_larger_than_the_budget_is_refused(tiny_model):
    llm = LLM(tiny_model, num_kv_blocks=64, enable_chunked_prefill=False, max_num_batched_tokens=64)
    with pytest.raises(ValueError, match="more than max_num_batched_tokens=64"):
        llm.generate([[5] * 40], SamplingParams(max_tokens=30))
    assert len(llm.generate([[5] * 40], SamplingParams(max_tokens=20))[0].token_ids) == 20


def test_generate_without_params_runs_with_the_model_s_sampling_defaults_and_given_params_as_they_are(tiny_model,
                                                                                                    tmp_path):
    mine = tmp_path / "generation_config.json"
    mine.write_text('{"temperature": 0.5, "top_k": 7, "repetition_penalty": 1.3}')
    llm = LLM(tiny_model, generation_config=str(mine), num_kv_blocks=64, seed=5)
    assert llm.sampling_defaults == {"temperature": 0.5, "top_k": 7, "repetition_penalty": 1.3}
    assert llm.sampling_params(seed=3) == SamplingParams(seed=3, temperature=0.5, top_k=7, repetition_penalty=1.3)
    assert llm.sampling_params(top_k=0, seed=3) == SamplingParams(seed=3, temperature=0.5, repetition_penalty=1.3)
    assert llm.sampling_params(temperature=0) == SamplingParams(temperature=0)      # greedy: none of them
    want = llm.generate("The engine", SamplingParams(seed=9, max_tokens=16, temperature=0.5, top_k=7,
                                                     repetition_penalty=1.3))[0].token_ids
    assert llm.generate("The engine", llm.sampling_params(seed=9))[0].token_ids == want
    assert LLM(tiny_model, generation_config="none", num_kv_blocks=64).sampling_params() == SamplingParams()

"""Tensor parallel over gloo on the CPU, in float32: one replica over two processes gives the tokens of one,
each rank holds half of the weights and of the KV pool, and a dead rank ends the replica with an
error that names it, leaving no process behind."""
import os
import re
import signal
import time

import pytest
import torch

from schemas.sampling import SamplingParams
from tests.workers.checkpoints import ARCHS, BASE, make_checkpoint
from workers import LLM
from workers.distributed import WorkerFailure

pytestmark = pytest.mark.timeout(120)

# a long shared head (prefix-cache hits), a prompt longer than the 32-token budget (chunked
# prefill) and short ones decoding beside it
PROMPTS = [[1, 5, 9, 33, 100, 7], list(range(10, 90)), list(range(10, 50)) + [3] * 12, [7] * 20]
OPTIONS = {"block_size": 8, "num_kv_blocks": 96, "max_num_batched_tokens": 32, "dtype": "float32"}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp")
    return {arch: make_checkpoint(root, arch) for arch in ARCHS}


def alive(pid: int) -> bool:
    """Running, not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def children(pid: int) -> list[int]:
    """Live child processes of pid."""
    kids = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) == pid and alive(int(entry)):
                    kids.append(int(entry))
        except (FileNotFoundError, ProcessLookupError):
            pass
    return kids


def gone(pids: list[int], within: float = 10.0) -> bool:
    deadline = time.monotonic() + within
    while any(alive(p) for p in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_two_ranks_give_the_greedy_tokens_of_one(checkpoints, tiny_tokenizer, arch):
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    want = [o.token_ids for o in LLM(str(checkpoints[arch]), tiny_tokenizer, **OPTIONS).generate(PROMPTS, params)]
    with LLM(str(checkpoints[arch]), tiny_tokenizer, tensor_parallel_size=2, **OPTIONS) as llm:
        got = llm.generate(PROMPTS, params)
        assert llm.stats()["prefix_cache_hits"] > 0        # the shared head was served from the cache
    assert [o.token_ids for o in got] == want


def test_two_ranks_with_speculative_decoding_give_the_tokens_of_one_without(checkpoints, tiny_tokenizer):
    """Drafts are input tokens like any other for the followers; rank 0 drafts and verifies."""
    params = SamplingParams(max_tokens=16, temperature=0.8, seed=4, ignore_eos=True)
    path = str(checkpoints["llama"])
    want = [o.token_ids for o in LLM(path, tiny_tokenizer, **OPTIONS).generate(PROMPTS, params)]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "adaptive": False}
    with LLM(path, tiny_tokenizer, tensor_parallel_size=2, speculative=spec, **OPTIONS) as llm:
        got = llm.generate(PROMPTS, params)
        assert llm.stats()["spec_draft_tokens"] > 0
    assert [o.token_ids for o in got] == want


def test_two_ranks_constrain_outputs_on_rank_0_and_give_the_tokens_of_one(checkpoints, tiny_tokenizer):
    """Grammar masks are sampling, which only rank 0 does: the followers run the same forward."""
    path = str(checkpoints["llama"])
    tiny_tokenizer.save_pretrained(path)           # the engine builds its grammars' vocabulary from the model's
    params = [SamplingParams(max_tokens=12, regex="[0-9]{3}-[a-z]{2,4}"),
              SamplingParams(max_tokens=12, temperature=0.8, seed=3, choice=["alpha", "beta", "gamma"]),
              SamplingParams(max_tokens=12, ignore_eos=True), SamplingParams(max_tokens=12, json_object=True)]
    want = LLM(path, tiny_tokenizer, **OPTIONS).generate(PROMPTS, params)
    with LLM(path, tiny_tokenizer, tensor_parallel_size=2, **OPTIONS) as llm:
        got = llm.generate(PROMPTS, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert re.fullmatch("[0-9]{3}-[a-z]{2,4}", got[0].text) and got[1].text in ("alpha", "beta", "gamma")
    assert got[0].finish_reason == got[1].finish_reason == "stop"


def test_each_rank_holds_half_the_weights_and_half_the_kv_pool(checkpoints, tiny_tokenizer):
    path = str(checkpoints["llama"])     # 4 heads, 2 KV heads: everything splits
    one = LLM(path, tiny_tokenizer, **OPTIONS).engine.runner.rank_bytes
    with LLM(path, tiny_tokenizer, tensor_parallel_size=2, **OPTIONS) as llm:
        two = llm.engine.runner.rank_bytes
    (params_one, kv_one), = one
    hidden, layers = BASE["hidden_size"], BASE["num_hidden_layers"]
    norms = (2 * layers + 1) * hidden * 4          # replicated on every rank
    for params, kv in two:
        assert kv == kv_one // 2
        assert params - norms == (params_one - norms) // 2


def test_kv_heads_fewer_than_ranks_are_replicated_and_still_agree(checkpoints, tiny_tokenizer):
    path = str(checkpoints["qwen3"])     # 1 KV head: each rank holds a copy
    (_, kv_one), = LLM(path, tiny_tokenizer, **OPTIONS).engine.runner.rank_bytes
    with LLM(path, tiny_tokenizer, tensor_parallel_size=2, **OPTIONS) as llm:
        assert [kv for _, kv in llm.engine.runner.rank_bytes] == [kv_one, kv_one]


def test_a_model_that_does_not_split_is_refused_before_any_follower_starts(checkpoints, tiny_tokenizer):
    with pytest.raises(ValueError, match="num_attention_heads=4 must divide by tensor_parallel_size=3"):
        LLM(str(checkpoints["llama"]), tiny_tokenizer, tensor_parallel_size=3, **OPTIONS)
    assert not torch.distributed.is_initialized()


def test_a_killed_follower_ends_the_replica_with_an_error_naming_it(checkpoints, tiny_tokenizer):
    llm = LLM(str(checkpoints["llama"]), tiny_tokenizer, tensor_parallel_size=2, **OPTIONS)
    pids = llm.engine.followers.pids()
    try:
        os.kill(pids[0], signal.SIGKILL)
        deadline = time.monotonic() + 5
        with pytest.raises(WorkerFailure, match=rf"tensor-parallel rank 1 \(pid {pids[0]}\) was killed by SIGKILL"):
            while time.monotonic() < deadline:
                llm.engine.check_alive()
                time.sleep(0.05)
        with pytest.raises(WorkerFailure, match="rank 1"):
            llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4))
    finally:
        llm.close()
    assert gone(pids)
    assert not torch.distributed.is_initialized()   # the group is left: a new replica can start
    with LLM(str(checkpoints["llama"]), tiny_tokenizer, tensor_parallel_size=2, **OPTIONS) as again:
        assert again.generate([[1, 2, 3]], SamplingParams(max_tokens=2))[0].token_ids


def test_a_follower_killed_mid_generation_fails_the_step(checkpoints, tiny_tokenizer):
    llm = LLM(str(checkpoints["llama"]), tiny_tokenizer, tensor_parallel_size=2, **OPTIONS)
    pid = llm.engine.followers.pids()[0]
    llm.engine.add_request("r", list(range(1, 60)), SamplingParams(max_tokens=400, ignore_eos=True))
    try:
        with pytest.raises(WorkerFailure, match="rank 1"):
            for i in range(1000):
                llm.engine.step()
                if i == 3:
                    os.kill(pid, signal.SIGKILL)
    finally:
        llm.close()
    assert gone([pid])


def test_closing_stops_every_follower(checkpoints, tiny_tokenizer):
    llm = LLM(str(checkpoints["llama"]), tiny_tokenizer, tensor_parallel_size=2, **OPTIONS)
    pids = llm.engine.followers.pids()
    llm.close()
    llm.close()                                       # twice is harmless
    assert gone(pids, within=1.0)


def test_closing_gives_the_process_its_threads_back(checkpoints, tiny_tokenizer):
    before = torch.get_num_threads()
    with LLM(str(checkpoints["llama"]), tiny_tokenizer, tensor_parallel_size=2, **OPTIONS):
        assert torch.get_num_threads() == max(1, os.cpu_count() // 2)   # the two ranks share the cores
    assert torch.get_num_threads() == before


def test_a_checkpoint_that_fails_to_load_leaves_no_follower(tmp_path, tiny_tokenizer):
    import shutil

    from safetensors.torch import load_file, save_file

    path = shutil.copytree(make_checkpoint(tmp_path, "llama"), tmp_path / "broken")
    weights = load_file(path / "model.safetensors")
    del weights["model.norm.weight"]
    save_file(weights, path / "model.safetensors")
    before = set(children(os.getpid()))   # e.g. multiprocessing's resource tracker, from another test
    with pytest.raises(ValueError, match=r"lacks weights for model\.norm\.weight"):
        LLM(str(path), tiny_tokenizer, tensor_parallel_size=2, **OPTIONS)
    assert gone([p for p in children(os.getpid()) if p not in before], within=5.0)
    assert not torch.distributed.is_initialized()

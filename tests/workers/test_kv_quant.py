"""The quantized KV cache in the engine (EngineConfig.kv_cache_dtype int8 and fp8): the pool buys about
2x bfloat16's blocks and 4x float32's for the same bytes; in each KV dtype a request's tokens are the same
bits alone or in any batch, with prefix caching on or off, under preemption, chunked prefill, speculation
and forks; a token's KV and logits are the same however its sequence was scheduled; a disaggregated
transfer carries the blocks' scales, and one between pools of different dtypes is refused by name.
The kernels' side is tests/kernels/test_kv_quant_kernels.py."""
import asyncio
from types import SimpleNamespace

import pytest
import structlog
import torch

from schemas.hashing import hash_blocks
from schemas.messages import KvFetch, Prefilled, decode
from tests.workers import test_speculative as speculative
from tests.workers.test_batch_invariance import TARGET, run_schedule
from workers import SamplingParams
from workers.engine.engine import KV_CACHE_DTYPES, EngineConfig, LLMEngine
from workers.engine.runner import ModelRunner
from workers.kv_transfer import NatsKvTransport
from workers.models.config import ModelConfig

QUANTIZED = ["int8", "fp8"]
SHARED = [(j * 13) % 3000 + 10 for j in range(48)]  # a 3-block prefix the prefix cache can hit
PROMPTS = [SHARED + [5, 6, 7], SHARED + list(range(200, 215)), list(range(300, 341)), SHARED + [5, 6, 7, 8]]
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=1)


def generate(model: str, prompts, params=GREEDY, **config) -> tuple[list, dict]:
    """(tokens, logprobs) of each prompt, and the engine's stats."""
    engine = LLMEngine(model, EngineConfig(**{"device": "cpu", **config}))
    reqs = [engine.add_request(f"r{i}", p, params) for i, p in enumerate(prompts)]
    while engine.has_unfinished():
        engine.step()
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    return [(r.output_token_ids, [lp.logprob for lp in r.logprobs]) for r in reqs], engine.stats()


# -- the pool ----------------------------------------------------------------------------------------

def test_the_pool_buys_about_twice_bfloat16s_and_four_times_float32s_blocks_for_the_same_bytes(tiny_model):
    budget = 1 << 22
    blocks, row = {}, {}
    for dtype in ("float32", "bfloat16"):
        for kv in KV_CACHE_DTYPES:
            engine = LLMEngine(tiny_model, EngineConfig(device="cpu", dtype=dtype, kv_cache_memory=budget,
                                                        kv_cache_dtype=kv))
            runner = engine.runner
            assert engine.kv.num_blocks == budget // runner.block_bytes() == runner.kv_pool.shape[2]
            assert runner.kv_pool.nbytes == engine.kv.num_blocks * runner.block_bytes() <= budget
            blocks[dtype, kv], row[dtype, kv] = engine.kv.num_blocks, runner.kv_pool.shape[-1]
            assert runner.kv_pool.dtype == {"auto": getattr(torch, dtype), "int8": torch.int8,
                                            "fp8": torch.float8_e4m3fn}[kv]
    head_dim = row["float32", "auto"]
    for kv in QUANTIZED:
        assert row["float32", kv] == row["bfloat16", kv] == head_dim + 2   # the row's bfloat16 scale
        assert blocks["float32", kv] == blocks["bfloat16", kv]             # the pool's dtype alone sizes it
        assert blocks["bfloat16", kv] / blocks["bfloat16", "auto"] >= 1.9
        assert blocks["float32", kv] / blocks["float32", "auto"] >= 3.8


def test_an_unknown_kv_cache_dtype_is_an_error_naming_the_field_and_its_choices():
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, int8, fp8"):
        EngineConfig(kv_cache_dtype="int4")


# -- the same tokens, in each KV dtype -----------------------------------------------------------------

@pytest.fixture(scope="module", params=QUANTIZED)
def alone(request, tiny_model):
    """Each prompt's greedy tokens and logprobs, alone, in this KV dtype."""
    kv = request.param
    return kv, [generate(tiny_model, [p], kv_cache_dtype=kv, num_kv_blocks=64)[0][0] for p in PROMPTS]


def test_batched_prefix_cached_preempted_and_chunked_requests_give_the_tokens_alone(tiny_model, alone):
    kv, want = alone
    batched, _ = generate(tiny_model, PROMPTS, kv_cache_dtype=kv, num_kv_blocks=64)
    one_by_one, cached = generate(tiny_model, PROMPTS, kv_cache_dtype=kv, num_kv_blocks=64, max_num_seqs=1)
    uncached, off = generate(tiny_model, PROMPTS, kv_cache_dtype=kv, num_kv_blocks=64, max_num_seqs=1,
                             enable_prefix_caching=False)
    preempted, tiny_pool = generate(tiny_model, PROMPTS, kv_cache_dtype=kv, num_kv_blocks=9)
    chunked, _ = generate(tiny_model, PROMPTS, kv_cache_dtype=kv, num_kv_blocks=64, max_num_batched_tokens=20)
    assert cached["prefix_cache_hits"] >= 2 * len(SHARED) and off["prefix_cache_hits"] == 0
    assert tiny_pool["preemptions"] > 0
    for name, got in {"batched": batched, "prefix cache": one_by_one, "no prefix cache": uncached,
                      "preempted": preempted, "chunked": chunked}.items():
        assert got == want, name


@pytest.mark.parametrize("kv", QUANTIZED)
def test_speculation_gives_the_same_tokens_as_without_it_in_a_quantized_cache(tiny_model, kv):
    # test_speculative's prompts (with repeats, so that the n-gram proposer drafts) and sampling; drafts
    # rejected are rolled back (their slots written again)
    options = {"kv_cache_dtype": kv, "num_kv_blocks": 64}
    prompts, params = speculative.PROMPTS[:2], speculative.PARAMS[:2]
    want, _ = speculative.run(tiny_model, None, prompts, params, **options)
    got, stats = speculative.run(tiny_model, speculative.ngram(), prompts, params, **options)
    assert got == want
    assert stats["spec_draft_tokens"] > stats["spec_accepted_tokens"] > 0


@pytest.mark.parametrize("kv", QUANTIZED)
def test_forked_choices_copy_the_partial_blocks_scales_and_each_is_its_seed_alone(tiny_model, kv):
    prompt = [(j * 11) % 4000 + 10 for j in range(43)]     # 2 full blocks of 16 and a partial one, copied
    engine = LLMEngine(tiny_model, EngineConfig(device="cpu", num_kv_blocks=64, kv_cache_dtype=kv,
                                                enable_prefix_caching=False))

    def run(seeds, group):
        reqs = [engine.add_request(f"{group}-{s}", prompt, SamplingParams(
            max_tokens=6, temperature=0.9, seed=s, ignore_eos=True, logprobs=1), group=group) for s in seeds]
        while engine.has_unfinished():
            engine.step()
        return [(r.output_token_ids, [lp.logprob for lp in r.logprobs]) for r in reqs]

    alone = [run([s], "")[0] for s in range(3)]
    assert run(range(3), "n3") == alone and engine.scheduler.num_forks == 2


# -- batch invariance -----------------------------------------------------------------------------------

LONG = 128   # with the prompts, past the CPU kernel's KV tiles of 64 and the reference's splits of 128


def watched_in_batch(model: str, kv: str, batch_size: int) -> dict:
    """A greedy and a seeded request's (tokens, logprobs) of LONG tokens, among batch_size - 2 neighbours of
    other lengths that end at other times."""
    engine = LLMEngine(model, EngineConfig(device="cpu", num_kv_blocks=400, kv_cache_dtype=kv))
    watched = {
        "greedy": engine.add_request("greedy", [(99 * 37 + j * 11) % 4000 + 10 for j in range(40)],
                                     SamplingParams(max_tokens=LONG, temperature=0, ignore_eos=True, logprobs=1)),
        "seeded": engine.add_request("seeded", [(98 * 37 + j * 11) % 4000 + 10 for j in range(17)], SamplingParams(
            max_tokens=LONG, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True, logprobs=1))}
    for i in range(batch_size - 2):
        engine.add_request(f"n{i}", [(i * 37 + j * 11) % 4000 + 10 for j in range(5 + 13 * i)], SamplingParams(
            max_tokens=LONG // (i % 3 + 1), temperature=0 if i % 2 else 0.9, seed=i, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    return {name: (r.output_token_ids, [lp.logprob for lp in r.logprobs]) for name, r in watched.items()}


@pytest.mark.parametrize("kv", QUANTIZED)
def test_long_generations_are_the_same_bits_alone_and_in_a_batch_of_4(tiny_model, kv):
    alone = watched_in_batch(tiny_model, kv, 2)
    batched = watched_in_batch(tiny_model, kv, 4)
    assert len(alone["greedy"][0]) == len(alone["seeded"][0]) == LONG
    assert batched == alone


@pytest.fixture(scope="module", params=[(torch.float32, "int8"), (torch.bfloat16, "fp8")], ids=["f32-int8",
                                                                                                "bf16-fp8"])
def runner(tiny_model, request):
    dtype, kv = request.param
    runner = ModelRunner(tiny_model, ModelConfig.load(tiny_model), dtype, torch.device("cpu"), 16, kv_cache_dtype=kv)
    runner.allocate_kv(160)
    return runner


@pytest.mark.parametrize("name", ["chunks beside a neighbour", "a tile-crossing chunk, then decodes"])
def test_a_tokens_quantized_kv_and_logits_are_the_same_in_one_prefill_in_chunks_or_decodes(runner, name):
    logits, kv = run_schedule(runner, "one prefill", 0)
    other_logits, other_kv = run_schedule(runner, name, 40)
    assert kv.shape[-1] == runner.model.attention_layers()[0].head_dim + 2 and len(logits) == len(TARGET)
    assert torch.equal(other_kv.view(torch.uint8), kv.view(torch.uint8))
    assert torch.equal(other_logits, logits)


# -- disaggregated transfer ---------------------------------------------------------------------------

class Bus:
    """The bus between two workers' transports, in process: a fetch is answered by the prefill side's
    transport, a release lets its lease go."""
    max_payload = 1 << 20

    def __init__(self, prefill: NatsKvTransport):
        self.prefill = prefill

    async def request(self, subject: str, data: bytes, timeout: float):
        return SimpleNamespace(data=self.prefill.answer(decode(data, KvFetch)))

    async def publish(self, subject: str, data: bytes):
        ask = decode(data, KvFetch)
        if ask.release:
            self.prefill.release(ask.lease)


def transfer(model: str, prompt: list[int], prefill_kv: str, decode_kv: str):
    """The prefill worker computes the prompt and offers its full blocks; the decode worker pulls them.
    Returns (what the pull did, both engines, the hashes)."""
    bs = 16
    p, d = (LLMEngine(model, EngineConfig(device="cpu", num_kv_blocks=64, kv_cache_dtype=kv))
            for kv in (prefill_kv, decode_kv))
    p.add_request("warm", prompt, SamplingParams(max_tokens=1, temperature=0))
    while p.has_unfinished():
        p.step()
    hashes = hash_blocks(prompt, bs, None)[:len(prompt) // bs]
    log = structlog.get_logger()

    async def main():
        pt = NatsKvTransport(SimpleNamespace(max_payload=Bus.max_payload), "p0", p, log, asyncio.Lock())
        dt = NatsKvTransport(Bus(pt), "d0", d, log, asyncio.Lock())
        lease, held = pt.offer("r", hashes)
        assert held == hashes
        pulled = await dt.fetch("r", Prefilled("p0", lease, held, bs, [0], 0), hashes)
        assert not pt.leases          # released
        return pulled
    return asyncio.run(main()), p, d, hashes


@pytest.mark.parametrize("kv", QUANTIZED)
def test_a_transfer_carries_the_blocks_scales_and_the_decode_worker_continues_with_the_same_tokens(tiny_model, kv):
    prompt = [(7 + 31 * i) % 4000 + 10 for i in range(70)]   # 4 full blocks travel
    pulled, p, d, hashes = transfer(tiny_model, prompt, kv, kv)
    assert not pulled.error and pulled.blocks == len(hashes) == 4
    assert pulled.bytes == len(hashes) * d.runner.block_bytes()
    for h in hashes:
        a, b = (e.runner.kv_pool[:, :, e.kv.cached[h].block_id].view(torch.uint8) for e in (p, d))
        assert torch.equal(a, b) and bool(a.any())
    want, _ = generate(tiny_model, [prompt], kv_cache_dtype=kv, num_kv_blocks=64)
    req = d.add_request("r", prompt, GREEDY)
    while d.has_unfinished():
        d.step()
    assert d.stats()["prefix_cache_hits"] == 4 * 16
    assert [(req.output_token_ids, [lp.logprob for lp in req.logprobs])] == want


@pytest.mark.parametrize("prefill_kv, decode_kv", [("int8", "auto"), ("auto", "fp8"), ("int8", "fp8")])
def test_a_transfer_between_pools_of_different_kv_dtypes_is_refused_naming_both(tiny_model, prefill_kv, decode_kv):
    prompt = [(7 + 31 * i) % 4000 + 10 for i in range(40)]
    pulled, _, d, _ = transfer(tiny_model, prompt, prefill_kv, decode_kv)
    names = {"auto": str(d.dtype).removeprefix("torch."), "int8": "int8", "fp8": "float8_e4m3fn"}  # auto: the model's
    assert pulled.blocks == 0 and f"KV is {names[prefill_kv]} " in pulled.error
    assert f"this worker's {names[decode_kv]} " in pulled.error and "kv_cache_dtype" in pulled.error
    assert not d.kv.cached


def test_write_blocks_refuses_kv_of_another_dtype_or_row(tiny_model):
    engine = LLMEngine(tiny_model, EngineConfig(device="cpu", num_kv_blocks=8, kv_cache_dtype="int8"))
    kv = engine.runner.read_blocks([1, 2], range(0, 2))
    assert kv.dtype == torch.int8 and kv.shape[2:] == (2, *engine.runner.kv_pool.shape[3:])
    engine.runner.write_blocks([3, 4], range(0, 2), kv)
    with pytest.raises(ValueError, match=r"does not fit this pool's torch\.int8"):
        engine.runner.write_blocks([3, 4], range(0, 2), kv.view(torch.float8_e4m3fn))


# -- the flags ------------------------------------------------------------------------------------------

def test_up_passes_kv_cache_dtype_to_every_worker_and_generate_takes_it():
    from ops import commands, up
    from ops.cli import parser as tokenbus
    from workers.service import engine_config
    from workers.service import parser as worker

    assert commands.KV_CACHE_DTYPES == KV_CACHE_DTYPES
    argv = up.worker_args(tokenbus().parse_args(["up", "--kv-cache-dtype", "fp8"]))
    assert argv == ["--kv-cache-dtype", "fp8"]
    assert engine_config(worker().parse_args(["--model", "m", *argv])).kv_cache_dtype == "fp8"
    assert up.worker_args(tokenbus().parse_args(["up"])) == []
    assert engine_config(worker().parse_args(["--model", "m"])).kv_cache_dtype == "auto"
    assert tokenbus().parse_args(["generate", "hi", "--kv-cache-dtype", "int8"]).kv_cache_dtype == "int8"
    with pytest.raises(SystemExit):
        worker().parse_args(["--model", "m", "--kv-cache-dtype", "int4"])


def test_two_tensor_parallel_ranks_each_quantize_their_heads_and_give_one_ranks_tokens(tiny_model):
    prompts = PROMPTS[1:3]
    want, _ = generate(tiny_model, prompts, kv_cache_dtype="int8", num_kv_blocks=32, dtype="float32")
    engine = LLMEngine(tiny_model, EngineConfig(device="cpu", num_kv_blocks=32, kv_cache_dtype="int8",
                                                tensor_parallel_size=2, dtype="float32"))   # as test_tensor_parallel
    try:
        reqs = [engine.add_request(f"r{i}", p, GREEDY) for i, p in enumerate(prompts)]
        while engine.has_unfinished():
            engine.step()
        assert engine.runner.kv_pool.dtype == torch.int8
        assert engine.runner.rank_bytes[0][1] == engine.runner.rank_bytes[1][1] == engine.runner.kv_pool.nbytes
    finally:
        engine.close()
    assert [r.output_token_ids for r in reqs] == [tokens for tokens, _ in want]   # the all-reduce's sums differ

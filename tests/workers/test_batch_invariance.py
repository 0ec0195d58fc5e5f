"""Batch invariance: a request's tokens and logprobs are the same bits alone, in any batch, at any
position of a long generation and at any torch thread count; a token's logits and KV are the same
whether its sequence was computed in one prefill, in chunks beside other requests, or token by
token (what preemption, recomputed as a prefill, and migration, resubmitted with the output so far
appended to the prompt, rest on). Logprobs are compared exactly: they move with the logits' last
bit, long before a token flips."""

import pytest
import torch

from kernels import bf16_linear
from tests.workers.engine_helpers import make_request, threads
from workers import SamplingParams
from workers.engine.engine import EngineConfig, LLMEngine
from workers.engine.runner import ModelRunner
from workers.engine.sampler import Sampler
from workers.engine.scheduler import Batch
from workers.layers.activation import silu_and_mul
from workers.layers.linear import linear, pack_hint
from workers.models.config import ModelConfig

LONG = 2000
GREEDY = SamplingParams(max_tokens=LONG, temperature=0, ignore_eos=True, logprobs=1)
SEEDED = SamplingParams(max_tokens=LONG, temperature=0.8, top_p=0.9, top_k=50, seed=7, ignore_eos=True, logprobs=1)


def prompt(i: int, n: int) -> list[int]:
    return [(i * 37 + j * 11) % 4000 + 10 for j in range(n)]


def other_params(i: int) -> SamplingParams:
    """Neighbours that end at different times and sample differently (greedy, plain, top_p)."""
    return SamplingParams(max_tokens=LONG // (i % 3 + 1), temperature=0 if i % 2 else 0.9,
                          top_p=1.0 if i % 4 else 0.95, seed=i, ignore_eos=True)


WATCHED = {"greedy": (prompt(99, 40), GREEDY), "seeded": (prompt(98, 17), SEEDED)}


def generate(model_dir: str, batch_size: int, names: tuple[str, ...] = ("greedy", "seeded"), **options) -> dict:
    """{name: (tokens, logprobs)} of the watched requests, the first arriving in the middle of
    batch_size - len(names) neighbours of other prompt lengths, the others last."""
    engine = LLMEngine(model_dir, EngineConfig(device="cpu", num_kv_blocks=3000, **options))
    neighbours = [f"n{i}" for i in range(batch_size - len(names))]
    half = len(neighbours) // 2
    watched = {}
    for rid in neighbours[:half] + [names[0]] + neighbours[half:] + list(names[1:]):
        if rid in WATCHED:
            watched[rid] = engine.add_request(rid, *WATCHED[rid])
        else:
            i = int(rid[1:])
            engine.add_request(rid, prompt(i, 5 + 13 * i), other_params(i))
    while engine.has_unfinished():
        engine.step()
    return {rid: (req.output_token_ids, [lp.logprob for lp in req.logprobs]) for rid, req in watched.items()}


@pytest.fixture(scope="module")
def batch_of_5(tiny_model):
    with threads(2):
        return generate(tiny_model, 5)


@pytest.mark.slow
@pytest.mark.serial            # two threads: alone, or they wait on the other tests
def test_2000_token_generations_are_identical_alone_and_in_batches_of_5_and_20(tiny_model, batch_of_5):
    with threads(2):
        alone = {**generate(tiny_model, 1, ("greedy",)), **generate(tiny_model, 1, ("seeded",))}
        batch_of_20 = generate(tiny_model, 20)
    for name in ("greedy", "seeded"):
        assert len(alone[name][0]) == LONG
        assert batch_of_5[name] == alone[name], name
        assert batch_of_20[name] == alone[name], name
    assert alone["greedy"][0] != alone["seeded"][0]


@pytest.mark.slow
@pytest.mark.serial            # two threads: alone, or they wait on the other tests
def test_2000_token_generations_are_identical_with_1_and_2_threads(tiny_model, batch_of_5):
    with threads(1):
        one_thread = generate(tiny_model, 5)
    assert one_thread == batch_of_5


@pytest.mark.slow
@pytest.mark.serial            # two threads: alone, or they wait on the other tests
@pytest.mark.parametrize("kv", ["int8", "fp8"])
def test_2000_token_generations_over_a_quantized_kv_cache_are_identical_alone_and_in_a_batch_of_5(tiny_model, kv):
    """Each (token, KV head) row is quantized with its own scale when written, so its bytes never depend
    on which other tokens share its block or its step."""
    with threads(2):
        alone = generate(tiny_model, 1, ("greedy",), kv_cache_dtype=kv)["greedy"]
        batched = generate(tiny_model, 5, ("greedy",), kv_cache_dtype=kv)["greedy"]
    assert len(alone[0]) == LONG
    assert batched == alone


# -- one token's logits and KV, however its sequence was computed -----------------------------------

BLOCK = 16


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def runner(tiny_model, request):
    runner = ModelRunner(tiny_model, ModelConfig.load(tiny_model), request.param, torch.device("cpu"), BLOCK)
    runner.allocate_kv(160)
    return runner


def compute(runner: ModelRunner, steps: list[list[tuple]], blocks: dict[str, list[int]]) -> torch.Tensor:
    """Runs the steps ([(request, new tokens)] each, rows in that order) and returns the logits of
    every token the request "t" computed, in position order."""
    rows = []
    for step in steps:
        batch = Batch()
        for req, n in step:
            batch.add(req, n)
        inputs = runner.prepare(batch, [blocks[req.request_id] for req in batch.requests])
        inputs.logit_rows = torch.arange(len(inputs.input_ids))
        logits = runner.execute(inputs)
        start = 0
        for req, n in step:
            if req.request_id == "t":
                rows.append(logits[start:start + n])
            start += n
            req.num_computed_tokens += n
    return torch.cat(rows)


def kv_of(runner: ModelRunner, blocks: list[int], length: int) -> torch.Tensor:
    """[2, layers, length, Hkv, D]: the KV the pool holds for positions 0..length-1."""
    kv = runner.kv_pool[:, :, blocks]
    return kv.reshape(*kv.shape[:2], -1, *kv.shape[-2:])[:, :, :length]


TARGET = prompt(5, 300)   # three KV splits and a prefill tile boundary


def schedules(target, neighbour) -> dict[str, list[list[tuple]]]:
    return {
        "one prefill": [[(target, 300)]],
        "chunks beside a neighbour": [[(neighbour, 50), (target, 37)], [(target, 100), (neighbour, 100)],
                                      [(neighbour, 1), (target, 1)], [(neighbour, 1), (target, 162)]],
        "a tile-crossing chunk, then decodes": [[(target, 290)]] + [[(neighbour, 1), (target, 1)]] * 10,
        "token by token": [[(target, 1)]] * 300,
    }


def run_schedule(runner: ModelRunner, name: str, first_block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits, KV) of the target; its blocks are shuffled and placed from first_block on."""
    target = make_request("t", TARGET, block_size=BLOCK)
    neighbour = make_request("n", prompt(7, 200), block_size=BLOCK)
    own = list(range(first_block, first_block + 19))[::-1]
    blocks = {"t": own, "n": list(range(first_block + 19, first_block + 32))}
    logits = compute(runner, schedules(target, neighbour)[name], blocks)
    return logits, kv_of(runner, own, len(TARGET))


@pytest.mark.parametrize("name", ["chunks beside a neighbour", "a tile-crossing chunk, then decodes",
                                  "token by token"])
def test_a_tokens_logits_and_kv_are_the_same_in_one_prefill_in_chunks_or_token_by_token(runner, name):
    logits, kv = run_schedule(runner, "one prefill", 0)
    other_logits, other_kv = run_schedule(runner, name, 40)
    assert logits.shape == other_logits.shape == (300, runner.cfg.vocab_size)
    assert torch.equal(other_kv, kv)
    assert torch.equal(other_logits, logits)


@pytest.mark.parametrize("count", [2, 3])
def test_a_tokens_logits_and_kv_are_the_same_with_1_2_or_3_threads(runner, count):
    with threads(1):
        logits, kv = run_schedule(runner, "chunks beside a neighbour", 0)
    with threads(count):
        other_logits, other_kv = run_schedule(runner, "chunks beside a neighbour", 40)
    assert torch.equal(other_kv, kv)
    assert torch.equal(other_logits, logits)


def test_a_request_resubmitted_with_its_output_appended_continues_with_the_same_tokens(tiny_model):
    # greedy: a resubmitted request's seeded draws restart at output position 0 (the caller's to carry)
    params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True, logprobs=1)
    engine = LLMEngine(tiny_model, EngineConfig(device="cpu", num_kv_blocks=64))
    whole = engine.add_request("whole", TARGET[:120], params)
    while engine.has_unfinished():
        engine.step()
    moved = SamplingParams(max_tokens=35, temperature=0, ignore_eos=True, logprobs=1)
    engine = LLMEngine(tiny_model, EngineConfig(device="cpu", num_kv_blocks=64, max_num_batched_tokens=64))
    engine.add_request("neighbour", prompt(8, 90), params)
    rest = engine.add_request("rest", whole.token_ids[:145], moved)
    while engine.has_unfinished():
        engine.step()
    assert rest.output_token_ids == whole.output_token_ids[25:]
    assert [lp.logprob for lp in rest.logprobs] == [lp.logprob for lp in whole.logprobs[25:]]


# -- the pieces: linear layers and the sampler ------------------------------------------------------

@pytest.mark.parametrize("inputs, outputs", [(256, 704), (2048, 512)])
def test_a_linear_rows_result_is_the_same_alone_anywhere_in_a_batch_and_at_1_or_2_threads(inputs, outputs):
    gen = torch.Generator().manual_seed(inputs)
    weight = torch.randn(outputs, inputs, generator=gen) * 0.05
    x = torch.randn(37, inputs, generator=gen)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, pack_hint(weight.dtype))
    with threads(2):
        batch = linear(x, weight, None, packed)
        flipped = linear(x.flip(0), weight, None, packed).flip(0)
        alone = torch.cat([linear(x[i:i + 1], weight, None, packed) for i in range(len(x))])
    with threads(1):
        one_thread = linear(x, weight, None, packed)
    assert torch.equal(flipped, batch)
    assert torch.equal(alone, batch)
    assert torch.equal(one_thread, batch)


# SmolLM2's projections (q/k/v, o, gate/up, down, LM head), the tiny model's, and two wider ones
BF16_SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576), (576, 49152), (256, 704), (704, 256),
               (2048, 512), (4096, 11008)]
BF16_PACKINGS = {
    "oneDNN in fixed calls": lambda w: torch.ops.mkldnn._reorder_linear_weight(w, pack_hint(w.dtype)),
    "the CPU's own (AMX or AVX-512 BF16)": bf16_linear.pack,
}


def onednn_bf16() -> bool:
    """Whether oneDNN packs a bf16 weight here (prepack_for_cpu leaves the weights unpacked where not)."""
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=torch.bfloat16), pack_hint(torch.bfloat16))
    except RuntimeError:
        return False
    return True


@pytest.mark.parametrize("packing", list(BF16_PACKINGS))
@pytest.mark.parametrize("inputs, outputs", BF16_SHAPES)
def test_a_bf16_linear_rows_result_is_the_same_alone_anywhere_in_a_batch_of_any_size_and_at_1_2_or_3_threads(
        inputs, outputs, packing):
    """oneDNN's kernels called on the whole batch are not: a row's bits change with the row
    count (from 2 rows up) and, for some shapes, with the thread count."""
    if packing != "oneDNN in fixed calls" and not bf16_linear.available():
        pytest.skip("the CPU has neither AMX nor AVX-512 BF16")
    if not onednn_bf16():
        pytest.skip("oneDNN has no bf16 linear on this CPU (it needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT)")
    gen = torch.Generator().manual_seed(inputs + outputs)
    weight = (torch.randn(outputs, inputs, generator=gen) * 0.05).bfloat16()
    x = torch.randn(150, inputs, generator=gen).bfloat16()
    packed = BF16_PACKINGS[packing](weight)
    with threads(2):
        batch = linear(x, weight, None, packed)
        flipped = linear(x.flip(0), weight, None, packed).flip(0)
        alone = torch.cat([linear(x[i:i + 1], weight, None, packed) for i in range(0, len(x), 7)])
        sizes = [linear(x[:n], weight, None, packed) for n in (2, 5, 31, 33, 64, 100)]
    for count in (1, 3):
        with threads(count):
            assert torch.equal(linear(x, weight, None, packed), batch), count
    assert torch.equal(flipped, batch)
    assert torch.equal(alone, batch[::7])
    for part in sizes:
        assert torch.equal(part, batch[:len(part)]), len(part)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_gives_a_row_the_same_bits_alone_and_at_1_2_or_3_threads(dtype):
    x = (torch.randn(163, 1408, generator=torch.Generator().manual_seed(0)) * 3).to(dtype)
    with threads(1):
        one_thread = silu_and_mul(x)
        alone = torch.cat([silu_and_mul(x[i:i + 1]) for i in range(len(x))])
    for count in (2, 3):
        with threads(count):
            assert torch.equal(silu_and_mul(x), one_thread), count
    assert torch.equal(alone, one_thread)


def sampling_rows(count: int) -> tuple[torch.Tensor, list]:
    """Logits from flat to peaked, and requests that take every path of the sampler: plain,
    top_k among the candidates or past them, top_p whose nucleus fits the candidates or not, min_p."""
    gen = torch.Generator().manual_seed(count)
    logits = torch.randn(count, 4096, generator=gen) * torch.linspace(0.3, 6, count)[:, None]
    kinds = [{}, {"top_k": 5}, {"top_k": 1000}, {"top_p": 0.9}, {"top_p": 0.5, "top_k": 300}, {"min_p": 0.05}]
    requests = []
    for i in range(count):
        req = make_request(f"r{i}", [1, 2, 3])
        req.params = SamplingParams(max_tokens=8, temperature=0.8, ignore_eos=True, **kinds[i % len(kinds)])
        req.seed = i
        requests.append(req)
    return logits, requests


def test_a_rows_sampled_token_is_the_same_alone_and_beside_any_rows():
    logits, requests = sampling_rows(48)
    sampler = Sampler()
    together = sampler(logits, requests)[0]
    alone = [sampler(logits[i:i + 1], requests[i:i + 1])[0][0] for i in range(len(requests))]
    reverse = sampler(logits.flip(0), requests[::-1])[0][::-1]
    plain_only = [sampler(logits[i:i + 1].expand(2, -1), [requests[i], requests[0]])[0][0] for i in range(48)]
    with threads(1):
        one_thread = sampler(logits, requests)[0]
    assert together == alone == reverse == plain_only == one_thread
    assert len(set(together)) > 24

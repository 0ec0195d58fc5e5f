"""The native CPU layers of a bfloat16 model (kernels/bf16_linear.py's linears, kernels/cpu_ops.py's norm,
rotation and gate) against the reference path they replace (torch's operations and oneDNN's linears in
fixed calls, TOKENBUS_CPU_LAYERS=torch): on SmolLM2 and a tiny checkpoint of every architecture, the
greedy tokens are the same, alone and in a batch, and the logprobs of every step agree within
LOGPROB_TOLERANCE (both paths round to bfloat16 at every layer; their sums run in other orders), until
the two part where the reference's two best tokens are within NEAR_TIE of each other, as bfloat16 and
float32 do (tests/workers/test_smollm2_vs_hf.py). The native path's logits are float32 sums, the
reference's bfloat16 (0.125 apart near 16): the tiny random checkpoints' large weights make such near
ties common, so there the two agree on fewer tokens than on SmolLM2."""
import pytest

from kernels import bf16_linear, cpu_ops
from schemas.sampling import SamplingParams
from tests.workers.checkpoints import ARCHS, make_checkpoint
from workers.engine.engine import EngineConfig, LLMEngine

pytestmark = pytest.mark.skipif(bf16_linear.kernel() is None or not cpu_ops.available(),
                                reason="the CPU has no bfloat16 instructions (the native path is not taken)")

LOGPROB_TOLERANCE = 0.25   # nats: two bfloat16 steps of a logit between 16 and 32 (8 significant bits)
NEAR_TIE = 0.25
QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.", "Explain photosynthesis briefly.",
             "How do I boil an egg?"]
PROMPTS = [[1, 17, 42, 99, 7, 300, 12], [1, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 200, 201, 202, 203, 204, 205],
           [1, 400, 401], [1, *range(20, 90)]]


def greedy(engine: LLMEngine, prompts: list[list[int]], tokens: int) -> list:
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True, logprobs=3)
    reqs = [engine.add_request(f"r{engine.num_steps}-{i}", p, params) for i, p in enumerate(prompts)]
    while engine.has_unfinished():
        engine.step()
    return reqs


def run(model: str, prompts: list[list[int]], tokens: int, alone: bool = True, **options) -> tuple[list, list]:
    """(token ids, logprobs) of each prompt, greedy, all in one batch; and, `alone`, each prompt alone
    gives the same tokens."""
    engine = LLMEngine(model, EngineConfig(num_kv_blocks=128, device="cpu", dtype="bfloat16",
                                           enable_prefix_caching=False, **options))
    try:
        batch = greedy(engine, prompts, tokens)
        if alone:
            assert [b.output_token_ids for b in batch] == [greedy(engine, [p], tokens)[0].output_token_ids
                                                         for p in prompts]
    finally:
        engine.close()
    return [b.output_token_ids for b in batch], [b.logprobs for b in batch]


def compare(model: str, prompts: list[list[int]], tokens: int, monkeypatch, near_tie: float = 0.0, **options) -> int:
    """The tokens both paths agree on, over all prompts; asserts the rest of the module's promise."""
    native, native_lp = run(model, prompts, tokens, **options)
    monkeypatch.setenv(cpu_ops.SWITCH, "torch")
    reference, reference_lp = run(model, prompts, tokens, alone=False, **options)
    same = 0
    for ours, theirs, ours_lp, theirs_lp in zip(native, reference, native_lp, reference_lp):
        n = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), len(ours))
        same += n
        for a, b in zip(ours_lp[:n], theirs_lp[:n]):
            assert abs(a.logprob - b.logprob) <= LOGPROB_TOLERANCE, (a, b)
        if n < len(ours):                                  # parted: where the reference's best two were close
            (_, best), (_, second) = theirs_lp[n].top[:2]
            assert best - second <= near_tie, (n, theirs_lp[n].top)
    return same


@pytest.mark.parametrize("arch", list(ARCHS))
def test_a_tiny_checkpoint_of_every_architecture_decodes_the_same_on_the_native_layers(arch, tmp_path, monkeypatch):
    path = make_checkpoint(tmp_path, arch)
    same = compare(str(path), [[t % 500 for t in p] for p in PROMPTS], 24, monkeypatch, NEAR_TIE)
    assert same >= 0.4 * 24 * len(PROMPTS)        # seen: 55-96 of 96


@pytest.mark.parametrize("options", [{"quantization": "int8"}, {"kv_cache_dtype": "int8"}])
def test_int8_weights_or_kv_under_bfloat16_activations_decode_the_same_on_the_native_layers(options, tmp_path,
                                                                                           monkeypatch):
    path = make_checkpoint(tmp_path, "qwen3")
    same = compare(str(path), [[t % 500 for t in p] for p in PROMPTS], 24, monkeypatch, NEAR_TIE, **options)
    assert same >= 0.4 * 24 * len(PROMPTS)        # seen: 49 (int8 KV) and 96 (int8 weights) of 96


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_smollm2_decodes_the_same_on_the_native_layers_as_on_torch_and_onednn(smollm2, monkeypatch):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                             tokenize=True, return_dict=True)["input_ids"]
               for q in QUESTIONS]
    same = compare(smollm2, prompts, 48, monkeypatch, NEAR_TIE)
    assert same >= 0.75 * 48 * len(prompts)

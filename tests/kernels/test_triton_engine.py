"""The engine's greedy outputs do not change when its attention runs on the Triton kernels (under
the interpreter on CPU: a small model and a few tokens keep it fast; natively on a CUDA device)."""
import pytest

pytest.importorskip("triton")

import kernels.reference
import kernels.triton
from lab.benchmarks.kernels import use_kernels
from schemas.sampling import SamplingParams
from tests.kernels.device import DEVICE
from workers.engine.engine import EngineConfig, LLMEngine

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], [30, 31, 32], list(range(100, 140))]


def greedy(model: str, backend) -> list[list[int]]:
    engine = LLMEngine(model, EngineConfig(device=DEVICE.type, dtype="float32", block_size=8, num_kv_blocks=64,
                                           max_num_batched_tokens=32))
    use_kernels(engine, backend)
    reqs = [engine.add_request(f"r{i}", p, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
            for i, p in enumerate(PROMPTS)]
    while engine.has_unfinished():      # a 32-token budget: chunked prefill, then mixed prefill and decode steps
        engine.step()
    return [r.output_token_ids for r in reqs]


def test_greedy_outputs_are_the_same_on_triton_and_reference_attention(tiny_model):
    assert greedy(tiny_model, kernels.triton) == greedy(tiny_model, kernels.reference)

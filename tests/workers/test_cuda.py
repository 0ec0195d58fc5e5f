"""The engine on a CUDA device (skipped without one), against HF transformers on the same GPU:
greedy outputs token for token in float32; in bfloat16 every token the engine picks is HF's own
argmax or a near tie of it (HF's logits, fed the engine's tokens); and the batching, prefix
caching, preemption and chunking of tests/workers/test_engine_consistency.py leave the greedy
tokens unchanged on the GPU as they do on the CPU."""
import pytest
import torch
import transformers

from tests.workers.checkpoints import ARCHS, make_checkpoint
from tests.workers.test_engine_consistency import GREEDY, generate
from tests.workers.test_engine_consistency import PROMPTS as CONSISTENCY_PROMPTS
from tests.workers.test_models_vs_hf import MAX_TOKENS, PROMPTS, engine_greedy
from workers.engine.engine import EngineConfig, LLMEngine

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

BF16_GAP = 0.1   # HF's logit of the engine's token at most this far below HF's largest, in bfloat16


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return {arch: make_checkpoint(root, arch) for arch in ARCHS}


def hf_on_gpu(path, dtype):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval().to("cuda")


@torch.inference_mode()
def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt], device="cuda")
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                         do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@torch.inference_mode()
def gaps(model, prompt: list[int], ours: list[int]) -> torch.Tensor:
    """For each token the engine chose: HF's largest logit minus HF's logit of that token, HF fed the
    prompt and the engine's tokens before it (0 where they agree)."""
    ids = torch.tensor([prompt + ours], device="cuda")
    logits = model(ids).logits[0, len(prompt) - 1:-1].float()
    chosen = logits.gather(1, torch.tensor(ours, device="cuda")[:, None])[:, 0]
    return (logits.max(1).values - chosen).cpu()


@pytest.mark.parametrize("arch", list(ARCHS))
def test_float32_greedy_outputs_equal_hf_generate_on_the_same_gpu(checkpoints, arch):
    engine = LLMEngine(str(checkpoints[arch]), EngineConfig(num_kv_blocks=64, device="cuda", dtype="float32"))
    assert engine.runner.device.type == "cuda"
    ours = engine_greedy(engine, PROMPTS, MAX_TOKENS)
    hf = hf_on_gpu(checkpoints[arch], torch.float32)
    assert ours == [hf_greedy(hf, p, MAX_TOKENS) for p in PROMPTS]


@pytest.mark.parametrize("arch", list(ARCHS))
def test_bfloat16_greedy_tokens_are_hf_argmax_or_a_near_tie(checkpoints, arch):
    engine = LLMEngine(str(checkpoints[arch]), EngineConfig(num_kv_blocks=64, device="cuda", dtype="bfloat16"))
    ours = engine_greedy(engine, PROMPTS, MAX_TOKENS)
    hf = hf_on_gpu(checkpoints[arch], torch.bfloat16)
    each = [gaps(hf, p, o) for p, o in zip(PROMPTS, ours)]
    every = torch.cat(each)
    same = sum(o == hf_greedy(hf, p, MAX_TOKENS) for p, o in zip(PROMPTS, ours))
    print(f"{arch}: bf16 argmax agreement {(every == 0).float().mean():.1%}, largest gap {every.max():.4f}, "
          f"{same}/{len(PROMPTS)} sequences equal to HF generate")
    assert every.max() <= BF16_GAP, [g.tolist() for g in each]


@pytest.mark.parametrize("config", [{}, {"max_num_seqs": 1}, {"max_num_seqs": 1, "enable_prefix_caching": False},
                                    {"num_kv_blocks": 8}, {"max_num_batched_tokens": 7}],
                         ids=["batched", "prefix-cache", "no-prefix-cache", "preempted", "chunked"])
def test_float32_greedy_tokens_do_not_depend_on_batching_caching_or_preemption(model_dir, config):
    run = lambda prompts, **more: generate(model_dir, prompts, GREEDY, device="cuda", dtype="float32",  # noqa: E731
                                           **({"num_kv_blocks": 64} | more))[0]
    alone = [run([p])[0] for p in CONSISTENCY_PROMPTS]
    assert run(CONSISTENCY_PROMPTS, **config) == alone

"""Greedy outputs of our engine equal HF transformers `generate`, token for token."""
import pytest
import torch
import transformers

from tests.workers.checkpoints import ARCHS, make_checkpoint
from workers import SamplingParams
from workers.engine.engine import EngineConfig, LLMEngine

PROMPTS = [[5, 17, 99, 230, 7], list(range(40, 77)), [300] * 3 + list(range(100, 160)), [11]]
MAX_TOKENS = 24


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                         do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def engine_greedy(engine: LLMEngine, prompts: list[list[int]], n: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    reqs = [engine.add_request(f"r{i}", p, params) for i, p in enumerate(prompts)]
    while engine.has_unfinished():
        engine.step()
    return [r.output_token_ids for r in reqs]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return {arch: make_checkpoint(root, arch) for arch in ARCHS}


@pytest.mark.parametrize("arch", list(ARCHS))
def test_greedy_batched_equals_hf_generate_each_prompt_alone(checkpoints, arch):
    path = checkpoints[arch]
    engine = LLMEngine(str(path), EngineConfig(num_kv_blocks=64, device="cpu", dtype="float32"))
    ours = engine_greedy(engine, PROMPTS, MAX_TOKENS)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for prompt, got in zip(PROMPTS, ours):
        assert got == hf_greedy(hf, prompt, MAX_TOKENS)


def test_a_sharded_bf16_checkpoint_loads_shard_by_shard_and_matches_hf(checkpoints, tmp_path):
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoints["qwen2"], dtype=torch.bfloat16)
    model.save_pretrained(tmp_path, max_shard_size="100KB")
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    engine = LLMEngine(str(tmp_path), EngineConfig(num_kv_blocks=64, device="cpu", dtype="float32"))
    ours = engine_greedy(engine, PROMPTS[:2], MAX_TOKENS)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert ours == [hf_greedy(hf, p, MAX_TOKENS) for p in PROMPTS[:2]]


def test_a_checkpoint_missing_a_weight_is_refused_by_name(checkpoints, tmp_path):
    from safetensors.torch import load_file, save_file

    path = checkpoints["llama"]
    weights = load_file(path / "model.safetensors")
    del weights["model.layers.1.mlp.down_proj.weight"]
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    save_file(weights, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"lacks weights for model\.layers\.1\.mlp\.down_proj\.weight"):
        LLMEngine(str(tmp_path), EngineConfig(num_kv_blocks=8, device="cpu"))


def test_config_errors_name_the_problem(tmp_path):
    from workers.models.config import ModelConfig

    with pytest.raises(ValueError, match=r"has no config\.json"):
        ModelConfig.load(tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": "gpt2"}')
    with pytest.raises(ValueError, match="model_type 'gpt2' is not supported"):
        ModelConfig.load(tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": "llama", "num_attention_heads": 4}')
    with pytest.raises(ValueError, match="lacks the field 'vocab_size'"):
        ModelConfig.load(tmp_path)


def test_a_sliding_window_caps_the_context_where_it_applies():
    from workers.models.config import ModelConfig

    base = {"vocab_size": 8, "hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 1,
            "num_attention_heads": 2, "max_position_embeddings": 32768, "sliding_window": 4096}
    assert ModelConfig.from_hf({**base, "model_type": "mistral"}).max_model_len == 4096
    assert ModelConfig.from_hf({**base, "model_type": "qwen2", "use_sliding_window": False}).max_model_len == 32768
    assert ModelConfig.from_hf({**base, "model_type": "qwen2", "use_sliding_window": True}).max_model_len == 4096


def test_greedy_with_logit_bias_equals_hf_generate_with_the_same_sequence_bias(checkpoints):
    """logit_bias is HF's sequence_bias on one-token sequences: a bias added to the token's logit every step."""
    path = checkpoints["llama"]
    engine = LLMEngine(str(path), EngineConfig(num_kv_blocks=64, device="cpu", dtype="float32"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompt = PROMPTS[1]
    plain = hf_greedy(hf, prompt, MAX_TOKENS)
    bias = {plain[0]: -100.0, plain[3]: -3.0, 42: 2.5}            # ban the first choice, nudge two others
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, logit_bias=bias)
    req = engine.add_request("b", prompt, params)
    while engine.has_unfinished():
        engine.step()
    ids = torch.tensor([prompt])
    want = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS,
                       do_sample=False, eos_token_id=None, pad_token_id=0,
                       sequence_bias={(t,): b for t, b in bias.items()})[0, len(prompt):].tolist()
    assert req.output_token_ids == want and want != plain and plain[0] not in want
    with pytest.raises(ValueError, match=r"logit_bias: token id 1000000 is outside the vocabulary \[0, "):
        engine.add_request("v", prompt, SamplingParams(logit_bias={1000000: 1}))

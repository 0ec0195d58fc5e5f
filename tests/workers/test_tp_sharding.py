"""Layers built for a tensor-parallel group shard every weight as Megatron does, and the loader
fills each rank's shard from the checkpoint (collectives themselves come with the TP issue)."""
import pytest
import torch
from safetensors.torch import load_file

from tests.workers.checkpoints import make_checkpoint
from workers.distributed import TPGroup
from workers.models.config import ModelConfig
from workers.models.llama import CausalLM
from workers.models.loader import load_weights


def load_rank(path, rank: int, size: int) -> dict[str, torch.Tensor]:
    model = CausalLM(ModelConfig.load(path), TPGroup(rank, size))
    load_weights(model, path)
    return dict(model.named_parameters())


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_two_ranks_hold_complementary_shards_of_every_weight(tmp_path, arch):
    path = make_checkpoint(tmp_path, arch)
    full = load_file(path / "model.safetensors")
    ranks = [load_rank(path, r, 2) for r in range(2)]
    attn, mlp = "model.layers.0.self_attn", "model.layers.0.mlp"
    q, k = full[f"{attn}.q_proj.weight"], full[f"{attn}.k_proj.weight"]
    for r, params in enumerate(ranks):
        qkv = params[f"{attn}.qkv_proj.weight"]
        half_q, half_k = q.shape[0] // 2, k.shape[0] // 2
        assert torch.equal(qkv[:half_q], q[r * half_q:(r + 1) * half_q])
        assert torch.equal(qkv[half_q:half_q + half_k], k[r * half_k:(r + 1) * half_k])
    o = torch.cat([p[f"{attn}.o_proj.weight"] for p in ranks], dim=1)      # row-parallel: columns split
    assert torch.equal(o, full[f"{attn}.o_proj.weight"])
    gate = torch.cat([p[f"{mlp}.gate_up_proj.weight"].chunk(2)[0] for p in ranks])
    assert torch.equal(gate, full[f"{mlp}.gate_proj.weight"])
    embed = torch.cat([p["model.embed_tokens.weight"] for p in ranks])   # vocab-parallel: rows split
    assert torch.equal(embed, full["model.embed_tokens.weight"])


def test_kv_heads_fewer_than_ranks_are_replicated(tmp_path):
    path = make_checkpoint(tmp_path, "qwen3")   # 4 query heads, 1 kv head
    k = load_file(path / "model.safetensors")["model.layers.0.self_attn.k_proj.weight"]
    for r in range(2):
        qkv = load_rank(path, r, 2)["model.layers.0.self_attn.qkv_proj.weight"]
        assert torch.equal(qkv[2 * 32:3 * 32], k)   # 2 local q heads of head_dim 32, then the whole kv head


def test_heads_that_do_not_divide_by_the_ranks_are_a_clear_error(tmp_path):
    path = make_checkpoint(tmp_path, "llama")   # 4 heads, 2 kv heads
    with pytest.raises(ValueError, match="num_attention_heads=4 must divide by tensor_parallel_size=3"):
        CausalLM(ModelConfig.load(path), TPGroup(0, 3))


def test_a_rank_reads_only_its_shard_of_each_split_weight_from_disk(tmp_path, monkeypatch):
    """The loader hands the layers safetensors slices; a rank of two asks each for half of a split
    weight (rows or columns), never for the whole tensor."""
    import workers.models.loader as loader

    path = make_checkpoint(tmp_path, "llama")
    read: dict[str, int] = {}

    class Recording:
        def __init__(self, name, real):
            self.name, self.real = name, real

        def __getitem__(self, key):
            read[self.name] = read.get(self.name, 0) + torch.empty(self.real.get_shape(), device="meta")[key].numel()
            return self.real[key]

    class File:
        def __init__(self, *args, **kwargs):
            self.f = loader_safe_open(*args, **kwargs)

        def __enter__(self):
            self.inner = self.f.__enter__()
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

        def keys(self):
            return self.inner.keys()

        def get_slice(self, name):
            return Recording(name, self.inner.get_slice(name))

    loader_safe_open = loader.safe_open
    monkeypatch.setattr(loader, "safe_open", File)
    load_rank(path, 1, 2)
    full = load_file(path / "model.safetensors")
    for name, tensor in full.items():
        split = any(s in name for s in ("_proj", "embed_tokens", "lm_head"))
        assert read[name] == (tensor.numel() // 2 if split else tensor.numel()), name

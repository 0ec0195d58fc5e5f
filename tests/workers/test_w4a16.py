"""compressed-tensors W4A16 checkpoints, written in the test by the compressed-tensors library itself
(RTN: each group's min-max scale), served as they are stored: the codes and scales load into the fused
and sharded layers and dequantize to the library's own decompression bit for bit; the native kernel
(float32 inputs) is a float32 matmul of the dequantized weight, PyTorch's int4 kernel (bfloat16) one of
its bfloat16-rounded operands, and both give a row the same bits in any batch; the engine generates from
the 4-bit checkpoint the float checkpoint's greedy tokens (float32; mostly, in bfloat16), the same alone
as batched, and on two ranks."""
import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers
from compressed_tensors.compressors import ModelCompressor
from compressed_tensors.compressors.pack_quantized import PackedQuantizationCompressor
from compressed_tensors.quantization import (
    QuantizationArgs,
    QuantizationConfig,
    QuantizationScheme,
    apply_quantization_config,
)
from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp
from safetensors.torch import load_file, save_file

from kernels import int8_linear
from tests.workers.checkpoints import make_checkpoint
from tests.workers.engine_helpers import threads
from workers import SamplingParams
from workers.distributed import SINGLE, TPGroup
from workers.engine.engine import EngineConfig, LLMEngine
from workers.layers import quant
from workers.models.config import ModelConfig
from workers.models.llama import CausalLM
from workers.models.loader import load_weights

GROUP = 32
needs_kernel = pytest.mark.skipif(not int8_linear.available(), reason="no AVX-512 or no compiler for the native kernel")
PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj"),
         "o_proj": ("o_proj",), "down_proj": ("down_proj",)}


def scheme(symmetric: bool) -> QuantizationScheme:
    args = QuantizationArgs(num_bits=4, type="int", strategy="group", group_size=GROUP, symmetric=symmetric)
    return QuantizationScheme(targets=["Linear"], weights=args)


def compress(src: Path, out: Path, symmetric: bool, dtype: torch.dtype = torch.float32) -> Path:
    """`src`'s linears (not the LM head) as llm-compressor saves a W4A16 model: the library's own
    quantization config, scales and zeros from each group's min and max, its pack-quantized compressor."""
    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=dtype)
    s = scheme(symmetric)
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": s}, ignore=["lm_head"]))
    for m in model.modules():
        if hasattr(m, "weight_scale"):
            scale, zero = compute_dynamic_scales_and_zp(m.weight, s.weights, m)
            m.weight_scale.data.copy_(scale)
            if hasattr(m, "weight_zero_point"):
                m.weight_zero_point.data.copy_(zero)
    compressor = ModelCompressor.from_pretrained_model(model, "pack-quantized")
    compressor.compress_model(model)
    model.save_pretrained(out)
    compressor.update_config(out)
    return out


def decompressed(path: Path, symmetric: bool) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors with every quantized linear's weight as the library decompresses it."""
    tensors = load_file(path / "model.safetensors")
    out = {k: v for k, v in tensors.items() if ".weight_" not in k}
    for name in [k.removesuffix(".weight_packed") for k in tensors if k.endswith(".weight_packed")]:
        parts = {p: tensors[f"{name}.{p}"] for p in ("weight_packed", "weight_scale", "weight_zero_point",
                                                      "weight_shape") if f"{name}.{p}" in tensors}
        out[f"{name}.weight"] = PackedQuantizationCompressor.decompress(parts, scheme(symmetric))["weight"]
    return out


def write_float(path: Path, tensors: dict, out: Path) -> Path:
    """The dequantized weights as a plain float checkpoint beside the quantized one."""
    out.mkdir()
    config = json.loads((path / "config.json").read_text())
    config.pop("quantization_config")
    (out / "config.json").write_text(json.dumps(config))
    shutil.copy(path / "generation_config.json", out)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    return out


@pytest.fixture(scope="module", params=[True, False], ids=["symmetric", "asymmetric"])
def checkpoint(request, tmp_path_factory):
    """(W4A16 checkpoint, its float twin, the library's decompressed tensors, symmetric)."""
    root = tmp_path_factory.mktemp("w4a16")
    src = make_checkpoint(root, "llama")
    path = compress(src, root / "w4a16", request.param)
    tensors = decompressed(path, request.param)
    return path, write_float(path, tensors, root / "float"), tensors, request.param


def loaded(path: Path, tp: TPGroup = SINGLE) -> CausalLM:
    model = CausalLM(ModelConfig.load(path), tp)
    load_weights(model, path)
    return model


def expected_weight(tensors: dict, layer: int, module: str) -> torch.Tensor:
    where = "mlp" if "up" in module or "down" in module else "self_attn"
    return torch.cat([tensors[f"model.layers.{layer}.{where}.{p}.weight"] for p in PARTS[module]])


def layers_of(model: CausalLM):
    for i, layer in enumerate(model.model.layers):
        yield i, "qkv_proj", layer.self_attn.qkv_proj
        yield i, "o_proj", layer.self_attn.o_proj
        yield i, "gate_up_proj", layer.mlp.gate_up_proj
        yield i, "down_proj", layer.mlp.down_proj


def test_the_config_names_w4a16_with_its_group_size_and_symmetry(checkpoint):
    path, _, _, symmetric = checkpoint
    cfg = ModelConfig.load(path)
    assert (cfg.quantization, cfg.quant_group_size, cfg.quant_symmetric) == ("w4a16", GROUP, symmetric)
    assert cfg.quantized("w4a16") is cfg and cfg.quantized("none") is cfg
    with pytest.raises(ValueError, match="quantized already"):
        cfg.quantized("int8")


def test_every_linear_holds_4_bit_codes_that_dequantize_to_the_librarys_weights_bit_for_bit(checkpoint):
    path, _, tensors, symmetric = checkpoint
    model = loaded(path)
    for i, name, module in layers_of(model):
        w = module.packed_weight
        assert isinstance(w, quant.Int4Weight) and module.weight is None
        assert w.codes.dtype == torch.uint8 and w.codes.shape[1] * 2 == expected_weight(tensors, i, name).shape[1]
        assert (w.zero is None) == symmetric
        assert torch.equal(w.dequantize(), expected_weight(tensors, i, name)), (i, name)
    assert torch.equal(model.lm_head.weight, tensors["lm_head.weight"])     # ignored: float


def test_bfloat16_scales_dequantize_to_the_librarys_bfloat16_weights(tmp_path):
    """The library multiplies in the scale's dtype; the layers keep the scales in float32 and multiply there
    (exactly: a 5-bit integer times an 8-bit significand), so rounding to bfloat16 gives the library's bits."""
    path = compress(make_checkpoint(tmp_path, "llama"), tmp_path / "bf16", False, torch.bfloat16)
    tensors = decompressed(path, False)
    assert tensors["model.layers.0.mlp.down_proj.weight"].dtype == torch.bfloat16
    for i, name, module in layers_of(loaded(path)):
        assert torch.equal(module.packed_weight.dequantize().bfloat16(), expected_weight(tensors, i, name)), (i, name)


def test_two_ranks_hold_complementary_shards_of_the_codes(checkpoint):
    path, _, tensors, _ = checkpoint
    ranks = [loaded(path, TPGroup(r, 2)) for r in range(2)]
    attn = [r.model.layers[1].self_attn for r in ranks]
    q, k = tensors["model.layers.1.self_attn.q_proj.weight"], tensors["model.layers.1.self_attn.k_proj.weight"]
    for r, a in enumerate(attn):
        w = a.qkv_proj.packed_weight.dequantize()
        half_q, half_k = q.shape[0] // 2, k.shape[0] // 2
        assert torch.equal(w[:half_q], q[r * half_q:(r + 1) * half_q])
        assert torch.equal(w[half_q:half_q + half_k], k[r * half_k:(r + 1) * half_k])
    down = torch.cat([r.model.layers[1].mlp.down_proj.packed_weight.dequantize() for r in ranks], dim=1)
    assert torch.equal(down, tensors["model.layers.1.mlp.down_proj.weight"])   # row-parallel: columns (groups) split


def test_a_split_that_cuts_a_group_is_refused_by_name(checkpoint):
    path = checkpoint[0]   # o_proj (64 inputs) and down_proj (128): 8 ranks would hold 8 or 16 of a group of 32
    config = json.loads((path / "config.json").read_text()) | {"num_attention_heads": 8, "num_key_value_heads": 8}
    with pytest.raises(ValueError, match=r"tensor_parallel_size=8 leaves each rank (8|16) of .* cuts its groups of 32"):
        load_weights(CausalLM(ModelConfig.from_hf(config), TPGroup(0, 8)), path)


def random_int4(n: int, k: int, symmetric: bool, seed: int = 0) -> quant.Int4Weight:
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    scale = torch.rand(n, k // GROUP, generator=gen) * 0.02 + 0.001
    zero = None if symmetric else torch.randint(0, 16, (n, k // GROUP), generator=gen, dtype=torch.uint8)
    return quant.Int4Weight(quant.pack_nibbles(codes), scale, zero, GROUP)


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_int4_kernel_computes_the_bf16_rounded_operands_product(symmetric, dtype):
    """The kernel reads bfloat16 inputs and (scale, zero) pairs, sums in float32 and rounds its output to
    bfloat16: against a float64 matmul of those same rounded operands, an output rounding apart."""
    w = random_int4(1536, 576, symmetric)
    w.packed = quant.pack_int4(w)
    assert w.packed is not None
    x, bias = torch.randn(37, 576).to(dtype), torch.randn(1536).to(dtype)
    y = quant.linear(x, w, bias)
    assert y.dtype == dtype
    codes = quant.unpack_nibbles(w.codes).double()
    pairs = w.packed.scales_and_zeros.double()                 # [K/g, N, 2], bfloat16 values
    scale, zero = (pairs[..., i].t().repeat_interleave(GROUP, dim=1) for i in (0, 1))
    expected = F.linear(x.bfloat16().double(), (codes - 8) * scale + zero, bias.double())
    ulps = 1 if dtype == torch.float32 else 2       # in bfloat16 the bias is added to the rounded output
    tolerance = ulps * 2 ** -8
    torch.testing.assert_close(y.double(), expected, rtol=tolerance, atol=tolerance * expected.abs().max().item())
    exact = F.linear(x.double(), w.dequantize().double(), bias.double())   # the unrounded weights: a few ulps of bf16
    torch.testing.assert_close(y.double(), exact, rtol=0.05, atol=0.02 * exact.abs().max().item())


@needs_kernel
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_native_int4_kernel_is_a_float32_matmul_of_the_dequantized_weight(symmetric, dtype):
    """kernels.int8_linear turns each code into (code - zero) * scale, the dequantized weight's float32 value,
    and sums in float32: float32 rounding of a 576-term sum apart (bfloat16: plus its output rounding)."""
    w = random_int4(1000, 576, symmetric)   # outputs not a multiple of 16: padded
    native = int8_linear.pack_int4(w.codes, w.scale, w.zero)
    assert torch.equal(int8_linear.unpack(native), w.codes)
    x, bias = torch.randn(37, 576).to(dtype), torch.randn(1000)
    y = int8_linear.linear(x, native, bias)
    assert y.dtype == dtype
    expected = F.linear(x.double(), w.dequantize().double(), bias.double())
    tolerance = 1e-5 if dtype == torch.float32 else 2 ** -8
    torch.testing.assert_close(y.double(), expected, rtol=tolerance, atol=tolerance * expected.abs().max().item())


def test_without_the_kernel_the_weight_is_dequantized_for_the_call():
    w = random_int4(48, 64, symmetric=False)
    x = torch.randn(5, 64)
    torch.testing.assert_close(quant.linear(x, w, None), x @ w.dequantize().t())


@pytest.mark.parametrize("kernel", ["pytorch", "native"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_int4_linear_gives_each_row_the_same_bits_in_any_batch_and_thread_count(dtype, kernel):
    w = random_int4(1536, 576, symmetric=False)
    if kernel == "pytorch":
        w.packed = quant.pack_int4(w)
    elif int8_linear.available():
        w.native = int8_linear.pack_int4(w.codes, w.scale, w.zero)
    else:
        pytest.skip("no AVX-512 or no compiler for the native kernel")
    x = torch.randn(64, 576).to(dtype)
    with threads(2):
        full = quant.linear(x, w, None)
        assert torch.equal(quant.linear(x.flip(0), w, None).flip(0), full)
    for n, t in ((1, 1), (5, 2), (17, 3), (63, 1)):
        with threads(t):
            assert torch.equal(quant.linear(x[:n], w, None), full[:n])
            assert torch.equal(quant.linear(x[n:n + 1], w, None), full[n:n + 1])


def engine(model_dir, **options) -> LLMEngine:
    return LLMEngine(str(model_dir), EngineConfig(device="cpu", num_kv_blocks=64, **options))


def generate(engine: LLMEngine, prompts: list[list[int]], tag: str = "") -> list[list[int]]:
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    reqs = [engine.add_request(f"{tag}r{i}", p, params) for i, p in enumerate(prompts)]
    while engine.has_unfinished():
        engine.step()
    return [r.output_token_ids for r in reqs]


PROMPTS = [[(i * 37 + j * 11) % 500 + 3 for j in range(5 + 9 * i)] for i in range(5)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_engine_generates_the_float_checkpoints_tokens_from_the_4_bit_one(checkpoint, dtype):
    """The same weights. In float32 the native kernel is a float32 matmul of them: the same greedy tokens. In
    bfloat16 PyTorch's int4 kernel rounds its inputs, scales and outputs where the float twin rounds its
    weights, so greedy tokens part where random weights' near-ties fall (measured: 80-98 of 120 kept)."""
    path, float_path, _, _ = checkpoint
    w4 = engine(path, dtype=dtype, enable_prefix_caching=False)
    assert all(isinstance(m.packed_weight, quant.Int4Weight) and m.packed_weight.packed is not None
               for _, _, m in layers_of(w4.runner.model))
    batched = generate(w4, PROMPTS)
    for i, (prompt, tokens) in enumerate(zip(PROMPTS, batched)):
        assert generate(w4, [prompt], tag=f"alone{i}") == [tokens]
    reference = generate(engine(float_path, dtype=dtype), PROMPTS)
    if dtype == "float32" and int8_linear.available():
        assert batched == reference
        return
    first = [next((i for i, (a, b) in enumerate(zip(f, q)) if a != b), len(f)) for f, q in zip(reference, batched)]
    assert sum(first) >= 0.5 * sum(map(len, reference)), first    # random weights: greedy ties split early at worst


def test_dequantized_per_call_the_engine_generates_the_float_checkpoints_tokens(checkpoint, monkeypatch):
    """Off the int4 kernel (as off CPU) the weight is widened for each call: float32 all through."""
    path, float_path, _, _ = checkpoint
    monkeypatch.setattr(quant, "pack_int4", lambda w: None)
    assert generate(engine(path, dtype="float32"), PROMPTS) == generate(engine(float_path, dtype="float32"), PROMPTS)


@pytest.mark.timeout(180)
def test_two_ranks_generate_what_one_does_from_the_4_bit_checkpoint(checkpoint, tiny_tokenizer):
    """Each rank runs its shard of the codes (float32: the native kernel; the all-reduce adds the row-parallel
    layers' partial sums in another order than one rank's sum, so a near-tie may part)."""
    from workers import LLM

    path = str(checkpoint[0])
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    options = {"block_size": 8, "num_kv_blocks": 96, "max_num_batched_tokens": 32}
    one = [o.token_ids for o in LLM(path, tiny_tokenizer, **options).generate(PROMPTS, params)]
    with LLM(path, tiny_tokenizer, tensor_parallel_size=2, **options) as llm:
        two = [o.token_ids for o in llm.generate(PROMPTS, params)]
    first = [next((i for i, (a, b) in enumerate(zip(f, q)) if a != b), len(f)) for f, q in zip(one, two)]
    assert sum(first) >= 0.5 * sum(map(len, one)), first


def test_int8_of_a_w4a16_checkpoint_is_refused_by_name(checkpoint):
    with pytest.raises(ValueError, match=r"quantization='int8': the checkpoint is quantized already \(w4a16\)"):
        engine(checkpoint[0], quantization="int8")


def test_a_scheme_not_served_is_refused_naming_the_field():
    base = {"quant_method": "compressed-tensors", "format": "pack-quantized",
            "config_groups": {"g": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "int",
                                                                      "strategy": "group", "group_size": 32}}}}
    with pytest.raises(ValueError, match=r"config_groups\.g\.weights\.num_bits=8"):
        ModelConfig.from_hf({"model_type": "llama", "vocab_size": 8, "hidden_size": 4, "intermediate_size": 8,
                             "num_hidden_layers": 1, "num_attention_heads": 1, "quantization_config": base})
    with pytest.raises(ValueError, match="quant_method='awq'"):
        ModelConfig.from_hf({"model_type": "llama", "vocab_size": 8, "hidden_size": 4, "intermediate_size": 8,
                             "num_hidden_layers": 1, "num_attention_heads": 1,
                             "quantization_config": {"quant_method": "awq"}})

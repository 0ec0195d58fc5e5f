"""`tokenbus plan`: the capacity arithmetic of a deployment, each step printed so a person can check it.

Inputs: a model (an HF checkpoint directory or config.json, a GGUF file, or a preset), a GPU (a
preset, or `cpu`: this machine, measured), the tensor-parallel size (the GPUs of one node, one
replica), the workload (daily users, turns a day, tokens in and out per turn, the peak over the
mean, the share of prompt tokens the prefix cache serves) and the SLOs.

The arithmetic, in order (docs/capacity.md has the seed's plan and where it differs from the design's
estimates):
1. weights per GPU: parameters × bytes per parameter / TP;
2. KV bytes per token: 2 (K and V) × layers × KV heads × head dim × bytes;
3. KV per node: TP × memory × memory utilization − the weights;
   (1-3, step 5's all-reduces, the GPU presets and the efficiencies are workers/engine/roofline.py's, which
   the mock engine shares)
4. concurrent requests per node: KV per node / (KV per token × context), at the average context in
   flight (the prompt and half the output) and at the full one;
5. step times from a roofline: a step takes the longer of its FLOPs at the card's peak × MFU and its
   bytes (weights once, then every sequence's KV) at its bandwidth × MBU, plus two all-reduces a
   layer when TP > 1;
6. one node's steady state under chunked prefill: with λ requests/s arriving, each step of T
   seconds decodes B = λ · output · T sequences (Little's law) and also carries the prefill of
   λ · T new prompts, so T = t_decode(B) + λ · T · t_prefill. The largest λ whose T stays within
   the TPOT SLO, whose B fits the KV, and whose first token (a prompt's prefill spread over the
   steps it shares, ≈ t_prefill / (1 − λ · t_prefill)) stays within the TTFT SLO, is a node's capacity;
7. nodes for the peak: the peak request rate / λ, over the target utilization; GPU-hours a day and
   $ per 1M tokens (input + output) when every node runs all day, and when the fleet follows the load;
8. the pipeline around the engines, from what `tokenbus bench-bus --calibration` measured (each role's CPU
   as ms a request + ms per 1,000 output tokens, the durable writes a request): each role's cores at the
   peak's requests/s and output tokens/s, over the target utilization (the tokenizer's scaled by the prompt's
   length over the calibration's); the broker's in servers of --server-cores, a whole number of the
   calibration's cluster (3 nodes, R3: replication is in the measured cost), each cluster's worth of
   servers one partition of the bus (`--bus-partitions`: a request's writes stay in its partition).
"""
import json
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from workers.engine.roofline import GB, GPUS, Efficiency, Gpu, Roofline, parameters
from workers.models.config import ModelConfig

BUS_CALIBRATION = Path(__file__).with_name("bus-calibration.json")   # measured for the repository (docs/capacity.md)

__all__ = ["GB", "GPUS", "MODELS", "Efficiency", "Gpu", "Plan", "Workload", "hf", "model_config", "parameters"]


def hf(vocab, hidden, intermediate, layers, heads, kv_heads, context, tie, dtype="bfloat16") -> dict:
    return {"model_type": "llama", "vocab_size": vocab, "hidden_size": hidden, "intermediate_size": intermediate,
            "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
            "max_position_embeddings": context, "tie_word_embeddings": tie, "torch_dtype": dtype,
            "rms_norm_eps": 1e-5, "rope_theta": 500000.0}


MODELS = {                      # the checkpoints' own config.json numbers
    "llama-3-70b": hf(128256, 8192, 28672, 80, 64, 8, 8192, False),
    "llama-3-8b": hf(128256, 4096, 14336, 32, 32, 8, 8192, False),
    "smollm2-135m": hf(49152, 576, 1536, 30, 9, 3, 8192, True),
}


@dataclass(slots=True)
class Workload:
    dau: float = 10e6
    turns: float = 15.0          # per user and day
    input_tokens: int = 3000
    output_tokens: int = 400
    peak_factor: float = 3.0     # peak rate over the day's mean
    prefix_reuse: float = 0.0    # share of prompt tokens served by the prefix cache

    @property
    def mean_rps(self) -> float:
        return self.dau * self.turns / 86400

    @property
    def peak_rps(self) -> float:
        return self.mean_rps * self.peak_factor


PEAK_SIZE = 2048


def peak_flops(dtype, size: int = PEAK_SIZE, rounds: int = 5) -> float:
    """FLOP/s of the best of `rounds` pairs of [size, size] x [size, size] products in one oneDNN call,
    the weight prepacked once (the engine's linear kernel at its most efficient), at torch's current
    thread count."""
    import torch

    from workers.layers.linear import onednn

    weight = torch.randn(size, size).to(dtype)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, size)
    x = torch.randn(size, size).to(dtype)
    onednn(x, packed, None)
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        onednn(x, packed, None)
        onednn(x, packed, None)
        best = min(best, (time.perf_counter() - start) / 2)
    return 2 * size ** 3 / best


def measured_cpu(dtype: str = "float32") -> Gpu:
    """This machine as a "GPU": the matmul peak and a large copy's bandwidth."""
    import torch

    flops = peak_flops(getattr(torch, dtype))
    x = torch.empty(64 << 20, dtype=torch.float32)          # 256 MB
    y = torch.empty_like(x)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        y.copy_(x)
        best = min(best, time.perf_counter() - start)
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return Gpu(f"this CPU ({torch.get_num_threads()} threads, {dtype})", memory, 2 * x.nbytes / best, flops)


def model_config(name: str) -> tuple[str, ModelConfig]:
    if name.lower() in MODELS:                  # SmolLM2-135M as well as smollm2-135m
        return name.lower(), ModelConfig.from_hf(MODELS[name.lower()])
    path = Path(name)
    if path.name == "config.json":
        return name, ModelConfig.from_hf(json.loads(path.read_text()))
    from workers.models import catalogue
    return name, ModelConfig.load(catalogue.resolve(name))


class Plan(Roofline):
    """A Roofline (workers/engine/roofline.py: weights, KV per token and per node, all-reduces) with a workload,
    SLOs and prices."""

    def __init__(self, cfg: ModelConfig, gpu: Gpu, tp: int, workload: Workload, eff: Efficiency,
                 dtype_bytes: int = 2, ttft_slo: float = 0.7, tpot_slo: float = 0.04, price: tuple = (2.0, 4.0)):
        super().__init__(cfg, gpu, tp, eff, dtype_bytes)
        self.w = workload
        self.ttft_slo, self.tpot_slo, self.price = ttft_slo, tpot_slo, price

    # 1-4: memory (weight_bytes, kv_bytes_per_token, kv_per_node: Roofline's)
    def context(self, full: bool = False) -> float:
        w = self.w
        return w.input_tokens + (w.output_tokens if full else w.output_tokens / 2)

    def concurrency(self, full: bool = False) -> float:
        return max(0.0, self.kv_per_node() / (self.kv_bytes_per_token() * self.context(full)))

    # 5: the roofline (allreduces: Roofline's)
    def prefill_seconds(self, tokens: float) -> float:
        """One prompt of `tokens` uncached tokens, alone on the node (compute-bound)."""
        n = max(int(tokens), 1)
        flops = self.cfg.request_flops(n, 1)
        return flops / (self.tp * self.gpu.flops * self.eff.mfu) + self.allreduces()

    def decode_seconds(self, batch: float) -> float:
        """One decode step of `batch` sequences at the average context: reading the weights once and
        every sequence's KV, or their FLOPs, whichever takes longer."""
        c, ctx = self.cfg, self.context()
        bytes_ = self.weight_bytes() + batch * ctx * self.kv_bytes_per_token()
        flops = batch * (2 * c.matmul_params() + 4 * c.num_layers * c.num_heads * c.head_dim * ctx
                         + 2 * c.hidden_size * c.vocab_size)
        return max(bytes_ / (self.tp * self.gpu.bandwidth * self.eff.mbu),
                   flops / (self.tp * self.gpu.flops * self.eff.mfu)) + self.allreduces()

    # 6: a node's steady state
    def uncached_prompt(self) -> float:
        return self.w.input_tokens * (1 - self.w.prefix_reuse)

    def steady(self, rate: float) -> dict | None:
        """A node at `rate` requests/s: step time, decode batch, TTFT; None where it cannot keep up."""
        tp_ = self.prefill_seconds(self.uncached_prompt())
        load = rate * tp_                           # share of each step spent prefilling
        if load >= 1:
            return None
        step = self.decode_seconds(0)
        for _ in range(100):                        # T = t_decode(λ·out·T) / (1 − λ·t_prefill): a fixed point
            batch = rate * self.w.output_tokens * step
            new = self.decode_seconds(batch) / (1 - load)
            if abs(new - step) < 1e-9:
                break
            step = new
        batch = rate * self.w.output_tokens * step
        return {"rate": rate, "step_s": step, "batch": batch, "ttft_s": tp_ / (1 - load), "prefill_share": load}

    def fits(self, s: dict | None) -> bool:
        return (s is not None and s["step_s"] <= self.tpot_slo and s["ttft_s"] <= self.ttft_slo
                and s["batch"] <= self.concurrency(full=True))

    def capacity(self) -> dict | None:
        """The highest request rate a node serves within the SLOs (bisection on λ)."""
        lo, hi = 0.0, 1.0
        while self.fits(self.steady(hi)):
            lo, hi = hi, hi * 2
            if hi > 1e7:
                break
        if lo == 0.0 and not self.fits(self.steady(1e-9)):
            return None
        for _ in range(60):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if self.fits(self.steady(mid)) else (lo, mid)
        return self.steady(lo)

    # 7: the fleet
    def report(self) -> dict:
        w, cap = self.w, self.capacity()
        out = {
            "model": {"parameters": parameters(self.cfg), "layers": self.cfg.num_layers,
                      "kv_heads": self.cfg.num_kv_heads, "head_dim": self.cfg.head_dim},
            "gpu": asdict(self.gpu), "tp": self.tp, "workload": {**asdict(w), "mean_rps": w.mean_rps,
                                                                   "peak_rps": w.peak_rps},
            "efficiency": asdict(self.eff), "slo": {"ttft_s": self.ttft_slo, "tpot_s": self.tpot_slo},
            "weights_per_gpu_bytes": self.weight_bytes() / self.tp,
            "bytes_per_parameter": self.bytes,
            "kv_bytes_per_token": self.kv_bytes_per_token(),
            "kv_per_node_bytes": self.kv_per_node(),
            "concurrency_average_context": self.concurrency(),
            "concurrency_full_context": self.concurrency(full=True),
            "prefill_seconds": self.prefill_seconds(self.uncached_prompt()),
            "decode_step_seconds_at_1": self.decode_seconds(1),
            "node": cap,
        }
        if cap is None:
            return out
        tokens_per_request = w.input_tokens + w.output_tokens
        nodes = math.ceil(w.peak_rps / (cap["rate"] * self.eff.target_utilization))
        mean_nodes = w.mean_rps / (cap["rate"] * self.eff.target_utilization)
        day_tokens = w.mean_rps * 86400 * tokens_per_request
        out.update({
            "node_output_tokens_per_s": cap["rate"] * w.output_tokens,
            "node_prefill_tokens_per_s": cap["rate"] * self.uncached_prompt(),
            "nodes_at_peak": nodes,
            "gpu_hours_per_day": {"provisioned_for_peak": nodes * self.tp * 24,
                                  "following_the_load": mean_nodes * self.tp * 24},
            "usd_per_million_tokens": {
                f"{p:g}": {"provisioned_for_peak": nodes * self.tp * 24 * p / (day_tokens / 1e6),
                           "following_the_load": mean_nodes * self.tp * 24 * p / (day_tokens / 1e6)}
                for p in self.price},
        })
        return out


# 8: the pipeline around the engines
def bus(cal: dict, w: Workload, nodes: int, util: float, server_cores: int) -> dict:
    """Each role's cores at the peak from a bench-bus calibration, and the nats-servers (module docstring, 8)."""
    rps, ktok = w.peak_rps, w.peak_rps * w.output_tokens / 1e3
    scale = {"tokenizer": w.input_tokens / cal["input_len"]}          # tokenizing is linear in the prompt
    cores = {role: (rps * c["ms_per_request"] + ktok * c["ms_per_1k_tokens"]) / 1e3 * scale.get(role, 1.0)
             for role, c in cal["roles"].items()}
    cluster = cal["nodes"]
    servers = cluster * max(1, math.ceil(cores["broker"] / util / (cluster * server_cores)))
    return {"calibration": {k: cal[k] for k in ("measured", "machine", "bus", "fsync", "nodes", "input_len",
                                                "tokens_separated")},
            "roles": cal["roles"], "input_scale": scale["tokenizer"], "output_ktokens_per_s": ktok, "cores": cores,
            "cores_at_target": {k: v / util for k, v in cores.items()},
            "worker_service_cores_per_node": cores["worker_service"] / nodes if nodes else None,
            "nats_servers": servers, "server_cores": server_cores, "bus_partitions": servers // cluster,
            "durable_writes_per_s": rps * cal["durable"]["stored_per_request"],
            "durable_bytes_per_s": rps * cal["durable"]["bytes_per_request"]}


def text(r: dict, model: str) -> str:
    w, e, node = r["workload"], r["efficiency"], r["node"]
    g = r["gpu"]
    lines = [
        f"plan: {model} on {r['tp']} × {g['name']} per node ({g['memory'] / GB:.0f} GB, "
        f"{g['bandwidth'] / 1e12:.2f} TB/s, {g['flops'] / 1e12:.3g} TFLOP/s each); MFU {e['mfu']}, MBU {e['mbu']}, "
        f"memory utilization {e['memory_utilization']}",
        f"workload: {w['dau']:,.0f} users × {w['turns']:g} turns/day = {w['mean_rps']:,.4g} requests/s on average, "
        f"{w['peak_rps']:,.4g} at the peak (× {w['peak_factor']:g}); {w['input_tokens']} in / {w['output_tokens']} out "
        f"tokens, {w['prefix_reuse']:.0%} of the prompt from the prefix cache",
        f" 1. weights per GPU      {r['model']['parameters'] / 1e9:.2f} B params × {r['bytes_per_parameter']} B / "
        f"{r['tp']} = {r['weights_per_gpu_bytes'] / GB:.1f} GB",
        f" 2. KV per token         2 × {r['model']['layers']} layers × {r['model']['kv_heads']} KV heads × "
        f"{r['model']['head_dim']} × {r['bytes_per_parameter']} B = {r['kv_bytes_per_token'] / 1e6:.3f} MB",
        f" 3. KV per node          {r['tp']} × {g['memory'] / GB:.0f} GB × {e['memory_utilization']} − weights = "
        f"{r['kv_per_node_bytes'] / GB:.0f} GB",
        f" 4. concurrent requests  {r['concurrency_average_context']:.0f} at the average context "
        f"({w['input_tokens'] + w['output_tokens'] / 2:.0f} tokens), {r['concurrency_full_context']:.0f} at the full "
        f"one ({w['input_tokens'] + w['output_tokens']})",
        f" 5. roofline             prefill of the uncached prompt {r['prefill_seconds'] * 1e3:.1f} ms alone; "
        f"a decode step of 1 {r['decode_step_seconds_at_1'] * 1e3:.1f} ms",
    ]
    if node is None:
        lines.append(" 6. a node cannot meet the SLOs on this workload at any rate")
        return "\n".join(lines)
    lines += [
        f" 6. one node             {node['rate']:.2f} requests/s within TTFT {r['slo']['ttft_s'] * 1e3:.0f} ms and "
        f"TPOT {r['slo']['tpot_s'] * 1e3:.0f} ms: step {node['step_s'] * 1e3:.1f} ms, decode batch "
        f"{node['batch']:.0f}, TTFT {node['ttft_s'] * 1e3:.0f} ms, {node['prefill_share']:.0%} of each step "
        f"prefilling; {r['node_output_tokens_per_s']:,.0f} output + {r['node_prefill_tokens_per_s']:,.0f} prefill "
        f"tokens/s",
        f" 7. nodes at the peak    {w['peak_rps']:,.4g} / ({node['rate']:.2f} × {e['target_utilization']}) = "
        f"{r['nodes_at_peak']:,} nodes ({r['nodes_at_peak'] * r['tp']:,} GPUs)",
        f"    GPU-hours a day      {r['gpu_hours_per_day']['provisioned_for_peak']:,.0f} provisioned for the peak, "
        f"{r['gpu_hours_per_day']['following_the_load']:,.0f} following the load",
    ]
    for price, cost in r["usd_per_million_tokens"].items():
        lines.append(f"    $ per 1M tokens at ${price}/GPU-hour: {cost['provisioned_for_peak']:.3f} provisioned for "
                     f"the peak, {cost['following_the_load']:.3f} following the load")
    if "bus" in r:
        lines += bus_text(r["bus"], w, e["target_utilization"])
    return "\n".join(lines)


def bus_text(b: dict, w: dict, util: float) -> list[str]:
    c, ktok = b["calibration"], b["output_ktokens_per_s"]
    lines = [f" 8. the pipeline         bench-bus on {c['bus']} ({c['nodes']} node{'s' * (c['nodes'] > 1)}, fsync "
             f"{c['fsync']}), {c['machine']}, {c['measured']}:",
             f"    a role's CPU is ms a request + ms per 1k output tokens"
             f"{'' if c['tokens_separated'] else ' (one output length measured: all counted per request)'}"]
    for role, k in b["roles"].items():
        scale = f" × {b['input_scale']:.2f} (prompt length)" if role == "tokenizer" and b["input_scale"] != 1 else ""
        lines.append(f"    {role.replace('_', ' '):15} ({w['peak_rps']:,.4g} × {k['ms_per_request']:.2f} + {ktok:,.0f} "
                     f"× {k['ms_per_1k_tokens']:.2f}) ms{scale} = {b['cores'][role]:,.0f} cores, "
                     f"{b['cores_at_target'][role]:,.0f} at {util:.0%}")
    lines += [f"    nats-servers    {b['cores_at_target']['broker']:,.0f} cores / {b['server_cores']} a server, "
              f"whole clusters of {c['nodes']} = {b['nats_servers']} servers; {b['durable_writes_per_s']:,.0f} durable "
              f"writes/s, {b['durable_bytes_per_s'] / 1e6:,.0f} MB/s",
              f"    partitions      {b['bus_partitions']}, each on its own {c['nodes']} servers (--bus-partitions "
              f"{b['bus_partitions']}, docs/cluster.md)",
              f"    worker service  {b['worker_service_cores_per_node']:.2f} cores on each GPU node"]
    return lines


def main(args) -> None:
    model, cfg = model_config(args.model)
    gpu = measured_cpu(args.cpu_dtype) if args.gpu == "cpu" else GPUS[args.gpu]
    workload = Workload(args.dau, args.turns, args.input_tokens, args.output_tokens, args.peak_factor,
                        args.prefix_reuse)
    eff = Efficiency(args.mfu, args.mbu, args.memory_utilization)
    dtype_bytes = 4 if args.gpu == "cpu" and args.cpu_dtype == "float32" else 2
    plan = Plan(cfg, gpu, args.tp, workload, eff, dtype_bytes, args.ttft_slo_ms / 1e3, args.tpot_slo_ms / 1e3,
                tuple(args.usd_per_gpu_hour))
    report = plan.report()
    if report.get("nodes_at_peak"):
        cal = json.loads(Path(args.bus_calibration or BUS_CALIBRATION).read_text())
        report["bus"] = bus(cal, workload, report["nodes_at_peak"], eff.target_utilization, args.server_cores)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(text(report, model))

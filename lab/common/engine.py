"""The engine and HF `generate` run in this process on requests of random token ids, greedy, EOS
ignored: the offline side of the engine benchmarks."""
import random
import time

import torch

from schemas.sampling import SamplingParams
from workers.engine.engine import LLMEngine


def workload(args, vocab_size: int) -> list[tuple[list[int], int]]:
    rng = random.Random(args.seed)
    prompt = lambda: [rng.randrange(16, vocab_size) for _ in range(rng.randint(*args.input_len))]  # noqa: E731
    return [(prompt(), rng.randint(*args.output_len)) for _ in range(args.num_requests)]


def run_engine(engine: LLMEngine, requests) -> float:
    for i, (prompt, n) in enumerate(requests):
        engine.add_request(f"b{i}", prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    return time.perf_counter() - start


def timed_engine_run(engine: LLMEngine, requests) -> tuple[float, list]:
    engine.kv.reset_prefix_cache()  # every run starts cold, as the first did
    engine.trace = []
    return run_engine(engine, requests), engine.trace


@torch.inference_mode()
def hf_generate(model, batch, streamer=None) -> None:
    """One static batch of (prompt, output length): left-padded, run for its longest output; `streamer`
    (transformers' BaseStreamer) is handed every step's tokens."""
    width = max(len(p) for p, _ in batch)
    ids = torch.tensor([[0] * (width - len(p)) + p for p, _ in batch], device=model.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in batch], device=model.device)
    n = max(n for _, n in batch)
    model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                   eos_token_id=None, pad_token_id=0, streamer=streamer)

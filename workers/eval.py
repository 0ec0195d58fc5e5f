"""`tokenbus eval ppl`: how well a model predicts a text, teacher-forced: the engine's per-token
log-likelihood and perplexity beside HF transformers' on the same tokens, in the same dtype.

The engine's figure is the engine's numerics: its scheduler prefills the text in its own chunks into
its paged KV cache, and its model runner computes the logits of every position of each chunk (a
generation step computes only the last one's); only the sampler is left out."""
import json
import math
import time
from pathlib import Path

import torch

from schemas.sampling import SamplingParams
from workers.engine.engine import EngineConfig, LLMEngine

TEXT = Path(__file__).parent / "models" / "data" / "ppl.txt"   # written for tokenbus, ships with it


def engine_logprobs(engine: LLMEngine, ids: list[int]) -> torch.Tensor:
    """float32 [len(ids) - 1]: log p(ids[i] | ids[:i]) for i >= 1, from the engine's own step parts."""
    req = engine.add_request("eval-ppl", ids, SamplingParams(max_tokens=1, temperature=0))
    out = []
    try:
        while engine.has_unfinished():
            batch = engine.scheduler.schedule()
            inputs = engine.runner.prepare(batch, [engine.kv.block_ids(req.request_id)])
            start, n = req.num_computed_tokens, batch.num_new_tokens[0]
            inputs.logit_rows = torch.arange(n)             # every position, not just the last
            logprobs = engine.runner.execute(inputs).float().log_softmax(-1)
            targets = torch.tensor(ids[start + 1:start + n + 1])
            out.append(logprobs[torch.arange(len(targets)), targets])
            sampled = [int(logprobs[-1].argmax())] if batch.samples[0] else []
            engine.scheduler.update(batch, [sampled] if sampled else [], [[None]] if sampled else [])
    finally:
        engine.abort(req.request_id)
    return torch.cat(out)


@torch.inference_mode()
def hf_logprobs(model, ids: list[int]) -> torch.Tensor:
    """The same, from transformers: one forward over the whole text."""
    logits = model(torch.tensor([ids])).logits[0, :-1]
    return logits.float().log_softmax(-1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]


def summary(logprobs: torch.Tensor, seconds: float) -> dict:
    mean = logprobs.double().mean().item()
    return {"mean_logprob": mean, "perplexity": math.exp(-mean), "seconds": seconds}


def ppl(args) -> None:
    from transformers import AutoTokenizer

    from workers.models.catalogue import resolve
    from workers.models.config import ModelConfig
    from workers.models.gguf import hf_dir
    from workers.models.reference import hf_model

    model = resolve(args.model)
    text = Path(args.text or TEXT)
    if not text.is_file():
        raise ValueError(f"--text {text}: no such file")
    ids = AutoTokenizer.from_pretrained(hf_dir(model)).encode(text.read_text())
    if args.max_tokens:
        ids = ids[:args.max_tokens]
    if len(ids) < 2:
        raise ValueError(f"--text {text} has {len(ids)} token(s): at least 2 are needed")
    context = ModelConfig.load(model).max_model_len
    if len(ids) >= context:
        raise ValueError(f"--text {text} has {len(ids)} tokens, more than the model's context takes ({context - 1}): "
                         f"evaluate the first N with --max-tokens N")
    engine = LLMEngine(model, EngineConfig(dtype=args.dtype, max_model_len=len(ids) + 1,
                                           num_kv_blocks=len(ids) // 16 + 2, device="cpu"))
    start = time.perf_counter()
    ours = engine_logprobs(engine, ids)
    result = {"model": model, "text": str(text), "dtype": args.dtype, "tokens": len(ids), "predicted": len(ids) - 1,
              "engine": summary(ours, time.perf_counter() - start)}
    engine.close()
    reference = hf_model(model, getattr(torch, args.dtype))
    start = time.perf_counter()
    theirs = hf_logprobs(reference, ids)
    result["hf"] = summary(theirs, time.perf_counter() - start)
    result["relative_difference"] = abs(result["engine"]["perplexity"] / result["hf"]["perplexity"] - 1)
    result["max_token_difference"] = (ours - theirs).abs().max().item()
    print(json.dumps(result) if args.json else table(result))


def table(r: dict) -> str:
    rows = [f"{'':18}{'mean log-likelihood':>21}{'perplexity':>12}{'seconds':>9}"]
    for name, key in (("tokenbus engine", "engine"), ("HF transformers", "hf")):
        s = r[key]
        rows.append(f"{name:18}{s['mean_logprob']:>21.5f}{s['perplexity']:>12.4f}{s['seconds']:>9.1f}")
    return "\n".join([f"{r['model']} ({r['dtype']}) on {r['text']}: {r['tokens']} tokens, {r['predicted']} predicted",
                      *rows, f"relative difference of the perplexity: {r['relative_difference']:.2g}; largest "
                      f"per-token difference of the log-likelihood: {r['max_token_difference']:.2g}"])

"""`tokenbus eval`: what a model's numerics cost, measured as llama.cpp measures it.

`eval ppl`: how well a model predicts a text, teacher-forced: the engine's per-token log-likelihood
and perplexity beside HF transformers' on the same tokens, in the same dtype; and, position by
position, the KL divergence of the engine's token distributions (in its dtype, KV cache dtype and
weight quantization) from the unquantized float32 model's, with the share of positions where both
rank the same token first (llama.cpp's `llama-perplexity --kl-divergence`).

The engine's figure is the engine's numerics: its scheduler prefills the text in its own chunks into
its paged KV cache, and its model runner computes the logits of every position of each chunk (a
generation step computes only the last one's); only the sampler is left out. The reference engine
runs beside it, step by step over the same chunks, so nothing of its distributions is stored.

`eval longctx`: a fact placed early in a long prompt and asked for at its end, at several prompt
lengths up to the model's context, answered greedily by the configured engine and by the unquantized
float32 one; a quantization that breaks long-range recall answers differently."""
import dataclasses
import json
import math
import time
from pathlib import Path

import torch

from schemas.sampling import SamplingParams
from workers.engine.engine import EngineConfig, LLMEngine

TEXT = Path(__file__).parent / "models" / "data" / "ppl.txt"   # written for tokenbus, ships with it
STEP_TOKENS = 512        # eval's step budget: a step's logits are [512, vocab], 100 MB each side for SmolLM2's
UNQUANTIZED = {"kv_cache_dtype": "auto", "quantization": "none"}   # the flags' defaults: the reference's numerics
QUANTILES = (99.9, 99.0, 95.0, 90.0, 50.0, 10.0, 5.0, 1.0)         # llama.cpp's KLD percentiles
FACT, QUESTION, ANSWER = "The secret code is 7431.", "What is the secret code?", "7431"
MARK = "\x00filler\x00"


def quantized(args, fields: set[str] | None = None) -> dict:
    """EngineConfig's options for --kv-cache-dtype and --quantization, those that differ from the unquantized
    default; a value this engine has no option for (EngineConfig lacks the field) is refused naming the flag."""
    fields = {f.name for f in dataclasses.fields(EngineConfig)} if fields is None else fields
    options = {}
    for name, default in UNQUANTIZED.items():
        value = getattr(args, name, default)
        if value == default:
            continue
        flag = "--" + name.replace("_", "-")
        if name not in fields:
            raise ValueError(f"{flag} {value}: this engine has no {name} option yet; only {flag} {default} runs")
        options[name] = value
    return options


def chunk_logprobs(engine: LLMEngine, ids: list[int]):
    """Yields, step by step, (log-probabilities float32 [n, vocab] of the next token at the n positions the step
    prefilled that have one in ids, the step's seconds)."""
    req = engine.add_request("eval-ppl", ids, SamplingParams(max_tokens=1, temperature=0))
    try:
        while engine.has_unfinished():
            start = time.perf_counter()
            batch = engine.scheduler.schedule()
            inputs = engine.runner.prepare(batch, [engine.kv.block_ids(req.request_id)])
            first, n = req.num_computed_tokens, batch.num_new_tokens[0]
            inputs.logit_rows = torch.arange(n)             # every position, not just the last
            logprobs = engine.runner.execute(inputs).float().log_softmax(-1)
            sampled = [int(logprobs[-1].argmax())] if batch.samples[0] else []
            engine.scheduler.update(batch, [sampled] if sampled else [], [[None]] if sampled else [])
            yield logprobs[:len(ids) - 1 - first], time.perf_counter() - start
    finally:
        engine.abort(req.request_id)


def side_by_side(engine: LLMEngine, reference: LLMEngine, ids: list[int]) -> dict[str, torch.Tensor]:
    """Both engines over the same text in the same chunks, compared position by position (each [len(ids) - 1]):
    the log-likelihood of the text's next token under each, the KL divergence of the engine's next-token
    distribution from the reference's, whether both rank the same token first; and the seconds of each side."""
    targets, at = torch.tensor(ids[1:]), 0
    cols = {k: [] for k in ("logprob", "reference_logprob", "kld", "same_top1")}
    seconds = torch.zeros(2, dtype=torch.float64)
    for (lq, sq), (lr, sr) in zip(chunk_logprobs(engine, ids), chunk_logprobs(reference, ids), strict=True):
        assert lq.shape == lr.shape, (lq.shape, lr.shape)   # the same step budget: the same chunks
        t = targets[at:at + len(lq), None]
        cols["logprob"].append(lq.gather(1, t)[:, 0])
        cols["reference_logprob"].append(lr.gather(1, t)[:, 0])
        cols["kld"].append(kl(lr, lq))
        cols["same_top1"].append(lq.argmax(-1) == lr.argmax(-1))
        seconds += torch.tensor([sq, sr], dtype=torch.float64)
        at += len(lq)
    return {k: torch.cat(v) for k, v in cols.items()} | {"seconds": seconds}


def kl(reference: torch.Tensor, ours: torch.Tensor) -> torch.Tensor:
    """KL(reference || ours) in nats per row, of two rows of log-probabilities each."""
    return (reference.exp() * (reference - ours)).sum(-1)


@torch.inference_mode()
def hf_logprobs(model, ids: list[int]) -> torch.Tensor:
    """The same, from transformers: one forward over the whole text."""
    logits = model(torch.tensor([ids])).logits[0, :-1]
    return logits.float().log_softmax(-1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]


def summary(logprobs: torch.Tensor, seconds: float) -> dict:
    mean = logprobs.double().mean().item()
    return {"mean_logprob": mean, "perplexity": math.exp(-mean), "seconds": seconds}


def divergence(cols: dict[str, torch.Tensor]) -> dict:
    """llama.cpp's --kl-divergence figures from side_by_side's columns."""
    kld, same = cols["kld"].double(), cols["same_top1"].double()
    dp = cols["logprob"].double().exp() - cols["reference_logprob"].double().exp()
    n, top1 = len(kld), same.mean().item()
    return {"kld": kld.mean().item(), "kld_max": kld.max().item(),
            "kld_quantiles": {f"{q:g}": torch.quantile(kld, q / 100).item() for q in QUANTILES},
            "top1_agreement": top1, "top1_agreement_stderr": math.sqrt(top1 * (1 - top1) / n),
            "delta_p": {"mean": dp.mean().item(), "rms": dp.square().mean().sqrt().item(),
                        "max": dp.max().item(), "min": dp.min().item()}}


def reference_model(args, model: str) -> str:
    """--reference resolved (default: the model itself); refused when its vocabulary is not the model's."""
    from workers.models.catalogue import resolve
    from workers.models.config import ModelConfig

    if not args.reference:
        made = ModelConfig.load(model).quantization
        if made is not None:
            raise ValueError(f"--model {model} is a {made} checkpoint: name the unquantized model it was made from "
                             "with --reference")
        return model
    base = resolve(args.reference)
    ours, theirs = ModelConfig.load(model).vocab_size, ModelConfig.load(base).vocab_size
    if ours != theirs:
        raise ValueError(f"--reference {args.reference}: its vocabulary has {theirs} tokens, --model's {ours}; "
                         "the two must share a tokenizer")
    return base


def text_ids(args, model: str) -> tuple[Path, list[int]]:
    from transformers import AutoTokenizer

    from workers.models.config import ModelConfig
    from workers.models.gguf import hf_dir

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
    return text, ids


def ppl(args) -> None:
    from workers.models import reference as hf
    from workers.models.catalogue import resolve

    model = resolve(args.model)
    base = reference_model(args, model)
    text, ids = text_ids(args, model)
    options = quantized(args)
    shape = {"max_model_len": len(ids) + 1, "num_kv_blocks": len(ids) // 16 + 2,
             "max_num_batched_tokens": STEP_TOKENS, "device": "cpu"}
    engine = LLMEngine(model, EngineConfig(dtype=args.dtype, **shape, **options))
    try:
        reference = LLMEngine(base, EngineConfig(dtype="float32", **shape))
        try:
            cols = side_by_side(engine, reference, ids)
        finally:
            reference.close()
    finally:
        engine.close()
    checkpoint = engine.model_cfg.quantization   # a quantized checkpoint's own (w4a16), else what was asked
    result = {"model": model, "text": str(text), "dtype": args.dtype, "kv_cache_dtype": args.kv_cache_dtype,
              "quantization": checkpoint or args.quantization, "tokens": len(ids), "predicted": len(ids) - 1,
              "engine": summary(cols["logprob"], cols["seconds"][0].item()),
              "reference": {"model": base, "dtype": "float32", **UNQUANTIZED,
                            **summary(cols["reference_logprob"], cols["seconds"][1].item())}}
    result["ppl_ratio"] = result["engine"]["perplexity"] / result["reference"]["perplexity"]
    result |= divergence(cols)
    result |= {"hf": None, "relative_difference": None, "max_token_difference": None}
    if checkpoint is None:   # transformers' side reads float checkpoints; a W4A16 one is compared with its source
        start = time.perf_counter()
        theirs = hf_logprobs(hf.hf_model(model, getattr(torch, args.dtype)), ids)
        result["hf"] = summary(theirs, time.perf_counter() - start)
        result["relative_difference"] = abs(result["engine"]["perplexity"] / result["hf"]["perplexity"] - 1)
        result["max_token_difference"] = (cols["logprob"] - theirs).abs().max().item()
    print(json.dumps(result) if args.json else table(result))


def table(r: dict) -> str:
    rows = [f"{'':18}{'mean log-likelihood':>21}{'perplexity':>12}{'seconds':>9}"]
    for name, key in (("tokenbus engine", "engine"), ("HF transformers", "hf"), ("unquantized fp32", "reference")):
        s = r[key]
        if s is None:
            continue
        rows.append(f"{name:18}{s['mean_logprob']:>21.5f}{s['perplexity']:>12.4f}{s['seconds']:>9.1f}")
    q, dp = r["kld_quantiles"], r["delta_p"]
    return "\n".join([
        f"{r['model']} ({r['dtype']}, kv {r['kv_cache_dtype']}, weights {r['quantization']}) on {r['text']}: "
        f"{r['tokens']} tokens, {r['predicted']} predicted", *rows,
        f"relative difference of the perplexity: {r['relative_difference']:.2g}; largest per-token difference of "
        f"the log-likelihood: {r['max_token_difference']:.2g}" if r["hf"] else "HF transformers: not run on a "
        "quantized checkpoint",
        f"against the unquantized float32 model ({r['reference']['model']}):",
        f"  PPL ratio {r['ppl_ratio']:.5f}",
        f"  KLD mean {r['kld']:.6f}, max {r['kld_max']:.6f}, 99.9% {q['99.9']:.6f}, 99% {q['99']:.6f}, "
        f"median {q['50']:.6f}",
        f"  same top-1 {100 * r['top1_agreement']:.2f} ± {100 * r['top1_agreement_stderr']:.2f} %",
        f"  Δp mean {100 * dp['mean']:.3f} %, RMS {100 * dp['rms']:.3f} %"])


# -- long context -----------------------------------------------------------------------------------

def prompt_lengths(spec: str, full: int) -> list[int]:
    """--lengths: comma-separated token counts (512, 4k = 4096) or full (the context less the answer's tokens);
    a count at or beyond full is taken as full."""
    lengths = []
    for part in spec.split(","):
        word = part.strip().lower()
        try:
            n = full if word == "full" else int(word[:-1]) * 1024 if word.endswith("k") else int(word)
        except ValueError:
            raise ValueError(f"--lengths {spec}: {part!r} is neither a token count (512, 4k) nor full") from None
        if n < 1:
            raise ValueError(f"--lengths {spec}: {part!r} is not a positive length")
        lengths.append(min(n, full))
    return sorted(set(lengths))


def framing(tokenizer) -> tuple[list[int], list[int]]:
    """The token ids before the filler (the fact) and after it (the question), as a chat turn when the model has a
    chat template, else as plain text."""
    if tokenizer.chat_template:
        user = f"{FACT}\n\n{MARK}\n\n{QUESTION} Answer with the number only."
        text = tokenizer.apply_chat_template([{"role": "user", "content": user}], add_generation_prompt=True,
                                             tokenize=False)
    else:
        text = f"{FACT}\n\n{MARK}\n\nQuestion: {QUESTION}\nAnswer:"
    head, tail = text.split(MARK)
    return [*tokenizer.encode(head, add_special_tokens=False)], [*tokenizer.encode(tail, add_special_tokens=False)]


def needle_prompt(head: list[int], tail: list[int], filler: list[int], length: int) -> list[int]:
    """head, then the filler text's tokens (repeated as needed), then tail: `length` tokens in all."""
    n = length - len(head) - len(tail)
    if n < 1:
        raise ValueError(f"--lengths: {length} tokens leave no room for filler (the fact and question take "
                         f"{len(head) + len(tail)})")
    return head + (filler * (n // len(filler) + 1))[:n] + tail


def greedy(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> list[tuple[list[int], float]]:
    """Each prompt's greedy answer, one prompt at a time, with its seconds."""
    out = []
    for i, ids in enumerate(prompts):
        start = time.perf_counter()
        req = engine.add_request(f"eval-longctx-{i}", ids, SamplingParams(max_tokens=max_tokens, temperature=0))
        while engine.has_unfinished():
            engine.step()
        out.append((list(req.output_token_ids), time.perf_counter() - start))
    return out


def answers(model: str, config: dict, prompts: list[list[int]], max_tokens: int) -> list[tuple[list[int], float]]:
    engine = LLMEngine(model, EngineConfig(**config))
    try:
        return greedy(engine, prompts, max_tokens)
    finally:
        engine.close()


def longctx(args) -> None:
    from transformers import AutoTokenizer

    from workers.models.catalogue import resolve
    from workers.models.config import ModelConfig
    from workers.models.gguf import hf_dir

    model = resolve(args.model)
    base = reference_model(args, model)
    tokenizer = AutoTokenizer.from_pretrained(hf_dir(model))
    context = min(ModelConfig.load(model).max_model_len, ModelConfig.load(base).max_model_len)
    if args.answer_tokens < 1 or args.answer_tokens >= context:
        raise ValueError(f"--answer-tokens {args.answer_tokens}: must be at least 1 and below the context ({context})")
    lengths = prompt_lengths(args.lengths, context - args.answer_tokens)
    head, tail = framing(tokenizer)
    filler = tokenizer.encode(TEXT.read_text(), add_special_tokens=False)
    prompts = [needle_prompt(head, tail, filler, n) for n in lengths]
    longest = lengths[-1] + args.answer_tokens
    shape = {"max_model_len": longest, "num_kv_blocks": longest // 16 + 2, "enable_prefix_caching": False,
             "device": "cpu"}
    ours = answers(model, {"dtype": args.dtype, **shape, **quantized(args)}, prompts, args.answer_tokens)
    theirs = answers(base, {"dtype": "float32", **shape}, prompts, args.answer_tokens)
    checks = [check(tokenizer, len(p), a, b) for p, a, b in zip(prompts, ours, theirs)]
    result = {"model": model, "dtype": args.dtype, "kv_cache_dtype": args.kv_cache_dtype,
              "quantization": args.quantization, "reference": {"model": base, "dtype": "float32", **UNQUANTIZED},
              "context": context, "fact": FACT, "question": QUESTION, "expected": ANSWER,
              "answer_tokens": args.answer_tokens, "checks": checks,
              "all_same_answers": all(c["same_answer"] for c in checks),
              "all_same_recall": all(c["same_recall"] for c in checks)}
    print(json.dumps(result) if args.json else longctx_table(result))


def check(tokenizer, length: int, ours: tuple[list[int], float], theirs: tuple[list[int], float]) -> dict:
    """One prompt length: both answers, whether they are the same tokens, whether each holds the fact."""
    answer, reference = (tokenizer.decode(ids, skip_special_tokens=True).strip() for ids, _ in (ours, theirs))
    return {"prompt_tokens": length, "answer": answer, "reference_answer": reference,
            "same_answer": ours[0] == theirs[0], "diverges_at": first_difference(ours[0], theirs[0]),
            "recalled": ANSWER in answer, "reference_recalled": ANSWER in reference,
            "same_recall": (ANSWER in answer) == (ANSWER in reference), "seconds": ours[1],
            "reference_seconds": theirs[1]}


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The index of the first answer token where a and b differ (one ending first counts); None when equal."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def longctx_table(r: dict) -> str:
    rows = [f"{'prompt tokens':>13}  {'same':10}  {'recalled':8}  {'answer':32}  unquantized fp32's answer"]
    for c in r["checks"]:
        same = "yes" if c["same_answer"] else f"from tok {c['diverges_at']}"
        recalled = f"{'yes' if c['recalled'] else 'no'}/{'yes' if c['reference_recalled'] else 'no'}"
        rows.append(f"{c['prompt_tokens']:>13}  {same:10}  {recalled:8}  {c['answer'][:30]!r:32}  "
                    f"{c['reference_answer'][:30]!r}")
    return "\n".join([f"{r['model']} ({r['dtype']}, kv {r['kv_cache_dtype']}, weights {r['quantization']}) against "
                      f"the unquantized float32 model; {r['fact']!r} first, {r['question']!r} last, greedy, "
                      f"{r['answer_tokens']} answer tokens at most; recalled: ours/unquantized", *rows,
                      "every answer the same as the unquantized model's" if r["all_same_answers"]
                      else "some answers differ from the unquantized model's"])

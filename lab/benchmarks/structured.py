"""`tokenbus bench-structured`: what structured output costs, side by side in one run.

- Steps: --batch chat requests (greedy, --output-len tokens each) run together in one engine, with 0%,
  25% and 100% of them (--shares) constrained by a typical JSON schema (an order: nested objects, an
  array of at least --min-items objects, an enum, bounded numbers, a pattern) that cannot close within
  --output-len tokens, so every row decodes to the end. Per share: the median decode step with every row
  running, the part of it spent filling and applying the grammar masks (apply_grammars), output tokens/s
  at that step time and the cost against 0%. The shares run in turn, --repeat times over, each time in
  a rotated order, in one engine (the grammar compiled before the first), and each figure is the median of
  its runs. Every constrained output is checked to be a prefix of a text the schema allows.
- Compiles: the vocabulary's tokenizer info (once per worker), then the typical schema, a large one
  (--large-properties properties of nested objects, arrays and enums) and a regex, each compiled cold
  (xgrammar's own cache off, as the engine runs it), median of --repeat, with the time of its conversion
  to a grammar alone (schemas.sampling.grammar_of, once per text in a process); and the longest the calling
  thread paused while the typical schema compiled on another (the engine compiles beside its step loop).
- Masks: the full run's constrained outputs, each cut at a different length, give the matchers of one
  batch; for them, the time to fill the bitmasks, to apply them with xgrammar's CPU kernel and with the
  engine's (workers.engine.grammar.apply_bitmask_cpu), median of 20.

Goal: at 100% constrained rows, at most GOAL_COST (10%) fewer output tokens/s than at 0%; the command
exits 1 when it is missed.
"""
import json
import statistics
import time

GOAL_COST = 0.10
PROMPT_ROOM = 256      # tokens: the KV pool holds every prompt of the batch (about 80 each) whole


def order_schema(min_items: int) -> dict:
    item = {"type": "object", "properties": {
        "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
        "name": {"type": "string", "maxLength": 24},
        "qty": {"type": "integer", "minimum": 1, "maximum": 99},
        "price": {"type": "number", "minimum": 0, "maximum": 10000}},
        "required": ["sku", "name", "qty", "price"]}
    return {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 1},
        "customer": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 32},
                                                      "email": {"type": "string", "maxLength": 48},
                                                      "tier": {"enum": ["free", "pro", "enterprise"]}},
                     "required": ["name", "email", "tier"]},
        "status": {"enum": ["new", "paid", "shipped", "cancelled"]},
        "items": {"type": "array", "items": item, "minItems": min_items}},
        "required": ["id", "customer", "status", "items"]}


def large_schema(properties: int) -> dict:
    """properties fields, each one of four shapes in turn: a nested object, an array of them, an enum, a
    bounded number."""
    shapes = [
        lambda i: {"type": "object", "properties": {"a": {"type": "string", "maxLength": 16},
                                                    "b": {"type": "integer", "minimum": 0, "maximum": i + 10},
                                                    "c": {"type": "boolean"}}, "required": ["a", "b"]},
        lambda i: {"type": "array", "items": {"type": "object", "properties": {
            "x": {"type": "number"}, "y": {"enum": [f"v{i}-{j}" for j in range(4)]}}}, "maxItems": 8},
        lambda i: {"enum": [f"choice-{i}-{j}" for j in range(6)]},
        lambda i: {"type": "number", "minimum": -i, "maximum": i * 100 + 1},
    ]
    props = {f"field_{i}": shapes[i % len(shapes)](i) for i in range(properties)}
    return {"type": "object", "properties": props, "required": list(props)[::2]}


class MaskClock:
    """Seconds spent in the sampler's apply_grammars, per step."""

    def __init__(self):
        from workers.engine import sampler

        self.sampler, self.inner, self.seconds = sampler, sampler.apply_grammars, 0.0
        sampler.apply_grammars = self.timed

    def timed(self, logits, requests):
        t = time.perf_counter()
        try:
            return self.inner(logits, requests)
        finally:
            self.seconds += time.perf_counter() - t

    def close(self) -> None:
        self.sampler.apply_grammars = self.inner


def run_share(llm, clock: MaskClock, prompts: list[list[int]], share: float, schema: dict, output_len: int,
              tag: str) -> dict:
    """The batch with round(share × batch) rows constrained: its decode steps with every row running."""
    from schemas.sampling import SamplingParams

    constrained = round(share * len(prompts))
    free = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    bound = SamplingParams(max_tokens=output_len, temperature=0, json_schema=schema)
    reqs = [llm.engine.add_request(f"{tag}-{i}", p, bound if i < constrained else free)
            for i, p in enumerate(prompts)]
    steps, masks = [], []
    while not all(r.finished for r in reqs):
        decoding = all(r.num_output_tokens >= 1 and not r.finished for r in reqs)
        clock.seconds, t = 0.0, time.perf_counter()
        llm.engine.step()
        if decoding and all(r.num_output_tokens >= 2 for r in reqs):
            steps.append(time.perf_counter() - t)
            masks.append(clock.seconds)
    outputs = [llm.tokenizer.decode(r.output_token_ids, skip_special_tokens=True) for r in reqs[:constrained]]
    return {"steps": len(steps), "step_ms": 1e3 * statistics.median(steps), "mask_ms": 1e3 * statistics.median(masks),
            "ended_early": sum(r.num_output_tokens < output_len for r in reqs), "outputs": outputs,
            "token_ids": [r.output_token_ids for r in reqs[:constrained]]}


def schema_grammar(schema: dict):
    """The schema compiled by xgrammar on an empty vocabulary: for checking texts, not sampling."""
    import xgrammar as xgr

    return xgr.GrammarCompiler(xgr.TokenizerInfo([])).compile_json_schema(json.dumps(schema), any_whitespace=False)


def follows(text: str, compiled) -> bool:
    """The text is a prefix of a JSON text the schema allows (a matcher of schema_grammar accepts it)."""
    import xgrammar as xgr

    return xgr.GrammarMatcher(compiled).accept_string(text)


def longest_pause(work) -> float:
    """Seconds: the longest the calling thread went between two turns of a short loop while `work` ran on
    another thread."""
    import threading

    worker = threading.Thread(target=work)
    worker.start()
    longest, last = 0.0, time.perf_counter()
    while worker.is_alive():
        sum(range(200))
        now = time.perf_counter()
        longest, last = max(longest, now - last), now
    worker.join()
    return longest


def mask_times(compiled, outputs: list[list[int]], vocab_size: int, repeat: int = 20) -> dict:
    """ms to fill one batch's bitmasks and to apply them with xgrammar's kernel and with the engine's; the
    batch's matchers are the outputs' grammar states, output i cut after i × 7 mod its length tokens."""
    import torch
    import xgrammar as xgr

    from workers.engine.grammar import apply_bitmask_cpu

    matchers = []
    for i, tokens in enumerate(outputs):
        m = xgr.GrammarMatcher(compiled)
        for token in tokens[:i * 7 % max(len(tokens), 1)]:
            m.accept_token(token)
        matchers.append(m)
    rows, logits = list(range(len(matchers))), torch.randn(len(matchers), vocab_size)
    bitmask = xgr.allocate_token_bitmask(len(matchers), vocab_size)

    def fill():
        for n, m in enumerate(matchers):
            m.fill_next_token_bitmask(bitmask, n)

    def ms(fn) -> float:
        times = []
        for _ in range(repeat):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return 1e3 * statistics.median(times)
    return {"rows": len(rows), "fill_ms": ms(fill),
            "xgrammar_apply_ms": ms(lambda: xgr.apply_token_bitmask_inplace(logits.clone(), bitmask)),
            "clone_ms": ms(logits.clone), "engine_apply_ms": ms(lambda: apply_bitmask_cpu(logits, bitmask, rows))}


def compile_times(model_dir: str, vocab_size: int, eos: tuple[int, ...], schemas: dict, repeat: int) -> dict:
    """Seconds: the tokenizer info, then each constraint compiled cold as the engine compiles it."""
    import xgrammar as xgr

    from schemas.sampling import SamplingParams, grammar_of, to_grammar
    from workers.engine.grammar import Grammars

    t = time.perf_counter()
    info = Grammars(model_dir, vocab_size, eos).tokenizer_info()
    rows = {"tokenizer info": {"seconds": time.perf_counter() - t, "chars": None}}
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    for name, params in schemas.items():
        params = SamplingParams(**params)
        times = []
        for _ in range(repeat):
            t = time.perf_counter()
            compiled = compiler.compile_grammar(to_grammar(params))
            times.append(time.perf_counter() - t)
        t = time.perf_counter()
        grammar_of.__wrapped__(*params.constraint)          # the conversion alone, past its cache
        rows[name] = {"seconds": statistics.median(times), "chars": len(params.constraint[1]),
                      "mib": compiled.memory_size_bytes / 2**20, "convert_seconds": time.perf_counter() - t}
    typical = SamplingParams(**schemas["typical schema"])
    rows["longest pause beside a compile"] = {
        "seconds": longest_pause(lambda: compiler.compile_grammar(to_grammar(typical))), "chars": None}
    return rows


def run(args) -> dict:
    from schemas.sampling import SamplingParams
    from workers import LLM

    schema, shares = order_schema(args.min_items), [s / 100 for s in args.shares]
    big = large_schema(args.large_properties)
    blocks = args.batch * ((PROMPT_ROOM + args.output_len) // 16 + 2)
    llm = LLM(args.model, max_num_seqs=args.batch, num_kv_blocks=blocks, dtype=args.dtype)
    clock = MaskClock()
    try:
        ask = ("Write order {i} of our shop as JSON: an id, the customer (name, email, tier), a status and the "
               "items, each with a sku, a name, a quantity and a price.")
        prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": ask.format(i=i)}],
                                                     add_generation_prompt=True, tokenize=True, return_dict=False)
                   for i in range(args.batch)]
        run_share(llm, clock, prompts[:4], 1.0, schema, 8, "warm")        # compiles; the first steps' costs
        runs: dict[float, list[dict]] = {s: [] for s in shares}
        for r in range(args.repeat):
            for s in shares[r % len(shares):] + shares[:r % len(shares)]:
                runs[s].append(run_share(llm, clock, prompts, s, schema, args.output_len, f"r{r}-{s}"))
        engine = llm.engine
        full = max(shares)
        masks = mask_times(engine.grammars.submit(SamplingParams(json_schema=schema)).result(),
                           [t for r in runs[full] for t in r["token_ids"]][:args.batch], engine.model_cfg.vocab_size)
        compiles = compile_times(llm.model_dir, engine.model_cfg.vocab_size, engine.model_cfg.eos_token_ids, {
            "typical schema": {"json_schema": schema}, f"large schema ({args.large_properties} properties)":
            {"json_schema": big}, "regex": {"regex": r"[A-Z]{3}-[0-9]{4}( [a-z]+){1,8}"}}, args.repeat)
    finally:
        clock.close()
        llm.close()
    base = statistics.median(r["step_ms"] for r in runs[shares[0]])
    checked = schema_grammar(schema)
    rows = []
    for s in shares:
        step = statistics.median(r["step_ms"] for r in runs[s])
        outputs = [o for r in runs[s] for o in r["outputs"]]
        rows.append({"share": s, "constrained_rows": round(s * args.batch), "step_ms": step,
                     "mask_ms": statistics.median(r["mask_ms"] for r in runs[s]),
                     "tokens_per_s": args.batch / step * 1e3, "cost": 1 - base / step,
                     "steps": min(r["steps"] for r in runs[s]), "ended_early": max(r["ended_early"] for r in runs[s]),
                     "outputs_follow_schema": all(follows(o, checked) for o in outputs), "outputs": len(outputs)})
    return {"model": llm.model_dir, "batch": args.batch, "output_len": args.output_len, "repeat": args.repeat,
            "rows": rows, "compiles": compiles, "masks": masks, "large_schema_chars": len(json.dumps(big)),
            "goal_cost": GOAL_COST}


def table(report: dict) -> str:
    lines = [f"structured output on {report['model']}: batch {report['batch']}, {report['output_len']} output "
             f"tokens each, median of {report['repeat']} runs",
             f"{'constrained':>12} {'step ms':>8} {'masks ms':>9} {'tokens/s':>9} {'cost':>7} {'steps':>6} "
             f"{'valid':>6}"]
    for r in report["rows"]:
        lines.append(f"{r['constrained_rows']:>5} ({r['share']:>4.0%}) {r['step_ms']:>8.1f} {r['mask_ms']:>9.2f} "
                     f"{r['tokens_per_s']:>9.0f} {r['cost']:>7.1%} {r['steps']:>6} "
                     f"{'yes' if r['outputs_follow_schema'] else 'NO':>6}")
    lines.append("compile (cold, one thread):")
    for name, c in report["compiles"].items():
        size = "" if c["chars"] is None else (f"  ({c['chars']} chars, {c['mib']:.2f} MiB compiled; converted in "
                                              f"{1e3 * c['convert_seconds']:.1f} ms)")
        lines.append(f"  {name:<34} {1e3 * c['seconds']:>8.1f} ms{size}")
    m = report["masks"]
    lines.append(f"masks of {m['rows']} rows at the outputs' states: fill {m['fill_ms']:.2f} ms; apply: "
                 f"xgrammar's kernel {m['xgrammar_apply_ms'] - m['clone_ms']:.2f} ms (less its copy of the logits), "
                 f"the engine's {m['engine_apply_ms']:.2f} ms")
    return "\n".join(lines)


def failures(report: dict) -> list[str]:
    out = []
    full = max(report["rows"], key=lambda r: r["share"])
    if full["cost"] > report["goal_cost"]:
        out.append(f"{full['share']:.0%} constrained rows cost {full['cost']:.1%} of the output tokens/s, more "
                   f"than the goal's {report['goal_cost']:.0%}")
    out += [f"a constrained output at {r['share']:.0%} does not follow the schema" for r in report["rows"]
            if not r["outputs_follow_schema"]]
    out += [f"{r['ended_early']} rows at {r['share']:.0%} ended before {report['output_len']} tokens"
            for r in report["rows"] if r["ended_early"]]
    return out


def main(args) -> int:
    report = run(args)
    print(table(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    missed = failures(report)
    for line in missed:
        print("MISSED:", line)
    return 1 if missed else 0

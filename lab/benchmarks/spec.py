"""`tokenbus bench-spec`: speculative decoding against none, on the same prompts, in one run.

Configurations, each in turn in a fresh LLM with the same engine options (pool, batch, dtype,
threads): off; n-gram (prompt lookup) with a fixed k (--k); n-gram with k chosen each step by the
goodput model (adaptive, k at most --k); and a draft model (--draft DIR, adaptive) when given.

Workloads (--workloads), the same token ids for every configuration, greedy, EOS ignored, every
request run to --output-len:
- single: --requests chat prompts one at a time, each asking the model to repeat, correct the
  spelling of, rewrite (one word replaced) or summarize one of a few built-in passages: the
  workload prompt lookup is for. Per configuration: TTFT p50, TPOT p50/p99 (per request:
  (e2e − TTFT) / (tokens − 1)), output tokens/s and the TPOT ratio to off (speedup).
- concurrent: --concurrency chat prompts of the tokenizer corpus' text (as `tokenbus bench`'s
  random workload cuts it), all added at once and the engine stepped until they end: output
  tokens/s and its ratio to off.
Each also reports the speculator's counts (acceptance rate, mean acceptance length, acceptance by
draft position, k at the end and its mean over the steps) and whether every request's output
token ids equal off's: speculation must not change an output, so a difference is a bug and the
command exits 1 (as it does when a configuration cannot run).

Before the first configuration, a throwaway engine with n-gram speculation runs a few of the
workload's prompts: the process's first calls of each kind of step are behind every configuration
alike. A warm-up of a few short requests of other tokens precedes each run; they opt out of
speculation, so the counts are the workload's own. The KV pool holds every request of the run whole: a draft
takes only free blocks that hold no cached KV, and none should wait for one.
"""
import gc
import math
import random
import traceback
from dataclasses import dataclass

from lab.common.corpus import Corpus, length
from lab.common.results import finish, fmt, ratio
from lab.common.turns import BLOCK_SIZE, OPTIONS, EngineLoop, Turn, Workload, closed_loop, figures, warmup

GOAL_SPEEDUP = 1.5        # single: n-gram TPOT p50 at least this many times lower than off's
GOAL_THROUGHPUT = 0.97    # concurrent: adaptive n-gram's output tokens/s at least this share of off's
SPEC_STATS = ("spec_k", "spec_drafts", "spec_draft_tokens", "spec_accepted_tokens", "spec_acceptance_rate",
              "spec_mean_acceptance_length", "spec_acceptance_per_position")


# -- the input-grounded workload's text ----------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Passage:
    text: str
    old: str              # a word of it, and its replacement, for the rewrite task
    new: str


PASSAGES = (
    Passage("""The lighthouse on the north cape was built in 1871, when three ships were lost on the rocks in a \
single winter. Its keeper lived in a small stone house at the foot of the tower with his wife and two \
daughters. Every evening at dusk he climbed the ninety-six steps, trimmed the wick and wound the clockwork \
that turned the lens, and every morning he climbed them again to put the light out.

The work was lonely but never idle. Salt crusted the windows and had to be washed off by hand. Oil was \
carried up in copper cans, one in each hand, and the brass fittings were polished until they shone. In \
storms the keeper stayed in the lamp room all night, listening to the wind and watching the sea for the \
lights of ships that had lost their way.

The lighthouse was automated in 1962, and the last keeper moved to the town on the other side of the bay. \
Today the stone house is a small museum, and on clear summer evenings visitors can still climb the tower \
and watch the beam sweep across the water.""", "lighthouse", "beacon"),
    Passage("""Good bread needs only four things: flour, water, salt and time. Most of the work is done by the \
yeast, and the baker's job is mainly to give it the right conditions. Mix the flour and water first and \
leave them to rest for half an hour. This lets the flour absorb the water and makes the dough easier to \
knead.

Next add the salt and the yeast, and knead the dough on a clean table for about ten minutes, until it is \
smooth and springs back when you press it with a finger. Put it in a bowl, cover it with a damp cloth and \
leave it somewhere warm until it has doubled in size. On a cold day this can take three hours or more.

Shape the dough into a round loaf, let it rise a second time, and bake it in a very hot oven. The bread is \
ready when it is dark brown and sounds hollow when you knock on the bottom. Let it cool before you cut it, \
however hard that is, because the inside is still cooking as the steam escapes.""", "dough", "paste"),
    Passage("""For two hundred years the weekly market was held in the square in front of the town hall. \
Farmers came in from the valley before dawn with carts of potatoes, cabbages, eggs and cheese, and by \
eight o'clock the square was so crowded that it was hard to walk from one side to the other.

When the new road was built, the council decided that the market should move to the old railway yard by \
the river, where there was room for vans to park. Many people were against the change. The shopkeepers \
around the square were afraid that they would lose their customers, and older residents said that the town \
would lose its heart.

In the end the move was a success. The railway yard had space for twice as many stalls, and new traders \
came from other towns to sell bread, fish, flowers and clothes. The square was planted with trees and \
became a quiet place to sit. On market days, people now walk along the river from one to the other, and \
the shops in between are busier than they have ever been.""", "market", "fair"),
    Passage("""The community garden began as an empty lot behind the library, full of broken glass and weeds. \
A group of neighbours asked the city for permission to clean it up, and one spring weekend more than forty \
people came with gloves, rakes and wheelbarrows. By Sunday evening the lot was clear, and the first beds \
had been marked out with string.

Each family that joined was given a bed of its own, and a few beds were kept for the school next door. The \
gardeners share the tools, the compost heap and the rain barrels, and they take turns watering in the \
summer when someone is away. There are only two rules: no chemicals, and whatever grows on the shared beds \
by the gate belongs to anyone who needs it.

Ten years later the garden has a greenhouse, a bench under an apple tree and a waiting list of families \
who would like a bed. The children from the school grow beans and sunflowers, and every autumn there is a \
harvest supper at long tables between the beds, with soup made from what the garden has grown.""",
            "garden", "allotment"),
)
TASKS = {
    "repeat": "Repeat the following text exactly, word for word.",
    "spelling": "Fix the spelling in this text. Reply with the corrected text only.",
    "replace": 'Rewrite this text replacing "{old}" with "{new}". Change nothing else.',
    "summarize": "Summarize the following text.",
}


def misspell(text: str) -> str:
    """Every seventh word of five letters or more with its third and fourth letters swapped."""
    words = text.split(" ")
    for i in range(3, len(words), 7):
        w = words[i]
        if len(w) >= 5 and w.isalpha():
            words[i] = w[:2] + w[3] + w[2] + w[4:]
    return " ".join(words)


def ask(task: str, p: Passage) -> str:
    text = misspell(p.text) if task == "spelling" else p.text
    return TASKS[task].format(old=p.old, new=p.new) + "\n\n" + text


def chat(tokenizer, text: str) -> list[int]:
    """One user message in the model's chat template, as LLM.chat sends it."""
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                         tokenize=True, return_dict=False)


# -- workloads ------------------------------------------------------------------------------------

def grounded(tokenizer, n: int, output_len: int) -> tuple[Workload, list[str]]:
    """Request i: task i mod 4 on passage (i + i // 4) mod 4 (no pair twice in the first 16); the
    workload, one request at a time, and each request's task."""
    tasks = [list(TASKS)[i % len(TASKS)] for i in range(n)]
    passages = [PASSAGES[(i + i // len(TASKS)) % len(PASSAGES)] for i in range(n)]
    turns = [Turn(chat(tokenizer, ask(t, p)), output_len) for t, p in zip(tasks, passages)]
    return Workload("single", [[t] for t in turns], 1), tasks


def random_chat(tokenizer, n: int, input_len: int, output_len: int, seed: int) -> Workload:
    """n user messages of the corpus' text, input_len tokens × (1 ± 0.5), all at once."""
    corpus, rng = Corpus(tokenizer.backend_tokenizer), random.Random(seed)
    turns = [Turn(chat(tokenizer, corpus.text(rng, length(rng, input_len, 0.5, "uniform"))), output_len)
             for _ in range(n)]
    return Workload("concurrent", [[t] for t in turns], n)


def describe(w: Workload) -> str:
    prompts = [len(t.prompt) for t in w.turns]
    what = "grounded chat prompts (repeat, spell-correct, rewrite, summarize a passage), one at a time" \
        if w.name == "single" else "random chat prompts (corpus text), all at once"
    return (f"{w.name}: {len(prompts)} {what}; prompts {min(prompts)}-{max(prompts)} tokens, "
            f"{w.turns[0].max_tokens} output tokens each; greedy, EOS ignored")


def pool(w: Workload) -> int:
    """KV blocks for every request of w and of its warm-up at once."""
    turns = w.turns + w.turns[:min(w.concurrency, 4)]
    return sum(math.ceil((len(t.prompt) + t.max_tokens) / BLOCK_SIZE) for t in turns)


# -- the configurations ---------------------------------------------------------------------------

def configurations(args) -> dict[str, dict | None]:
    """The speculative option of each configuration, checked (a ValueError names what is wrong)."""
    from workers.engine.speculative import SpeculativeConfig

    ngram = {"method": "ngram", "num_speculative_tokens": args.k}
    configs = {"off": None, f"ngram-k{args.k}": {**ngram, "adaptive": False},
               "ngram-adaptive": {**ngram, "adaptive": True}}
    if args.draft:
        configs["draft-adaptive"] = {"method": "draft", "model": args.draft, "num_speculative_tokens": args.k,
                                     "adaptive": True}
    for spec in configs.values():
        SpeculativeConfig.of(spec)
    return configs


class SpecLoop(EngineLoop):
    """bench-peers' engine loop that also notes the speculator's k in each step where some request
    could draft (a request's last token has no room for drafts: no choice is made then)."""

    def __init__(self, *args, **options):
        super().__init__(*args, **options)
        self.ks: list[int] = []

    def poll(self):
        done = super().poll()
        spec = self.llm.engine.speculator
        if spec is not None and spec.rows:
            self.ks.append(spec.k)
        return done


def prime(w: Workload, model: str, dtype: str | None, tokenizer, spec: dict) -> None:
    """Before any configuration is timed: the workload's first few prompts through a throwaway engine
    with speculation, so that the process's first calls of every kind of step (prefill, decode,
    verify) are behind off and the others alike, whichever runs first."""
    from schemas.sampling import SamplingParams

    loop = EngineLoop(model, w, dtype, tokenizer=tokenizer, num_kv_blocks=pool(w), speculative=spec)
    with loop.llm as llm:
        llm.generate([t.prompt for t in w.turns[:min(w.concurrency, 4)]], SamplingParams(max_tokens=16, **OPTIONS))


def measure(w: Workload, model: str, dtype: str | None, tokenizer, spec: dict | None) -> dict:
    """One configuration on one workload in a fresh LLM: the warm-up, then the run; its figures, the
    speculator's counts and the output token ids by request."""
    from schemas.sampling import SamplingParams

    loop = SpecLoop(model, w, dtype, tokenizer=tokenizer, num_kv_blocks=pool(w), speculative=spec)
    try:
        warm = warmup(w, loop.llm.engine.model_cfg.vocab_size).turns
        loop.llm.generate([t.prompt for t in warm], SamplingParams(max_tokens=4, speculative=False, **OPTIONS))
        results, seconds = closed_loop(w, loop)
        stats = loop.llm.stats()
    finally:
        loop.llm.close()
    row = {**figures(w, results, seconds), "preemptions": stats["preemptions"],
           **{k.removeprefix("spec_"): stats.get(k) for k in SPEC_STATS},
           "k_last": loop.ks[-1] if loop.ks else None,
           "mean_k": round(sum(loop.ks) / len(loop.ks), 3) if loop.ks else None}
    return {**row, "outputs": [loop.outputs[i] for i in range(len(w.turns))]}


def identity(outputs: list[list[int]], reference: list[list[int]]) -> dict:
    """Whether each request's output token ids equal the reference's; the first difference if not."""
    differ = [i for i, (a, b) in enumerate(zip(outputs, reference, strict=True)) if a != b]
    if not differ:
        return {"identical": True, "requests_differing": 0}
    i = differ[0]
    at = next((p for p, (a, b) in enumerate(zip(outputs[i], reference[i])) if a != b),
              min(len(outputs[i]), len(reference[i])))
    return {"identical": False, "requests_differing": len(differ), "first_difference": {"request": i, "position": at}}


def compare(rows: dict[str, dict]) -> None:
    """Adds each row's identity with off's outputs, its TPOT speedup and its throughput ratio."""
    base = rows["off"]
    for r in rows.values():
        if "error" in r or "error" in base:
            continue
        r.update(identity(r["outputs"], base["outputs"]))
        r["speedup_tpot_p50"] = ratio(base["tpot_ms"]["p50"], r["tpot_ms"]["p50"])
        r["vs_off_output_tokens_per_s"] = ratio(r["output_tokens_per_s"], base["output_tokens_per_s"])


def goals(report: dict) -> list[dict]:
    """single: each n-gram configuration's TPOT p50 ≥ 1.5× lower than off's; concurrent: adaptive
    n-gram's output tokens/s ≥ 0.97× off's."""
    out = []
    single = report["workloads"].get("single", {}).get("configs", {})
    for name, r in single.items():
        if name.startswith("ngram"):
            value = r.get("speedup_tpot_p50")
            out.append({"workload": "single", "config": name, "goal": f"TPOT p50 ≥ {GOAL_SPEEDUP}× lower than off",
                        "value": value, "met": value is not None and value >= GOAL_SPEEDUP})
    adaptive = report["workloads"].get("concurrent", {}).get("configs", {}).get("ngram-adaptive")
    if adaptive is not None:
        value = adaptive.get("vs_off_output_tokens_per_s")
        out.append({"workload": "concurrent", "config": "ngram-adaptive",
                    "goal": f"output tok/s ≥ {GOAL_THROUGHPUT}× off's", "value": value,
                    "met": value is not None and value >= GOAL_THROUGHPUT})
    return out


# -- the run --------------------------------------------------------------------------------------

def workload(name: str, args, tokenizer) -> tuple[Workload, list[str] | None]:
    if name == "single":
        return grounded(tokenizer, args.requests, args.output_len)
    return random_chat(tokenizer, args.concurrency, args.input_len, args.output_len, args.seed), None


def run(args) -> dict:
    """Every configuration on every workload: the report (with each request's output token ids)."""
    import torch
    from transformers import AutoTokenizer

    from workers.models import catalogue
    from workers.models.gguf import hf_dir

    torch.set_num_threads(args.threads)
    model = catalogue.resolve(args.model)
    tokenizer = AutoTokenizer.from_pretrained(hf_dir(model))
    configs = configurations(args)
    report = {"model": model, "dtype": args.dtype, "threads": args.threads, "k": args.k,
              "configs": configs, "workloads": {}}
    for wname in args.workloads:
        w, tasks = workload(wname, args, tokenizer)
        print(f"bench-spec: {describe(w)}", flush=True)
        prime(w, model, args.dtype, tokenizer, configs[f"ngram-k{args.k}"])
        rows = {}
        for name, spec in configs.items():
            try:
                rows[name] = measure(w, model, args.dtype, tokenizer, spec)
            except Exception as e:                     # reported; the other configurations go on
                traceback.print_exc()
                rows[name] = {"error": f"{type(e).__name__}: {e}"}
            gc.collect()                               # the last LLM's weights and pool, before the next
            print(f"bench-spec:   {name}: {line(rows[name])}", flush=True)
        compare(rows)
        report["workloads"][wname] = {"about": describe(w), "prompt_tokens": [len(t.prompt) for t in w.turns],
                                      **({"tasks": tasks} if tasks else {}), "configs": rows}
    report["goals"] = goals(report)
    return report


def failures(report: dict) -> list[str]:
    """What makes the run fail: an output that differs from off's, a configuration that did not run."""
    out = []
    for wname, w in report["workloads"].items():
        for name, r in w["configs"].items():
            if "error" in r:
                out.append(f"{wname}/{name} did not run: {r['error'].splitlines()[0]}")
            elif r.get("identical") is False:
                d = r["first_difference"]
                out.append(f"{wname}/{name}: OUTPUTS DIFFER from speculation off in {r['requests_differing']} "
                           f"request(s), first at request {d['request']}, token {d['position']} (a bug)")
    return out


def main(args) -> int:
    report = run(args)
    return finish("bench-spec", report, args, table, plot, failures(report))


# -- the table ------------------------------------------------------------------------------------

def line(r: dict) -> str:
    if "error" in r:
        return f"unavailable: {r['error'].splitlines()[0]}"
    accept = f", acceptance {r['acceptance_rate']:.2f}" if r["draft_tokens"] else ""
    return (f"{r['output_tokens_per_s']:.1f} output tok/s, TTFT p50 {fmt(r['ttft_ms']['p50'])} ms, "
            f"TPOT p50 {fmt(r['tpot_ms']['p50'], '.2f')} ms{accept}")


def times(v) -> str:
    return "-" if v is None else f"{v:.2f}x"


def spec_columns(r: dict) -> str:
    """accept, len, k, k avg, by position: "-" where nothing was drafted (off, or no guess ever)."""
    drafted = bool(r["draft_tokens"])
    positions = " ".join(f"{p:.2f}" for p in r["acceptance_per_position"]) if drafted else "-"
    return (f"{fmt(r['acceptance_rate'] if drafted else None, '.2f'):>7}"
            f"{fmt(r['mean_acceptance_length'] if drafted else None, '.2f'):>6}"
            f"{fmt(r['k_last'], 'd'):>6}{fmt(r['mean_k'], '.2f'):>6}  {positions}")


def identical(r: dict) -> str:
    return {True: "yes", False: "NO"}.get(r.get("identical"), "-")


def table(report: dict) -> str:
    lines = [f"bench-spec: {report['model']}, {report['dtype'] or 'the engine’s dtype'}, {report['threads']} threads, "
             f"k ≤ {report['k']}"]
    spec_head = f"{'accept':>7}{'len':>6}{'k':>6}{'k avg':>6}  by position"
    for wname, w in report["workloads"].items():
        lines += ["", w["about"]]
        if wname == "single":
            lines.append(f"{'':16}{'ident':>6}{'TTFT p50':>10}{'TPOT p50':>10}{'p99':>8}{'speedup':>9}{'tok/s':>8}"
                         + spec_head)
        else:
            lines.append(f"{'':16}{'ident':>6}{'tok/s':>8}{'vs off':>8}{'TTFT p50':>10}{'TPOT p50':>10}" + spec_head)
        for name, r in w["configs"].items():
            if "error" in r:
                lines.append(f"{name:16}unavailable: {r['error'].splitlines()[0]}")
                continue
            if wname == "single":
                lines.append(f"{name:16}{identical(r):>6}{fmt(r['ttft_ms']['p50']):>10}"
                             f"{fmt(r['tpot_ms']['p50'], '.2f'):>10}{fmt(r['tpot_ms']['p99'], '.2f'):>8}"
                             f"{times(r.get('speedup_tpot_p50')):>9}{r['output_tokens_per_s']:>8.1f}{spec_columns(r)}")
            else:
                lines.append(f"{name:16}{identical(r):>6}{r['output_tokens_per_s']:>8.1f}"
                             f"{times(r.get('vs_off_output_tokens_per_s')):>8}{fmt(r['ttft_ms']['p50']):>10}"
                             f"{fmt(r['tpot_ms']['p50'], '.2f'):>10}{spec_columns(r)}")
    if report["goals"]:
        lines.append("")
    for g in report["goals"]:
        lines.append(f"goal, {g['workload']}: {g['config']} {g['goal']}: {fmt(g['value'], '.3f')}x, "
                     f"{'met' if g['met'] else 'NOT met'}")
    lines += ["", "ident: every request's output token ids equal off's; TTFT, TPOT in ms (per request: (e2e − TTFT) "
              "/ (tokens − 1)); speedup: off's TPOT p50 over this one's; tok/s: output tokens per second (vs off: "
              "over off's); accept: accepted over drafted tokens; len: mean accepted drafts per verify step; k: the "
              "speculator's k in the last step where a request could draft, k avg: its mean over those steps; by "
              "position: the share of drafts kept at each draft position, of those verified there"]
    return "\n".join(lines)


def plot(report: dict, path: str) -> None:
    """TPOT p50 (single) and output tokens/s (concurrent) per configuration (PNG or SVG by the name)."""
    from matplotlib.figure import Figure

    workloads = report["workloads"]
    fig = Figure(figsize=(6.5 * len(workloads), 3.2))
    for ax, (wname, w) in zip(fig.subplots(1, len(workloads), squeeze=False)[0], workloads.items()):
        rows = {n: r for n, r in w["configs"].items() if "error" not in r}
        single = wname == "single"
        ax.barh(list(rows), [(r["tpot_ms"]["p50"] if single else r["output_tokens_per_s"]) or 0 for r in rows.values()],
                color=["tab:gray" if n == "off" else "tab:blue" for n in rows])
        ax.set(title=f"{wname}: {'TPOT p50' if single else 'output tokens/s'}", xlabel="ms" if single else "tokens/s")
        ax.invert_yaxis()
        ax.grid(True, axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)

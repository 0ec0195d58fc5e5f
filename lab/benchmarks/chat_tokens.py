"""The tokenizer service on multi-turn chats: the time to prepare each turn's tokens (the chat template and
the encode, what `tb.prepare` answers) with a message-at-a-time encode whose history is kept
(`services/tokenizer/segments.py`) against the whole-text encode every turn (transformers'
`apply_chat_template(tokenize=True)`, what serving stacks do), interleaved turn by turn, the tokens checked
equal. Conversations take turns round-robin; each turn is the whole history plus a new user message, then
the assistant's reply is appended (corpus text of the given token lengths).

    python -m lab.benchmarks.chat_tokens [--model smollm2-135m-instruct] [--turns 8] [--json]
"""
import argparse
import json
import random
import statistics
import time

from lab.common.corpus import Corpus
from services.tokenizer.service import Tokenizer
from workers.models import catalogue


def chats(args, corpus: Corpus) -> list[list[tuple[str, str]]]:
    """Each conversation's (user message, reply) per turn; the first user message after a system prompt."""
    rng = random.Random(args.seed)
    return [[(corpus.text(rng, args.user_len), corpus.text(rng, args.reply_len)) for _ in range(args.turns)]
            for _ in range(args.conversations)]


def run(args) -> dict:
    tok = Tokenizer(str(catalogue.resolve(args.model)))
    corpus = Corpus(tok.hf.backend_tokenizer)
    system = corpus.text(random.Random(args.seed + 1), args.system_len)
    histories = [[{"role": "system", "content": system}] for _ in range(args.conversations)]
    turns = chats(args, corpus)
    rows = []
    for turn in range(args.turns):
        kept, whole, tokens = [], [], []
        for history, chat in zip(histories, turns):
            user, reply = chat[turn]
            history.append({"role": "user", "content": user})
            start = time.perf_counter()
            ids = tok.chat(history)
            mid = time.perf_counter()
            expected = list(tok.hf.apply_chat_template(history, add_generation_prompt=True, tokenize=True,
                                                       return_dict=False))
            kept.append(mid - start)
            whole.append(time.perf_counter() - mid)
            if ids != expected:
                raise SystemExit(f"turn {turn + 1}: the kept-history tokens differ from the whole encode")
            tokens.append(len(ids))
            history.append({"role": "assistant", "content": reply})
        k, w = statistics.median(kept) * 1e3, statistics.median(whole) * 1e3
        rows.append({"turn": turn + 1, "prompt_tokens": round(statistics.mean(tokens)), "kept_ms": round(k, 2),
                     "whole_ms": round(w, 2), "speedup": round(w / k, 2)})
    seg = tok.segments
    return {"model": args.model, "exact": seg.exact, "hits": seg.hits, "misses": seg.misses, "turns": rows}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m lab.benchmarks.chat_tokens", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--conversations", type=int, default=16)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--system-len", type=int, default=600, help="tokens of the shared system prompt")
    p.add_argument("--user-len", type=int, default=150, help="tokens of each user message")
    p.add_argument("--reply-len", type=int, default=200, help="tokens of each reply")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    report = run(args)
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(f"{args.model}: median ms to prepare a turn's tokens over {args.conversations} conversations "
          f"(segments exact: {report['exact']}; {report['hits']} kept, {report['misses']} encoded)")
    print(f"{'turn':>4} {'prompt tokens':>13} {'history kept':>12} {'whole encode':>12} {'ratio':>6}")
    for r in report["turns"]:
        print(f"{r['turn']:>4} {r['prompt_tokens']:>13,} {r['kept_ms']:>12.2f} {r['whole_ms']:>12.2f} "
              f"{r['speedup']:>5.1f}×")


if __name__ == "__main__":
    main()

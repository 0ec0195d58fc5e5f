"""Bytes a request takes in the request log's Parquet archive (services/recorder/archive.py) against its
msgpack end record on the bus, for seed-shaped records: 3,000 prompt and 400 output token ids of real
English text (the repository's docs and the tiny model's corpus) through the SmolLM2 tokenizer, each
record its own stretch of the text.

    python -m lab.capacity.archive_size [--model smollm2-135m-instruct] [--json FILE]
"""
import argparse
import random
import tempfile
import time
from pathlib import Path

import orjson

from ops.tokenizer import load_tokenizer
from schemas.messages import Completion, encode
from schemas.sampling import SamplingParams
from services.recorder.archive import Archive, parquet

ROOT = Path(__file__).parents[2]
PROMPT, OUTPUT = 3000, 400
REPEAT = 5                                 # encodings timed
TEXTS = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "workers" / "models" / "data" / "corpus.txt"]


def records(ids: list[int], seed: int = 0) -> list[Completion]:
    """As many records as the token ids hold without reusing one stretch, as the worker stores them."""
    rng, out, t0 = random.Random(seed), [], 1_780_000_000.0
    step = PROMPT + OUTPUT
    for i in range(len(ids) // step):
        chunk = ids[i * step:(i + 1) * step]
        created = t0 + i * 0.2
        sampling = SamplingParams(max_tokens=1024, temperature=0.7, top_p=0.9, seed=rng.getrandbits(63))
        out.append(Completion(f"req-{rng.getrandbits(64):016x}", "acme", "w17", sampling, chunk[:PROMPT],
                              chunk[PROMPT:], "stop", None,
                              {"prompt_tokens": PROMPT, "completion_tokens": OUTPUT, "cached_tokens": 1024},
                              {"queue_ms": 12.418, "intake_ms": 3.207, "ttft_ms": 241.77, "e2e_ms": 9877.102},
                              created, ended=created + 10.118))
    return out


def measure(recs: list[Completion]) -> dict:
    with tempfile.TemporaryDirectory() as d:
        archive = Archive(d)
        [path] = archive.write(recs)
        assert archive.read() == sorted(recs, key=lambda r: (r.created, r.id))
        size = Path(path).stat().st_size
    msgpack = sum(len(encode(r)) for r in recs)
    t0 = time.perf_counter()
    for _ in range(REPEAT):
        parquet(recs)
    return {"records": len(recs), "msgpack_bytes": msgpack, "parquet_bytes": size,
            "encode_ms_per_request": (time.perf_counter() - t0) / REPEAT / len(recs) * 1e3,
            "msgpack_per_request": msgpack / len(recs), "parquet_per_request": size / len(recs),
            "ratio": msgpack / size}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct", help="the checkpoint whose tokenizer makes the ids")
    p.add_argument("--json", help="also write the figures here")
    args = p.parse_args()
    tok = load_tokenizer(args.model)
    ids = tok.encode("\n\n".join(p.read_text() for p in TEXTS), add_special_tokens=False).ids
    m = measure(records(ids))
    print(f"{m['records']} records of {PROMPT} + {OUTPUT} token ids ({args.model}'s tokenizer, {len(ids):,} ids)")
    print(f"{'':20}{'total':>12}{'per request':>14}")
    print(f"{'msgpack (the bus)':20}{m['msgpack_bytes']:>12,}{m['msgpack_per_request']:>14,.0f}")
    print(f"{'Parquet, zstd':20}{m['parquet_bytes']:>12,}{m['parquet_per_request']:>14,.0f}")
    print(f"ratio {m['ratio']:.2f}; {m['encode_ms_per_request']:.2f} ms of one core to encode a request")
    if args.json:
        Path(args.json).write_bytes(orjson.dumps(m))


if __name__ == "__main__":
    main()

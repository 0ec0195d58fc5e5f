"""The completions log: windows of TB_RESULTS, export to JSON lines and import into another stack; and
replay's comparison, on hand-built records."""
import asyncio
import datetime as dt
import subprocess
import sys
import time

import orjson
import pytest

import bus
from ops import records
from ops.procs import free_port, start_nats, stop
from ops.replay import Replay, first_difference, replayable, report, request
from schemas import subjects
from schemas.messages import Completion, encode
from schemas.sampling import SamplingParams


def completion(i: int, tenant: str = "acme", **kw) -> Completion:
    sampling = SamplingParams(max_tokens=4, temperature=0.7, seed=i)
    fields = {"id": f"r{i}", "tenant": tenant, "worker": "w0", "sampling": sampling, "prompt_token_ids": [1, 2, 3, i],
              "output_token_ids": [10 + i, 11, 12, 13], "finish_reason": "length",
              "usage": {"prompt_tokens": 4, "completion_tokens": 4}, "timing": {"ttft_ms": 1.5}, "created": 100.0 + i}
    return Completion(**{**fields, **kw})


async def store(nats_url: str, payloads: list[bytes]) -> None:
    nc = await bus.connect(nats_url, "test")
    js = nc.jetstream()
    await bus.ensure_streams(js)
    for i, data in enumerate(payloads):
        await js.publish(subjects.done("acme", f"r{i}"), data)
    await nc.close()


async def window(nats_url: str, **kw) -> list[Completion]:
    nc = await bus.connect(nats_url, "test")
    try:
        return await records.select(nc.jetstream(), **kw)
    finally:
        await nc.close()


def tokenbus(*args: str) -> str:
    return subprocess.run([sys.executable, "-m", "ops.cli", *args], check=True, capture_output=True, text=True,
                          timeout=60).stdout


def test_since_takes_iso_times_and_durations_back_from_now():
    now = dt.datetime(2025, 6, 1, 12, 0, tzinfo=dt.UTC)
    assert records.parse_time("90s", now) == now - dt.timedelta(seconds=90)
    assert records.parse_time("2h", now) == dt.datetime(2025, 6, 1, 10, 0, tzinfo=dt.UTC)
    assert records.parse_time("2025-06-01T11:30:00", now) == dt.datetime(2025, 6, 1, 11, 30, tzinfo=dt.UTC)
    assert records.parse_time("2025-06-01T11:30:00+02:00").utcoffset() == dt.timedelta(hours=2)
    with pytest.raises(ValueError, match="--since"):
        records.parse_time("yesterday")


def test_windows_of_the_log_skip_replays_and_undecodable_records(nats_url):
    recs = [completion(i) for i in range(5)]
    replayed = completion(9, id=f"{records.REPLAY_PREFIX}abc")
    asyncio.run(store(nats_url, [encode(r) for r in recs[:3]] + [b"junk", encode(replayed)]))
    time.sleep(0.05)
    middle = dt.datetime.now(dt.UTC)
    asyncio.run(store(nats_url, [encode(r) for r in recs[3:]]))
    assert [r.id for r in asyncio.run(window(nats_url))] == ["r0", "r1", "r2", "r3", "r4"]
    assert asyncio.run(window(nats_url, last=3)) == recs[2:]
    assert [r.id for r in asyncio.run(window(nats_url, since=middle))] == ["r3", "r4"]
    assert asyncio.run(window(nats_url, request_id="r1")) == [recs[1]]
    assert asyncio.run(window(nats_url, request_id=replayed.id)) == [replayed]
    assert asyncio.run(window(nats_url, since=dt.datetime.now(dt.UTC) + dt.timedelta(hours=1))) == []


def test_export_then_import_moves_a_window_to_another_stack_once(nats_url, tmp_path):
    recs = [completion(i) for i in range(4)]
    asyncio.run(store(nats_url, [encode(r) for r in recs]))
    tokenbus("log", "export", str(tmp_path / "all.jsonl"), "--nats-url", nats_url)
    tokenbus("log", "export", str(tmp_path / "last.jsonl"), "--last", "2", "--nats-url", nats_url)
    lines = (tmp_path / "all.jsonl").read_bytes().splitlines()
    assert len(lines) == 4 and orjson.loads(lines[0])["t"] == "completion"
    assert orjson.loads(lines[0])["sampling"]["seed"] == 0
    assert orjson.loads(lines[3])["prompt_token_ids"] == [1, 2, 3, 3]
    assert records.loads(tmp_path / "last.jsonl") == recs[2:]

    port = free_port()
    other = start_nats(port, tmp_path / "other")
    try:
        laptop = f"nats://127.0.0.1:{port}"
        assert "imported 4 records" in tokenbus("log", "import", str(tmp_path / "all.jsonl"), "--nats-url", laptop)
        tokenbus("log", "import", str(tmp_path / "all.jsonl"), "--nats-url", laptop)   # deduplicated by request id
        assert asyncio.run(window(laptop)) == recs
    finally:
        stop([other])


def test_importing_a_bad_line_names_it(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(records.dumps(completion(1)) + b'{"t": "completion", "v": 1, "id": "x"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not a completion record: tenant: missing"):
        records.loads(path)


def test_first_difference_is_the_first_unequal_position_or_the_shorter_length():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 9, 3]) == 1
    assert first_difference([1, 2, 3], [1, 2]) == 2
    assert first_difference([], [5]) == 0


def test_an_aborted_request_is_replayed_for_the_tokens_it_had_with_its_seed():
    rec = completion(3, finish_reason="abort", output_token_ids=[5, 6])
    req = request(rec, "replay-1")
    assert req.prompt_token_ids == rec.prompt_token_ids and req.tenant == "acme"
    assert req.sampling.max_tokens == 2 and req.sampling.seed == 3 and req.sampling.temperature == 0.7
    assert request(completion(3), "replay-2").sampling.max_tokens == 4
    assert not replayable(completion(4, finish_reason="abort", output_token_ids=[]))


def test_the_report_counts_identical_and_names_the_first_difference_and_failures():
    same, changed, failed = completion(1), completion(2), completion(3)
    replays = [Replay(same, "replay-a", tokens=list(same.output_token_ids), finish_reason="length"),
               Replay(changed, "replay-b", tokens=[12, 11, 99, 13], finish_reason="length"),
               Replay(failed, "replay-c", error="no result within 5 s")]
    r = report(replays, skipped=1, tokenizer=None)
    assert (r["replayed"], r["identical"], r["skipped"]) == (3, 1, 1)
    diff, err = r["diffs"]
    assert diff["request_id"] == "r2" and diff["position"] == 2
    assert (diff["logged_token"], diff["replayed_token"]) == (12, 99)
    assert err == {"request_id": "r3", "replay_id": "replay-c", "tenant": "acme", "error": "no result within 5 s",
                   "position": None}

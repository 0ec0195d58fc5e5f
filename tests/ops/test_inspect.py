"""`tokenbus inspect` as a user runs it, against a real nats-server: watching a wildcard subject and
reading a stream from a point, readable and as JSON lines, with garbage among the payloads."""
import asyncio
import subprocess
import sys

import orjson
from tokenizers import Tokenizer

import bus
from schemas import subjects
from schemas.messages import Cancel, FinalChunk, GenerateRequest, TokenChunk, encode
from schemas.sampling import SamplingParams

GARBAGE = [b"\xc1not msgpack", b"", b"\x92\x01\x02", encode(Cancel("x"))[:-3]]


def start(nats_url: str, *args: str) -> subprocess.Popen:
    """inspect in a child process, once it says it is subscribed."""
    p = subprocess.Popen([sys.executable, "-m", "ops.cli", "inspect", *args, "--nats-url", nats_url],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = p.stderr.readline()
    assert line.startswith("inspect: "), line + p.stderr.read()
    return p


async def publish(nats_url: str, msgs: list[tuple[str, bytes]], js: bool = False) -> None:
    nc = await bus.connect(nats_url, "test")
    for subject, data in msgs:
        if js:
            await nc.jetstream().publish(subject, data)
        else:
            await nc.publish(subject, data, headers={subjects.REQUEST_ID: subject.split(".")[-1]})
    await nc.flush()
    await nc.close()


def chunks(tok: Tokenizer) -> list[tuple[str, bytes]]:
    ids = tok.encode(" hello world").ids
    return [("tb.out.r1", encode(TokenChunk("r1", 0, 0, ids[:1], 9, [1, 2]))),
            ("tb.out.r1", encode(FinalChunk("r1", 1, 1, ids[1:], "length", usage={"completion_tokens": 2})))]


def test_inspect_prints_exactly_n_messages_and_shows_garbage_as_undecodable(nats_url, tiny_model):
    tok = Tokenizer.from_file(f"{tiny_model}/tokenizer.json")
    good = chunks(tok)
    msgs = [good[0], *[(f"tb.out.g{i}", g) for i, g in enumerate(GARBAGE)], good[1],
            ("tb.cancel.r1", encode(Cancel("r1")))]
    p = start(nats_url, "tb.>", "--count", "6", "--model", tiny_model)
    asyncio.run(publish(nats_url, msgs))
    out, err = p.communicate(timeout=30)
    assert p.returncode == 0, err
    lines = out.splitlines()
    assert len(lines) == 6                                        # the 7th message is not printed
    assert lines[0].startswith("tb.out.r1 ") and "Tb-Request-Id=r1" in lines[0] and " chunk " in lines[0]
    ids = tok.encode(" hello world").ids
    assert f"text={tok.decode(ids[:1])!r}" in lines[0] and "seq=0" in lines[0]
    assert all("UNDECODABLE" in line for line in lines[1:5])
    assert "not msgpack" in lines[1] and "empty payload" in lines[2] and "a message is a map" in lines[3]
    assert "final" in lines[5] and "finish_reason='length'" in lines[5] and f"text={tok.decode(ids[1:])!r}" in lines[5]


def test_inspect_json_is_one_object_per_message_with_decoded_fields(nats_url, tiny_model):
    tok = Tokenizer.from_file(f"{tiny_model}/tokenizer.json")
    p = start(nats_url, "tb.out.*", "--count", "3", "--json", "--model", tiny_model)
    asyncio.run(publish(nats_url, [chunks(tok)[0], ("tb.out.bad", b"\xff\x00junk"), chunks(tok)[1]]))
    out, _ = p.communicate(timeout=30)
    objs = [orjson.loads(line) for line in out.splitlines()]
    assert len(objs) == 3
    assert objs[0]["type"] == "chunk" and objs[0]["message"]["token_ids"] == tok.encode(" hello world").ids[:1]
    assert objs[0]["text"] == tok.decode(objs[0]["message"]["token_ids"]) and objs[0]["size"] > 0
    assert objs[0]["headers"] == {subjects.REQUEST_ID: "r1"}
    assert objs[1]["subject"] == "tb.out.bad" and objs[1]["payload"] == "ff006a756e6b"
    assert "not msgpack" in objs[1]["error"]
    assert objs[2]["type"] == "final"


def test_inspect_reads_a_stream_from_a_sequence_and_stops_at_its_end(nats_url):
    async def fill():
        nc = await bus.connect(nats_url, "test")
        await bus.ensure_streams(nc.jetstream())
        await nc.close()
        reqs = [GenerateRequest(f"q{i}", "acme", SamplingParams(max_tokens=i + 1), prompt=f"prompt {i}")
                for i in range(4)]
        await publish(nats_url, [(subjects.request_new("acme", r.id), encode(r)) for r in reqs]
                      + [(subjects.request_new("acme", "bad"), b"garbage")], js=True)

    asyncio.run(fill())
    p = subprocess.run([sys.executable, "-m", "ops.cli", "inspect", "tb.req.>", "--stream", subjects.REQUESTS_STREAM,
                        "--from", "3", "--json", "--nats-url", nats_url], capture_output=True, text=True, timeout=30)
    objs = [orjson.loads(line) for line in p.stdout.splitlines()]
    assert [o["seq"] for o in objs] == [3, 4, 5]
    assert [o["message"]["id"] for o in objs[:2]] == ["q2", "q3"] and objs[0]["text"] == "prompt 2"
    assert objs[0]["message"]["sampling"]["max_tokens"] == 3 and "error" in objs[2]

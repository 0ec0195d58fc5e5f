"""Tracing (bus/tracing.py): a span's W3C trace context survives NATS headers (a core request-reply, as
tb.prepare, and a JetStream publish read back by a pull consumer and by get_msg, as a resume reads the request
log), the log lines of a traced request carry its trace id, and with no endpoint configured nothing of the SDK
runs: no provider, no exporter thread, headers left as they were."""
import asyncio
import json
import os
import subprocess
import sys

import nats
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import bus
from bus import tracing
from schemas import subjects


@pytest.fixture
def spans():
    exporter = InMemorySpanExporter()
    assert tracing.setup("test", "t-1", exporter=exporter)
    yield exporter
    tracing.shutdown()


def test_a_trace_context_survives_core_request_reply_and_jetstream_headers(nats_url, spans):
    async def run():
        nc = await nats.connect(nats_url)
        js = nc.jetstream()
        await bus.ensure_streams(js)
        seen = {}

        async def answer(msg):                    # a tokenizer: its span is a child of the asker's
            with tracing.span("tokenize", tracing.context_of(msg.headers)) as s:
                seen["tokenize"] = s.get_span_context()
            await msg.respond(b"ok")

        await nc.subscribe(subjects.PREPARE, cb=answer)
        root = tracing.start("request", attributes={"tokenbus.request_id": "r1"})
        ctx = tracing.traced(root)
        await nc.request(subjects.PREPARE, b"x", timeout=2, headers=tracing.inject({subjects.REQUEST_ID: "r1"}, ctx))
        ack = await js.publish(subjects.request_new("acme", "r1"), b"req",
                               headers=tracing.inject(subjects.msg_id("r1"), ctx))
        sub = await js.pull_subscribe(subjects.request_new("acme", "r1"), "t")
        pulled = (await sub.fetch(1, timeout=2))[0]
        stored = await js.get_msg(subjects.REQUESTS_STREAM, ack.seq)
        root.end()
        await nc.close()
        return root, seen, pulled.headers, stored.headers

    root, seen, pulled, stored = asyncio.run(run())
    want = root.get_span_context()
    assert seen["tokenize"].trace_id == want.trace_id
    for headers in (pulled, stored):
        assert headers["Nats-Msg-Id"] == "r1" and headers[subjects.REQUEST_ID] == "r1"
        with tracing.span("route", tracing.context_of(headers)) as s:
            got = s
        assert got.get_span_context().trace_id == want.trace_id and got.parent.span_id == want.span_id
    by_name = {s.name: s for s in spans.get_finished_spans()}
    assert by_name["tokenize"].parent.span_id == want.span_id
    assert by_name["request"].resource.attributes["service.name"] == "test"


def test_log_lines_about_a_traced_request_carry_its_trace_id(spans, capfd):
    from bus.log import configure

    log = configure("test")
    root = tracing.start("request")
    tracing.remember("r2", root)
    log.info("outside any span", request_id="r2")
    with tracing.span("inside", tracing.traced(root)):
        log.info("inside a span")
    log.info("another request", request_id="r3")
    root.end()
    lines = [json.loads(line) for line in capfd.readouterr().err.splitlines()]
    tid = tracing.trace_id(root)
    assert lines[0]["trace_id"] == tid and lines[1]["trace_id"] == tid and len(lines[1]["span_id"]) == 16
    assert "trace_id" not in lines[2]


OFF = """
import sys, threading
from opentelemetry import trace
from bus import tracing
assert not tracing.setup("gateway", "g-1", None)
assert not tracing.ON and tracing.provider is None
assert type(trace.get_tracer_provider()).__name__ == "ProxyTracerProvider"    # the API's default: no SDK
assert not any(m.startswith("opentelemetry.sdk") for m in sys.modules), "the SDK was imported"
assert tracing.inject({"Nats-Msg-Id": "r"}) == {"Nats-Msg-Id": "r"} and tracing.inject(None) is None
assert tracing.context_of({"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"}) is None
with tracing.span("route") as s:
    assert not s.is_recording()
assert not [t.name for t in threading.enumerate() if t.name.startswith("Otel")]
assert tracing.setup("gateway", "g-1", "http://127.0.0.1:9")                    # on: the exporter's thread runs
assert tracing.provider is not None
assert [t.name for t in threading.enumerate() if t.name.startswith("Otel")]
"""


def test_without_an_endpoint_no_provider_no_exporter_thread_and_headers_untouched():
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    done = subprocess.run([sys.executable, "-c", OFF], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def test_the_endpoint_is_the_flag_then_the_environment_with_the_traces_path(monkeypatch):
    monkeypatch.delenv(tracing.ENDPOINT_ENV, raising=False)
    assert tracing.endpoint(None) is None
    assert tracing.endpoint("http://jaeger:4318/") == "http://jaeger:4318/v1/traces"
    monkeypatch.setenv(tracing.ENDPOINT_ENV, "http://collector:4318")
    assert tracing.endpoint(None) == "http://collector:4318/v1/traces"
    assert tracing.endpoint("http://c:4318/v1/traces") == "http://c:4318/v1/traces"


def test_up_passes_its_otlp_endpoint_to_every_child_and_every_service_parser_takes_it(tmp_path, monkeypatch):
    from ops import procs
    from ops.cli import parser as tokenbus
    from ops.up import Stack
    from services.gateway.app import parser as gateway
    from services.recorder.service import parser as recorder
    from services.router.service import parser as router
    from services.tokenizer.service import parser as tokenizer
    from workers.service import parser as worker

    assert tokenbus().parse_args(["up", "--otlp-endpoint", "http://j:4318"]).otlp_endpoint == "http://j:4318"
    started = []
    monkeypatch.setattr(procs, "spawn", lambda argv, *_: started.append(argv))
    stack = Stack("m", 8000, tmp_path, otlp_endpoint="http://j:4318")
    stack.spawn("router", "services.router", "--nats-url", "nats://x")
    stack.spawn("w0", "workers.service", "--model", "m", role="worker")
    assert all(argv[-2:] == ["--otlp-endpoint", "http://j:4318"] for argv in started)
    for p, base in ((gateway(), ["--model", "m"]), (recorder(), []), (router(), []), (tokenizer(), ["--model", "m"]),
                    (worker(), ["--model", "m"])):
        assert p.parse_args([*base, "--otlp-endpoint", "http://j:4318"]).otlp_endpoint == "http://j:4318"

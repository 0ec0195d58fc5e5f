"""One trace per request across the real stack, through a migration and a resume on another gateway.

The services run as processes (`tokenbus up`'s Stack, given --otlp-endpoint as `tokenbus up --otlp-endpoint`
passes it), so the SDK's in-memory exporter cannot see their spans: this test runs an OTLP/HTTP receiver in
the test process that decodes each posted ExportTraceServiceRequest with opentelemetry-proto's message classes
(what a collector does) and asserts on the spans. A request streams from gateway 0 on one of two workers; that
worker is SIGKILLed mid-stream, the router moves the request (a `migration` span), the other worker continues
it (attempt 1), and the client resumes on gateway 1 (a `resume` span): every span of the request has the trace
id the gateway's root span started, and the services' log lines about it carry that id."""
import asyncio
import gzip
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import websockets
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from ops.procs import free_port
from ops.up import Stack
from tests.e2e.conftest import WORKER_ARGS, receive, running, send

pytestmark = [pytest.mark.slow, pytest.mark.serial, pytest.mark.timeout(240)]

LONG = {"max_tokens": 400, "temperature": 0.8, "seed": 7, "ignore_eos": True}


def value(v):
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


class Receiver(ThreadingHTTPServer):
    """An OTLP/HTTP (protobuf) trace receiver on a free port: every span posted, as a dict."""

    def __init__(self):
        self.spans: list[dict] = []
        self.lock = threading.Lock()
        super().__init__(("127.0.0.1", free_port()), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def of(self, rid: str) -> list[dict]:
        with self.lock:
            return [s for s in self.spans if s["attributes"].get("tokenbus.request_id") == rid]

    def wait(self, rid: str, test, timeout: float = 30.0) -> list[dict]:
        end = time.monotonic() + timeout
        while not test(spans := self.of(rid)):
            assert time.monotonic() < end, f"spans of {rid}: {sorted(s['name'] for s in spans)}"
            time.sleep(0.05)
        return spans


class Handler(BaseHTTPRequestHandler):
    def do_POST(self):
        body = self.rfile.read(int(self.headers["Content-Length"]))
        if self.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        got = ExportTraceServiceRequest.FromString(body)
        spans = []
        for rs in got.resource_spans:
            resource = {a.key: value(a.value) for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    spans.append({"name": s.name, "trace_id": s.trace_id.hex(), "span_id": s.span_id.hex(),
                                  "parent": s.parent_span_id.hex(), "service": resource["service.name"],
                                  "instance": resource["service.instance.id"],
                                  "attributes": {a.key: value(a.value) for a in s.attributes}})
        with self.server.lock:
            self.server.spans += spans
        out = ExportTraceServiceResponse().SerializeToString()
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *args):
        pass


def named(spans: list[dict], name: str) -> list[dict]:
    return [s for s in spans if s["name"] == name]


def test_one_trace_id_from_the_gateway_through_a_migration_and_a_resume_on_another_gateway(tiny_model, tmp_path,
                                                                                            monkeypatch):
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")       # the children export every 100 ms, not 5 s
    receiver = Receiver()
    stack = Stack(tiny_model, free_port(), tmp_path, nats_port=free_port(), workers=2, worker_args=WORKER_ARGS,
                  gateways=2, otlp_endpoint=receiver.url)
    try:
        with running(stack):
            async def run():
                async with websockets.connect(stack.urls[0]) as ws:
                    await send(ws, {"type": "generate", "id": "t", "prompt": "a traced request", **LONG,
                                    "resumable": True})
                    resume_id = (await receive(ws))["resume_id"]
                    rid, got = resume_id.split(".")[0], []
                    while len(got) < 5:
                        got += (await receive(ws)).get("token_ids", [])
                    first = receiver.wait(rid, lambda s: named(s, "route"))
                    killed = named(first, "route")[0]["attributes"]["tokenbus.worker"]
                    stack.kill(killed)                              # SIGKILL, mid-stream
                    receiver.wait(rid, lambda s: named(s, "migration"))
                    async with websockets.connect(stack.urls[1]) as other:    # the client comes back elsewhere
                        await send(other, {"type": "resume", "id": resume_id, "offset": len(got)})
                        while (frame := await receive(other, 120))["type"] not in ("done", "error"):
                            pass
                return rid, killed, frame

            rid, killed, end = asyncio.run(run())
            assert end["type"] == "done", end
            spans = receiver.wait(rid, lambda s: {"request", "resume", "decode"} <= {x["name"] for x in s})
            logs = {name: stack.log(name).read_text() for name in ("gateway", "gateway1", "router")}

        traces = {s["trace_id"] for s in spans}
        assert len(traces) == 1, f"{len(traces)} traces: {[(s['name'], s['trace_id']) for s in spans]}"
        tid = traces.pop()
        whole = [s for s in receiver.spans if s["trace_id"] == tid]    # the trace: its spans without a request id too
        names = {s["name"] for s in whole}
        assert {"request", "admission", "tokenize", "route", "migration", "queue", "prefill", "decode",
                "resume"} <= names, names

        root = named(whole, "request")[0]
        assert root["parent"] == "" and root["service"] == "gateway"
        assert root["attributes"]["gen_ai.request.model"] and root["attributes"]["tokenbus.end"] == "resumed"
        assert named(whole, "tokenize")[0]["service"] == "tokenizer"
        assert named(whole, "tokenize")[0]["parent"] == root["span_id"]
        migration = named(whole, "migration")[0]
        assert migration["service"] == "router" and migration["attributes"]["tokenbus.departed_worker"] == killed
        survivor = migration["attributes"]["tokenbus.worker"]
        assert survivor != killed and migration["attributes"]["tokenbus.attempt"] == 1
        moved = [s for s in whole if s["service"] == "worker" and s["attributes"]["tokenbus.worker"] == survivor]
        assert {"queue", "prefill", "decode"} <= {s["name"] for s in moved}
        assert all(s["attributes"]["tokenbus.attempt"] == 1 and s["parent"] == migration["span_id"] for s in moved)
        assert named(moved, "decode")[0]["attributes"]["gen_ai.usage.output_tokens"] == LONG["max_tokens"]
        resume = named(whole, "resume")[0]
        assert resume["service"] == "gateway" and resume["instance"] != root["instance"]
        assert resume["attributes"]["gen_ai.usage.output_tokens"] == LONG["max_tokens"]

        for name, text in logs.items():                  # logs meet traces: the lines about it carry its trace id
            lines = [json.loads(line) for line in text.splitlines() if rid in line and line.startswith("{")]
            assert lines and all(e.get("trace_id") == tid for e in lines if e.get("request_id") == rid), name
    finally:
        receiver.shutdown()

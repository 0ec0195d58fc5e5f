"""OpenTelemetry traces, off unless configured: one trace per request, its W3C trace context (traceparent,
tracestate) carried in the NATS headers of the messages that carry the request (docs/tracing.md).

setup() turns tracing on in a process when --otlp-endpoint or OTEL_EXPORTER_OTLP_ENDPOINT names a collector:
an SDK tracer provider whose BatchSpanProcessor posts spans by OTLP over HTTP (protobuf), service.name the
process's role. Off (neither set) nothing of the SDK is imported: span() and start() give the API's
invalid span, inject() leaves the headers as they are, so a request costs one test of ON per call.

The services call: inject(headers) on a message that carries a request on (its context: the current
span's, or the one given), context_of(headers) on one that arrives, span() around a phase in one task,
start() for a span whose end comes later (a stream, a queue), remember() to tie a request id to its trace
so that every log line naming the request carries the trace id (bus/log.py)."""
import contextlib
import os
import time
from collections import OrderedDict

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import INVALID_SPAN, Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

ENDPOINT_ENV = "OTEL_EXPORTER_OTLP_ENDPOINT"
TRACES_PATH = "/v1/traces"
REMEMBERED = 65_536                      # request ids whose trace id a process keeps for its log lines

ON = False                               # whether setup() made a provider: everything below tests it first
PROPAGATOR = TraceContextTextMapPropagator()
provider = None                          # the SDK's TracerProvider once on
tracer: trace.Tracer = trace.NoOpTracer()
traces: OrderedDict[str, str] = OrderedDict()    # request id -> its trace id (32 hex digits), newest last

def add_argument(p) -> None:
    """--otlp-endpoint, every service's."""
    p.add_argument("--otlp-endpoint", metavar="URL", help=f"export traces by OTLP over HTTP to this collector "
                   f"(e.g. http://127.0.0.1:4318; {TRACES_PATH} is added); default: ${ENDPOINT_ENV}, and without "
                   "it no tracing")


def endpoint(given: str | None) -> str | None:
    """The URL spans are posted to: --otlp-endpoint's, else OTEL_EXPORTER_OTLP_ENDPOINT's, with /v1/traces
    added as the OTLP/HTTP specification says; None: tracing stays off."""
    url = given or os.environ.get(ENDPOINT_ENV)
    if not url:
        return None
    url = url.rstrip("/")
    return url if url.endswith(TRACES_PATH) else url + TRACES_PATH


def setup(role: str, instance: str, otlp_endpoint: str | None = None, exporter=None) -> bool:
    """Turns tracing on for this process (service.name `role`, service.instance.id `instance`) when an endpoint
    is configured, or with `exporter` (a test's SpanExporter, spans exported as they end); False: it stays off."""
    global ON, provider, tracer
    url = endpoint(otlp_endpoint)
    if url is None and exporter is None:
        return False
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": role, "service.instance.id": instance}))
    if exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=url)))
    tracer, ON = provider.get_tracer("tokenbus"), True
    return True


def shutdown() -> None:
    """Exports what is buffered and turns tracing off (the provider also flushes at exit by itself)."""
    global ON, provider, tracer
    if provider is not None:
        provider.shutdown()
    ON, provider, tracer = False, None, trace.NoOpTracer()
    traces.clear()


def inject(headers: dict | None, context: Context | None = None) -> dict | None:
    """The headers with the trace context of `context` (default: the current one) added; as they are when off."""
    if ON:
        headers = {} if headers is None else headers
        PROPAGATOR.inject(headers, context)
    return headers


def context_of(headers: dict | None) -> Context | None:
    """The trace context a message's headers carry; None when off or when they carry none."""
    if not ON or not headers or "traceparent" not in headers:
        return None
    return PROPAGATOR.extract(headers)


def traced(span: Span) -> Context | None:
    """A context whose parent is `span`, for children started later; None when off."""
    return trace.set_span_in_context(span) if ON else None


def span(name: str, context: Context | None = None, attributes: dict | None = None,
         kind: SpanKind = SpanKind.INTERNAL):
    """A span around a block, current within it (its children and the log lines in it see it); when off, the
    invalid span, with nothing started."""
    if not ON:
        return contextlib.nullcontext(INVALID_SPAN)
    return tracer.start_as_current_span(name, context, kind, attributes)


def start(name: str, context: Context | None = None, attributes: dict | None = None,
          kind: SpanKind = SpanKind.INTERNAL, start_time: int | None = None) -> Span:
    """A span that ends later (span.end()), not made current; the invalid span when off."""
    if not ON:
        return INVALID_SPAN
    return tracer.start_span(name, context, kind, attributes, start_time=start_time)


def current() -> Span:
    """The current span (the invalid span outside any, and when off)."""
    return trace.get_current_span() if ON else INVALID_SPAN


def ns(unix: float) -> int:
    """A time.time() as a span's start or end time (nanoseconds)."""
    return int(unix * 1e9)


def perf_ns(perf: float) -> int:
    """A time.perf_counter() of the recent past as a span's time (nanoseconds since the epoch)."""
    return time.time_ns() - int((time.perf_counter() - perf) * 1e9)


def error(span: Span, code: str) -> None:
    """Marks a span as ended with an error (its code: error.type, as OTel's conventions name it)."""
    if span.is_recording():
        span.set_attribute("error.type", code)
        span.set_status(Status(StatusCode.ERROR, code))


def trace_id(span: Span) -> str | None:
    ctx = span.get_span_context()
    return format(ctx.trace_id, "032x") if ctx.is_valid else None


def remember(request_id: str, span_or_context) -> None:
    """Ties the request id to its trace: log lines naming the request get its trace id (bus/log.py)."""
    if not ON or span_or_context is None:
        return
    s = span_or_context if isinstance(span_or_context, Span) else trace.get_current_span(span_or_context)
    if (tid := trace_id(s)) is not None:
        traces[request_id] = tid
        traces.move_to_end(request_id)
        if len(traces) > REMEMBERED:
            traces.popitem(last=False)


def add_ids(_logger, _name, event: dict) -> dict:
    """A structlog processor: trace_id and span_id of the current span, or the trace id remembered for the
    line's request_id. Off: nothing."""
    if not ON:
        return event
    ctx = trace.get_current_span().get_span_context()
    if ctx.is_valid:
        event.setdefault("trace_id", format(ctx.trace_id, "032x"))
        event.setdefault("span_id", format(ctx.span_id, "016x"))
    elif (tid := traces.get(event.get("request_id"))) is not None:
        event.setdefault("trace_id", tid)
    return event

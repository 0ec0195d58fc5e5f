"""Structured JSON logs for every process on the bus (structlog + orjson), one line per event on stderr; with
tracing on, a line about a request carries its trace_id (and span_id inside a span: bus/tracing.py)."""
import logging
import sys

import orjson
import structlog

from bus import tracing


def configure(service: str, level: str = "info") -> structlog.typing.FilteringBoundLogger:
    structlog.configure(
        processors=[structlog.contextvars.merge_contextvars, structlog.processors.add_log_level, tracing.add_ids,
                    structlog.processors.TimeStamper(fmt="iso", utc=True),
                    structlog.processors.format_exc_info, structlog.processors.JSONRenderer(serializer=orjson.dumps)],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        logger_factory=structlog.BytesLoggerFactory(sys.stderr.buffer), cache_logger_on_first_use=True)
    return structlog.get_logger().bind(service=service)

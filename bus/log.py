"""Structured JSON logs for every process on the bus (structlog + orjson), one line per event on stderr."""
import logging
import sys

import orjson
import structlog


def configure(service: str, level: str = "info") -> structlog.typing.FilteringBoundLogger:
    structlog.configure(
        processors=[structlog.contextvars.merge_contextvars, structlog.processors.add_log_level,
                    structlog.processors.TimeStamper(fmt="iso", utc=True),
                    structlog.processors.format_exc_info, structlog.processors.JSONRenderer(serializer=orjson.dumps)],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        logger_factory=structlog.BytesLoggerFactory(sys.stderr.buffer), cache_logger_on_first_use=True)
    return structlog.get_logger().bind(service=service)

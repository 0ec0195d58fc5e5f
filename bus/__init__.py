"""The NATS runtime that services, workers and ops share: what a process does on the bus, where
schemas/ says what travels on it. Callers use the package (bus.connect, bus.publish, bus.consume, ...);
each job has its module:

  bus/connection.py  connect (reconnecting, streams made again), run on uvloop, run_until_signal, close
  bus/streams.py     the streams (sized, none dropping what it holds), the stages' consumers and the KV
                     buckets, as nats.js.api configs
  bus/publish.py     JetStream publish retried under one Nats-Msg-Id until stored, or NotStored
  bus/ends.py        a request's end record in TB_RESULTS, stored once (the first end wins), read back
  bus/consume.py     a durable pull consumer streamed into a handler, made again when lost
  bus/heartbeats.py  the worker registry: watch, live_workers, and when a worker has left or has room
  bus/lifecycle.py   a process's probes (/healthz, /readyz) and its drain (SIGTERM, tokenbus drain)
  bus/log.py         structured JSON logs (structlog)
  bus/tracing.py     OpenTelemetry traces, off unless an OTLP endpoint is given: the trace context in headers"""
from bus.connection import BUS_ERRORS, CLUSTER_PING, CLUSTER_PINGS, close, connect, run, run_until_signal, servers_of
from bus.consume import add_consumer, consume, gone, recreate
from bus.ends import ended, partition, store_end
from bus.heartbeats import lapsed, live_workers, restated, spare, watch
from bus.lifecycle import Life
from bus.publish import PUBLISH_ATTEMPT, PUBLISH_DEADLINE, PUBLISH_RETRY, NotStored, publish, refused
from bus.streams import (
                         HANDOFFS,
                         NOT_CLUSTERED,
                         ROUTER,
                         STREAMS,
                         ensure_streams,
                         gateways,
                         handoffs,
                         infos,
                         limits,
                         recorder,
                         registry,
                         replicated,
                         responses,
                         router,
                         streams,
                         suspects,
                         work_filter,
                         worker_consumer,
)

__all__ = ["BUS_ERRORS", "CLUSTER_PING", "CLUSTER_PINGS", "HANDOFFS", "NOT_CLUSTERED", "PUBLISH_ATTEMPT",
           "PUBLISH_DEADLINE", "PUBLISH_RETRY", "ROUTER", "STREAMS", "Life", "NotStored", "add_consumer", "close",
           "connect", "consume", "ended", "ensure_streams", "gateways", "gone", "handoffs", "infos", "lapsed", "limits",
           "live_workers", "partition", "publish", "recorder", "recreate", "refused", "registry", "replicated",
           "responses", "restated", "router", "run", "run_until_signal", "servers_of", "spare", "store_end", "streams",
           "suspects", "watch", "work_filter", "worker_consumer"]

"""Subjects, stream and bucket names, and the limits every service obeys: plain names and numbers
(bus/ turns them into JetStream configs and connections).

Subjects go broad → narrow. A durable subject ends in its request id (the token a partitioned bus's
partition() mapping hashes), after the tenant or worker; the per-request subjects of the stream of
tokens and control (tb.out, tb.cancel) are core NATS, stored nowhere."""
import argparse
import contextlib
import os
import re

# -- subjects ------------------------------------------------------------------------------------

REQUESTS_STREAM, REQUESTS_SUBJECTS = "TB_REQUESTS", "tb.req.>"     # requests while routed, run, resumed
ROUTE_STREAM, ROUTE_SUBJECTS = "TB_ROUTE", "tb.route.>"            # prefilled requests handed back, a work queue
WORK_STREAM, WORK_SUBJECTS = "TB_WORK", "tb.work.>"                # one subject per worker, a work queue
RESULTS_STREAM, RESULTS_SUBJECTS = "TB_RESULTS", "tb.done.>"       # the end records, until archived
USAGE_STREAM, USAGE_SUBJECTS = "TB_USAGE", "tb.usage.>"            # the metering log: one record per request
DEAD_STREAM, DEAD_SUBJECTS = "TB_DEAD", "tb.dead.>"                # dead-lettered requests, with the reason
WORKERS_BUCKET = "tb_workers"                                      # heartbeats, key = worker id
REGISTRY_STREAM = f"KV_{WORKERS_BUCKET}"                           # the stream under it
LIMITS_BUCKET = "tb_limits"                                        # tenants' shared token buckets, key = tenant
GATEWAYS_BUCKET = "tb_gateways"                                    # live gateways, key = gateway id
RESPONSES_BUCKET = "tb_responses"                                  # stored Responses API responses, key = tenant_id
SUSPECTS_BUCKET = "tb_suspects"                                    # the request a worker runs alone, key = worker id
CANCEL_ALL = "tb.cancel.*"
RESEND_ALL = "tb.resend.*"
PROGRESS_ALL = "tb.progress.*"
RESUMED_ALL = "tb.resumed.*"
TOKENIZE = "tb.tokenize"                                           # request-reply: a prompt's tokens
PREPARE = "tb.prepare"                                             # request-reply: a request's tokens, checked

TOKEN = re.compile(r"[A-Za-z0-9_-]{1,64}")


def token(kind: str, value: str) -> str:
    """value as one subject token; ValueError naming `kind` if it could break the subject tree."""
    if not isinstance(value, str) or not TOKEN.fullmatch(value):
        raise ValueError(f"{kind} {value!r} must be 1-64 characters of A-Z a-z 0-9 _ -")
    return value


# A request's durable subjects end in its id: the partition() mapping of a partitioned bus hashes that
# token, so every record of one request lands in the same partition (see partitions() below).

def request_new(tenant: str, request_id: str) -> str:
    return f"tb.req.new.{token('tenant', tenant)}.{token('request id', request_id)}"


def route(tenant: str, request_id: str) -> str:
    return f"tb.route.{token('tenant', tenant)}.{token('request id', request_id)}"


def work(worker: str, request_id: str) -> str:
    return f"tb.work.{token('worker', worker)}.{token('request id', request_id)}"


def done(tenant: str, request_id: str) -> str:
    return f"tb.done.{token('tenant', tenant)}.{token('request id', request_id)}"


def usage(tenant: str, request_id: str) -> str:
    return f"tb.usage.{token('tenant', tenant)}.{token('request id', request_id)}"


def out(request_id: str) -> str:
    return f"tb.out.{token('request id', request_id)}"


def cancel(request_id: str) -> str:
    return f"tb.cancel.{token('request id', request_id)}"


def resend(request_id: str) -> str:
    """Request-reply: the worker running the request answers with the output tokens from an offset."""
    return f"tb.resend.{token('request id', request_id)}"


def progress(request_id: str) -> str:
    """Request-reply: the gateway streaming the request answers with the tokens its client has."""
    return f"tb.progress.{token('request id', request_id)}"


def resumed(request_id: str) -> str:
    """A gateway now streams the request to its client, who resumed it there: any other gateway lets it go."""
    return f"tb.resumed.{token('request id', request_id)}"


def dead(tenant: str, request_id: str) -> str:
    return f"tb.dead.{token('tenant', tenant)}.{token('request id', request_id)}"


def kv_events(worker: str) -> str:
    return f"tb.kv.{token('worker', worker)}"


KV_EVENTS_ALL = "tb.kv.*"                # never matches tb.kv.snapshot.<worker>: one token more


def kv_snapshot(worker: str) -> str:
    """Request-reply: a request here is answered with the worker's KvSnapshot parts."""
    return f"tb.kv.snapshot.{token('worker', worker)}"


def kv_transfer(worker: str) -> str:
    """Request-reply: a decode worker pulls the KV blocks a prefill worker offered it (KvFetch), or
    lets them go (KvFetch with release set); the prefill worker answers each fetch with one KvBlocks."""
    return f"tb.kvx.{token('worker', worker)}"


KV_TRANSFER_ALL = "tb.kvx.*"


def router_stats(router: str) -> str:
    return f"tb.router.stats.{token('router', router)}"


ROUTER_STATS_ALL = "tb.router.stats.*"


def drain(name: str) -> str:
    """Request-reply: the process of this name (a worker id, a service instance's id) or every process of
    this role (gateway, tokenizer, router, recorder, worker) answers with its name and drains (tokenbus
    drain)."""
    return f"tb.drain.{token('name', name)}"


def drained(name: str) -> str:
    """A drained process says so as it leaves: what it held is finished or handed over."""
    return f"tb.drained.{token('name', name)}"


DRAIN_ALL = "tb.drain.*"
DRAINED_ALL = "tb.drained.*"


REQUEST_ID = "Tb-Request-Id"            # the header that names the request in every stage's messages


def msg_id(request_id: str, dedup: str | None = None) -> dict[str, str]:
    """Headers of every JetStream publish of a request: the message id deduplicates retried publishes
    (the request id unless `dedup` says otherwise), Tb-Request-Id names the request for logs and inspect."""
    return {"Nats-Msg-Id": dedup or request_id, REQUEST_ID: request_id}

# -- streams, consumers, buckets -----------------------------------------------------------

DUPLICATE_WINDOW = 120.0                 # seconds a retried publish is deduplicated
LOG_MAX_AGE = 7 * 24 * 3600.0            # dead letters kept this long; the request log, in the recorder's archive
QUEUE_MAX_AGE = 3600.0
MAX_MSG_SIZE = 4 << 20
STREAM_NAMES = (REQUESTS_STREAM, ROUTE_STREAM, WORK_STREAM, RESULTS_STREAM, USAGE_STREAM, DEAD_STREAM)

# -- retention (docs/records.md) -------------------------------------------------------------------
# Every stream is capped in bytes and refuses a publish when full (discard new): none drops old records to
# make room. TB_USAGE keeps a usage record until the recorder has written it to the database (interest
# retention, its consumer made with the stream); TB_RESULTS keeps an end record until the recorder has
# archived it and ENDS_KEEP has passed. The bytes are shares of the bus's storage (TB_BUS_STORAGE, sized by
# `tokenbus up` from the data dir's free space), split evenly over the partitions.

BUS_STORAGE_ENV = "TB_BUS_STORAGE"
DEFAULT_BUS_STORAGE = 6 << 30            # bytes, without TB_BUS_STORAGE
MIN_BUS_STORAGE = 256 << 20              # bytes a partition needs at least: each stream 12.8 MiB or more
SHARES = {REQUESTS_STREAM: 0.25, ROUTE_STREAM: 0.05, WORK_STREAM: 0.15, RESULTS_STREAM: 0.30,
          USAGE_STREAM: 0.15, DEAD_STREAM: 0.10}
RECORDER_DURABLE = "recorder"            # the recorders' consumer on USAGE_STREAM and RESULTS_STREAM
ENDS_KEEP = QUEUE_MAX_AGE                # an archived end record stays this long (a late redelivery reads it)
BACKLOG_FULL = 0.9                       # admission refuses while TB_USAGE or TB_RESULTS is this full


def bus_storage() -> int:
    """The bytes the bus's streams may hold, from TB_BUS_STORAGE (default DEFAULT_BUS_STORAGE); ValueError
    naming the variable."""
    text = os.environ.get(BUS_STORAGE_ENV) or str(DEFAULT_BUS_STORAGE)
    if not text.isdigit():
        raise ValueError(f"{BUS_STORAGE_ENV}={text!r}: expected a number of bytes")
    return int(text)


def stream_bytes(base: str, storage: int, partitions: int = 1) -> int:
    """max_bytes of stream `base` in each partition of a bus of `storage` bytes."""
    return int(storage * SHARES[base]) // partitions

# -- partitions ------------------------------------------------------------------------------------
# A partitioned bus (TB_BUS_PARTITIONS=N, `tokenbus up --bus-partitions N`; docs/cluster.md) splits each
# of the six streams into N, TB_REQUESTS_0 .. TB_REQUESTS_<N-1>, and so on. No publisher chooses: every
# durable subject ends in its request id, nats-server's partition() subject mapping (mappings()) appends
# the partition that id hashes to, and partition p's streams capture the subjects ending in p. So a
# request's whole life (request, work item, handoff, completion, usage, dead letter) stays in one
# partition; partition p's router reads p's streams, and a worker pulls its work from each partition.

PARTITIONS_ENV = "TB_BUS_PARTITIONS"
MAX_PARTITIONS = 64
WHOLE = {REQUESTS_STREAM: REQUESTS_SUBJECTS, ROUTE_STREAM: ROUTE_SUBJECTS, WORK_STREAM: WORK_SUBJECTS,
         RESULTS_STREAM: RESULTS_SUBJECTS, USAGE_STREAM: USAGE_SUBJECTS, DEAD_STREAM: DEAD_SUBJECTS}
ENTRIES = {REQUESTS_STREAM: "tb.req.new.*.*", ROUTE_STREAM: "tb.route.*.*", WORK_STREAM: "tb.work.*.*",
           RESULTS_STREAM: "tb.done.*.*", USAGE_STREAM: "tb.usage.*.*", DEAD_STREAM: "tb.dead.*.*"}


def partitions() -> int:
    """The bus's number of partitions, from TB_BUS_PARTITIONS (default 1: not partitioned); ValueError
    naming the variable for anything but a whole number from 1 to MAX_PARTITIONS."""
    text = os.environ.get(PARTITIONS_ENV) or "1"
    try:
        return partition_count(text)
    except argparse.ArgumentTypeError as e:
        raise ValueError(f"{PARTITIONS_ENV}={e}") from None


def partition_count(text: str) -> int:
    """A --bus-partitions value: a whole number from 1 to MAX_PARTITIONS."""
    if not text.isdigit() or not 1 <= int(text) <= MAX_PARTITIONS:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a whole number of partitions from 1 to "
                                         f"{MAX_PARTITIONS}")
    return int(text)


def parts(n: int | None = None) -> list[int | None]:
    """The partitions of a bus of n (default partitions()): [None] when it is not partitioned."""
    n = partitions() if n is None else n
    return [None] if n == 1 else list(range(n))


def stream(base: str, part: int | None) -> str:
    """The name of stream `base` (e.g. TB_WORK) in partition `part` (None: the bus is not partitioned)."""
    return base if part is None else f"{base}_{part}"


def stream_subjects(base: str, part: int | None) -> list[str]:
    return [WHOLE[base]] if part is None else [f"{ENTRIES[base]}.{part}"]


def part_of(stream: str) -> int | None:
    """The partition of a stream by its name: TB_WORK_2 → 2, TB_WORK → None."""
    head, _, tail = stream.rpartition("_")
    return int(tail) if head in STREAM_NAMES and tail.isdigit() else None


def partition_tag(part: int) -> str:
    """The server tag that places partition `part`'s streams (a cluster's servers carry the tags of the
    partitions they serve: ops/cluster.py; a single server ignores placement)."""
    return f"tb-p{part}"


def within(subject: str, part: int | None) -> str:
    """A subject or filter of one kind of request subject (ending in the request id) in partition `part`."""
    return subject if part is None else f"{subject}.{part}"


def tenant_filters(base: str, tenant: str | None, part: int | None) -> list[str]:
    """The filters of one tenant's messages (every tenant's: None) in stream `base` of partition `part`. On a
    bus not partitioned they also match records stored before subjects ended in the request id."""
    kind = ENTRIES[base].removesuffix(".*.*")
    if part is not None:
        return [f"{kind}.{token('tenant', tenant) if tenant else '*'}.*.{part}"]
    return [f"{kind}.{token('tenant', tenant)}", f"{kind}.{tenant}.>"] if tenant else [WHOLE[base]]


def mappings(n: int) -> dict[str, str]:
    """nats-server's `mappings` for a bus of n partitions (none for one): each durable subject gets the
    partition its last token, the request id, hashes to."""
    if n == 1:
        return {}
    out = {}
    for entry in ENTRIES.values():
        tokens, k = [], 0
        for t in entry.split("."):
            if t == "*":
                k += 1
                t = f"{{{{wildcard({k})}}}}"
            tokens.append(t)
        out[entry] = ".".join([*tokens, f"{{{{partition({n},{k})}}}}"])
    return out


REPLICAS = 3                             # copies of every stream and bucket on a cluster: one server may die

TOKENIZE_QUEUE = "tokenizer"              # the tokenizers' queue group on TOKENIZE and PREPARE: one answers
ROUTER_DURABLE = "router"                 # the routers' pull consumer on REQUESTS_STREAM and on ROUTE_STREAM
PREPARE_SECONDS = 2.0                     # a PREPARE ask unanswered this long: the asker goes on without it


def worker_durable(worker: str) -> str:
    """The durable a worker pulls its work queue subject (work(worker)) through."""
    return f"worker-{token('worker', worker)}"


HEARTBEAT_SECONDS = 0.5
WORKER_TTL = 3.0                         # a worker whose heartbeat is older than this has left
IN_PROGRESS_SECONDS = 2.0                # a worker touches the work items it runs this often
ACK_WAIT = 10.0                          # after this an unacked message is redelivered
WORK_ACK_WAIT = 4 * IN_PROGRESS_SECONDS
MAX_DELIVER = 5
MAX_STRIKES = 2                          # failures or crashes of workers before a request is dead-lettered
LIMITS_TTL = 120.0                       # a tenant's shared bucket untouched this long is full (60 s refill it)
GATEWAY_TTL = 3.0                        # a gateway that has not said it is alive for this long has left
RESPONSES_TTL = 30 * 24 * 3600.0         # a stored response (the Responses API's `store`), as OpenAI keeps them
SUSPECT_TTL = QUEUE_MAX_AGE              # a worker's suspect is kept as long as its work could be redelivered
REQUEST_DEADLINE = 300.0                 # seconds from acceptance to a done or error frame, at most (gateway)
STALL_SECONDS = 5.0                      # a stream silent this long is checked (outcome, resend)
RESUME_GRACE = 10.0                      # seconds a stream whose client's connection dropped waits for a resume
DRAIN_TIMEOUT = 300.0                    # seconds a draining process finishes what it holds before handing it
#                                          over: a 4,096-token answer at 70 ms a token
DRAIN_SETTLE = 2 * HEARTBEAT_SECONDS     # a drain's first seconds: the readers of its draining beat see it
CHUNK_RATE = 1000.0                      # token chunks per second a worker publishes at most (its --chunk-rate)
MAX_CHUNK_INTERVAL = 0.1                 # seconds a stream's tokens wait in the worker for their chunk, at most


def chunk_rate(text: str) -> float:
    """A --chunk-rate value (the worker's, and what `tokenbus up` and bench-pipeline pass it): chunks
    per second, a number from 0 up (0: a chunk per stream per step)."""
    with contextlib.suppress(ValueError):
        if 0 <= (value := float(text)) < float("inf"):
            return value
    raise argparse.ArgumentTypeError(f"{text!r}: expected chunks per second, a number from 0 up")
ROLES = ("both", "prefill", "decode")     # a worker's --role: colocated, or one side of disaggregated serving
KV_LEASE_SECONDS = 30.0                  # a prefill worker keeps offered blocks pinned this long after the last fetch
KV_FETCH_TIMEOUT = 2.0                   # seconds a decode worker waits for one KvBlocks answer
KV_FETCH_WINDOW = 4                      # KvFetch requests one transfer has in flight at most (its flow control)
KV_PAYLOAD_MARGIN = 4096                 # bytes of a KvBlocks message left for its header under max_payload
KV_SNAPSHOT_PART = 1 << 15               # hashes per KvSnapshot message (about 300 kB, under the 1 MB payload)
KV_SNAPSHOT_TIMEOUT = 2.0                # seconds a router waits for a whole snapshot before asking again
ROUTER_STATS_SECONDS = 1.0


def past_deadline(created: float, now: float) -> bool:
    """A request accepted at `created` (unix time; 0: unknown) whose REQUEST_DEADLINE has passed: its
    client has had, or is about to have, its timeout; no stage should start it any more."""
    return created > 0 and now - created >= REQUEST_DEADLINE


# -- limits ---------------------------------------------------------------------------------------

MAX_FRAME_BYTES = 1 << 20                # one websocket frame
MAX_PROMPT_CHARS = 400_000
MAX_MESSAGES = 512                       # chat messages in one request
MAX_STOP = 16                            # stop strings
MAX_INFLIGHT_PER_CONNECTION = 256        # concurrent requests on one websocket
MAX_ID_CHARS = 256                       # a client id, echoed in every frame of its request
MAX_TOKENS = 4096                        # max_tokens of one request (the gateway's --max-tokens changes it)
MAX_BODY_BYTES = 4 << 20                 # one HTTP request body
MAX_HEADERS = 100                        # header fields of one HTTP request or websocket handshake
MAX_HEADER_BYTES = 32 << 10              # the request line and headers together
QUEUE_WATERMARK = 1.0                    # a worker with this × max_num_seqs queued beyond a full batch takes no more
BATCH_PRIORITY = 100                     # a batch key's default; the router places a request this late as batch
BATCH_WATERMARK = 0.75                   # spare room for batch: fewer than this × max_num_seqs running ...
BATCH_KV_FREE = 0.25                     # ... at least this share of the KV blocks free, and nothing waiting

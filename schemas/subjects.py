"""Subjects, streams, consumers, the worker registry bucket and the limits every service obeys.

Subjects go broad → narrow. Streams capture tenants and worker ids, never request ids; the
per-request subjects (tb.out, tb.cancel) are core NATS, stored nowhere."""
import argparse
import asyncio
import contextlib
import dataclasses
import re
import signal
import sys
import time

import nats
import nats.errors
import nats.js.errors
import orjson
import uvloop
from nats.js import api

from schemas import credentials as creds
from schemas.messages import Heartbeat, WireError, decode

# -- subjects ------------------------------------------------------------------------------------

REQUESTS_STREAM, REQUESTS_SUBJECTS = "TB_REQUESTS", "tb.req.>"     # the replayable request log
ROUTE_STREAM, ROUTE_SUBJECTS = "TB_ROUTE", "tb.route.>"            # tokenized requests, a work queue
WORK_STREAM, WORK_SUBJECTS = "TB_WORK", "tb.work.>"                # one subject per worker, a work queue
RESULTS_STREAM, RESULTS_SUBJECTS = "TB_RESULTS", "tb.done.>"       # the completions log
USAGE_STREAM, USAGE_SUBJECTS = "TB_USAGE", "tb.usage.>"            # the metering log: one record per request
DEAD_STREAM, DEAD_SUBJECTS = "TB_DEAD", "tb.dead.>"                # dead-lettered requests, with the reason
WORKERS_BUCKET = "tb_workers"                                      # heartbeats, key = worker id
REGISTRY_STREAM = f"KV_{WORKERS_BUCKET}"                           # the stream under it
OUTCOMES_BUCKET = "tb_outcomes"                                    # how each request ended, key = request id
LIMITS_BUCKET = "tb_limits"                                        # tenants' shared token buckets, key = tenant
GATEWAYS_BUCKET = "tb_gateways"                                    # live gateways, key = gateway id
SUSPECTS_BUCKET = "tb_suspects"                                    # the request a worker runs alone, key = worker id
CANCEL_ALL = "tb.cancel.*"
RESEND_ALL = "tb.resend.*"
PROGRESS_ALL = "tb.progress.*"
RESUMED_ALL = "tb.resumed.*"

TOKEN = re.compile(r"[A-Za-z0-9_-]{1,64}")


def token(kind: str, value: str) -> str:
    """value as one subject token; ValueError naming `kind` if it could break the subject tree."""
    if not isinstance(value, str) or not TOKEN.fullmatch(value):
        raise ValueError(f"{kind} {value!r} must be 1-64 characters of A-Z a-z 0-9 _ -")
    return value


def request_new(tenant: str) -> str:
    return f"tb.req.new.{token('tenant', tenant)}"


def route(tenant: str) -> str:
    return f"tb.route.{token('tenant', tenant)}"


def work(worker: str) -> str:
    return f"tb.work.{token('worker', worker)}"


def done(tenant: str) -> str:
    return f"tb.done.{token('tenant', tenant)}"


def usage(tenant: str) -> str:
    return f"tb.usage.{token('tenant', tenant)}"


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


def dead(tenant: str) -> str:
    return f"tb.dead.{token('tenant', tenant)}"


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


REQUEST_ID = "Tb-Request-Id"            # the header that names the request in every stage's messages


def msg_id(request_id: str, dedup: str | None = None) -> dict[str, str]:
    """Headers of every JetStream publish of a request: the message id deduplicates retried publishes
    (the request id unless `dedup` says otherwise), Tb-Request-Id names the request for logs and inspect."""
    return {"Nats-Msg-Id": dedup or request_id, REQUEST_ID: request_id}


# -- streams, consumers, bucket --------------------------------------------------------------

DUPLICATE_WINDOW = 120.0                 # seconds a retried publish is deduplicated
LOG_MAX_AGE = 7 * 24 * 3600.0
LOG_MAX_BYTES = 1 << 30
USAGE_MAX_AGE = 400 * 24 * 3600.0        # bills look back a year
QUEUE_MAX_AGE = 3600.0
MAX_MSG_SIZE = 4 << 20
REPLICAS = 3                             # copies of every stream and bucket on a cluster: one server may die
NOT_CLUSTERED = 10074                    # JetStream's "replicas > 1 not supported in non-clustered mode"

STREAMS = [
    api.StreamConfig(name=REQUESTS_STREAM, subjects=[REQUESTS_SUBJECTS], retention=api.RetentionPolicy.LIMITS,
                     storage=api.StorageType.FILE, max_age=LOG_MAX_AGE, max_bytes=LOG_MAX_BYTES,
                     duplicate_window=DUPLICATE_WINDOW, max_msg_size=MAX_MSG_SIZE),
    api.StreamConfig(name=ROUTE_STREAM, subjects=[ROUTE_SUBJECTS], retention=api.RetentionPolicy.WORK_QUEUE,
                     storage=api.StorageType.FILE, max_age=QUEUE_MAX_AGE, duplicate_window=DUPLICATE_WINDOW,
                     max_msg_size=MAX_MSG_SIZE),
    api.StreamConfig(name=WORK_STREAM, subjects=[WORK_SUBJECTS], retention=api.RetentionPolicy.WORK_QUEUE,
                     storage=api.StorageType.FILE, max_age=QUEUE_MAX_AGE, duplicate_window=DUPLICATE_WINDOW,
                     max_msg_size=MAX_MSG_SIZE),
    api.StreamConfig(name=RESULTS_STREAM, subjects=[RESULTS_SUBJECTS], retention=api.RetentionPolicy.LIMITS,
                     storage=api.StorageType.FILE, max_age=LOG_MAX_AGE, max_bytes=LOG_MAX_BYTES,
                     duplicate_window=DUPLICATE_WINDOW, max_msg_size=MAX_MSG_SIZE),
    api.StreamConfig(name=USAGE_STREAM, subjects=[USAGE_SUBJECTS], retention=api.RetentionPolicy.LIMITS,
                     storage=api.StorageType.FILE, max_age=USAGE_MAX_AGE, max_bytes=LOG_MAX_BYTES,
                     duplicate_window=DUPLICATE_WINDOW, max_msg_size=MAX_MSG_SIZE),
    api.StreamConfig(name=DEAD_STREAM, subjects=[DEAD_SUBJECTS], retention=api.RetentionPolicy.LIMITS,
                     storage=api.StorageType.FILE, max_age=LOG_MAX_AGE, max_bytes=LOG_MAX_BYTES,
                     duplicate_window=DUPLICATE_WINDOW, max_msg_size=MAX_MSG_SIZE),
]

HEARTBEAT_SECONDS = 0.5
WORKER_TTL = 3.0                         # a worker whose heartbeat is older than this has left
IN_PROGRESS_SECONDS = 2.0                # a worker touches the work items it runs this often
ACK_WAIT = 10.0                          # after this an unacked message is redelivered
WORK_ACK_WAIT = 4 * IN_PROGRESS_SECONDS
MAX_DELIVER = 5
MAX_STRIKES = 2                          # failures or crashes of workers before a request is dead-lettered
LIMITS_TTL = 120.0                       # a tenant's shared bucket untouched this long is full (60 s refill it)
GATEWAY_TTL = 3.0                        # a gateway that has not said it is alive for this long has left
OUTCOME_TTL = 2 * QUEUE_MAX_AGE          # outlives every work item that could still be redelivered
SUSPECT_TTL = QUEUE_MAX_AGE              # a worker's suspect is kept as long as its work could be redelivered
REQUEST_DEADLINE = 300.0                 # seconds from acceptance to a done or error frame, at most (gateway)
STALL_SECONDS = 5.0                      # a stream silent this long is checked (outcome, resend)
RESUME_GRACE = 10.0                      # seconds a stream whose client's connection dropped waits for a resume
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


def consumer(durable: str, filter_subject: str, ack_wait: float = ACK_WAIT) -> api.ConsumerConfig:
    """A durable pull consumer with explicit acks: any number of replicas fetch from it."""
    return api.ConsumerConfig(durable_name=durable, filter_subject=filter_subject, ack_policy=api.AckPolicy.EXPLICIT,
                              deliver_policy=api.DeliverPolicy.ALL, ack_wait=ack_wait, max_deliver=MAX_DELIVER,
                              max_ack_pending=10_000)


TOKENIZER = consumer("tokenizer", "tb.req.new.>")     # on REQUESTS_STREAM
ROUTER = consumer("router", ROUTE_SUBJECTS)            # on ROUTE_STREAM


def worker_consumer(worker: str) -> api.ConsumerConfig:
    return consumer(f"worker-{token('worker', worker)}", work(worker), WORK_ACK_WAIT)


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


# -- connecting -----------------------------------------------------------------------------------

async def connect(url: str, name: str, log=None, role: str | None = None,
                  credentials: creds.Credentials | None = None) -> nats.NATS:
    """A connection that keeps reconnecting: a restarted nats-server must not end a service. url is one
    server or a cluster's comma-separated list (any order; one is picked at random, the next on failure).
    After a reconnect every stream and bucket is made again if the server lost it (a wiped store); core
    subscriptions come back by themselves, watchers (watch()) and pull consumers (consume()) see the
    reconnect count and start over. Connection errors are one log line each (nats-py's default prints
    a traceback); a permissions violation is printed even without a log. It connects as `role`
    (default: `name`, schemas/roles.py) with `credentials` (default: the environment's)."""
    async def error(e: Exception) -> None:
        if log is not None:
            log.warning("nats connection error", error=f"{type(e).__name__}: {e}")
        elif "permissions violation" in str(e).lower():
            print(f"{name}: {e}", file=sys.stderr, flush=True)

    async def reconnected() -> None:               # a task of its own: nats-py awaits this inside its reconnect
        task = asyncio.get_running_loop().create_task(check())
        checks.add(task)
        task.add_done_callback(checks.discard)

    async def check() -> None:
        if log is not None:
            log.warning("nats reconnected", reconnects=nc.stats["reconnects"])
        try:
            await ensure_streams(nc.jetstream())
        except (nats.errors.Error, asyncio.TimeoutError) as e:   # the next publish that finds one gone retries
            if log is not None:
                log.warning("streams not checked after reconnect", error=str(e) or type(e).__name__)

    checks: set[asyncio.Task] = set()
    servers = servers_of(url)
    pings = {"ping_interval": CLUSTER_PING, "max_outstanding_pings": CLUSTER_PINGS} if len(servers) > 1 else {}
    nc = await nats.connect(servers, name=name, max_reconnect_attempts=-1, reconnect_time_wait=0.25,
                            connect_timeout=2, allow_reconnect=True, error_cb=error, reconnected_cb=reconnected,
                            **pings, **(credentials or creds.from_env()).options(role or name))
    return nc


CLUSTER_PING, CLUSTER_PINGS = 1.0, 3     # with a server list: a server that stops answering (cut off) is left in ~4 s


def servers_of(url: str) -> list[str]:
    """The servers of --nats-url: one URL, or several separated by commas; ValueError if none."""
    servers = [u.strip() for u in url.split(",") if u.strip()]
    if not servers:
        raise ValueError(f"--nats-url {url!r} names no server")
    return servers


BUS_ERRORS = (nats.errors.Error, asyncio.TimeoutError,
              RuntimeError)              # nats-py writing to a transport that closed under it (its server died)

PUBLISH_ATTEMPT = 2.0                    # seconds one JetStream publish waits for its ack
PUBLISH_DEADLINE = 60.0                  # seconds a publish is retried, under the same Nats-Msg-Id
PUBLISH_RETRY = 0.25                     # between attempts


class NotStored(Exception):
    """A JetStream publish that no attempt got acknowledged within its deadline."""


async def publish(js, subject: str, data: bytes, headers: dict[str, str], log,
                  deadline: float = PUBLISH_DEADLINE) -> api.PubAck:
    """Publishes to JetStream until the stream acknowledges it, retrying under the same headers (so the
    same Nats-Msg-Id: the stream stores it once however many attempts arrive) for up to `deadline`
    seconds, through a broker restart; a stream found missing is made again. NotStored names the
    deadline, or says the stream refused it."""
    end, attempts = time.monotonic() + deadline, 0
    while True:
        attempts += 1
        try:
            return await js.publish(subject, data, headers=headers, timeout=PUBLISH_ATTEMPT)
        except (nats.errors.Error, asyncio.TimeoutError) as e:
            reason = str(e) or type(e).__name__
            if refused(e):
                raise NotStored(f"{subject}: refused by the stream: {reason}") from None
            if isinstance(e, nats.errors.ConnectionClosedError):     # closed for good: no attempt can succeed
                raise NotStored(f"{subject}: not stored: {reason}") from None
            if time.monotonic() + PUBLISH_RETRY >= end:
                raise NotStored(f"{subject}: not stored after {attempts} attempts within PUBLISH_DEADLINE="
                                f"{deadline:g} s: {reason}") from None
            log.warning("publish not acknowledged; retrying", subject=subject, attempt=attempts,
                        msg_id=headers.get("Nats-Msg-Id"), error=reason)
            if isinstance(e, nats.js.errors.NoStreamResponseError):
                with contextlib.suppress(nats.errors.Error, asyncio.TimeoutError):
                    await ensure_streams(js)
            await asyncio.sleep(PUBLISH_RETRY)


async def ensure_streams(js) -> None:
    """Creates the streams and the buckets, or updates them to this build's config."""
    for config in STREAMS:
        try:
            await replicated(js.add_stream, config, "num_replicas")
        except nats.js.errors.BadRequestError:      # exists with another config: this build's, its copies kept
            kept = (await js.stream_info(config.name)).config.num_replicas
            await js.update_stream(dataclasses.replace(config, num_replicas=kept))
    await registry(js)
    await outcomes(js)
    await limits(js)
    await gateways(js)
    await suspects(js)


async def replicated(create, config, field: str):
    """create(config) with REPLICAS copies, or with one where the server is not in a cluster (it says so).
    A cluster of fewer than REPLICAS servers, or with too few of them up, refuses: that is an error."""
    try:
        return await create(dataclasses.replace(config, **{field: REPLICAS}))
    except nats.js.errors.APIError as e:
        if e.err_code != NOT_CLUSTERED:
            raise
        return await create(dataclasses.replace(config, **{field: 1}))


async def registry(js):
    """The KV bucket of worker heartbeats; an entry not refreshed within WORKER_TTL expires. On disk, so
    a restarted broker still has it (and its sequence: a watcher started before goes on)."""
    try:
        return await js.key_value(WORKERS_BUCKET)
    except nats.js.errors.BucketNotFoundError:
        return await replicated(js.create_key_value, api.KeyValueConfig(
            bucket=WORKERS_BUCKET, ttl=WORKER_TTL, history=1, storage=api.StorageType.FILE), "replicas")


async def outcomes(js):
    """The KV bucket of request outcomes (key = request id), on disk: one entry per request, kept
    OUTCOME_TTL, written with create() so the first end of a request is the only one recorded."""
    try:
        return await js.key_value(OUTCOMES_BUCKET)
    except nats.js.errors.BucketNotFoundError:
        return await replicated(js.create_key_value, api.KeyValueConfig(
            bucket=OUTCOMES_BUCKET, ttl=OUTCOME_TTL, history=1, storage=api.StorageType.FILE,
            max_value_size=MAX_MSG_SIZE), "replicas")


async def limits(js):
    """The KV bucket of tenants' token buckets shared by the gateways (key = tenant, a TenantBucket), on
    disk, changed by compare-and-set. An entry untouched for LIMITS_TTL is gone: its bucket has refilled."""
    try:
        return await js.key_value(LIMITS_BUCKET)
    except nats.js.errors.BucketNotFoundError:
        return await replicated(js.create_key_value, api.KeyValueConfig(
            bucket=LIMITS_BUCKET, ttl=LIMITS_TTL, history=1, storage=api.StorageType.FILE), "replicas")


async def gateways(js):
    """The KV bucket of live gateways (key = gateway id): each puts its key every GATEWAY_TTL / 3; its
    count of entries is the number of gateways sharing the tenants' limits."""
    try:
        return await js.key_value(GATEWAYS_BUCKET)
    except nats.js.errors.BucketNotFoundError:
        return await replicated(js.create_key_value, api.KeyValueConfig(
            bucket=GATEWAYS_BUCKET, ttl=GATEWAY_TTL, history=1, storage=api.StorageType.FILE), "replicas")


async def suspects(js):
    """The KV bucket of suspects (key = worker id, value = the id of the request it runs alone; none when
    it runs none). A worker restarted under the same id reads what its previous life said, however long
    the restart took (its heartbeat in tb_workers is gone WORKER_TTL after its last), so only that request
    takes a strike for the crash when their items are delivered again."""
    try:
        return await js.key_value(SUSPECTS_BUCKET)
    except nats.js.errors.BucketNotFoundError:
        return await replicated(js.create_key_value, api.KeyValueConfig(
            bucket=SUSPECTS_BUCKET, ttl=SUSPECT_TTL, history=1, storage=api.StorageType.FILE), "replicas")


def spare(waiting: int, running: int, max_num_seqs: int, kv_free: int, kv_total: int) -> bool:
    """Room for batch work beyond what a worker's interactive traffic needs now (admission and the router
    each count running and free KV with what they sent since the heartbeat)."""
    return waiting == 0 and running < BATCH_WATERMARK * max_num_seqs and kv_free >= BATCH_KV_FREE * kv_total


def lapsed(hb: Heartbeat, now: float) -> bool:
    """A worker whose last heartbeat is WORKER_TTL old has left, whether or not the bucket has expired it."""
    return now - hb.ts >= WORKER_TTL


def restated(old: Heartbeat | None, new: Heartbeat) -> bool:
    """Whether `new` only says `old` again with a fresh time: the side thread's stand-in beat while a long
    step holds the worker's loop (workers/sideline.py). Its counts are the step's start's, so what was
    routed to the worker since is not in them: a reader keeps its own count of that instead of zeroing it.
    (Zeroed, a worker in a multi-second prefill looked emptier at each stand-in beat and drew the new
    requests, which then waited for its step to end: measured on SmolLM2, 3 workers on 2 cores.)"""
    return old is not None and dataclasses.replace(old, ts=new.ts) == new


async def live_workers(kv) -> list[Heartbeat]:
    """The latest heartbeat of every live worker in the registry bucket, by worker id: one older than
    WORKER_TTL is gone, whether or not the bucket has expired its entry yet."""
    beats = []
    watcher = await kv.watchall()
    try:
        async for entry in watcher:
            if entry is None:                # the end of the current values
                break
            if entry.value and entry.operation is None:
                with contextlib.suppress(WireError):
                    beats.append(decode(entry.value, Heartbeat))
    finally:
        await watcher.stop()
    now = time.time()
    return sorted((b for b in beats if not lapsed(b, now)), key=lambda b: b.worker)


def refused(e: Exception) -> bool:
    """The stream answered and said no (e.g. a message over its size limit): another attempt is no better.
    A server still starting (503) or not answering is worth retrying."""
    retry = (nats.js.errors.ServiceUnavailableError, nats.js.errors.ServerError)
    return isinstance(e, nats.js.errors.APIError) and not isinstance(e, retry)


WATCH_POLL = 0.5                         # seconds between looks at the reconnect count while a watch is idle
WATCH_IDLE = WORKER_TTL                  # a watch that had entries and then none this long starts over
WATCH_INACTIVE = 30.0                    # seconds the server keeps a watcher's consumer that nobody listens to


async def watch(nc, handle, log) -> None:
    """handle(entry) for every entry of the registry bucket, forever: its current values, None once they
    are read, then every change. After a reconnect (a restarted broker forgets the watcher's consumer),
    WATCH_IDLE without an entry once it had some (its consumer may have died with a cluster node while
    this connection's server lives), or a failure, the bucket is found or made again and the watch starts
    over from the current values."""
    while True:
        reconnects = nc.stats["reconnects"]
        try:
            watcher = await (await registry(nc.jetstream())).watchall(inactive_threshold=WATCH_INACTIVE)
        except (nats.errors.Error, asyncio.TimeoutError) as e:
            log.warning("registry watch not started; retrying", error=str(e) or type(e).__name__)
            await asyncio.sleep(RECREATE_WAIT)
            continue
        last, had, why = time.monotonic(), False, "a reconnect"
        try:
            while nc.stats["reconnects"] == reconnects:
                try:
                    entry = await watcher.updates(WATCH_POLL)
                except nats.errors.TimeoutError:
                    if had and time.monotonic() - last >= WATCH_IDLE:
                        why = f"{WATCH_IDLE:g} s without an entry"
                        break
                    continue
                handle(entry)
                last, had = time.monotonic(), had or entry is not None
        finally:
            with contextlib.suppress(Exception):
                await watcher.stop()
        log.warning(f"registry watch restarted after {why}")


PULL_EXPIRES = 5.0                       # seconds a pull request waits on the server
CONSUMER_RETRY = 0.5


async def consume(nc, stream: str, config: api.ConsumerConfig, handle, log, batch: int = 64, room=None) -> None:
    """Streams a durable pull consumer of `stream` into handle(msg), forever; handle acks.
    Any number of replicas may run this on the same durable: each message goes to one of them.

    Pull requests for up to `batch` messages stay outstanding on a private inbox and are topped up
    as messages arrive, so a message is handed over the moment it is stored: no round trip per
    fetch and no waiting for a batch to fill (nats-py's fetch(n) waits for n or its timeout).
    room(): how many more messages the caller can take now (default: unbounded)."""
    await add_consumer(nc.jetstream(), stream, config, log)
    inbox, queue = nc.new_inbox(), asyncio.Queue()
    sub = await nc.subscribe(inbox, cb=queue.put)
    next_subject = f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{config.durable_name}"
    outstanding, reconnects, asked = 0, nc.stats["reconnects"], 0.0
    try:
        while True:
            if nc.stats["reconnects"] != reconnects:  # a restarted server forgot the pulls (and maybe the consumer)
                reconnects, outstanding = nc.stats["reconnects"], 0
                await add_consumer(nc.jetstream(), stream, config, log)
            want = min(batch, room() if room else batch) - outstanding
            if want > 0 and outstanding <= batch // 2:
                request = {"batch": want, "expires": int(PULL_EXPIRES * 1e9)}
                await nc.publish(next_subject, orjson.dumps(request), reply=inbox)
                outstanding, asked = outstanding + want, time.monotonic()
            try:
                async with asyncio.timeout(WATCH_POLL if outstanding else 0.01):
                    msgs = [await queue.get()]
            except TimeoutError:                 # nothing yet; pulls expired or lost in a reconnect: ask again
                if time.monotonic() - asked >= PULL_EXPIRES:
                    outstanding = 0
                continue
            while not queue.empty():             # the whole burst in one turn of the event loop
                msgs.append(queue.get_nowait())
            for msg in msgs:
                status = msg.headers and msg.headers.get("Status")
                if status:                       # 408 expired / 409 conflict: these will not come
                    left = msg.headers.get("Nats-Pending-Messages")
                    outstanding = max(0, outstanding - int(left)) if left else 0
                    if gone(msg.headers):
                        await recreate(nc, stream, config, log)
                    continue
                outstanding -= 1
                try:
                    await handle(msg)
                except Exception:                # a bug in one message's handling must not stop the stage
                    log.exception("message handling failed", subject=msg.subject)
    finally:
        await sub.unsubscribe()


def gone(headers) -> bool:
    """A pull answered because the consumer no longer exists (deleted, e.g. by the router when this
    worker's heartbeat lapsed under load): 409 Consumer Deleted, or 503 no responders."""
    return headers["Status"] == "503" or "Deleted" in (headers.get("Description") or "")


RECREATE_WAIT = 0.5                      # between attempts while another consumer holds the subject


async def recreate(nc, stream: str, config: api.ConsumerConfig, log) -> None:
    """Creates the consumer again so a live stage keeps pulling; the router may still be moving the
    work it held (a work-queue subject takes one consumer at a time), so a refusal waits a little."""
    try:
        await nc.jetstream().add_consumer(stream, config)
        log.warning("consumer recreated", stream=stream, consumer=config.durable_name)
    except (nats.errors.Error, asyncio.TimeoutError) as e:
        log.warning("consumer not recreated yet", consumer=config.durable_name, error=str(e) or type(e).__name__)
        await asyncio.sleep(RECREATE_WAIT)


async def add_consumer(js, stream: str, config: api.ConsumerConfig, log) -> None:
    """Creates the durable (or finds it), retrying while the server refuses, e.g. while a router's
    re-routing still holds this worker's subject of the work queue."""
    while True:
        try:
            await js.add_consumer(stream, config)
            return
        except (nats.errors.Error, asyncio.TimeoutError) as e:     # refused, or the server is not back yet
            log.warning("consumer not created; retrying", consumer=config.durable_name,
                        error=str(e) or type(e).__name__)
            await asyncio.sleep(CONSUMER_RETRY)


def run(main) -> None:
    """Runs a service's main coroutine on uvloop (libuv): a message's trip through a stage costs a
    few event-loop turns, and uvloop's are several times cheaper than asyncio's."""
    uvloop.run(main)


async def run_until_signal(main, nc) -> None:
    """Runs the coroutine main() until it returns or SIGTERM / SIGINT arrives, then closes nc."""
    task = asyncio.ensure_future(main())
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, task.cancel)
    try:
        with contextlib.suppress(asyncio.CancelledError):
            await task
    finally:
        await close(nc)


async def close(nc) -> None:
    """Flushes what was published and closes. Not drain(): a pull fetch in flight would hold it for
    its whole timeout, and anything unacked is redelivered anyway."""
    with contextlib.suppress(Exception):
        await nc.flush(timeout=1)
    await nc.close()

"""What JetStream stores, as this build configures it: the six streams (six per partition of a
partitioned bus), the durable pull consumers of the stages, and the five KV buckets (worker heartbeats,
tenants' shared limits, live gateways, suspects, stored responses). ensure_streams() creates them or
brings them to this build's config, each with REPLICAS copies on a cluster and one on a single server;
the bucket functions find or make one bucket. Names, subjects and sizes are schemas/subjects.py's: this
module turns them into nats.js.api configs."""
import contextlib
import dataclasses

import nats.js.errors
from nats.js import api

from schemas import subjects as s

NOT_CLUSTERED = 10074                    # JetStream's "replicas > 1 not supported in non-clustered mode"

NEW = api.DiscardPolicy.NEW                # a full stream refuses the publish: none drops what it was given

STREAMS = [
    api.StreamConfig(name=s.REQUESTS_STREAM, subjects=[s.REQUESTS_SUBJECTS], retention=api.RetentionPolicy.LIMITS,
                     storage=api.StorageType.FILE, max_age=s.QUEUE_MAX_AGE, discard=NEW,
                     duplicate_window=s.DUPLICATE_WINDOW, max_msg_size=s.MAX_MSG_SIZE),
    api.StreamConfig(name=s.ROUTE_STREAM, subjects=[s.ROUTE_SUBJECTS], retention=api.RetentionPolicy.WORK_QUEUE,
                     storage=api.StorageType.FILE, max_age=s.QUEUE_MAX_AGE, discard=NEW,
                     duplicate_window=s.DUPLICATE_WINDOW, max_msg_size=s.MAX_MSG_SIZE),
    api.StreamConfig(name=s.WORK_STREAM, subjects=[s.WORK_SUBJECTS], retention=api.RetentionPolicy.WORK_QUEUE,
                     storage=api.StorageType.FILE, max_age=s.QUEUE_MAX_AGE, discard=NEW,
                     duplicate_window=s.DUPLICATE_WINDOW, max_msg_size=s.MAX_MSG_SIZE),
    api.StreamConfig(name=s.RESULTS_STREAM, subjects=[s.RESULTS_SUBJECTS], retention=api.RetentionPolicy.LIMITS,
                     storage=api.StorageType.FILE, discard=NEW,          # trimmed by the recorder once archived
                     duplicate_window=s.DUPLICATE_WINDOW, max_msg_size=s.MAX_MSG_SIZE),
    api.StreamConfig(name=s.USAGE_STREAM, subjects=[s.USAGE_SUBJECTS], retention=api.RetentionPolicy.INTEREST,
                     storage=api.StorageType.FILE, discard=NEW,          # kept until the recorder acks it
                     duplicate_window=s.DUPLICATE_WINDOW, max_msg_size=s.MAX_MSG_SIZE),
    api.StreamConfig(name=s.DEAD_STREAM, subjects=[s.DEAD_SUBJECTS], retention=api.RetentionPolicy.LIMITS,
                     storage=api.StorageType.FILE, max_age=s.LOG_MAX_AGE, discard=NEW,
                     duplicate_window=s.DUPLICATE_WINDOW, max_msg_size=s.MAX_MSG_SIZE),
]


def streams(n: int | None = None, storage: int | None = None) -> list[api.StreamConfig]:
    """The streams of a bus of n partitions (default: TB_BUS_PARTITIONS) and `storage` bytes (default:
    TB_BUS_STORAGE): STREAMS, or each of them once per partition, capturing the subjects the partition()
    mapping gives it (schemas/subjects.py) and placed on the servers tagged for the partition; each
    stream's max_bytes its share of the storage (subjects.SHARES)."""
    n = s.partitions() if n is None else n
    storage = s.bus_storage() if storage is None else storage
    return [dataclasses.replace(c, name=s.stream(c.name, p), subjects=s.stream_subjects(c.name, p),
                                max_bytes=s.stream_bytes(c.name, storage, n),
                                placement=None if p is None else api.Placement(tags=[s.partition_tag(p)]))
            for c in STREAMS for p in s.parts(n)]


def consumer(durable: str, filter_subject: str, ack_wait: float = s.ACK_WAIT) -> api.ConsumerConfig:
    """A durable pull consumer with explicit acks: any number of replicas fetch from it."""
    return api.ConsumerConfig(durable_name=durable, filter_subject=filter_subject, ack_policy=api.AckPolicy.EXPLICIT,
                              deliver_policy=api.DeliverPolicy.ALL, ack_wait=ack_wait, max_deliver=s.MAX_DELIVER,
                              max_ack_pending=10_000)


def router(part: int | None = None) -> api.ConsumerConfig:
    """The routers' consumer on REQUESTS_STREAM (of partition `part`): new requests."""
    return consumer(s.ROUTER_DURABLE, s.within(s.ENTRIES[s.REQUESTS_STREAM], part))


def handoffs(part: int | None = None) -> api.ConsumerConfig:
    """The routers' consumer on ROUTE_STREAM (of partition `part`): prefilled requests handed back."""
    return consumer(s.ROUTER_DURABLE, s.within(s.ENTRIES[s.ROUTE_STREAM], part))


ROUTER, HANDOFFS = router(), handoffs()


def work_filter(worker: str, part: int | None = None) -> str:
    """The subjects of one worker's work queue (in partition `part`)."""
    return s.within(f"tb.work.{s.token('worker', worker)}.*", part)


def worker_consumer(worker: str, part: int | None = None) -> api.ConsumerConfig:
    return consumer(s.worker_durable(worker), work_filter(worker, part), s.WORK_ACK_WAIT)


async def infos(js, base: str, partitions: int | None = None) -> list[api.StreamInfo]:
    """Stream `base`'s info in each partition of a bus of `partitions` (default TB_BUS_PARTITIONS); a stream
    not made yet is left out (it holds nothing)."""
    out = []
    for part in s.parts(partitions):
        with contextlib.suppress(nats.js.errors.NotFoundError):
            out.append(await js.stream_info(s.stream(base, part)))
    return out


def recorder(base: str, part: int | None = None) -> api.ConsumerConfig:
    """The recorders' consumer on stream `base` (USAGE_STREAM or RESULTS_STREAM, of partition `part`): every
    record, delivered until acked however long the database is away (no max_deliver), held a minute each."""
    return dataclasses.replace(consumer(s.RECORDER_DURABLE, s.within(s.ENTRIES[base], part), RECORDER_ACK_WAIT),
                               max_deliver=-1, max_ack_pending=RECORDER_PENDING)


RECORDER_ACK_WAIT = 60.0                 # seconds a recorder holds a batch before JetStream delivers it again
RECORDER_PENDING = 50_000                # records handed to the recorders and not yet acked, at most


async def ensure_streams(js, partitions: int | None = None, storage: int | None = None) -> None:
    """Creates the streams (each partition's, on a bus of `partitions`; default TB_BUS_PARTITIONS) and the
    buckets, or updates them to this build's config. A stream that exists keeps its copies and, unless
    `storage` is given, its size (`tokenbus up` sizes the streams; a service only makes what is missing).
    TB_USAGE's recorder consumer is made with it: interest retention keeps what that consumer has not acked."""
    for config in streams(partitions, storage):
        try:
            await replicated(js.add_stream, config, "num_replicas")
        except nats.js.errors.BadRequestError:      # exists with another config: this build's, its copies kept
            had = (await js.stream_info(config.name)).config
            kept = {"num_replicas": had.num_replicas, **({} if storage else {"max_bytes": had.max_bytes})}
            await js.update_stream(dataclasses.replace(config, **kept))
        if config.retention == api.RetentionPolicy.INTEREST:
            await js.add_consumer(config.name, recorder(s.USAGE_STREAM, s.part_of(config.name)))
    await registry(js)
    await limits(js)
    await gateways(js)
    await suspects(js)
    await responses(js)


async def replicated(create, config, field: str):
    """create(config) with REPLICAS copies, or with one where the server is not in a cluster (it says so).
    A cluster of fewer than REPLICAS servers, or with too few of them up, refuses: that is an error."""
    try:
        return await create(dataclasses.replace(config, **{field: s.REPLICAS}))
    except nats.js.errors.APIError as e:
        if e.err_code != NOT_CLUSTERED:
            raise
        return await create(dataclasses.replace(config, **{field: 1}))


async def bucket(js, name: str, **config):
    """The KV bucket `name`, created on disk with one entry per key (and `config`) if it is not there."""
    try:
        return await js.key_value(name)
    except nats.js.errors.BucketNotFoundError:
        return await replicated(js.create_key_value, api.KeyValueConfig(
            bucket=name, history=1, storage=api.StorageType.FILE, **config), "replicas")


async def registry(js):
    """The KV bucket of worker heartbeats; an entry not refreshed within WORKER_TTL expires. On disk, so
    a restarted broker still has it (and its sequence: a watcher started before goes on)."""
    return await bucket(js, s.WORKERS_BUCKET, ttl=s.WORKER_TTL)


async def limits(js):
    """The KV bucket of tenants' token buckets shared by the gateways (key = tenant, a TenantBucket), on
    disk, changed by compare-and-set. An entry untouched for LIMITS_TTL is gone: its bucket has refilled."""
    return await bucket(js, s.LIMITS_BUCKET, ttl=s.LIMITS_TTL)


async def responses(js):
    """The KV bucket of stored Responses API responses (key = tenant_response-id), on disk, each kept RESPONSES_TTL."""
    return await bucket(js, s.RESPONSES_BUCKET, ttl=s.RESPONSES_TTL, max_value_size=s.MAX_MSG_SIZE)


async def gateways(js):
    """The KV bucket of live gateways (key = gateway id): each puts its key every GATEWAY_TTL / 3; its
    count of entries is the number of gateways sharing the tenants' limits."""
    return await bucket(js, s.GATEWAYS_BUCKET, ttl=s.GATEWAY_TTL)


async def suspects(js):
    """The KV bucket of suspects (key = worker id, value = the id of the request it runs alone; none when
    it runs none). A worker restarted under the same id reads what its previous life said, however long
    the restart took (its heartbeat in tb_workers is gone WORKER_TTL after its last), so only that request
    takes a strike for the crash when their items are delivered again."""
    return await bucket(js, s.SUSPECTS_BUCKET, ttl=s.SUSPECT_TTL)

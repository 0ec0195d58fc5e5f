"""Who may do what on the bus: the subject permissions of every role, derived from the subjects, streams,
consumers and buckets in schemas/subjects.py. nats-server enforces them (ops/bus.py renders them into
its config); docs/security.md has the same table in words.

A role publishes and subscribes only to its own subjects, reads its replies on an inbox of its own
(_INBOX_<role>.>, schemas/credentials.py) and answers requests only on the reply subjects of requests it
received (allow_responses). JetStream is an API over subjects too ($JS.API.>): a role may look up and
create tokenbus's streams and buckets (every service makes again what a wiped store lost, on start and
after a reconnect), never update or delete one (only admin may), and may create, pull from and ack only
the consumers of the streams it reads."""
from dataclasses import dataclass, field

from schemas import subjects as s

API = "$JS.API"
KV_STREAMS = [f"KV_{b}" for b in (s.WORKERS_BUCKET, s.LIMITS_BUCKET, s.GATEWAYS_BUCKET,
                                   s.SUSPECTS_BUCKET, s.RESPONSES_BUCKET)]
ALL_STREAMS = [*s.STREAM_NAMES, *KV_STREAMS]
MAX_REPLIES = 1024                       # answers to one request: a worker's KvSnapshot comes in parts


def all_streams(partitions: int = 1) -> list[str]:
    """Every stream of a bus of `partitions`: each of the six once per partition, and the buckets'."""
    return [*(s.stream(name, p) for name in s.STREAM_NAMES for p in s.parts(partitions)), *KV_STREAMS]


@dataclass(slots=True)
class Permissions:
    publish: list[str]
    subscribe: list[str]
    deny_publish: list[str] = field(default_factory=list)
    deny_subscribe: list[str] = field(default_factory=list)
    replies: int = 0                     # answers allowed per request received (allow_responses)


def each(subject) -> str:
    """Every subject of a kind: subjects.out → tb.out.*, subjects.done → tb.done.*.* (any request id, tenant
    or worker)."""
    sample = subject(*["x"] * subject.__code__.co_argcount)
    return ".".join("*" if t == "x" else t for t in sample.split("."))


def keep_streams() -> list[str]:
    """bus.ensure_streams and its buckets (bus/streams.py): look up, and create if missing, every stream, and
    the recorders' consumer on TB_USAGE, made with it (interest retention keeps what that consumer has not
    acked); only the recorder pulls from it."""
    return [*(f"{API}.STREAM.{op}.{stream}" for stream in ALL_STREAMS for op in ("INFO", "CREATE")),
            f"{API}.CONSUMER.DURABLE.CREATE.{s.USAGE_STREAM}.{s.RECORDER_DURABLE}"]


def durable(stream: str, name: str) -> list[str]:
    """A durable pull consumer (bus.consume): make or find it, pull from it, ack what it hands over."""
    return [f"{API}.CONSUMER.DURABLE.CREATE.{stream}.{name}", f"{API}.CONSUMER.INFO.{stream}.{name}",
            f"{API}.CONSUMER.MSG.NEXT.{stream}.{name}", f"$JS.ACK.{stream}.{name}.>"]


def reader(stream: str) -> list[str]:
    """Reading the whole of a stream: ephemeral and ordered consumers (watchers, inspect, exports), pulls,
    single messages, the stream's flow control."""
    return [f"{API}.CONSUMER.CREATE.{stream}", f"{API}.CONSUMER.CREATE.{stream}.>", f"{API}.CONSUMER.INFO.{stream}.*",
            f"{API}.CONSUMER.MSG.NEXT.{stream}.*", f"{API}.STREAM.MSG.GET.{stream}", f"{API}.DIRECT.GET.{stream}",
            f"{API}.DIRECT.GET.{stream}.>", f"$JS.FC.{stream}.>", f"$JS.ACK.{stream}.>"]


def kv_get(bucket: str) -> list[str]:
    """One key of a bucket (a direct get if the bucket allows it)."""
    stream = f"KV_{bucket}"
    return [f"{API}.STREAM.MSG.GET.{stream}", f"{API}.DIRECT.GET.{stream}", f"{API}.DIRECT.GET.{stream}.>"]


def kv_write(bucket: str) -> list[str]:
    return [f"$KV.{bucket}.*"]


REGISTRY, LIMITS, GATEWAYS = s.WORKERS_BUCKET, s.LIMITS_BUCKET, s.GATEWAYS_BUCKET
ENDS = f"{API}.STREAM.MSG.GET.{s.RESULTS_STREAM}"        # one request's end record (bus.ended)
SUSPECTS, RESPONSES = s.SUSPECTS_BUCKET, s.RESPONSES_BUCKET
DRAINING = [s.DRAINED_ALL], [s.DRAIN_ALL]              # every service's: says it drained; hears tokenbus drain

ROLES: dict[str, Permissions] = {
    # accepts requests, streams their tokens, meters them; resumes a stream from the request log's copy;
    # shares tenants' rate limits with the other gateways (tb_limits) and says it is alive (tb_gateways)
    "gateway": Permissions(
        publish=[each(s.request_new), s.CANCEL_ALL, s.RESEND_ALL, s.RESUMED_ALL, each(s.usage),
                 *keep_streams(), *reader(f"KV_{REGISTRY}"), ENDS, *kv_get(LIMITS),
                 *kv_write(LIMITS), *kv_write(GATEWAYS), s.TOKENIZE, s.PREPARE, *kv_get(RESPONSES),
                 *kv_write(RESPONSES),
                 f"{API}.STREAM.MSG.GET.{s.REQUESTS_STREAM}", *DRAINING[0]],
        subscribe=[each(s.out), s.PROGRESS_ALL, s.ROUTER_STATS_ALL, s.RESUMED_ALL, *DRAINING[1]], replies=1),
    # answers tb.prepare and tb.tokenize: a request's tokens; writes nothing
    "tokenizer": Permissions(publish=[*keep_streams(), *DRAINING[0]], subscribe=[s.PREPARE, s.TOKENIZE, *DRAINING[1]],
                             replies=1),
    # the request log (tokenized, or tokenized here by asking tb.prepare) and handed-back prefilled requests
    # → one worker's work queue; moves a departed worker's work; ends requests past their deadline (their
    # end records)
    "router": Permissions(
        publish=[each(s.work), each(s.out), each(s.kv_snapshot), s.ROUTER_STATS_ALL, s.PREPARE,
                 *keep_streams(), *durable(s.REQUESTS_STREAM, s.ROUTER_DURABLE),
                 *durable(s.ROUTE_STREAM, s.ROUTER_DURABLE), *reader(f"KV_{REGISTRY}"), each(s.done), ENDS,
                 f"{API}.CONSUMER.INFO.{s.WORK_STREAM}.*", f"{API}.CONSUMER.DELETE.{s.WORK_STREAM}.*",
                 f"{API}.CONSUMER.CREATE.{s.WORK_STREAM}.*.{each(s.work)}",
                 f"{API}.CONSUMER.MSG.NEXT.{s.WORK_STREAM}.*", f"$JS.ACK.{s.WORK_STREAM}.>", *DRAINING[0]],
        subscribe=[s.KV_EVENTS_ALL, s.RESULTS_SUBJECTS, *DRAINING[1]], replies=1),
    # runs its work queue: tokens, end records, usage (when the gateway's is missing), dead letters,
    # heartbeats, the request it runs alone, KV events; disaggregated: hands prefilled requests back to the
    # router, and pulls and serves KV blocks
    "worker": Permissions(
        publish=[each(s.out), each(s.done), each(s.usage), each(s.dead), each(s.route), s.KV_TRANSFER_ALL,
                 s.KV_EVENTS_ALL, s.PROGRESS_ALL, *keep_streams(), *kv_write(REGISTRY), *kv_get(REGISTRY),
                 *kv_write(SUSPECTS), *kv_get(SUSPECTS), ENDS,
                 f"{API}.CONSUMER.DURABLE.CREATE.{s.WORK_STREAM}.*", f"{API}.CONSUMER.INFO.{s.WORK_STREAM}.*",
                 f"{API}.CONSUMER.MSG.NEXT.{s.WORK_STREAM}.*", f"$JS.ACK.{s.WORK_STREAM}.>", *DRAINING[0]],
        subscribe=[s.CANCEL_ALL, s.RESEND_ALL, each(s.kv_snapshot), s.KV_TRANSFER_ALL, *DRAINING[1]],
        replies=MAX_REPLIES),
    # tokenbus status: the registry
    "status": Permissions(publish=[*keep_streams(), *reader(f"KV_{REGISTRY}")], subscribe=[]),
    # the recorder: usage records into the database, end records into the archive, acked after; trims the
    # archived end records past ENDS_KEEP
    "recorder": Permissions(
        publish=[*keep_streams(), *durable(s.USAGE_STREAM, s.RECORDER_DURABLE),
                 *durable(s.RESULTS_STREAM, s.RECORDER_DURABLE), f"{API}.STREAM.PURGE.{s.RESULTS_STREAM}",
                 f"{API}.STREAM.MSG.GET.{s.USAGE_STREAM}", f"{API}.STREAM.MSG.GET.{s.RESULTS_STREAM}", *DRAINING[0]],
        subscribe=[*DRAINING[1]], replies=1),
    # tokenbus usage: the metering log's tail not yet in the database; with the recorder, TB_USAGE's only reader
    "usage": Permissions(publish=[*keep_streams(), *reader(s.USAGE_STREAM)], subscribe=[]),
    # tokenbus replay: logged requests sent again, their tokens read
    "replay": Permissions(publish=[each(s.request_new), s.CANCEL_ALL, *keep_streams(),
                                   *reader(s.RESULTS_STREAM)],
                          subscribe=[each(s.out)]),
    # tokenbus log export / import: the completions log
    "log": Permissions(publish=[each(s.done), *keep_streams(), *reader(s.RESULTS_STREAM)], subscribe=[]),
    # tokenbus inspect: reads every subject and stream but the metering log and other roles' inboxes
    "inspect": Permissions(publish=[*keep_streams(), *reader("*")], subscribe=[">"],
                           deny_publish=reader(s.USAGE_STREAM), deny_subscribe=[s.USAGE_SUBJECTS, "_INBOX.>"]),
    # the operator: tokenbus up (streams, readiness), chaos, health checks; creates and updates streams
    "admin": Permissions(publish=[">"], subscribe=[">"]),
}


def inbox(role: str) -> str:
    return f"_INBOX_{role}.>"


ROLES["inspect"].deny_subscribe += [inbox(r) for r in ROLES if r != "inspect"]


def partitioned(entries: list[str], n: int) -> list[str]:
    """The permissions on a bus of n partitions: one naming one of the six streams, once for each of its
    partitions; a durable subject's, with the partition token too (nats-server checks the subject its
    partition() mapping made)."""
    if n == 1:
        return entries
    out = []
    for entry in entries:
        variants = [entry, f"{entry}.*"] if entry.endswith(tuple(s.ENTRIES.values())) else [entry]
        for v in variants:
            tokens = v.split(".")
            if not set(tokens) & set(s.STREAM_NAMES):
                out.append(v)
                continue
            out += [".".join(s.stream(t, p) if t in s.STREAM_NAMES else t for t in tokens) for p in range(n)]
    return out


def permissions(role: str, partitions: int = 1) -> dict:
    """The role's `permissions` block of a nats-server user, its own inbox included, on a bus of
    `partitions` partitions."""
    p = ROLES[role]
    out = {"publish": {"allow": partitioned(p.publish, partitions)},
           "subscribe": {"allow": [*p.subscribe, inbox(role)]}}
    if p.deny_publish:
        out["publish"]["deny"] = partitioned(p.deny_publish, partitions)
    if p.deny_subscribe:
        out["subscribe"]["deny"] = p.deny_subscribe
    if p.replies:
        out["allow_responses"] = {"max": p.replies}
    return out

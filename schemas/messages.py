"""Every message that crosses NATS: one dataclass each, msgpack on the wire with a type tag `t`
and a version `v`. `decode` checks every field against its annotation (schemas/wire.py), so a bad
message is a WireError that names the field, never an exception deep inside a service."""
import json
import math
import typing
from dataclasses import dataclass, field

import msgpack

from schemas.sampling import MAX_TOKENS_BOUND, SamplingParams
from schemas.subjects import MAX_MESSAGES, MAX_PROMPT_CHARS
from schemas.wire import WireError, build, check_name, check_token_ids, in_range, limit, to_dict

VERSION = 1
MAX_TOOLS = 128                         # function tools of one request
MAX_PROMPT_TOKENS = 1 << 20             # token ids of one prompt (the engine holds it to max_model_len)
MAX_SALT_CHARS = 256
MAX_ATTEMPTS = 1 << 10                  # re-routes of one request; strikes are far fewer (MAX_STRIKES)
MAX_TEXT_CHARS = 1 << 16                # an error message or a dead letter's reason
MIN_PRIORITY, MAX_PRIORITY = -(1 << 31), (1 << 31) - 1   # a request's priority: an int32, lower runs first
MIN_WEIGHT, MAX_WEIGHT = 1e-3, 1e3    # a tenant's weight: its share of a worker under the fair policy
SCHEDULING_POLICIES = ("fcfs", "priority", "fair")   # a worker's (workers.engine.scheduler)
KV_TIERS = ("pool", "host", "disk")               # a prefix cache's tiers, highest first (workers.engine.kv_tiers)


@dataclass(slots=True)
class Meter:
    """What a usage record needs beyond the tokens: the API key's id, the API, the served model's name.
    The gateway sets it; the worker writes the usage record from it when the gateway cannot (it died)."""
    key_id: str = ""
    api: str = ""                                 # ws | chat | completions
    model: str = ""


def check_meter(meter: "Meter | None") -> None:
    if meter is not None:
        for name in ("key_id", "api", "model"):
            limit(len(getattr(meter, name)), MAX_SALT_CHARS, f"meter.{name}", "MAX_SALT_CHARS", "characters")


@dataclass(slots=True)
class GenerateRequest:
    """gateway → TB_REQUESTS: what the client asked, exactly one of messages, prompt and prompt_token_ids, and
    the prompt's tokens as a tokenizer made them (`tokens`: the gateway asks one on tb.prepare before it
    stores the request; the router asks when they are missing)."""
    TYPE: typing.ClassVar[str] = "request"
    id: str
    tenant: str
    sampling: SamplingParams
    messages: list[dict[str, str]] | None = None
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    cache_salt: str | None = None
    created: float = 0.0                          # unix time the gateway accepted it
    meter: Meter | None = None                  # who to bill, carried to the worker
    priority: int = 0                             # lower runs first on a worker with the priority policy
    model: str = ""                               # the served model's name ("": the tokenizer's first model)
    revision: str = ""                            # the revision that must serve it ("": any of the model's)
    weight: float = 1.0                           # the tenant's (its key's): its share under the fair policy
    tools: list[dict] | None = None               # OpenAI function tools the chat template shows the model
    group: str = ""                               # n > 1: the first choice's id, shared by its prompt's choices
    tokens: list[int] | None = None               # the prompt's token ids, the chat template applied

    def check(self) -> None:
        given = [name for name in ("messages", "prompt", "prompt_token_ids") if getattr(self, name) is not None]
        if len(given) != 1:
            raise WireError(f"exactly one of messages, prompt, prompt_token_ids is needed (got {given or 'none'})")
        check_names(self.id, self.tenant, self.cache_salt, self.created, self.group)
        check_model(self.model, self.revision)
        in_range("priority", self.priority, MIN_PRIORITY, MAX_PRIORITY)
        in_range("weight", self.weight, MIN_WEIGHT, MAX_WEIGHT)
        check_meter(self.meter)
        if self.messages is not None:
            limit(len(self.messages), MAX_MESSAGES, "messages", "MAX_MESSAGES", "messages")
            chars = sum(len(k) + len(v) for m in self.messages for k, v in m.items())
            limit(chars, MAX_PROMPT_CHARS, "messages", "MAX_PROMPT_CHARS", "characters")
        if self.tools is not None:
            limit(len(self.tools), MAX_TOOLS, "tools", "MAX_TOOLS", "tools")
            limit(len(json.dumps(self.tools)), MAX_PROMPT_CHARS, "tools", "MAX_PROMPT_CHARS", "characters")
        if self.prompt is not None:
            limit(len(self.prompt), MAX_PROMPT_CHARS, "prompt", "MAX_PROMPT_CHARS", "characters")
        if self.prompt_token_ids is not None:
            check_token_ids("prompt_token_ids", self.prompt_token_ids, MAX_PROMPT_TOKENS, "MAX_PROMPT_TOKENS")
        if self.tokens is not None:
            check_token_ids("tokens", self.tokens, MAX_PROMPT_TOKENS, "MAX_PROMPT_TOKENS")


@dataclass(slots=True)
class Prefilled:
    """A request whose prompt a prefill worker computed (disaggregated serving), as it hands the request
    to a decode worker: the tokens it sampled (already streamed to the client), and the KV it holds for
    the decode worker to pull, named by the chained block hashes (tenant salt included) under a lease."""
    worker: str                                   # the prefill worker: tb.kvx.<worker> serves the blocks
    lease: str                                    # what the blocks are pinned under there
    block_hashes: list[int]                       # the prompt's full blocks it holds, from the first
    block_size: int
    output_token_ids: list[int]                   # sampled there, already sent (chunks 0..chunks-1)
    seed: int                                     # the request's sampling seed as drawn there
    cached_tokens: int = 0                        # prompt tokens the prefill worker's prefix cache served
    chunks: int = 1                               # chunks it published
    received: float = 0.0                         # unix time the prefill worker took the request
    first_token: float = 0.0                      # and sampled its first token

    def check(self) -> None:
        check_name("prefilled.worker", self.worker)
        check_name("prefilled.lease", self.lease)
        limit(len(self.block_hashes), MAX_PROMPT_TOKENS, "prefilled.block_hashes", "MAX_PROMPT_TOKENS", "hashes")
        in_range("prefilled.block_size", self.block_size, 1, 1 << 16)
        check_token_ids("prefilled.output_token_ids", self.output_token_ids, MAX_TOKENS_BOUND, "MAX_TOKENS_BOUND")
        in_range("prefilled.chunks", self.chunks, 0, MAX_TOKENS_BOUND)


@dataclass(slots=True)
class TokenizedRequest:
    """tokenizer → TB_ROUTE: the request as token ids. A prefill worker hands a request it prefilled
    back to TB_ROUTE with `prefilled` set, for the router to place on a decode worker."""
    TYPE: typing.ClassVar[str] = "tokenized"
    id: str
    tenant: str
    sampling: SamplingParams
    prompt_token_ids: list[int]
    cache_salt: str | None = None
    created: float = 0.0
    meter: Meter | None = None
    prefilled: Prefilled | None = None
    priority: int = 0                             # GenerateRequest's
    model: str = ""                               # GenerateRequest's: the router picks a worker serving it
    revision: str = ""
    weight: float = 1.0                           # GenerateRequest's
    group: str = ""                               # GenerateRequest's: routed to one worker, forked after one prefill

    def check(self) -> None:
        check_names(self.id, self.tenant, self.cache_salt, self.created, self.group)
        check_model(self.model, self.revision)
        in_range("priority", self.priority, MIN_PRIORITY, MAX_PRIORITY)
        in_range("weight", self.weight, MIN_WEIGHT, MAX_WEIGHT)
        check_meter(self.meter)
        check_token_ids("prompt_token_ids", self.prompt_token_ids, MAX_PROMPT_TOKENS, "MAX_PROMPT_TOKENS")
        if self.prefilled is not None:
            self.prefilled.check()


@dataclass(slots=True)
class WorkItem:
    """router → TB_WORK (tb.work.<worker>): a tokenized request bound to one worker."""
    TYPE: typing.ClassVar[str] = "work"
    request: TokenizedRequest
    worker: str
    routed: float = 0.0
    attempt: int = 0                              # re-routes after a worker left; part of the Nats-Msg-Id
    strikes: int = 0                              # workers it failed or crashed so far (follows the request id)
    prefill: bool = False                         # a remote prefill: the prompt and first token, then a handoff

    def check(self) -> None:
        self.request.check()
        check_name("worker", self.worker)
        in_range("attempt", self.attempt, 0, MAX_ATTEMPTS)
        in_range("strikes", self.strikes, 0, MAX_ATTEMPTS)

    @property
    def msg_id(self) -> str:
        rid = self.request.id if self.request.prefilled is None else f"{self.request.id}.pd"   # the decode leg
        return rid if self.attempt == 0 else f"{rid}.{self.attempt}"


@dataclass(slots=True)
class Logprobs:
    """The model's log-probabilities of a chunk's tokens, for requests that asked for them:
    logprob[i] of token i, and its best alternatives (top_ids[i], top_logprobs[i], best first)."""
    logprob: list[float]
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]


@dataclass(slots=True)
class TokenChunk:
    """worker → tb.out.<id>: the tokens one engine step produced. `seq` counts chunks from 0;
    `offset` is the number of output tokens before this chunk, so a reader drops duplicates.
    The first chunk also carries the prompt's last tokens, the detokenizer's context, and the
    prompt tokens the prefix cache served."""
    TYPE: typing.ClassVar[str] = "chunk"
    id: str
    seq: int
    offset: int
    token_ids: list[int]
    prompt_tokens: int = 0
    prompt_tail: list[int] = field(default_factory=list)
    cached_tokens: int = 0
    logprobs: Logprobs | None = None


@dataclass(slots=True)
class FinalChunk:
    """worker → tb.out.<id>: the last chunk of a request, with its last tokens (maybe none)."""
    TYPE: typing.ClassVar[str] = "final"
    id: str
    seq: int
    offset: int
    token_ids: list[int]
    finish_reason: str                            # stop | length | abort
    stop_reason: int | str | None = None
    usage: dict[str, int] = field(default_factory=dict)       # prompt_tokens, completion_tokens, cached_tokens
    timing: dict[str, float] = field(default_factory=dict)    # queue_ms, ttft_ms, e2e_ms as the worker saw them
    worker: str = ""
    prompt_tail: list[int] = field(default_factory=list)     # when it is also the first chunk
    logprobs: Logprobs | None = None


@dataclass(slots=True)
class ErrorChunk:
    """any stage → tb.out.<id>: the request was refused; `code` is machine-readable, `message` names the limit."""
    TYPE: typing.ClassVar[str] = "error"
    id: str
    code: str
    message: str


@dataclass(slots=True)
class Resend:
    """gateway → tb.resend.<id> (request-reply): the output tokens from `offset` on, for a gateway that
    saw a gap. The worker running the request answers with a TokenChunk (seq -1); nobody else answers."""
    TYPE: typing.ClassVar[str] = "resend"
    id: str
    offset: int

    def check(self) -> None:
        check_name("request id", self.id)
        in_range("offset", self.offset, 0, MAX_TOKENS_BOUND)


@dataclass(slots=True)
class Progress:
    """gateway → the reply subject of a request on tb.progress.<id>: the output tokens its client has
    received, from the first on. A worker that takes a moved request asks, and continues from there."""
    TYPE: typing.ClassVar[str] = "progress"
    id: str
    token_ids: list[int]

    def check(self) -> None:
        check_name("request id", self.id)
        check_token_ids("token_ids", self.token_ids, MAX_TOKENS_BOUND, "MAX_TOKENS_BOUND", empty=True)


@dataclass(slots=True)
class Resumed:
    """gateway → tb.resumed.<id>: the request's client resumed its stream on `gateway`. Another gateway still
    holding the request (its client's connection dropped, or it has not noticed yet) lets it go: no cancel,
    no usage record."""
    TYPE: typing.ClassVar[str] = "resumed"
    id: str
    gateway: str

    def check(self) -> None:
        check_name("request id", self.id)
        check_name("gateway", self.gateway)


def ending(c: "Completion", offset: int = 0, context: int = 0) -> "FinalChunk | ErrorChunk":
    """The last chunk of a request as its end record has it: its output tokens from `offset` on (seq -1:
    not one of the stream's numbered chunks) with the last `context` prompt tokens (the detokenizer's),
    or its error."""
    if c.finish_reason == "error":
        return ErrorChunk(c.id, c.error_code, c.error_message)
    return FinalChunk(c.id, -1, offset, c.output_token_ids[offset:], c.finish_reason, c.stop_reason, c.usage,
                      c.timing, c.worker, c.prompt_token_ids[-context:] if context else [])


@dataclass(slots=True)
class DeadLetter:
    """→ TB_DEAD (tb.dead.<tenant>): a request that failed or crashed workers MAX_STRIKES times, with why;
    it is answered with an error and never delivered again."""
    TYPE: typing.ClassVar[str] = "dead"
    request: TokenizedRequest
    reason: str
    strikes: int
    worker: str = ""                              # the last worker it failed on
    ts: float = 0.0

    def check(self) -> None:
        self.request.check()
        in_range("strikes", self.strikes, 0, MAX_ATTEMPTS)
        limit(len(self.reason), MAX_TEXT_CHARS, "reason", "MAX_TEXT_CHARS", "characters")


@dataclass(slots=True)
class Cancel:
    """gateway → tb.cancel.<id>: stop generating (client cancel, disconnect or a stop string)."""
    TYPE: typing.ClassVar[str] = "cancel"
    id: str
    reason: str = "abort"

    def check(self) -> None:
        check_name("request id", self.id)


@dataclass(slots=True)
class Speculation:
    """A speculating worker's drafting, in its heartbeat: the last step's choice of k and what it was
    chosen from, then counts since the worker started."""
    method: str                                   # ngram | draft
    k: int                                        # draft tokens per request of the last step (0: none)
    k_max: int
    adaptive: bool                                # false: always k_max
    rows: int                                     # requests of the last step that could draft
    acceptance_estimate: float                    # the moving average k is chosen by
    drafts: int                                   # requests' verify steps that had drafts
    draft_tokens: int
    accepted_tokens: int
    acceptance_rate: float                        # accepted_tokens / draft_tokens
    mean_acceptance_length: float                 # accepted draft tokens per verify step with drafts
    acceptance_per_position: list[float]          # the rate at draft position 0, 1, ...


@dataclass(slots=True)
class KvTransfer:
    """A disaggregated worker's KV transfers since it started, in its heartbeat: what it served as a
    prefill worker and what it pulled as a decode worker."""
    handoffs: int = 0                             # requests it prefilled and handed to a decode worker
    leases: int = 0                               # offers pinned now
    served_blocks: int = 0
    served_bytes: int = 0
    transfers: int = 0                            # handed-in requests whose blocks it pulled (or tried to)
    pulled_blocks: int = 0
    pulled_bytes: int = 0
    cached_blocks: int = 0                        # offered blocks it held already: not pulled
    failures: int = 0                             # transfers that failed (timeout, a gone prefill worker, a mismatch)
    recomputes: int = 0                           # requests that computed the KV a failed transfer lacked
    transfer_seconds: float = 0.0                 # all transfers together
    transfer_ms_p50: float = 0.0                  # over the last TRANSFER_WINDOW transfers
    transfer_ms_p99: float = 0.0


@dataclass(slots=True)
class KvFetch:
    """decode worker → tb.kvx.<prefill worker> (request-reply): the KV of `hashes` under `lease`, layers
    [layer_start, layer_end) of each, answered by one KvBlocks; `release` lets the lease go (no answer)."""
    TYPE: typing.ClassVar[str] = "kv_fetch"
    lease: str
    hashes: list[int] = field(default_factory=list)
    layer_start: int = 0
    layer_end: int = 0
    release: bool = False

    def check(self) -> None:
        check_name("lease", self.lease)
        limit(len(self.hashes), 1 << 16, "hashes", "65536", "hashes")
        in_range("layer_start", self.layer_start, 0, 1 << 16)
        in_range("layer_end", self.layer_end, 0, 1 << 16)


@dataclass(slots=True)
class Heartbeat:
    """worker → KV bucket tb_workers (key = worker id), every HEARTBEAT_SECONDS."""
    TYPE: typing.ClassVar[str] = "heartbeat"
    worker: str
    ts: float
    model: str
    block_size: int
    max_num_seqs: int
    running: int
    waiting: int
    kv_blocks_total: int
    kv_blocks_free: int
    prefix_cache_queries: int                     # in tokens
    prefix_cache_hits: int                        # in tokens
    requests_finished: int
    preemptions: int = 0                          # counters since the worker started, like the three above
    prompt_tokens: int = 0                        # of the requests it took
    generation_tokens: int = 0                    # it published
    kv_blocks_queued: int = 0                     # blocks the waiting requests will add (less their cached prefix)
    isolated: str = ""                            # a request running alone (it has a strike): a crash now is its
    speculation: Speculation | None = None        # None: the worker does not speculate
    role: str = "both"                            # both (colocated) | prefill | decode
    kv_transfer: KvTransfer | None = None         # None: a colocated worker
    scheduling_policy: str = "fcfs"               # fcfs | priority | fair (the engine's, workers.engine.scheduler)
    revision: str = ""                            # of the model it serves (schemas/revision.py)
    forks: int = 0                                # choices admitted onto a sibling's computed prompt (n > 1)
    kv_tiers: dict[str, float] = field(default_factory=dict)   # the prefix cache's tiers below the pool, per tier
    #                                 (host_*, disk_*): hits, blocks, bytes, bytes_in, bytes_out, seconds; empty: none
    draining: bool = False                        # it finishes what it holds and takes nothing new: the router and
    #                                 admission choose it no more; its work, if handed over, moves without a strike


@dataclass(slots=True)
class KvEvent:
    """worker → tb.kv.<worker>: block hashes it stored and removed in one engine step (disjoint lists).
    `seq` counts the worker's events from 1; a reader that sees one missing asks for a snapshot.
    With a prefix cache in tiers, `stored` holds each hash that moved too, and `tiers` the tier that holds
    it now, one per stored hash (an index of KV_TIERS); empty: all in the pool (a worker without tiers).
    `removed`: gone from every tier."""
    TYPE: typing.ClassVar[str] = "kv"
    worker: str
    seq: int
    stored: list[int]
    removed: list[int]
    tiers: list[int] = field(default_factory=list)


@dataclass(slots=True)
class KvSnapshot:
    """worker → the reply subject of a request on tb.kv.snapshot.<worker>: every hash it holds, in
    `parts` messages of at most KV_SNAPSHOT_PART hashes, as of its event `seq` (later events apply on top)."""
    TYPE: typing.ClassVar[str] = "kv_snapshot"
    worker: str
    seq: int
    part: int
    parts: int
    hashes: list[int]
    tiers: list[int] = field(default_factory=list)   # each hash's tier, as KvEvent's; empty: all in the pool


@dataclass(slots=True)
class RouterStats:
    """router → tb.router.stats.<router>, every ROUTER_STATS_SECONDS: counters since it started.
    Predicted vs actual prefix hits are over the routed requests whose completion it has seen."""
    TYPE: typing.ClassVar[str] = "router_stats"
    router: str
    ts: float
    policy: str
    routed: int                                   # decisions, re-routes included
    guarded: int                                  # decisions where the guard ruled out a worker
    completed: int                                # completions matched to a decision
    prompt_tokens: int                            # of the completed
    predicted_hit_tokens: int
    actual_hit_tokens: int
    exact: int                                    # completions whose actual hit equals the prediction
    snapshots: int                                # snapshot requests sent
    gaps: int                                     # event sequence gaps seen
    routed_to: dict[str, int] = field(default_factory=dict)       # worker -> decisions
    index_blocks: dict[str, int] = field(default_factory=dict)    # worker -> hashes in its index
    prefill: dict[str, int] = field(default_factory=dict)         # "remote:<why>" / "local:<why>" -> decisions
    handoffs: int = 0                                             # prefilled requests placed on a decode worker


@dataclass(slots=True)
class Completion:
    """worker (or router) → TB_RESULTS (tb.done.<tenant>.<id>): a request's end record, done or failed,
    one per request id: the first end is stored (published expecting its subject empty) and any later one
    refused, so a late redelivery neither runs nor records the request again; a gateway that lost chunks
    or the final chunk reads the rest here; replay and export read the log. finish_reason "error"
    carries error_code and error_message."""
    TYPE: typing.ClassVar[str] = "completion"
    id: str
    tenant: str
    worker: str
    sampling: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    finish_reason: str
    stop_reason: int | str | None = None
    usage: dict[str, int] = field(default_factory=dict)
    timing: dict[str, float] = field(default_factory=dict)
    created: float = 0.0
    error_code: str = ""
    error_message: str = ""
    ended: float = 0.0                            # unix time it ended


@dataclass(slots=True)
class Usage:
    """gateway → TB_USAGE (tb.usage.<tenant>): one record per finished request, for metering."""
    TYPE: typing.ClassVar[str] = "usage"
    id: str
    tenant: str
    key_id: str                                   # the API key's id (never the key); "" without keys
    model: str
    api: str                                      # ws | chat | completions
    finish_reason: str                            # stop | length | abort
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    timing: dict[str, float] = field(default_factory=dict)    # the gateway's ttft_ms, e2e_ms; the worker's queue_ms
    created: float = 0.0                          # unix time the gateway accepted the request
    finished: float = 0.0
    revision: str = ""                            # the model's revision that served it
    fallback: bool = False                        # answered by the gateway's fallback upstream (model: its name)


@dataclass(slots=True)
class TenantBucket:
    """gateway → KV bucket tb_limits (key = tenant): a tenant's token bucket shared by every gateway, `level`
    tokens at unix time `ts` (refilled at tokens_per_minute / 60 since), changed only by compare-and-set."""
    TYPE: typing.ClassVar[str] = "tenant_bucket"
    level: float
    ts: float


@dataclass(slots=True)
class Tokens:
    """tokenizer → the asker of tb.tokenize or tb.prepare (request-reply on a GenerateRequest): the prompt's token
    ids as the pipeline runs them (the chat template applied), and the model's context; or the error (code,
    message). tb.prepare also refuses what the pipeline would: a prompt that leaves no room for output, a token
    id outside the vocabulary, a constraint the engine cannot follow."""
    TYPE: typing.ClassVar[str] = "tokens"
    token_ids: list[int]
    max_model_len: int
    code: str = ""
    message: str = ""

    def check(self) -> None:
        check_token_ids("token_ids", self.token_ids, MAX_PROMPT_TOKENS, "MAX_PROMPT_TOKENS", empty=True)
        limit(len(self.message), MAX_TEXT_CHARS, "message", "MAX_TEXT_CHARS", "characters")


Message = (GenerateRequest | TokenizedRequest | WorkItem | TokenChunk | FinalChunk | ErrorChunk | Cancel
           | Heartbeat | KvEvent | KvSnapshot | RouterStats | Completion | Usage | Resend | Progress
           | DeadLetter | Resumed | KvFetch | TenantBucket | Tokens)
TYPES = {cls.TYPE: cls for cls in typing.get_args(Message)}


def check_names(rid: str, tenant: str, salt: str | None, created: float, group: str = "") -> None:
    check_name("request id", rid)
    check_name("tenant", tenant)
    if group:
        check_name("group", group)
    if salt is not None:
        limit(len(salt), MAX_SALT_CHARS, "cache_salt", "MAX_SALT_CHARS", "characters")
    if not math.isfinite(created):
        raise WireError(f"created: must be a finite number (got {created!r})")


def check_model(model: str, revision: str) -> None:
    limit(len(model), MAX_SALT_CHARS, "model", "MAX_SALT_CHARS", "characters")
    limit(len(revision), MAX_SALT_CHARS, "revision", "MAX_SALT_CHARS", "characters")


def encode(msg) -> bytes:
    return msgpack.packb(to_obj(msg))


def decode(data: bytes, *expected: type):
    """The message in data, checked field by field; WireError if it is not one of `expected`."""
    try:
        obj = msgpack.unpackb(data)
    except Exception as e:
        raise WireError(f"not msgpack: {type(e).__name__} {e}".rstrip()) from None
    return from_obj(obj, *expected)


def received(msg, expected: type, log, what: str):
    """The message in a NATS message, or None once "bad <what> dropped" is logged with the subject."""
    try:
        return decode(msg.data, expected)
    except WireError as e:
        log.error(f"bad {what} dropped", error=str(e), subject=msg.subject)
        return None


def from_obj(obj, *expected: type):
    """The message in an unpacked map (msgpack, or JSON lines of an exported log), checked like decode."""
    if not isinstance(obj, dict):
        raise WireError(f"a message is a map, got {type(obj).__name__}")
    if type(obj.get("v")) is not int or obj["v"] != VERSION:
        raise WireError(f"v: version {obj.get('v')!r} is not supported (this build speaks {VERSION})")
    kind = obj.get("t")
    cls = TYPES.get(kind) if isinstance(kind, str) else None
    if cls is None or (expected and cls not in expected):
        want = ", ".join(c.TYPE for c in expected) if expected else ", ".join(TYPES)
        raise WireError(f"t: message type {kind!r} is not one of: {want}")
    msg = build(cls, obj, "")
    if hasattr(msg, "check"):
        msg.check()
    return msg


def to_obj(msg) -> dict:
    """The map encode packs: the type tag, the version and the fields."""
    obj = {"t": msg.TYPE, "v": VERSION}
    obj.update(to_dict(msg))
    return obj

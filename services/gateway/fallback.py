"""The fallback: an OpenAI-compatible upstream (`--fallback-url`) that answers what the cluster cannot take.

A request falls back when admission finds no capacity (its 503s: no worker registered, every worker
busy) or the bus is unreachable (NATS reconnecting, or the request's publish not stored), and its key
may (the keys file's `fallback`). Never once the pipeline accepted it, nor for the client's own
errors or the tenant's limits: a fallback is admitted against the tenant's limits like any request,
settled with the upstream's counts, and metered (its usage record says `fallback`).

The upstream sits behind a circuit breaker: FAILURES consecutive failures (a connect error, a
timeout, a 5xx, a stream cut short) open it; while open nothing is forwarded and the cluster's 503
is the answer; after COOLDOWN seconds the next request goes through as the probe (the others still
get the 503), and its success closes the breaker, its failure opens it again.

The HTTP API relays the upstream's answer as it is (http_relay.py); a websocket generate becomes a streamed chat
completion (messages) or completion (prompt, prompt_token_ids) whose text comes back as delta frames
(Spilled)."""
import asyncio
import time
from dataclasses import dataclass, field

import httpx
import orjson

from schemas.messages import GenerateRequest, Usage
from services.gateway import frames
from services.gateway.errors import ApiError
from services.gateway.keys import Key

FAILURES = 5                     # consecutive failures that open the breaker (--fallback-failures)
COOLDOWN = 30.0                  # seconds an open breaker forwards nothing (--fallback-cooldown)
CONNECT_TIMEOUT = 5.0            # seconds to connect to the upstream
KEY_ENV = "TOKENBUS_FALLBACK_KEY"   # the environment variable with the upstream's key (--fallback-key-env)
PATHS = {"chat": "/chat/completions", "completions": "/completions"}
LOCAL = {"priority", "speculative"}  # this cluster's scheduling, not forwarded
STATES = ("closed", "open", "half_open")
MAX_ERROR_CHARS = 300            # of an upstream's error message, quoted in ours


@dataclass(slots=True)
class Breaker:
    failures: int = FAILURES
    cooldown: float = COOLDOWN
    state: str = "closed"                         # closed | open | half_open (a probe is in flight)
    failed: int = 0                               # consecutive failures
    opened: float = 0.0                           # monotonic time it last opened

    def allow(self, now: float) -> str | None:
        """How a request may go upstream now: "closed", "half_open" (it is the probe), or None (not at all)."""
        if self.state == "closed":
            return "closed"
        if self.state == "open" and now - self.opened >= self.cooldown:
            self.state = "half_open"
            return "half_open"
        return None

    def record(self, via: str, ok: bool, now: float) -> None:
        """The outcome of a request that went through `via`. Only the probe closes an open breaker."""
        if via == "half_open" and self.state == "half_open":
            self.state, self.failed = ("closed", 0) if ok else ("open", self.failed + 1)
            self.opened = self.opened if ok else now
        elif via == "closed" and self.state == "closed":
            self.failed = 0 if ok else self.failed + 1
            if self.failed >= self.failures:
                self.state, self.opened = "open", now

    def release(self, via: str) -> None:
        """A probe that ended with no verdict (its client left first): the next request probes instead."""
        if via == "half_open" and self.state == "half_open":
            self.state = "open"

    def shown(self, now: float) -> str:
        return "half_open" if self.state == "open" and now - self.opened >= self.cooldown else self.state


class Upstream:
    """The fallback's address, key and model, its HTTP client (opened in the gateway's lifespan) and breaker."""

    def __init__(self, url: str, key: str | None, model: str | None, failures: int = FAILURES,
                 cooldown: float = COOLDOWN):
        if not url.startswith(("http://", "https://")) or len(url) < 10:
            raise ValueError(f"--fallback-url {url!r}: expected the upstream's base URL, e.g. http://host:8000/v1")
        if failures < 1 or cooldown < 0:
            raise ValueError(f"--fallback-failures {failures} must be at least 1 and --fallback-cooldown {cooldown:g} "
                             "at least 0")
        self.url, self.key, self.model = url.rstrip("/"), key, model
        self.breaker = Breaker(failures, cooldown)
        self.client: httpx.AsyncClient | None = None

    def open(self, timeout: float) -> None:
        headers = {"authorization": f"Bearer {self.key}"} if self.key else {}
        self.client = httpx.AsyncClient(headers=headers, timeout=httpx.Timeout(timeout, connect=CONNECT_TIMEOUT))

    async def close(self) -> None:
        if self.client is not None:
            await self.client.aclose()

    def body(self, b: dict, model: str, max_tokens: int, stream: bool) -> dict:
        """The request as the upstream gets it: the model's name there, max_tokens explicit (what admission
        charged), the usage asked for on a stream (to meter it), this cluster's scheduling fields left out."""
        out = {k: v for k, v in b.items() if v is not None and k not in LOCAL}
        out["model"] = model
        if "max_completion_tokens" not in out:
            out["max_tokens"] = max_tokens
        if stream:
            out["stream"] = True
            out["stream_options"] = {**(out.get("stream_options") or {}), "include_usage": True}
        return out

    async def send(self, f: "Forward", api: str, body: dict) -> httpx.Response:
        """The upstream's response to a chat or completions request, its status 2xx and its body not read yet;
        ApiError for a refusal or a failure, each recorded in the breaker (a 4xx is an answer: the upstream is up)."""
        request = self.client.build_request("POST", self.url + PATHS[api], json=body)
        try:
            resp = await self.client.send(request, stream=True)
        except httpx.HTTPError as e:
            f.failed()
            raise f.unavailable(f"{type(e).__name__}: {str(e) or 'no answer'}") from None
        if resp.status_code < 300:
            f.answered()
            return resp
        try:
            text = (await resp.aread()).decode(errors="replace")
        except httpx.HTTPError:
            text = ""
        finally:
            await resp.aclose()
        if resp.status_code >= 500:
            f.failed()
            raise f.unavailable(f"HTTP {resp.status_code}: {said(text)}")
        f.answered()
        raise refusal(resp, text, f)


def said(text: str) -> str:
    """An upstream's error message: its OpenAI-shaped error's, or the start of its body."""
    try:
        msg = orjson.loads(text)["error"]["message"]
    except (orjson.JSONDecodeError, KeyError, TypeError):
        msg = text.strip()
    return str(msg)[:MAX_ERROR_CHARS] or "(no body)"


def refusal(resp: httpx.Response, text: str, f: "Forward") -> ApiError:
    """An upstream's 4xx as ours: the client's request refused (its status, the upstream's code), the gateway's key
    refused (502), or the upstream over its own limit (the cluster's 503)."""
    status, msg = resp.status_code, said(text)
    if status in (401, 403):
        f.outcome = "failed"
        return ApiError(502, f"the fallback upstream refused the gateway's key (HTTP {status}: {msg}); see "
                             "--fallback-key-env", "fallback_failed")
    if status == 429:
        f.outcome = "failed"
        return f.unavailable(f"HTTP 429: {msg}")
    try:
        err = orjson.loads(text)["error"]
        code, param = err.get("code"), err.get("param")
    except (orjson.JSONDecodeError, KeyError, TypeError, AttributeError):
        code = param = None
    f.outcome = "refused"
    return ApiError(status, f"the fallback upstream refused the request (HTTP {status}): {msg}",
                    code if isinstance(code, str) else "fallback_refused", param if isinstance(param, str) else None)


@dataclass(slots=True, eq=False)
class Forward:
    """One request answered by the upstream: its admission ticket, its counts as the upstream's chunks give them,
    and how it ended (settled, metered, logged and counted once, in end())."""
    gw: object                                    # the Gateway
    key: Key
    ticket: object                                # its admission Ticket
    rid: str
    api: str                                      # ws | chat | completions
    cause: ApiError                               # the cluster's refusal that sent it here
    via: str                                      # how the breaker let it through
    t0: float                                     # perf_counter when it arrived
    estimate: int                                 # prompt tokens admission estimated
    model: str                                    # its name at the upstream
    created: float = field(default_factory=time.time)
    usage: dict | None = None                     # the upstream's usage object
    chunks: int = 0                               # chunks with text: the completion tokens when no usage comes
    finish_reason: str | None = None
    ttft: float | None = None
    upstream_id: str = ""
    outcome: str = ""                             # ok | failed | refused | aborted
    ended: bool = False

    @property
    def upstream(self) -> Upstream:
        return self.gw.upstream

    def answered(self) -> None:
        self.upstream.breaker.record(self.via, True, time.monotonic())

    def failed(self) -> None:
        self.outcome = "failed"
        self.upstream.breaker.record(self.via, False, time.monotonic())

    def unavailable(self, why: str) -> ApiError:
        """The cluster's 503, saying that the fallback failed too."""
        c = self.cause
        return ApiError(c.status, f"{c.message}; the fallback upstream failed too: {why}", c.code, c.param,
                        c.retry_after)

    def take(self, obj: dict) -> None:
        """Counts a chunk (or the whole answer) of the upstream."""
        self.upstream_id = self.upstream_id or str(obj.get("id", ""))
        if isinstance(obj.get("usage"), dict):
            self.usage = obj["usage"]
        for c in obj.get("choices") or ():
            if not isinstance(c, dict):
                continue
            text = c.get("text") if "text" in c else (c.get("delta") or c.get("message") or {}).get("content")
            if text:
                self.chunks += 1
                self.ttft = self.ttft if self.ttft is not None else time.perf_counter() - self.t0
            self.finish_reason = c.get("finish_reason") or self.finish_reason

    def counts(self) -> tuple[int, int, int]:
        """(prompt, cached, completion) tokens: the upstream's usage, else the estimate and one token a chunk."""
        u = self.usage or {}
        prompt, completion = u.get("prompt_tokens"), u.get("completion_tokens")
        cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        if not all(type(v) is int and v >= 0 for v in (prompt, completion, cached)):
            return self.estimate, 0, self.chunks
        return prompt, cached, completion

    def end(self, outcome: str | None = None, reason: str | None = None) -> None:
        """Settles the tenant's limits with the counts, meters what ran and logs it; once."""
        if self.ended:
            return
        self.ended = True
        self.outcome = outcome or self.outcome or "ok"
        gw, now = self.gw, time.perf_counter()
        self.upstream.breaker.release(self.via)
        prompt, cached, completion = self.counts()
        ran = self.outcome == "ok" or self.chunks > 0 or self.usage is not None    # the upstream ran it
        metered = self.outcome == "ok" or (self.outcome == "aborted" and ran)     # as the pipeline's: no errors
        gw.admission.settle(self.ticket, prompt + completion if ran else 0)
        gw.metrics.fallback(self.key.tenant, self.outcome)
        reason = "abort" if self.outcome == "aborted" else reason or self.finish_reason or "stop"
        timing = {"ttft_ms": ms(self.ttft), "e2e_ms": ms(now - self.t0)}
        model = self.model
        gw.log.info("request served by fallback" if metered else "fallback failed", request_id=self.rid,
                    tenant=self.key.tenant, key_id=self.key.id, upstream=self.upstream.url, model=model,
                    upstream_id=self.upstream_id, cause=self.cause.code, outcome=self.outcome,
                    finish_reason=reason if metered else None, prompt_tokens=prompt if ran else 0,
                    completion_tokens=completion, **timing)
        if metered:
            gw.spawn(gw.meter(Usage(self.rid, self.key.tenant, self.key.id, model, self.api, reason, prompt, cached,
                                    completion, {k: v for k, v in timing.items() if v is not None}, self.created,
                                    time.time(), fallback=True)))


def ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 3)


class Spilled:
    """A websocket generate the upstream answers: its text as delta frames (`token_ids` empty: the upstream's
    tokens are not this model's), then a done frame with the upstream's usage and `"fallback": true`, or an
    error frame. A cancel or the connection's end stops it (a fallback stream cannot be resumed)."""
    resumable = False

    def __init__(self, conn, cid: str, f: Forward, frame: dict, req: GenerateRequest):
        self.conn, self.cid, self.f, self.frame, self.req = conn, cid, f, frame, req
        self.task: asyncio.Task | None = None

    def start(self) -> None:
        self.conn.inflight[self.cid] = self
        self.task = asyncio.get_running_loop().create_task(self.run())

    async def run(self) -> None:
        try:
            frame = await self.relay()
        except ApiError as e:
            frame = e.frame(self.cid)
            if e.status >= 500:                   # the websocket's codes have none for the upstream's failure
                frame["code"] = e.code or "unavailable"
        self.f.end()
        if self.conn.inflight.get(self.cid) is self:
            del self.conn.inflight[self.cid]
            await self.conn.send(frame)

    async def relay(self) -> dict:
        f, up = self.f, self.f.upstream
        api = "chat" if self.req.messages is not None else "completions"
        b = {k: v for k, v in self.frame.items() if k in frames.SAMPLING or k in frames.PROMPTS}
        if "prompt_token_ids" in b:
            b["prompt"] = b.pop("prompt_token_ids")
        resp = await up.send(f, api, up.body(b, f.model, self.req.sampling.max_tokens, True))
        done = False
        try:
            async with asyncio.timeout(f.gw.request_timeout - (time.perf_counter() - f.t0)):
                async for line in resp.aiter_lines():
                    data = line[5:].strip() if line.startswith("data:") else ""
                    if data == "[DONE]":
                        done = True
                        break
                    obj = orjson.loads(data) if data.startswith("{") else {}
                    if "error" in obj:
                        raise httpx.StreamError(said(data))
                    await self.deltas(obj)
        except (httpx.HTTPError, TimeoutError, orjson.JSONDecodeError) as e:
            f.failed()
            why = f"{type(e).__name__}: {e}" if not isinstance(e, TimeoutError) else (
                f"the request did not finish within --request-timeout={f.gw.request_timeout:g} s")
            raise ApiError(502, f"the fallback upstream's stream broke: {why}", "fallback_failed") from None
        finally:
            await resp.aclose()
        if not done:
            f.failed()
            raise ApiError(502, "the fallback upstream's stream broke: it ended before [DONE]", "fallback_failed")
        return self.done(f.finish_reason or "stop")

    async def deltas(self, obj: dict) -> None:
        before = self.f.chunks
        self.f.take(obj)
        if self.f.chunks == before:
            return
        c = obj["choices"][0]
        text = c.get("text") if "text" in c else c["delta"]["content"]
        await self.conn.send({"type": "delta", "id": self.cid, "text": text, "token_ids": []})

    def done(self, reason: str) -> dict:
        prompt, _, completion = self.f.counts()
        return {"type": "done", "id": self.cid, "finish_reason": reason,
                "usage": {"prompt_tokens": prompt, "completion_tokens": completion},
                "timing": {"ttft_ms": ms(self.f.ttft), "e2e_ms": ms(time.perf_counter() - self.f.t0)},
                "fallback": True}

    async def abort(self) -> None:
        """A cancel, or the connection's end: the upstream's stream is closed, what came is metered."""
        self.conn.inflight.pop(self.cid, None)
        if self.task is not None:
            self.task.cancel()
        self.f.end("aborted")

"""The load clients of the gateway's two protocols, each with many requests in flight: WsClient over a
few websockets (ws://…/ws), HttpClient over OpenAI's streamed chat or text completions
(http://…/v1/…, server-sent events). Each request's timings come back as a Result."""
import asyncio
import itertools
import time
import urllib.parse
import urllib.request

import orjson
import websockets

from lab.common.results import Result


class WsClient:
    """Requests over a few websockets, each carrying many at once; one reader per connection."""

    def __init__(self, url: str, connections: int, api_key: str | None, options: dict):
        self.url, self.n, self.options = url, connections, options
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
        self.conns: list[websockets.ClientConnection] = []
        self.pending: list[dict[str, tuple[Result, asyncio.Future]]] = []
        self.readers: list[asyncio.Task] = []
        self.ids = itertools.count()

    async def open(self) -> None:
        for i in range(self.n):
            try:
                ws = await websockets.connect(self.url, max_size=None, compression=None,
                                              additional_headers=self.headers)
            except (OSError, websockets.InvalidHandshake) as e:
                raise ValueError(f"{self.url}: {e}") from None
            self.conns.append(ws)
            self.pending.append({})
            self.readers.append(asyncio.create_task(self.read(i)))

    async def close(self) -> None:
        for ws in self.conns:
            await ws.close()
        for t in self.readers:
            t.cancel()

    async def request(self, messages: list[dict], max_tokens: int) -> Result:
        return await self.send({"messages": messages, "max_tokens": max_tokens})

    async def send(self, fields: dict) -> Result:
        """One generate frame of `fields` (a prompt and max_tokens) and the options; its Result."""
        i = min(range(self.n), key=lambda k: len(self.pending[k]))
        rid = str(next(self.ids))
        frame = {"type": "generate", "id": rid, **fields, **self.options}
        r, done = Result(time.perf_counter()), asyncio.get_running_loop().create_future()
        self.pending[i][rid] = (r, done)
        await self.conns[i].send(orjson.dumps(frame).decode())
        try:
            return await done
        except asyncio.CancelledError:           # the bench's timeout: stop it in the gateway too
            if self.pending[i].pop(rid, None):
                await self.conns[i].send(orjson.dumps({"type": "cancel", "id": rid}).decode())
            raise

    async def read(self, i: int) -> None:
        pending = self.pending[i]
        try:
            async for raw in self.conns[i]:
                t = time.perf_counter()
                f = orjson.loads(raw)
                if f["id"] not in pending:
                    continue
                r = pending[f["id"]][0]
                kind = f["type"]
                if kind == "delta":
                    if f["token_ids"]:
                        r.chunks.append(t)
                    r.parts.append(f["text"])
                    continue
                if kind == "done":
                    r.prompt_tokens, r.output_tokens = f["usage"]["prompt_tokens"], f["usage"]["completion_tokens"]
                else:
                    r.error = f.get("code") or "error"
                r.end = t
                pending.pop(f["id"])[1].set_result(r)   # (a timed-out request was popped already)
        except websockets.ConnectionClosed:
            pass
        for r, done in pending.values():          # the connection went away under them
            r.error, r.end = "connection_closed", time.perf_counter()
            done.set_result(r)
        pending.clear()


class HttpClient:
    """OpenAI chat completions (or, with endpoint="/completions", text completions) streamed as
    server-sent events, on plain asyncio streams (HTTP/1.1, keep-alive connections reused): a few µs
    of parsing per chunk."""

    def __init__(self, url: str, model: str | None, api_key: str | None, options: dict,
                 endpoint: str = "/chat/completions"):
        u = urllib.parse.urlsplit(url)
        self.base, self.api_key = f"{u.scheme}://{u.netloc}", api_key
        self.tls = u.scheme == "https"
        self.host, self.port = u.hostname, u.port or (443 if self.tls else 80)
        self.path = u.path if u.path.endswith(endpoint) else u.path.rstrip("/") + "/v1" + endpoint
        self.head = (f"POST {self.path} HTTP/1.1\r\nHost: {u.netloc}\r\nContent-Type: application/json\r\n"
                     f"Accept: text/event-stream\r\n" + (f"Authorization: Bearer {api_key}\r\n" if api_key else ""))
        self.model, self.options = model, options
        self.idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def open(self) -> None:
        if self.model is None:                   # the one the gateway serves
            self.model = await asyncio.to_thread(served_model, self.base, self.api_key)

    async def close(self) -> None:
        for _, w in self.idle:
            w.close()

    async def request(self, messages: list[dict], max_tokens: int) -> Result:
        return await self.send({"messages": messages, "max_tokens": max_tokens})

    async def send(self, fields: dict) -> Result:
        """One streamed request of `fields` (a prompt and max_tokens) and the options; its Result."""
        body = orjson.dumps({"model": self.model, **fields, "stream": True,
                             "stream_options": {"include_usage": True}, **self.options})
        head = f"{self.head}Content-Length: {len(body)}\r\n\r\n".encode()
        r = Result(time.perf_counter())
        conn = None
        try:
            for reused in (bool(self.idle), False):  # a kept-alive connection the server closed: once more
                conn = self.idle.pop() if reused else await asyncio.open_connection(self.host, self.port, ssl=self.tls)
                conn[1].write(head + body)
                status = await conn[0].readline()
                if status or not reused:
                    break
                conn[1].close()
            if await self.exchange(conn[0], status, r):
                self.idle.append(conn)
                conn = None
        except (OSError, asyncio.IncompleteReadError, ValueError, IndexError) as e:
            r.error, r.end = "connection_error" if isinstance(e, OSError) else "bad_response", time.perf_counter()
        finally:
            if conn is not None:                 # broken, not kept alive, or cancelled by the bench's timeout
                conn[1].close()
        return r

    async def exchange(self, reader: asyncio.StreamReader, status_line: bytes, r: Result) -> bool:
        """Reads one response into r; True when the connection can carry the next request."""
        status = int(status_line.split()[1])
        headers = {}
        while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
            k, _, v = line.decode("latin-1").partition(":")
            headers[k.strip().lower()] = v.strip().lower()
        events = SseEvents(r)
        async for data in body(reader, headers):
            if status == 200:
                events.feed(data, time.perf_counter())
            else:
                events.buf += data
        r.end = time.perf_counter()
        if status != 200:
            r.error = error_code(events.buf, status)
        elif not events.finished and r.error is None:
            r.error = "incomplete_stream"
        if r.output_tokens == 0:                  # no usage chunk: count the chunks
            r.output_tokens = len(r.chunks)
        return headers.get("connection") != "close"


def served_model(base: str, api_key: str | None) -> str:
    """The first model GET /v1/models lists."""
    req = urllib.request.Request(f"{base}/v1/models", headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return orjson.loads(r.read())["data"][0]["id"]
    except (OSError, ValueError, KeyError, IndexError) as e:
        raise ValueError(f"{base}/v1/models did not name a model ({e}); give --served-model") from None


async def body(reader: asyncio.StreamReader, headers: dict):
    """The response body's pieces as they arrive: chunked, by length, or up to the connection's end."""
    if headers.get("transfer-encoding") == "chunked":
        while (size := int((await reader.readline()).split(b";")[0], 16)) > 0:
            yield (await reader.readexactly(size + 2))[:-2]
        while (await reader.readline()) not in (b"\r\n", b"\n", b""):   # trailers
            pass
    elif "content-length" in headers:
        yield await reader.readexactly(int(headers["content-length"]))
    else:
        while data := await reader.read(65536):
            yield data


class SseEvents:
    """`data: {...}` events of an OpenAI stream into a Result; `data: [DONE]` ends it."""

    def __init__(self, r: Result):
        self.r, self.buf, self.finished = r, b"", False

    def feed(self, data: bytes, t: float) -> None:
        self.buf += data.replace(b"\r\n", b"\n")
        *events, self.buf = self.buf.split(b"\n\n")
        for event in events:
            for line in event.split(b"\n"):
                if line.startswith(b"data:"):
                    self.data(line[5:].strip(), t)

    def data(self, payload: bytes, t: float) -> None:
        if payload == b"[DONE]":
            self.finished = True
            return
        obj = orjson.loads(payload)
        r = self.r
        if "error" in obj:
            r.error = error_code(payload, 200)
            return
        for choice in obj.get("choices") or ():
            text = (choice.get("delta") or {}).get("content") or choice.get("text")   # chat or text completions
            if text:
                r.chunks.append(t)
                r.parts.append(text)
        usage = obj.get("usage")
        if usage:
            r.prompt_tokens, r.output_tokens = usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0)


def error_code(raw: bytes, status: int) -> str:
    """The error's code from an OpenAI error body ({"error": {"code"|"type": …}}), else http_<status>."""
    try:
        err = orjson.loads(raw)["error"]
        return str(err.get("code") or err.get("type") or f"http_{status}")
    except Exception:
        return f"http_{status}"

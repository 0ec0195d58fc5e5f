"""`tokenbus chat`: a terminal chat over the gateway's websocket. Each turn sends the whole history,
streams the reply as it arrives and ends with a stats line. A dropped connection (a gateway crash, a
network blip) is opened again, on the next of the gateways given, with backoff, and the reply in
progress resumes from the tokens already printed. A turn sets only the sampling fields the user gave; the
rest are the served model's defaults, which the first line shows."""
import asyncio
import contextlib
import os
import sys
import threading
import urllib.parse
import urllib.request
from pathlib import Path

import orjson
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidURI

from schemas import generation
from schemas.subjects import MAX_FRAME_BYTES

HELP = "/reset clears the history, /quit or Ctrl-D exits"
BACKOFF = (0.1, 0.25, 0.5, 1.0, 2.0, 4.0)        # seconds before each attempt to reconnect after a drop
MODELS_TIMEOUT = 5.0                              # seconds GET /v1/models has to say the model's defaults


class Link:
    """The connection to one of the gateways; after a drop, the next ones in turn, with BACKOFF."""

    def __init__(self, urls: list[str], headers: dict | None):
        self.urls, self.headers, self.at, self.ws = urls, headers, 0, None

    async def open(self) -> None:
        """Connects to the current gateway, else to the others in turn; the last one's error if none answers."""
        for i in range(len(self.urls)):
            at = (self.at + i) % len(self.urls)
            try:
                self.ws = await connect(self.urls[at], max_size=MAX_FRAME_BYTES, additional_headers=self.headers)
                self.at = at
                return
            except (OSError, InvalidHandshake, TimeoutError) as e:
                error = e
        raise error

    async def reopen(self) -> None:
        """After a drop: the next gateway, and the others, again after each pause of BACKOFF."""
        for wait in BACKOFF:
            await asyncio.sleep(wait)
            self.at = (self.at + 1) % len(self.urls)
            with contextlib.suppress(OSError, InvalidHandshake, TimeoutError):
                await self.open()
                return
        await self.open()                         # a last try; its error ends the chat

    async def send(self, frame: dict) -> None:
        try:
            await self.ws.send(orjson.dumps(frame).decode())
        except ConnectionClosed:                  # dropped while the user was typing: the next gateway
            await self.reopen()
            await self.ws.send(orjson.dumps(frame).decode())

    async def close(self) -> None:
        if self.ws is not None:
            await self.ws.close()


async def chat(url: str | list[str], max_tokens: int = 256, temperature: float | None = None,
               system: str | None = None, input_fn=input, output=sys.stdout, api_key: str | None = None,
               tools: list[dict] | None = None, tool_choice: str | None = None, sampling: dict | None = None,
               n: int = 1) -> None:
    """A chat until /quit or EOF. `temperature` and `sampling` (the other fields of generation.FIELDS by name) are
    set in every turn unless None; a field left unset is the served model's default, which the first line shows.
    `n` > 1: each turn asks for n choices, shows them all and keeps the first in the history (such a turn has no
    resume point)."""
    history: list[dict] = []
    head = [{"role": "system", "content": system}] if system else []
    auth = {"Authorization": f"Bearer {api_key}"} if api_key else None
    link = Link([url] if isinstance(url, str) else list(url), auth)
    fields = {k: v for k, v in {"temperature": temperature, **(sampling or {})}.items() if v is not None}
    await link.open()
    try:
        defaults = await asyncio.to_thread(model_defaults, link.urls[link.at], auth)
        print(f"[connected to {link.urls[link.at]}{defaults} · {HELP}]", file=output)
        turn = 0
        while True:
            try:
                line = (await read_line(input_fn, "you> ")).strip()
            except EOFError:
                print(file=output)
                return
            if line == "/quit":
                return
            if line == "/reset":
                history.clear()
                print("[history cleared]", file=output)
                continue
            if not line:
                continue
            turn += 1
            history.append({"role": "user", "content": line})
            frame = {"type": "generate", "id": f"t{turn}", "messages": head + history, "max_tokens": max_tokens,
                     **fields, **({"n": n} if n > 1 else {"resumable": True}), **tooling(tools, tool_choice)}
            reply = await stream(link, frame, output)
            if reply is None:
                history.pop()                     # the turn failed: ask again without it
            else:
                history.append(reply)
    finally:
        await link.close()


def model_defaults(ws_url: str, headers: dict | None) -> str:
    """` · model defaults temperature 0.2, top_p 0.9, ...`: the sampling defaults of the gateway's default model,
    from GET /v1/models beside its websocket; empty when it does not say (an older gateway, no HTTP API there)."""
    u = urllib.parse.urlsplit(ws_url)
    url = urllib.parse.urlunsplit(("https" if u.scheme == "wss" else "http", u.netloc, "/v1/models", "", ""))
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=MODELS_TIMEOUT) as r:
            defaults = orjson.loads(r.read())["data"][0]["sampling_defaults"]
    except (OSError, ValueError, KeyError, IndexError, TypeError):
        return ""
    return f" · model defaults {generation.shown(defaults)}"


async def read_line(input_fn, prompt: str) -> str:
    """input_fn(prompt) on a daemon thread: unlike asyncio.to_thread, a thread still blocked in input()
    does not keep Ctrl-C from ending the program."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()

    def read():
        try:
            result, error = input_fn(prompt), None
        except BaseException as e:               # EOFError above all; handed to the awaiting task
            result, error = None, e
        loop.call_soon_threadsafe(settle, done, result, error)

    threading.Thread(target=read, daemon=True).start()
    return await done


def settle(future: asyncio.Future, result, error) -> None:
    if future.done():                             # the chat was cancelled meanwhile
        return
    if error is None:
        future.set_result(result)
    else:
        future.set_exception(error)


async def stream(link: Link, frame: dict, output) -> dict | None:
    """Prints a reply as its deltas arrive (a tool call as `[tool call NAME ARGUMENTS]`), then its stats; the
    reply as an assistant message, or None after an error frame. A dropped connection resumes the reply on the
    next gateway from the tokens received (a reply not yet accepted is asked for again). A frame of n > 1 choices:
    the first streams, the others' text follows it once every choice has ended, each with its stats."""
    cid, parts, received, resume_id, resumed = frame["id"], [], 0, None, 0
    calls: list[dict] = []
    others: dict[int, list[str]] = {}             # choice index -> its text (n > 1: shown after the first)
    ends: dict[int, dict] = {}
    await link.send(frame)
    while True:
        try:
            f = orjson.loads(await link.ws.recv())
        except ConnectionClosed:
            await link.reopen()
            resumed += 1
            if resume_id is None:
                await link.send(frame)
            else:
                cid = resume_id                   # the resumed stream's frames carry the id it was resumed by
                await link.send({"type": "resume", "id": resume_id, "offset": received})
            continue
        if f["type"] == "accepted" and f["id"] == cid:
            resume_id = f["resume_id"]
        elif f["type"] == "delta" and f["id"] == cid and f.get("index", 0):
            others.setdefault(f["index"], []).append(f["text"])
        elif f["type"] == "delta" and f["id"] == cid:
            parts.append(f["text"])
            received += len(f["token_ids"])
            output.write(f["text"] + "".join(shown(calls, p) for p in f.get("tool_calls", ())))
            output.flush()
        elif f["type"] == "done" and f["id"] == cid:
            ends[f.get("index", 0)] = f
            if f.get("index", 0) == 0:
                print(f"{']' if calls else ''}\n{stats(f, resumed)}", file=output, flush=True)
            if len(ends) < frame.get("n", 1):
                continue
            for i in range(1, len(ends)):
                print(f"[choice {i}] {''.join(others.get(i, ()))}\n{stats(ends[i])}", file=output, flush=True)
            return {"role": "assistant", "content": "".join(parts), **({"tool_calls": calls} if calls else {})}
        elif f["type"] == "error" and f["id"] in (cid, None):
            end = "\n" if parts else ""
            print(f"{end}[error {f['code']}: {f['message']}]", file=output, flush=True)
            return None


def tooling(tools: list[dict] | None, choice: str | None) -> dict:
    """A generate frame's tools and tool_choice (auto, none, required, or a function's name)."""
    if not tools:
        return {}
    if choice in (None, "auto", "none", "required"):
        return {"tools": tools, **({"tool_choice": choice} if choice else {})}
    return {"tools": tools, "tool_choice": {"type": "function", "function": {"name": choice}}}


def shown(calls: list[dict], piece: dict) -> str:
    """A tool call's piece as printed (and kept in `calls`, OpenAI's objects): its name opens it, the
    arguments follow as they come, the next call closes it."""
    fn = piece.get("function", {})
    if piece.get("id") is not None:
        calls.append({"id": piece["id"], "type": "function", "function": {"name": fn.get("name", ""),
                                                                          "arguments": fn.get("arguments", "")}})
        return f"{']' if len(calls) > 1 else ''}\n[tool call {fn.get('name', '')} {fn.get('arguments', '')}"
    calls[-1]["function"]["arguments"] += fn.get("arguments", "")
    return fn.get("arguments", "")


def stats(done: dict, resumed: int = 0) -> str:
    n, ttft, e2e = done["usage"]["completion_tokens"], done["timing"]["ttft_ms"], done["timing"]["e2e_ms"]
    first = "-" if ttft is None else f"{ttft:.1f} ms"
    note = f" · resumed {resumed}×" if resumed else ""
    return f"[ttft {first} · {rate(n, ttft, e2e):.1f} tok/s · {n} tokens · finish {done['finish_reason']}{note}]"


def rate(n: int, ttft_ms: float | None, e2e_ms: float) -> float:
    """Decode speed: the tokens after the first over the time after the first (all over e2e for one token)."""
    if n > 1 and ttft_ms is not None and e2e_ms > ttft_ms:
        return (n - 1) * 1000 / (e2e_ms - ttft_ms)
    return n * 1000 / e2e_ms if e2e_ms > 0 else 0.0


def run(url: str | list[str], **kw) -> int:
    """chat() until /quit, EOF or Ctrl-C; the exit status (1 when no gateway can be reached, or none comes
    back after a drop)."""
    try:
        asyncio.run(chat(url, **kw))
    except KeyboardInterrupt:
        print(file=kw.get("output", sys.stdout))
        return 130
    except (OSError, InvalidURI, InvalidHandshake, ConnectionClosed, TimeoutError) as e:
        print(f"chat: {url if isinstance(url, str) else ' '.join(url)}: {e}", file=sys.stderr)
        return 1
    return 0


def register(sub) -> None:
    c = sub.add_parser("chat", help="a terminal chat client over the websocket protocol")
    c.add_argument("--url", action="append", metavar="URL",
                   help="the gateway's websocket (default ws://127.0.0.1:8000/ws); given again, more gateways: a "
                        "dropped connection resumes its answer on the next")
    c.add_argument("--max-tokens", type=int, default=256, help="tokens of each reply at most")
    c.add_argument("--temperature", type=float, help="sampling temperature, 0: greedy (default: the model's)")
    for name in generation.FIELDS[1:]:
        c.add_argument(f"--{name.replace('_', '-')}", type=int if name == "top_k" else float,
                       help=f"{name} (default: the model's)")
    c.add_argument("--n", type=int, default=1, help="choices of each reply, all shown; the first is kept in the "
                                                     "history")
    c.add_argument("--system", help="a system message that starts every conversation")
    c.add_argument("--api-key", default=os.environ.get("TOKENBUS_API_KEY"),
                   help="the gateway's API key, if it has keys (default: $TOKENBUS_API_KEY)")
    c.add_argument("--tools", metavar="FILE", help="a JSON array of OpenAI function tools the model may call "
                                                   "(calls are shown, not run)")
    c.add_argument("--tool-choice", metavar="CHOICE", help="with --tools: auto (default), none, required, or the "
                                                           "name of the function to call")
    c.set_defaults(func=main)


def main(args) -> None:
    try:
        tools = orjson.loads(Path(args.tools).read_bytes()) if args.tools else None
    except (OSError, orjson.JSONDecodeError) as e:
        sys.exit(f"chat: --tools {args.tools}: {e}")
    sys.exit(run(args.url or ["ws://127.0.0.1:8000/ws"], max_tokens=args.max_tokens, temperature=args.temperature,
                 system=args.system, api_key=args.api_key, tools=tools, tool_choice=args.tool_choice,
                 sampling={name: getattr(args, name) for name in generation.FIELDS[1:]}, n=args.n))

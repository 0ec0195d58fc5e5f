"""`tokenbus chat`: a terminal chat over the gateway's websocket. Each turn sends the whole history,
streams the reply as it arrives and ends with a stats line."""
import asyncio
import sys
import threading

import orjson
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidURI

from schemas.subjects import MAX_FRAME_BYTES

HELP = "/reset clears the history, /quit or Ctrl-D exits"


async def chat(url: str, max_tokens: int = 256, temperature: float = 0.7, system: str | None = None,
               input_fn=input, output=sys.stdout, api_key: str | None = None) -> None:
    history: list[dict[str, str]] = []
    head = [{"role": "system", "content": system}] if system else []
    auth = {"Authorization": f"Bearer {api_key}"} if api_key else None
    async with connect(url, max_size=MAX_FRAME_BYTES, additional_headers=auth) as ws:
        print(f"[connected to {url} · {HELP}]", file=output)
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
                     "temperature": temperature}
            await ws.send(orjson.dumps(frame).decode())
            reply = await stream(ws, frame["id"], output)
            if reply is None:
                history.pop()                     # the turn failed: ask again without it
            else:
                history.append({"role": "assistant", "content": reply})


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


async def stream(ws, cid: str, output) -> str | None:
    """Prints a reply as its deltas arrive, then its stats; the reply's text, or None after an error frame."""
    parts = []
    while True:
        f = orjson.loads(await ws.recv())
        if f["type"] == "delta" and f["id"] == cid:
            parts.append(f["text"])
            output.write(f["text"])
            output.flush()
        elif f["type"] == "done" and f["id"] == cid:
            print(f"\n{stats(f)}", file=output, flush=True)
            return "".join(parts)
        elif f["type"] == "error" and f["id"] in (cid, None):
            end = "\n" if parts else ""
            print(f"{end}[error {f['code']}: {f['message']}]", file=output, flush=True)
            return None


def stats(done: dict) -> str:
    n, ttft, e2e = done["usage"]["completion_tokens"], done["timing"]["ttft_ms"], done["timing"]["e2e_ms"]
    first = "-" if ttft is None else f"{ttft:.1f} ms"
    return f"[ttft {first} · {rate(n, ttft, e2e):.1f} tok/s · {n} tokens · finish {done['finish_reason']}]"


def rate(n: int, ttft_ms: float | None, e2e_ms: float) -> float:
    """Decode speed: the tokens after the first over the time after the first (all over e2e for one token)."""
    if n > 1 and ttft_ms is not None and e2e_ms > ttft_ms:
        return (n - 1) * 1000 / (e2e_ms - ttft_ms)
    return n * 1000 / e2e_ms if e2e_ms > 0 else 0.0


def run(url: str, **kw) -> int:
    """chat() until /quit, EOF or Ctrl-C; the exit status (1 when the gateway cannot be reached or drops us)."""
    try:
        asyncio.run(chat(url, **kw))
    except KeyboardInterrupt:
        print(file=kw.get("output", sys.stdout))
        return 130
    except (OSError, InvalidURI, InvalidHandshake, ConnectionClosed) as e:
        print(f"chat: {url}: {e}", file=sys.stderr)
        return 1
    return 0

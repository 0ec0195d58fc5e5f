"""An HTTP request of several choices: `n` > 1 (choice i of a prompt sampled with the seed after the first's, i
times), a list of prompts on /v1/completions (each its own request, choice index prompt × n + sample), and `echo`
(each choice's text starts with its prompt). Every choice is a request of its own through the pipeline (admitted,
logged, routed and metered on its own), all owned by one Exchange; the answer gathers them by index. The usage
counts each prompt once and every choice's tokens. Streams of several choices carry no resume points."""
import orjson
from starlette.responses import Response

from services.gateway import errors, tools
from services.gateway.http_answer import (
    EventStream,
    answer,
    choice,
    chunk,
    delta_choice,
    event,
    json,
    logprobs,
    usage_so_far,
)
from services.gateway.http_parse import Call
from services.gateway.owners import Exchange
from services.gateway.session import Gateway
from services.gateway.stream import Request


async def start(ex: Exchange, call: Call, gw: Gateway, key, priority: int | None, t0: float) -> list[Request]:
    """Every choice admitted and started (cid: its index); the ones started are aborted if one is refused."""
    started = []
    try:
        for i, req in enumerate(call.choices):
            ticket = await gw.admit(key, req, priority)
            started.append(await gw.start(ex, str(i), req, ticket, call.api, t0, call.stream))
    except BaseException:
        for r in started:
            await r.abort()
        raise
    return started


def usage(call: Call, rs: list[Request]) -> dict:
    """Each prompt's tokens once (the first of its n choices), every choice's output tokens."""
    firsts = rs[::call.n]
    prompt = sum(r.prompt_tokens for r in firsts)
    completion = sum(r.received for r in rs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(r.cached_tokens for r in firsts)}}


def prompt_text(call: Call, r: Request, i: int) -> str:
    req = call.choices[i]
    return req.prompt if req.prompt is not None else r.tokenizer.decode(req.prompt_token_ids, skip_special_tokens=False)


def whole(call: Call, rs: list[Request], got: dict[int, list[dict]]) -> Response:
    """The non-streaming answer: choices by index (or the first error, as its status)."""
    failed = next((fs[-1] for fs in got.values() if fs[-1]["type"] == "error"), None)
    if failed is not None:
        return errors.from_pipeline(failed["code"], failed["message"]).response()
    choices = [choice(call, r, i, got[i], prompt_text(call, r, i) if call.echo else "") for i, r in enumerate(rs)]
    return json(answer(call, choices, usage(call, rs)))


async def gather(ex: Exchange, n: int, got: dict[int, list[dict]] | None = None) -> dict[int, list[dict]]:
    """Every choice's frames, until each has its done or error frame."""
    got = got if got is not None else {i: [] for i in range(n)}
    ended = {i for i, fs in got.items() if fs and fs[-1]["type"] in ("done", "error")}
    while len(ended) < n:
        f = await ex.frames.get()
        i = int(f["id"] or 0)
        got[i].append(f)
        if f["type"] in ("done", "error"):
            ended.add(i)
    return got


def stream(ex: Exchange, call: Call, rs: list[Request], first: list[dict]) -> EventStream:
    return EventStream(events(ex, call, rs, first), ex)


async def events(ex: Exchange, call: Call, rs: list[Request], first: list[dict]):
    """Each choice's chunks with its index as its frames come; the finish chunks, the usage, then [DONE]."""
    streams = [tools.ToolStream(call.tools) if call.tools is not None else None for _ in rs]
    offsets, ended = [0] * len(rs), set()
    opening = []
    for i, r in enumerate(rs):
        if call.api == "chat":
            opening.append(indexed(delta_choice(call, "", role=True), i))
        elif call.echo:
            opening.append(indexed(delta_choice(call, prompt_text(call, r, i)), i))
    so_far = usage_so_far(rs[0], 0) if call.continuous_usage else None
    out = [event(chunk(call, [c], so_far), b"") for c in opening]             # one choice per chunk, as OpenAI's
    pending = list(first)
    while True:
        for f in pending:
            i = int(f["id"] or 0)
            if f["type"] == "error":
                yield b"".join([*out, event(orjson.dumps(errors.from_pipeline(f["code"], f["message"]).body()), b"")])
                return
            offsets[i] += len(f.get("token_ids", ()))
            out += [event(data, b"") for data in chunks(call, rs[i], f, i, streams[i])]
            if f["type"] == "done":
                ended.add(i)
        if len(ended) == len(rs):
            if call.include_usage:
                out.append(event(chunk(call, [], usage(call, rs)), b""))
            yield b"".join([*out, event(b"[DONE]", b"")])
            return
        yield b"".join(out)
        out, pending = [], [await ex.frames.get()]
        while not ex.frames.empty():
            pending.append(ex.frames.get_nowait())


def chunks(call: Call, r: Request, f: dict, i: int, ts: tools.ToolStream | None) -> list[bytes]:
    """The chunks of one frame of choice i."""
    if f["type"] == "delta":
        lp = logprobs(call, [f], r.tokenizer) if call.logprobs else None
        if ts is not None:
            return [chunk(call, [{"index": i, "delta": d, "logprobs": lp, "finish_reason": None}])
                    for d in ts.feed(f["text"])]
        return [chunk(call, [indexed(delta_choice(call, f["text"], lp), i)])]
    out = [] if ts is None else [chunk(call, [{"index": i, "delta": d, "logprobs": None, "finish_reason": None}])
                                 for d in ts.finish()]
    finish = "tool_calls" if ts is not None and ts.called and f["finish_reason"] == "stop" else f["finish_reason"]
    return [*out, chunk(call, [indexed(delta_choice(call, "", None, finish), i)])]


def indexed(choice: dict, i: int) -> dict:
    return {**choice, "index": i}

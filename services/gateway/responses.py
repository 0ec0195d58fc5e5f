"""OpenAI's Responses API: POST /v1/responses, GET and DELETE /v1/responses/{id}.

A response is a chat completion underneath: its `instructions`, the stored conversation of its
`previous_response_id`, and its `input` (a string, or message, function_call and function_call_output items)
become chat messages; function `tools`, `tool_choice`, `text.format` and `max_output_tokens` become the chat's
tools, tool_choice, response_format and max_tokens, checked by the same parser (http_parse.py) and run through
the same pipeline. The answer's text and tool calls (tools.py) become output items, streamed as the `response.*`
events the official client parses. Unless `store` is false, the response and its conversation are kept in the
JetStream KV bucket tb_responses (RESPONSES_TTL), under its tenant: any gateway continues or retrieves it, a
gateway restart loses none, and no tenant reads another's."""
import time
import uuid

import nats.js.errors
import orjson
from starlette.requests import Request as HttpRequest
from starlette.responses import Response

import bus
from schemas import subjects
from services.gateway import errors, frames, tools
from services.gateway.api import Disconnected, abort, body, to_the_end, watching
from services.gateway.errors import ApiError
from services.gateway.http_answer import EventStream, json
from services.gateway.http_parse import Call, bad, parse
from services.gateway.owners import Exchange
from services.gateway.session import Gateway

FIELDS = {"model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls", "max_output_tokens",
          "temperature", "top_p", "text", "stream", "store", "previous_response_id", "metadata", "user", "seed",
          "include"}
INCLUDABLE = {"file_search_call.results", "web_search_call.results", "web_search_call.action.sources",   # nothing
              "message.input_image.image_url", "computer_call_output.output.image_url",                # of these
              "code_interpreter_call.outputs", "reasoning.encrypted_content"}                          # is served
ROLES = ("user", "system", "developer", "assistant")


# -- handlers -------------------------------------------------------------------------------------

async def create(request: HttpRequest) -> Response:
    gw: Gateway = request.app.state.gateway
    t0, ex = time.perf_counter(), Exchange(gw)
    try:
        key = gw.authorize(request.headers, request.query_params)
        b = {k: v for k, v in (await body(request)).items() if v is not None}
        asked = Asked(b)
        history = (await load(gw, key.tenant, asked.previous))["messages"] if asked.previous else []
        call = parse("chat", asked.chat_body(history), gw)
        r = await gw.start(ex, "http", call.req, await gw.admit(key, call.req), "responses", t0, False)
        first = await watching(request, ex.frames.get())
    except ApiError as e:
        return e.response()
    except Disconnected:
        await abort(ex)
        return Response(status_code=499)
    if first["type"] == "error":
        return errors.from_pipeline(first["code"], first["message"]).response()
    answer = Answer(asked, call, r, history, key.tenant)
    if asked.stream:
        return EventStream(answer.events(ex, first, gw), ex)
    got = await to_the_end(request, ex, first)
    if isinstance(got, Response):
        return got
    answer.feed("".join(f["text"] for f in got if f["type"] == "delta"))
    answer.finish(got[-1]["finish_reason"])
    await answer.keep(gw)
    return json(answer.response("completed"))


async def retrieve(request: HttpRequest) -> Response:
    gw: Gateway = request.app.state.gateway
    try:
        key = gw.authorize(request.headers, request.query_params)
        stored = await load(gw, key.tenant, request.path_params["response_id"])
    except ApiError as e:
        return e.response()
    if request.method == "DELETE":
        await (await bucket(gw)).delete(entry(key.tenant, stored["response"]["id"]))
        return json({"id": stored["response"]["id"], "object": "response", "deleted": True})
    return json(stored["response"])


# -- the request ----------------------------------------------------------------------------------

class Asked:
    """A checked Responses body, and the chat body it runs as."""

    def __init__(self, b: dict):
        extra = sorted(b.keys() - FIELDS)
        if extra:
            raise bad(f"{extra[0][:40]}: unknown or unsupported parameter", extra[0][:40])
        self.b, self.stream, self.store = b, flag(b, "stream", False), flag(b, "store", True)
        self.previous = b.get("previous_response_id")
        if self.previous is not None and not isinstance(self.previous, str):
            raise bad(f"previous_response_id: expected a string, got {frames.kind(self.previous)}",
                      "previous_response_id")
        if not isinstance(b.get("instructions", ""), str):
            raise bad(f"instructions: expected a string, got {frames.kind(b['instructions'])}", "instructions")
        included(b.get("include", []))
        self.messages = input_messages(b.get("input"))
        self.tools = [function(t, i) for i, t in enumerate(b.get("tools") or [])]

    def chat_body(self, history: list[dict]) -> dict:
        """The chat completion this response runs as (the instructions are this response's alone)."""
        b = self.b
        system = [{"role": "system", "content": b["instructions"]}] if b.get("instructions") else []
        chat = {"model": b.get("model"), "messages": [*system, *history, *self.messages]}
        chat |= {k: b[k] for k in ("temperature", "top_p", "seed", "parallel_tool_calls", "user") if k in b}
        if "max_output_tokens" in b:
            chat["max_tokens"] = b["max_output_tokens"]
        if self.tools:
            chat["tools"] = self.tools
        if "tool_choice" in b:
            chat["tool_choice"] = choice(b["tool_choice"])
        if "text" in b:
            chat["response_format"] = text_format(b["text"])
        return chat


def flag(b: dict, name: str, default: bool) -> bool:
    v = b.get(name, default)
    if not frames.is_bool(v):
        raise bad(f"{name}: expected true or false, got {frames.kind(v)}", name)
    return v


def included(v) -> None:
    """`include` (the OpenAI Agents SDK always sends it, often empty): extra data of built-in tools, images and
    reasoning, which no response here holds, so asking adds nothing; output text logprobs are not served."""
    if not isinstance(v, list):
        raise bad(f"include: expected an array of strings, got {frames.kind(v)}", "include")
    for i, x in enumerate(v):
        if not isinstance(x, str):
            raise bad(f"include[{i}]: expected a string, got {frames.kind(x)}", "include")
        if x == "message.output_text.logprobs":
            raise bad("include: message.output_text.logprobs is not served (no logprobs on /v1/responses)", "include")
        if x not in INCLUDABLE:
            raise bad(f"include: unknown {x[:60]!r} (known: {', '.join(sorted(INCLUDABLE))})", "include")


def input_messages(v) -> list[dict]:
    """The chat messages of `input`: a string is one user message; items are messages (text content, or
    input_text / output_text parts), function_call (an assistant's tool call) and function_call_output."""
    if isinstance(v, str):
        return [{"role": "user", "content": v}]
    if not isinstance(v, list) or not v:
        raise bad(f"input: required, a string or a non-empty array of items (got {frames.kind(v)})", "input")
    out: list[dict] = []
    for i, item in enumerate(v):
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message" and item.get("role") in ROLES:
            out.append({"role": item["role"], "content": text_of(item.get("content"), i)})
        elif kind == "function_call" and all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if out and out[-1]["role"] == "assistant" and "tool_calls" in out[-1]:
                out[-1]["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output" and isinstance(item.get("call_id"), str):
            output = item.get("output")
            out.append({"role": "tool", "tool_call_id": item["call_id"],
                        "content": output if isinstance(output, str) else orjson.dumps(output).decode()})
        else:
            raise bad(f"input[{i}]: expected a message (role {', '.join(ROLES)}), a function_call (call_id, name, "
                      f"arguments) or a function_call_output (call_id, output) item; got type {frames.show(kind)}",
                      "input")
    return out


def text_of(content, i: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") in ("input_text", "output_text")
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise bad(f"input[{i}].content: expected a string or input_text / output_text parts", "input")


def function(t, i: int) -> dict:
    """A Responses function tool as a chat tool."""
    if not isinstance(t, dict) or t.get("type") != "function":
        got = frames.show(t.get("type") if isinstance(t, dict) else t)
        raise bad(f"tools[{i}].type: only function tools are served (got {got})", "tools")
    return {"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters") if k in t}}


def choice(c):
    if isinstance(c, dict) and c.get("type") == "function":
        return {"type": "function", "function": {"name": c.get("name")}}
    return c


def text_format(t) -> dict:
    f = t.get("format", {"type": "text"}) if isinstance(t, dict) else None
    if not isinstance(f, dict):
        raise bad("text.format: expected an object", "text")
    if f.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {"name": f.get("name", "output"), "schema": f.get("schema"),
                                                       "strict": f.get("strict", False)}}
    return {"type": f.get("type")}


# -- the answer -----------------------------------------------------------------------------------

class Answer:
    """The response being made: its output items from the answer's text, as it comes or at once."""

    def __init__(self, asked: Asked, call: Call, r, history: list[dict], tenant: str):
        self.asked, self.call, self.r, self.history, self.tenant = asked, call, r, history, tenant
        self.id, self.created = f"resp_{uuid.uuid4().hex}", int(time.time())
        self.stream = tools.ToolStream(call.tools) if call.tools is not None else None
        self.items: list[dict] = []              # output items, the last one open while its text comes
        self.finish_reason = None
        self.seq = 0

    def feed(self, text: str) -> list[dict]:
        """The events of more answer text: content grows the message item, a tool call opens its own."""
        deltas = self.stream.feed(text) if self.stream is not None else [{"content": text}] if text else []
        return [e for d in deltas for e in self.delta(d)]

    def delta(self, d: dict) -> list[dict]:
        out = []
        if d.get("content"):
            item = self.items[-1] if self.items and self.items[-1]["type"] == "message" else None
            if item is None:
                out += self.open({"type": "message", "id": f"msg_{uuid.uuid4().hex}", "status": "in_progress",
                                  "role": "assistant", "content": [{"type": "output_text", "text": "",
                                                                    "annotations": []}]})
                item = self.items[-1]
                out.append(self.event("response.content_part.added", item_id=item["id"],
                                      output_index=len(self.items) - 1, content_index=0,
                                      part={"type": "output_text", "text": "", "annotations": []}))
            item["content"][0]["text"] += d["content"]
            out.append(self.event("response.output_text.delta", item_id=item["id"], output_index=len(self.items) - 1,
                                  content_index=0, delta=d["content"], logprobs=[]))
        for piece in d.get("tool_calls", ()):
            fn = piece["function"]
            if piece.get("id") is not None:
                out += self.open({"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": piece["id"],
                                  "name": fn["name"], "arguments": "", "status": "in_progress"})
            item = self.items[-1]
            if fn.get("arguments"):
                item["arguments"] += fn["arguments"]
                out.append(self.event("response.function_call_arguments.delta", item_id=item["id"],
                                      output_index=len(self.items) - 1, delta=fn["arguments"]))
        return out

    def open(self, item: dict) -> list[dict]:
        out = self.close()
        self.items.append(item)
        return [*out, self.event("response.output_item.added", output_index=len(self.items) - 1,
                                 item=dict(item, content=[]) if item["type"] == "message" else dict(item))]

    def close(self) -> list[dict]:
        """The events that end the open item."""
        if not self.items or self.items[-1]["status"] == "completed":
            return []
        item, i = self.items[-1], len(self.items) - 1
        item["status"] = "completed"
        if item["type"] == "message":
            part = item["content"][0]
            out = [self.event("response.output_text.done", item_id=item["id"], output_index=i, content_index=0,
                              text=part["text"], logprobs=[]),
                   self.event("response.content_part.done", item_id=item["id"], output_index=i, content_index=0,
                              part=part)]
        else:
            out = [self.event("response.function_call_arguments.done", item_id=item["id"], output_index=i,
                              arguments=item["arguments"])]
        return [*out, self.event("response.output_item.done", output_index=i, item=item)]

    def finish(self, reason: str) -> list[dict]:
        out = [e for d in (self.stream.finish() if self.stream is not None else []) for e in self.delta(d)]
        self.finish_reason = reason
        return [*out, *self.close()]

    def event(self, kind: str, **fields) -> dict:
        self.seq += 1
        return {"type": kind, "sequence_number": self.seq, **fields}

    def response(self, status: str) -> dict:
        b, r = self.asked.b, self.r
        incomplete = status == "completed" and self.finish_reason == "length"
        return {
            "id": self.id, "object": "response", "created_at": self.created, "model": self.call.model,
            "status": "incomplete" if incomplete else status, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": b.get("instructions"), "metadata": b.get("metadata") or {},
            "output": self.items if status != "in_progress" else [],
            "parallel_tool_calls": b.get("parallel_tool_calls", True),    # the sampling it ran with (the model's
            "temperature": self.call.req.sampling.temperature,           # defaults for what the body left out)
            "top_p": self.call.req.sampling.top_p, "tool_choice": b.get("tool_choice", "auto"),
            "tools": b.get("tools") or [],
            "max_output_tokens": b.get("max_output_tokens"), "previous_response_id": self.asked.previous,
            "store": self.asked.store, "text": b.get("text", {"format": {"type": "text"}}), "truncation": "disabled",
            "usage": None if status == "in_progress" else {
                "input_tokens": r.prompt_tokens, "input_tokens_details": {"cached_tokens": r.cached_tokens},
                "output_tokens": r.received, "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": r.prompt_tokens + r.received}}

    def conversation(self) -> list[dict]:
        """The chat messages a later response continues: this one's input and what it answered."""
        text = "".join(i["content"][0]["text"] for i in self.items if i["type"] == "message")
        calls = [{"id": i["call_id"], "type": "function", "function": {"name": i["name"], "arguments": i["arguments"]}}
                 for i in self.items if i["type"] == "function_call"]
        said = {"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {})}
        return [*self.history, *self.asked.messages, said]

    async def keep(self, gw: Gateway) -> None:
        if self.asked.store:
            value = orjson.dumps({"tenant": self.tenant, "response": self.response("completed"),
                                  "messages": self.conversation()})
            await (await bucket(gw)).put(entry(self.tenant, self.id), value)

    async def events(self, ex: Exchange, first: dict, gw: Gateway):
        """The server-sent events of the response as the pipeline's frames come."""
        out = [self.event("response.created", response=self.response("in_progress")),
               self.event("response.in_progress", response=self.response("in_progress"))]
        f = first
        while True:
            if f["type"] == "delta":
                out += self.feed(f["text"])
            elif f["type"] == "error":
                failed = {**self.response("failed"), "error": {"code": f["code"], "message": f["message"]}}
                yield sse([*out, self.event("response.failed", response=failed)])
                return
            else:
                out += self.finish(f["finish_reason"])
                await self.keep(gw)
                yield sse([*out, self.event("response.completed", response=self.response("completed"))])
                return
            yield sse(out)
            out, f = [], await ex.frames.get()


def sse(events: list[dict]) -> bytes:
    return b"".join(b"event: " + e["type"].encode() + b"\ndata: " + orjson.dumps(e) + b"\n\n" for e in events)


# -- the store ------------------------------------------------------------------------------------

async def bucket(gw: Gateway):
    return await bus.responses(gw.js)


def entry(tenant: str, rid: str) -> str:
    """The key of a tenant's response: the tenant's name first, so no other tenant's id reaches it."""
    return f"{tenant}_{rid}"


async def load(gw: Gateway, tenant: str, rid: str) -> dict:
    """A stored response of this tenant; 404 when it is not there (or is another tenant's)."""
    if not (rid.startswith("resp_") and subjects.TOKEN.fullmatch(rid)):
        raise ApiError(404, f"response {rid[:80]!r} does not exist", "not_found", "response_id")
    try:
        got = orjson.loads((await (await bucket(gw)).get(entry(tenant, rid))).value)
    except (nats.js.errors.KeyNotFoundError, nats.js.errors.KeyDeletedError):
        got = None
    if got is None or got.get("tenant") != tenant:
        raise ApiError(404, f"response {rid!r} does not exist (or was not stored, or has expired)", "not_found",
                       "response_id")
    return got

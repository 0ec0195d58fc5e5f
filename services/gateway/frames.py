"""The client frames of the websocket protocol, checked field by field before anything is published:
a FrameError names the field or the limit, and carries the client's id when it could be read."""
import dataclasses
import re
import time
import uuid

import orjson

from schemas.messages import MAX_PRIORITY, MIN_PRIORITY, GenerateRequest
from schemas.sampling import MAX_TOKEN_ID, MAX_TOKENS_BOUND, SEED_BOUND, SamplingParams
from schemas.subjects import MAX_ID_CHARS, MAX_MESSAGES, MAX_PROMPT_CHARS, MAX_STOP, TOKEN
from schemas.wire import WireError


class FrameError(ValueError):
    def __init__(self, message: str, id: str | None = None, code: str = "invalid_request",
                 retry_after: int | None = None):
        super().__init__(message)
        self.id, self.code, self.retry_after = id, code, retry_after


def is_str(v) -> bool:
    return isinstance(v, str)


def is_bool(v) -> bool:
    return isinstance(v, bool)


def is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_num(v) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def is_ints(v) -> bool:
    return isinstance(v, list) and set(map(type, v)) <= {int}    # one pass in C: a prompt has thousands


def is_stop(v) -> bool:
    return is_str(v) or (isinstance(v, list) and all(map(is_str, v)))


SAMPLING = {  # field -> (check, what it must be)
    "max_tokens": (is_int, "an integer"),
    "min_tokens": (is_int, "an integer"),
    "temperature": (is_num, "a number"),
    "top_p": (is_num, "a number"),
    "top_k": (is_int, "an integer"),
    "min_p": (is_num, "a number"),
    "seed": (is_int, "an integer"),
    "stop": (is_stop, "a string or an array of strings"),
    "stop_token_ids": (is_ints, "an array of integers"),
    "ignore_eos": (is_bool, "true or false"),
    "repetition_penalty": (is_num, "a number"),
    "presence_penalty": (is_num, "a number"),
    "frequency_penalty": (is_num, "a number"),
    "speculative": (is_bool, "true or false"),
    "logit_bias": (lambda v: isinstance(v, dict), "an object of token id to bias"),
    "json_schema": (lambda v: isinstance(v, dict), "an object (a JSON schema)"),
    "json_object": (is_bool, "true or false"),
    "regex": (is_str, "a string"),
    "choice": (lambda v: isinstance(v, list) and all(map(is_str, v)), "an array of strings"),
    "grammar": (is_str, "a string (an EBNF grammar)"),
}
ITEMS = {"stop": (is_str, "a string"), "stop_token_ids": (is_int, "an integer"),
         "prompt_token_ids": (is_int, "an integer")}  # array fields: what each element must be
PROMPTS = ("messages", "prompt", "prompt_token_ids")
TOOLING = ("tools", "tool_choice", "parallel_tool_calls")     # as the HTTP API's (services/gateway/tools.py)
FIELDS = {"generate": {"type", "id", "resumable", "priority", "model", "n", *PROMPTS, *SAMPLING, *TOOLING},
          "cancel": {"type", "id"},
          "resume": {"type", "id", "offset"}}
MAX_N = 16                                    # choices of one prompt (n)
DIGITS = re.compile(r"[0-9]{1,15}")           # a sequence or an offset in a resume point


def parse(event: dict) -> dict:
    """The JSON object in an ASGI websocket.receive event."""
    text = event.get("text")
    if text is None:
        raise FrameError("frames are JSON text; got a binary frame")
    try:
        frame = orjson.loads(text)
    except orjson.JSONDecodeError as e:
        raise FrameError(f"frame is not valid JSON: {e}") from None
    if not isinstance(frame, dict):
        raise FrameError(f"a frame is a JSON object, got {kind(frame)}")
    return frame


def header(frame: dict) -> tuple[str, str]:
    """The frame's type and id, once its type, id and field names are valid."""
    cid = frame.get("id")
    echo = cid if isinstance(cid, str) and 0 < len(cid) <= MAX_ID_CHARS else None
    t = frame.get("type")
    if not isinstance(t, str) or t not in FIELDS:
        got = show(t) if "type" in frame else "missing"
        raise FrameError(f"type: must be one of {', '.join(FIELDS)} (got {got})", echo)
    if "id" not in frame:
        raise FrameError("id: missing")
    if not isinstance(cid, str):
        raise FrameError(f"id: expected a string, got {kind(cid)}")
    if echo is None:
        raise FrameError(f"id: must be 1 to MAX_ID_CHARS={MAX_ID_CHARS} characters (got {len(cid)})")
    extra = sorted(frame.keys() - FIELDS[t])
    if extra:
        raise FrameError(f"{extra[0][:40]}: unknown field in a {t} frame", cid)
    return t, cid


def request(frame: dict, rid: str, tenant: str) -> GenerateRequest:
    """The GenerateRequest a checked generate frame asks for."""
    cid = frame["id"]
    given = [k for k in PROMPTS if frame.get(k) is not None]
    if len(given) != 1:
        raise FrameError(f"exactly one of messages, prompt, prompt_token_ids is needed (got {given or 'none'})", cid)
    name = given[0]
    prompt = {"messages": messages, "prompt": text, "prompt_token_ids": token_ids}[name](frame[name], cid)
    req = GenerateRequest(rid, tenant, sampling(frame, cid), **{name: prompt}, created=time.time())
    try:
        req.check()                              # the bounds every stage checks when it decodes
    except WireError as e:
        raise FrameError(str(e), cid) from None
    return req


def resumable(frame: dict) -> bool:
    """Whether a generate frame asks for an accepted frame with its resume id (and a stream kept for a
    resume when its connection drops)."""
    v = frame.get("resumable", False)
    if not is_bool(v):
        raise FrameError(f"resumable: expected true or false, got {kind(v)}", frame["id"])
    return v


def model(frame: dict) -> str | None:
    """The model a generate frame asks for (a name, or name@revision); None: the gateway's default."""
    v = frame.get("model")
    if v is not None and not is_str(v):
        raise FrameError(f"model: expected a string, got {kind(v)}", frame.get("id"))
    return v


def priority(frame: dict) -> int | None:
    """The priority a generate frame (or a request body) asks for; None: the key's default."""
    v = frame.get("priority")
    if v is not None and not (is_int(v) and MIN_PRIORITY <= v <= MAX_PRIORITY):
        raise FrameError(f"priority: must be an integer in [{MIN_PRIORITY}, {MAX_PRIORITY}] (lower runs first), "
                         f"got {show(v)}", frame.get("id"))
    return v


def n(frame: dict) -> int:
    """The choices of its prompt a generate frame (or a request body) asks for."""
    v = frame.get("n", 1)
    if not is_int(v) or not 1 <= v <= MAX_N:
        raise FrameError(f"n: must be an integer in [1, MAX_N={MAX_N}] (got {show(v)})", frame.get("id"))
    return v


def choices(req: GenerateRequest, n: int) -> list[GenerateRequest]:
    """The n choices of a request's prompt: choice i has its own request id and the seed after the first's i
    times (if one was given), so each is reproducible and they differ; with n > 1 they share a group (the first's
    id: routed to one worker, which computes the prompt once and forks the others onto it)."""
    if n == 1:
        return [req]
    req.group = req.id
    seed = req.sampling.seed
    return [req] + [dataclasses.replace(req, id=uuid.uuid4().hex, sampling=dataclasses.replace(
        req.sampling, seed=None if seed is None else (seed + i) % SEED_BOUND)) for i in range(1, n)]


def resume_id(rid: str, seq: int) -> str:
    """What a client resumes a request by: the request id and its sequence number in the request log."""
    return f"{rid}.{seq}"


def resume(frame: dict) -> tuple[str, int, int]:
    """The request id, request-log sequence and offset of a checked resume frame."""
    cid = frame["id"]
    rid, seq = point(cid, 2, "id", cid)
    if "offset" not in frame:
        raise FrameError("offset: missing (the output tokens already received)", cid)
    offset = frame["offset"]
    if not is_int(offset) or not 0 <= offset <= MAX_TOKENS_BOUND:
        raise FrameError(f"offset: must be an integer in [0, {MAX_TOKENS_BOUND}] (the output tokens already "
                         f"received), got {show(offset)}", cid)
    return rid, seq, offset


def event_point(last: str) -> tuple[str, int, int]:
    """The request id, request-log sequence and offset in a Last-Event-ID (an SSE event's id)."""
    return point(last, 3, "Last-Event-ID", None)


def point(s: str, parts: int, name: str, cid: str | None) -> tuple:
    """(request id, sequence[, offset]) of `rid.seq` (parts 2) or `rid.seq.offset` (parts 3)."""
    fields = s.split(".")
    rid, numbers = fields[0], fields[1:]
    if len(fields) != parts or not TOKEN.fullmatch(rid) or not all(DIGITS.fullmatch(n) for n in numbers) \
            or int(numbers[0]) < 1:
        what = "<request id>.<sequence>" + (".<offset>" if parts == 3 else "")
        raise FrameError(f"{name}: {show(s)} is not a resume point ({what}, as the gateway gave it)", cid)
    return rid, *map(int, numbers)


def messages(v, cid: str) -> list[dict[str, str]]:
    """Chat messages whose every value is a string; an assistant message's `tool_calls` (OpenAI's objects) are
    checked and carried as their JSON text."""
    if not isinstance(v, list) or not v:
        raise FrameError(f"messages: expected a non-empty array of {{role, content}} objects, got {kind(v)}", cid)
    if len(v) > MAX_MESSAGES:
        raise FrameError(f"messages: {len(v)} messages is more than MAX_MESSAGES={MAX_MESSAGES}", cid)
    chars, out = 0, []
    for i, m in enumerate(v):
        if not isinstance(m, dict):
            raise FrameError(f"messages[{i}]: expected an object, got {kind(m)}", cid)
        if isinstance(m.get("tool_calls"), list):
            m = {**m, "tool_calls": orjson.dumps(tool_calls(m["tool_calls"], f"messages[{i}]", cid)).decode()}
        for key in ("role", "content"):
            if key not in m:
                raise FrameError(f"messages[{i}].{key}: missing", cid)
        for key, value in m.items():
            if not isinstance(value, str):
                raise FrameError(f"messages[{i}].{key[:40]}: expected a string, got {kind(value)}", cid)
            chars += len(value)
        out.append(m)
    too_long("messages", chars, "characters", cid)
    return out


def tool_calls(calls: list, where: str, cid: str | None = None) -> list[dict]:
    """An assistant message's tool calls, checked: [{"id", "type": "function", "function": {"name", "arguments"}}]."""
    out = []
    for j, c in enumerate(calls):
        f = c.get("function") if isinstance(c, dict) else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not isinstance(f.get("arguments"), str):
            raise FrameError(f'{where}.tool_calls[{j}]: expected {{"id", "type": "function", "function": '
                             f'{{"name": string, "arguments": string}}}}', cid)
        out.append({"id": str(c.get("id", "")), "type": "function",
                    "function": {"name": f["name"], "arguments": f["arguments"]}})
    return out


def text(v, cid: str) -> str:
    if not isinstance(v, str):
        raise FrameError(f"prompt: expected a string, got {kind(v)}", cid)
    too_long("prompt", len(v), "characters", cid)
    return v


def token_ids(v, cid: str) -> list[int]:
    if not is_ints(v):
        raise wrong("prompt_token_ids", v, "an array of integers", cid)
    too_long("prompt_token_ids", len(v), "tokens", cid)
    if v and not (min(v) >= 0 and max(v) <= MAX_TOKEN_ID):
        bad = next(i for i, t in enumerate(v) if not 0 <= t <= MAX_TOKEN_ID)
        raise FrameError(f"prompt_token_ids[{bad}]: {v[bad]} is not a token id in [0, {MAX_TOKEN_ID}]", cid)
    return v


def too_long(name: str, n: int, unit: str, cid: str) -> None:
    if n > MAX_PROMPT_CHARS:
        raise FrameError(f"{name}: {n} {unit} is more than MAX_PROMPT_CHARS={MAX_PROMPT_CHARS}", cid)


def sampling(frame: dict, cid: str) -> SamplingParams:
    kw = {}
    for name, (ok, want) in SAMPLING.items():
        v = frame.get(name)
        if v is None:
            continue
        if not ok(v):
            raise wrong(name, v, want, cid)
        kw[name] = float(v) if want == "a number" else v
    if isinstance(kw.get("stop"), list) and len(kw["stop"]) > MAX_STOP:
        raise FrameError(f"stop: {len(kw['stop'])} stop strings is more than MAX_STOP={MAX_STOP}", cid)
    try:
        return SamplingParams(**kw)
    except ValueError as e:                      # names the field and its rule
        raise FrameError(str(e), cid) from None


KINDS = {type(None): "null", bool: "a boolean", int: "an integer", float: "a float", str: "a string", list: "an array",
         dict: "an object"}


def wrong(name: str, v, want: str, cid: str) -> FrameError:
    """The error for a value of the wrong type; for an array, it names the first bad element. An integer past
    64 bits (which JSON parsing reads as a float) is out of range, not of the wrong type."""
    if isinstance(v, list) and name in ITEMS:
        ok, item = ITEMS[name]
        i = next(i for i, x in enumerate(v) if not ok(x))
        return wrong(f"{name}[{i}]", v[i], item, cid)
    if "integer" in want and isinstance(v, float) and v.is_integer() and abs(v) >= 2 ** 63:
        return FrameError(f"{name}: {v:.0f} is out of range (integers here have at most 64 bits)", cid)
    return FrameError(f"{name}: expected {want}, got {kind(v)}", cid)


def kind(v) -> str:
    """v's JSON type, for messages."""
    return KINDS.get(type(v), type(v).__name__)


def show(v, limit: int = 40) -> str:
    s = repr(v) if isinstance(v, str) else kind(v)
    return s if len(s) <= limit else s[:limit] + "…"

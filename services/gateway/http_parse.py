"""The HTTP API's request bodies checked into a Call: OpenAI's fields for /v1/chat/completions and
/v1/completions (and vLLM's extensions), each wrong one refused with a 400 naming the field, before
anything is published."""
import re
import uuid
from dataclasses import dataclass

import orjson

from schemas.messages import GenerateRequest
from schemas.sampling import CONSTRAINTS
from services.gateway import frames, tools
from services.gateway.errors import ApiError
from services.gateway.frames import FrameError
from services.gateway.session import Gateway
from services.gateway.tools import Tools

EXTENSIONS = {"ignore_eos", "top_k", "min_p", "repetition_penalty", "stop_token_ids", "speculative", "min_tokens"}
GUIDED = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice",
          "guided_grammar": "grammar"}     # vLLM's structured-output extensions -> SamplingParams' fields
RESPONSE_FORMATS = ("text", "json_object", "json_schema")
# OpenAI's fields that change nothing a completion says: checked for their type, then ignored (docs/api.md)
IGNORED = {"store": (frames.is_bool, "true or false"), "metadata": (lambda v: isinstance(v, dict), "an object"),
           "service_tier": (frames.is_str, "a string")}
COMMON = {"model", "max_tokens", "temperature", "top_p", "seed", "stop", "n", "logprobs", "presence_penalty",
          "frequency_penalty", "logit_bias", "user", "stream", "stream_options", "priority", *EXTENSIONS, *IGNORED,
          "response_format", *GUIDED}
STREAM_OPTIONS = {"include_usage", "continuous_usage_stats", "include_obfuscation"}
FIELDS = {"chat": COMMON | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
                            "parallel_tool_calls"},
          "completions": COMMON | {"prompt", "echo"}}
MAX_N = frames.MAX_N
MAX_PROMPTS = 32                                  # prompts of one /v1/completions request
MAX_COMPLETIONS = 64                              # choices of one request: n × prompts
ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_LOGPROBS = 20
COMPLETIONS_MAX_TOKENS = 16                       # OpenAI's default for /v1/completions


@dataclass(slots=True)
class Call:
    """A checked HTTP request: what to run and how to answer."""
    api: str                                      # chat | completions
    req: GenerateRequest
    stream: bool
    include_usage: bool                           # a last chunk with the usage
    continuous_usage: bool                        # vLLM's continuous_usage_stats: the usage so far in every chunk
    obfuscation: bool                             # OpenAI's include_obfuscation: chunks padded to hide their size
    logprobs: bool
    id: str                                       # chatcmpl-… or cmpl-…
    created: int
    model: str
    fingerprint: str | None = None                # the served revision (OpenAI's system_fingerprint)
    tools: Tools | None = None                    # how the answer's tool calls are found (None: no tools)
    reqs: list[GenerateRequest] | None = None     # every choice's request, choice i's at index i (req is the first)
    n: int = 1                                    # choices of each prompt
    echo: bool = False                            # completions: each choice's text starts with its prompt

    @property
    def choices(self) -> list[GenerateRequest]:
        return self.reqs or [self.req]



def parse(api: str, b: dict, gw: Gateway) -> Call:
    b = {k: v for k, v in b.items() if v is not None}           # null means "not given"
    extra = sorted(b.keys() - FIELDS[api])
    if extra:
        raise bad(f"{extra[0][:40]}: unknown or unsupported parameter", extra[0][:40])
    model = b.get("model")
    if not isinstance(model, str):
        raise bad("model: required, a string", "model")
    gw.models.find(model)                                     # 404 for a model or revision not served, first
    for name, (ok, want) in IGNORED.items():
        if name in b and not ok(b[name]):
            raise bad(f"{name}: expected {want}, got {frames.show(b[name])}", name)
    try:
        n = frames.n(b)
    except FrameError as e:
        raise bad(str(e), "n") from None
    echo = flag(b, "echo")
    stream = flag(b, "stream")
    opts = stream_options(b, stream)
    fields, top = sampling_fields(api, b, gw)
    spec, shown, constraint = tools.parse(b, "") if api == "chat" else (None, None, {})
    if constraint and any(k in fields for k in CONSTRAINTS):
        raise bad("tool_choice: a required or named tool constrains the output; response_format or guided_* "
                  "cannot constrain it too", "tool_choice")
    if echo and top is not None:
        raise bad("echo: with logprobs it needs the prompt's logprobs, which are not computed", "echo")
    prompts = [messages(b.get("messages"))] if api == "chat" else [dict([p]) for p in completion_prompts(b)]
    if n * len(prompts) > MAX_COMPLETIONS:
        raise bad(f"n: {n} choices of {len(prompts)} prompts is more than MAX_COMPLETIONS={MAX_COMPLETIONS}", "n")
    reqs = []
    for prompt in prompts:
        try:
            req = frames.request({"id": "http", **fields, **constraint, **prompt}, uuid.uuid4().hex, "default")
        except FrameError as e:
            raise bad(str(e), param_of(str(e))) from None
        req.sampling.logprobs, req.tools = top, shown
        reqs += frames.choices(req, n)
    req = reqs[0]
    gw.choose(req, model)
    for other in reqs[1:]:                    # every choice from the revision the first one's id drew
        other.model, other.revision = req.model, req.revision
    gw.fill(reqs, fields)
    revision = gw.served(req)[1]
    if spec is not None:
        spec.parser = revision.tool_parser if revision is not None else "hermes"   # a gateway of no models file
    prefix = "chatcmpl-" if api == "chat" else "cmpl-"
    return Call(api, req, stream, *opts, top is not None, prefix + req.id, int(req.created), model,
                revision.revision if revision is not None else None, spec, reqs if len(reqs) > 1 else None, n, echo)


def bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, "invalid_request", param)


def param_of(message: str) -> str | None:
    m = re.match(r"([a-z_]+)", message)
    return m.group(1) if m else None


def flag(b: dict, name: str) -> bool:
    v = b.get(name, False)
    if not frames.is_bool(v):
        raise bad(f"{name}: expected true or false, got {frames.kind(v)}", name)
    return v


def stream_options(b: dict, stream: bool) -> tuple[bool, bool, bool]:
    """(include_usage, continuous usage, obfuscation). continuous_usage_stats needs include_usage, as vLLM's."""
    opts = b.get("stream_options")
    if opts is None:
        return False, False, False
    if not stream:
        raise bad("stream_options: only allowed when stream is true", "stream_options")
    if not isinstance(opts, dict):
        raise bad(f"stream_options: expected an object, got {frames.kind(opts)}", "stream_options")
    extra = sorted(opts.keys() - STREAM_OPTIONS)
    if extra:
        raise bad(f"stream_options.{extra[0][:40]}: unknown option (known: {', '.join(sorted(STREAM_OPTIONS))})",
                  "stream_options")
    try:
        include, continuous, pad = (flag({k: v for k, v in opts.items() if v is not None}, name)
                                    for name in ("include_usage", "continuous_usage_stats", "include_obfuscation"))
    except ApiError as e:
        raise bad(f"stream_options.{e.message}", "stream_options") from None
    return include, include and continuous, pad


def sampling_fields(api: str, b: dict, gw: Gateway) -> tuple[dict, int | None]:
    """The SamplingParams fields of the body (the websocket protocol's names), and the number of top
    logprobs wanted (None: no logprobs)."""
    fields = {k: b[k] for k in frames.SAMPLING if k in b}
    fields |= {field: b[name] for name, field in GUIDED.items() if name in b} | response_format(b)
    default = gw.max_tokens if api == "chat" else COMPLETIONS_MAX_TOKENS
    fields["max_tokens"] = b.get("max_completion_tokens", b.get("max_tokens", default))
    if api == "chat":
        want = flag(b, "logprobs")
        top = b.get("top_logprobs")
        if top is not None and not want:
            raise bad("top_logprobs: needs logprobs: true", "top_logprobs")
        n = top if top is not None else 0
        name = "top_logprobs"
    else:
        n = b.get("logprobs")
        want, name = n is not None, "logprobs"
    if not want:
        return fields, None
    if not frames.is_int(n) or not 0 <= n <= MAX_LOGPROBS:
        raise bad(f"{name}: must be an integer in [0, {MAX_LOGPROBS}] (got {frames.show(n)})", name)
    return fields, n


def response_format(b: dict) -> dict:
    """The SamplingParams field of OpenAI's response_format (json_schema's `strict` is accepted: the schema is
    always enforced)."""
    f = b.get("response_format")
    if f is None:
        return {}
    if not isinstance(f, dict) or f.get("type") not in RESPONSE_FORMATS:
        raise bad(f"response_format.type: must be one of {', '.join(RESPONSE_FORMATS)} (got "
                  f"{frames.show(f.get('type') if isinstance(f, dict) else f)})", "response_format")
    if f["type"] != "json_schema":
        return {"json_object": True} if f["type"] == "json_object" else {}
    spec = f.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
        raise bad("response_format.json_schema: expected an object with a schema object", "response_format")
    if not frames.is_bool(spec.get("strict", False)):
        raise bad(f"response_format.json_schema.strict: expected true or false, got {frames.kind(spec['strict'])}",
                  "response_format")
    return {"json_schema": spec.get("schema", {"type": "object"})}


def messages(v) -> dict:
    """The chat messages with text content (content parts of type text joined). An assistant message's
    tool_calls travel as their JSON text, a tool message's tool_call_id as it is: every value a string."""
    if not isinstance(v, list) or not v:
        raise bad(f"messages: required, a non-empty array of {{role, content}} objects (got {frames.kind(v)})",
                  "messages")
    out = []
    for i, m in enumerate(v[:frames.MAX_MESSAGES + 1]):
        if not isinstance(m, dict):
            raise bad(f"messages[{i}]: expected an object, got {frames.kind(m)}", "messages")
        m = {k: x for k, x in m.items() if x is not None}
        extra = sorted(m.keys() - {"role", "content", "name", "tool_calls", "tool_call_id"})
        if extra:
            raise bad(f"messages[{i}].{extra[0][:40]}: not supported", "messages")
        if m.get("role") not in ROLES:
            raise bad(f"messages[{i}].role: must be one of {', '.join(ROLES)} (got {frames.show(m.get('role'))})",
                      "messages")
        for key in ("name", "tool_call_id"):
            if not isinstance(m.get(key, ""), str):
                raise bad(f"messages[{i}].{key}: expected a string, got {frames.kind(m[key])}", "messages")
        out.append(message(m, i))
    return {"messages": out}


def message(m: dict, i: int) -> dict[str, str]:
    role = m["role"]
    calls = m.get("tool_calls")
    if calls is not None and role != "assistant":
        raise bad(f"messages[{i}].tool_calls: only an assistant message has tool calls", "messages")
    if role == "tool" and "tool_call_id" not in m:
        raise bad(f"messages[{i}].tool_call_id: required in a tool message", "messages")
    text = "" if calls is not None and "content" not in m else content(m.get("content"), i)
    out = {"role": role, "content": text, **{k: m[k] for k in ("name", "tool_call_id") if k in m}}
    if calls is not None:
        if not isinstance(calls, list):
            raise bad(f"messages[{i}].tool_calls: expected an array, got {frames.kind(calls)}", "messages")
        try:
            out["tool_calls"] = orjson.dumps(frames.tool_calls(calls, f"messages[{i}]")).decode()
        except FrameError as e:
            raise bad(str(e), "messages") from None
    return out


def content(c, i: int) -> str:
    if isinstance(c, str):
        return c
    if not isinstance(c, list):
        raise bad(f"messages[{i}].content: expected a string or an array of text parts, got {frames.kind(c)}",
                  "messages")
    texts = []
    for j, part in enumerate(c):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise bad(f"messages[{i}].content[{j}]: only {{\"type\": \"text\", \"text\": ...}} parts are supported",
                      "messages")
        texts.append(part["text"])
    return "".join(texts)


def completion_prompts(b: dict) -> list[tuple[str, object]]:
    """The prompts of a completions body: a string, token ids, or an array of up to MAX_PROMPTS of those."""
    p = b.get("prompt")
    if isinstance(p, list) and p and all(isinstance(x, str | list) for x in p):
        if len(p) > MAX_PROMPTS:
            raise bad(f"prompt: {len(p)} prompts is more than MAX_PROMPTS={MAX_PROMPTS}", "prompt")
        return [completion_prompt(x) for x in p]
    return [completion_prompt(p)]


def completion_prompt(p) -> tuple[str, object]:
    """("prompt", text) or ("prompt_token_ids", ids)."""
    if isinstance(p, str):
        return "prompt", p
    if isinstance(p, list) and p and frames.is_ints(p):
        return "prompt_token_ids", p
    raise bad(f"prompt: required, a string, an array of token ids, or an array of those (got {frames.kind(p)})",
              "prompt")

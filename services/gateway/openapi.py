"""The OpenAPI document of the HTTP API, served at /openapi.json: the bounds in it are the ones the
gateway enforces (schemathesis generates requests from it)."""
from schemas import generation
from schemas.messages import MAX_PRIORITY, MAX_TOOLS, MIN_PRIORITY
from schemas.sampling import (
    LOGIT_BIAS_BOUND,
    MAX_CHOICE_CHARS,
    MAX_CHOICES,
    MAX_LOGIT_BIAS,
    MAX_REGEX_CHARS,
    MAX_REPETITION_PENALTY,
    MAX_SCHEMA_CHARS,
    MAX_STOP_CHARS,
    MAX_STOP_TOKEN_IDS,
    MAX_TEMPERATURE,
    MAX_TOKEN_ID,
    MAX_TOP_K,
    MIN_REPETITION_PENALTY,
    SEED_BOUND,
)
from schemas.subjects import MAX_MESSAGES, MAX_STOP
from services.gateway.http_parse import MAX_COMPLETIONS, MAX_LOGPROBS, MAX_N, MAX_PROMPTS, ROLES
from services.gateway.tools import MAX_TOOL_NAME_CHARS


def nullable(schema: dict) -> dict:
    return {**schema, "nullable": True}


def number(lo=None, hi=None, exclusive_lo=False) -> dict:
    s = {"type": "number"}
    if lo is not None:
        s["minimum"] = lo
        if exclusive_lo:
            s["exclusiveMinimum"] = True
    if hi is not None:
        s["maximum"] = hi
    return nullable(s)


def integer(lo=None, hi=None) -> dict:
    s = {"type": "integer"}
    if lo is not None:
        s["minimum"] = lo
    if hi is not None:
        s["maximum"] = hi
    return nullable(s)


def obj(properties: dict, required=()) -> dict:
    s = {"type": "object", "properties": properties, "additionalProperties": False}
    if required:
        s["required"] = list(required)
    return s


def sampling(max_tokens: int) -> dict:
    word = {"type": "string", "minLength": 1, "maxLength": MAX_STOP_CHARS}
    return {
        "max_tokens": integer(1, max_tokens),
        "min_tokens": {**integer(0, max_tokens), "description": "extension (vLLM's): output tokens before EOS or a "
                       "stop token id may be sampled (at most max_tokens)"},
        "temperature": {**number(0, MAX_TEMPERATURE), "description": "0 (greedy) or at least 1e-05; unset, as "
                        "top_p, top_k, min_p and repetition_penalty: the model's sampling_defaults (GET /v1/models)"},
        "top_p": number(0, 1, exclusive_lo=True),
        "seed": integer(0, SEED_BOUND - 1),
        "stop": nullable({"oneOf": [word, {"type": "array", "maxItems": MAX_STOP, "items": word}]}),
        "n": {**integer(1, MAX_N), "description": "choices of each prompt (choice i seeded with seed + i); at most "
              f"MAX_COMPLETIONS={MAX_COMPLETIONS} choices in all"},
        "presence_penalty": number(-2, 2),
        "frequency_penalty": number(-2, 2),
        "user": nullable({"type": "string"}),
        "stream": nullable({"type": "boolean"}),
        "stream_options": nullable(obj({
            "include_usage": nullable({"type": "boolean"}),
            "continuous_usage_stats": nullable({"type": "boolean", "description": "extension (vLLM's): with "
                                                "include_usage, the usage so far in every chunk"}),
            "include_obfuscation": nullable({"type": "boolean", "description": "pad each chunk with an "
                                             "`obfuscation` field to a multiple of 64 bytes (default false)"})})),
        "logit_bias": nullable({"type": "object", "maxProperties": MAX_LOGIT_BIAS,
                                "propertyNames": {"pattern": "^[0-9]{1,10}$"},
                                "additionalProperties": {"type": "number", "minimum": -LOGIT_BIAS_BOUND,
                                                         "maximum": LOGIT_BIAS_BOUND}}),
        "priority": {**integer(MIN_PRIORITY, MAX_PRIORITY), "description": "extension (vLLM's): lower runs first "
                     "on workers with the priority policy; never more urgent than the key's priority"},
        "store": nullable({"type": "boolean", "description": "accepted and ignored"}),
        "metadata": nullable({"type": "object", "description": "accepted and ignored"}),
        "service_tier": nullable({"type": "string", "description": "accepted and ignored"}),
        "ignore_eos": nullable({"type": "boolean", "description": "extension: generate until max_tokens"}),
        "top_k": integer(-1, MAX_TOP_K),
        "min_p": number(0, 1),
        "repetition_penalty": number(MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY),
        "stop_token_ids": nullable({"type": "array", "maxItems": MAX_STOP_TOKEN_IDS,
                                    "items": {"type": "integer", "minimum": 0, "maximum": MAX_TOKEN_ID}}),
        "speculative": nullable({"type": "boolean", "description": "extension: false keeps this request from "
                                 "verifying draft tokens on a worker that speculates (the same tokens either way)"}),
        "response_format": nullable({"oneOf": [
            obj({"type": {"type": "string", "enum": ["text", "json_object"]}}, ["type"]),
            obj({"type": {"type": "string", "enum": ["json_schema"]},
                 "json_schema": {"type": "object", "properties": {
                     "name": {"type": "string"}, "description": {"type": "string"}, "schema": {"type": "object"},
                     "strict": nullable({"type": "boolean"})}}}, ["type", "json_schema"])],
            "description": "structured output: the text follows the JSON schema (strict or not), or is a JSON object"}),
        "guided_json": nullable({"type": "object",
                                 "description": "extension (vLLM's): a JSON schema the text follows"}),
        "guided_regex": nullable({"type": "string", "minLength": 1, "maxLength": MAX_REGEX_CHARS,
                                  "description": "extension (vLLM's): a regular expression the text matches"}),
        "guided_choice": nullable({"type": "array", "minItems": 1, "maxItems": MAX_CHOICES,
                                   "items": {"type": "string", "minLength": 1, "maxLength": MAX_CHOICE_CHARS},
                                   "description": "extension (vLLM's): the text is one of these"}),
        "guided_grammar": nullable({"type": "string", "minLength": 1, "maxLength": MAX_SCHEMA_CHARS,
                                    "description": "extension (vLLM's): an EBNF grammar (rule root) the text follows"}),
    }


def several(item: dict) -> dict:
    return {"type": "array", "minItems": 1, "maxItems": MAX_PROMPTS, "items": item}


def message() -> dict:
    part = obj({"type": {"type": "string", "enum": ["text"]}, "text": {"type": "string"}}, ["type", "text"])
    call = obj({"id": {"type": "string"}, "type": {"type": "string", "enum": ["function"]},
                "function": obj({"name": {"type": "string"}, "arguments": {"type": "string"}}, ["name", "arguments"])},
               ["function"])
    return obj({"role": {"type": "string", "enum": [r for r in ROLES if r != "tool"]},
                "content": {"oneOf": [{"type": "string"}, {"type": "array", "items": part}]},
                "name": {"type": "string"}, "tool_calls": {"type": "array", "items": call,
                                                           "description": "an assistant message's tool calls"}},
               ["role", "content"])


def tool_message() -> dict:
    return obj({"role": {"type": "string", "enum": ["tool"]}, "content": {"type": "string"},
                "tool_call_id": {"type": "string"}}, ["role", "content", "tool_call_id"])


FUNCTION = obj({"type": {"type": "string", "enum": ["function"]},
                "function": obj({"name": {"type": "string", "minLength": 1, "maxLength": MAX_TOOL_NAME_CHARS},
                                 "description": {"type": "string"}, "parameters": {"type": "object"},
                                 "strict": nullable({"type": "boolean"})}, ["name"])}, ["type", "function"])
TOOLING = {
    "tools": nullable({"type": "array", "minItems": 1, "maxItems": MAX_TOOLS, "items": FUNCTION,
                       "description": "function tools (names unique); tool calls come back in message.tool_calls"}),
    "tool_choice": nullable({"oneOf": [{"type": "string", "enum": ["none", "auto", "required"]},
                                       obj({"type": {"type": "string", "enum": ["function"]},
                                            "function": obj({"name": {"type": "string"}}, ["name"])},
                                           ["type", "function"])],
                             "description": "auto (default with tools), none, required, or one function by name; "
                                            "anything but none needs tools"}),
    "parallel_tool_calls": nullable({"type": "boolean", "description": "false: one call at most (required)"}),
}


EVENT = {"type": "object", "required": ["data"], "properties": {   # one server-sent event
    "data": {"type": "string", "description": "a chunk as JSON, an error as JSON, or [DONE]"}}}
USAGE = {"type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"], "properties": {
    "prompt_tokens": {"type": "integer"}, "completion_tokens": {"type": "integer"}, "total_tokens": {"type": "integer"},
    "prompt_tokens_details": {"type": "object", "properties": {"cached_tokens": {"type": "integer"}}}}}
ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type", "param", "code"],
    "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                   "param": {"type": "string", "nullable": True}, "code": {"type": "string", "nullable": True}}}}}


def completion(kind: str, choice: dict) -> dict:
    return {"type": "object", "required": ["id", "object", "created", "model", "choices", "usage"], "properties": {
        "id": {"type": "string"}, "object": {"type": "string", "enum": [kind]}, "created": {"type": "integer"},
        "model": {"type": "string"}, "system_fingerprint": {"type": "string", "nullable": True,
                                                             "description": "the revision of the model that answered"},
        "choices": {"type": "array", "items": choice}, "usage": USAGE}}


def choice(extra: dict) -> dict:
    return {"type": "object", "required": ["index", "finish_reason", *extra], "properties": {
        "index": {"type": "integer"}, "finish_reason": {"type": "string"},
        "logprobs": {"type": "object", "nullable": True}, **extra}}


def errors(*statuses: int) -> dict:
    retry = {"Retry-After": {"description": "seconds until a retry may pass", "schema": {"type": "integer"}}}
    body = {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}
    return {str(s): {"description": WHY[s], "content": body, **({"headers": retry} if s in (429, 503) else {})}
            for s in statuses}


WHY = {400: "invalid request: the message names the field or the limit", 401: "missing or wrong API key",
       403: "the stream to resume is another tenant's", 404: "no such model, or no such stream to resume",
       413: "body over MAX_BODY_BYTES", 429: "over the tenant's rate or concurrency limit",
       431: "too many header fields", 500: "the pipeline failed", 502: "the worker failed",
       503: "no worker could take the request soon"}


RESUME = {"name": "Last-Event-ID", "in": "header", "required": False,
          "description": "resume a stream after this event of it (its id: request id, sequence, offset); the body is "
                         "then read only for stream_options.include_usage",
          "schema": {"type": "string", "pattern": r"^[A-Za-z0-9_-]{1,64}\.[0-9]{1,15}\.[0-9]{1,15}$"}}


def operation(summary: str, body: dict, answer: dict) -> dict:
    return {"summary": summary, "parameters": [RESUME],
            "requestBody": {"required": True, "content": {"application/json": {"schema": body}}},
            "responses": {"200": {"description": "the completion, or server-sent events when stream is true",
                                  "content": {"application/json": {"schema": answer},
                                              "text/event-stream": {"schema": EVENT}}},
                          **errors(400, 401, 403, 404, 413, 429, 431, 503)}}


PIN = "a served model's name, or name@revision to pin one of its revisions (GET /v1/models lists them)"


def document(models: list[str], max_tokens: int) -> dict:
    """The document of a gateway serving `models` (their names; name@revision pins a revision, as the description
    says: a pin to a revision with no live worker is a 503)."""
    common = sampling(max_tokens)
    ids = {"type": "array", "minItems": 1, "items": {"type": "integer"}}
    chat = obj({"model": {"type": "string", "enum": models, "description": PIN},
                "messages": {"type": "array", "minItems": 1, "maxItems": MAX_MESSAGES,
                             "items": {"oneOf": [message(), tool_message()]}},
                "max_completion_tokens": integer(1, max_tokens), **common, **TOOLING,
                "logprobs": nullable({"type": "boolean"}), "top_logprobs": integer(0, MAX_LOGPROBS)},
               ["model", "messages"])
    text = obj({"model": {"type": "string", "enum": models, "description": PIN},
                "prompt": {"oneOf": [{"type": "string"}, ids, several({"type": "string"}), several(ids)]},
                "echo": nullable({"type": "boolean", "description": "each choice's text starts with its prompt (not "
                                                                    "with logprobs)"}),
                **common, "logprobs": integer(0, MAX_LOGPROBS)}, ["model", "prompt"])
    reply = {"type": "object", "required": ["role", "content"]}
    chat_answer = completion("chat.completion", choice({"message": reply}))
    text_answer = completion("text_completion", choice({"text": {"type": "string"}}))
    models = {"type": "object", "required": ["object", "data"], "properties": {
        "object": {"type": "string"}, "data": {"type": "array", "items": {
            "type": "object", "required": ["id", "object", "created", "owned_by"],
            "properties": {"id": {"type": "string"}, "object": {"type": "string"}, "created": {"type": "integer"},
                           "owned_by": {"type": "string"}, "revision": {"type": "string"},
                           "revisions": {"type": "array", "items": {"type": "object", "properties": {
                               "revision": {"type": "string"}, "share": {"type": "number"}}}},
                           "sampling_defaults": {"type": "object", "additionalProperties": {"type": "number"},
                                                 "description": "what a request that leaves a field of "
                                                                + ", ".join(generation.FIELDS) + " unset gets"}}}}}}
    health = {"type": "object", "required": ["status", "workers"],
              "properties": {"status": {"type": "string"}, "workers": {"type": "integer"}}}
    return {
        "openapi": "3.0.3",
        "info": {"title": "tokenbus", "version": "1", "description": "OpenAI-compatible completions over tokenbus"},
        "components": {"securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
                       "schemas": {"Error": ERROR}},
        "security": [{"bearer": []}],
        "paths": {
            "/v1/chat/completions": {"post": operation("a chat completion", chat, chat_answer)},
            "/v1/completions": {"post": operation("a text completion", text, text_answer)},
            "/v1/models": {"get": {"summary": "the served models, each with its revisions", "responses": {
                "200": {"description": "the models", "content": {"application/json": {"schema": models}}},
                **errors(401, 431)}}},
            "/v1/models/{model}": {"get": {
                "summary": "one served model", "parameters": [{"name": "model", "in": "path", "required": True,
                                                               "schema": {"type": "string"}}],
                "responses": {"200": {"description": "the model", "content": {"application/json": {
                    "schema": models["properties"]["data"]["items"]}}},
                              **errors(401, 404, 431)}}},
            **{path: {"get": {"summary": "ready when a worker is registered", "security": [], "responses": {
                "200": {"description": "ready", "content": {"application/json": {"schema": health}}},
                "503": {"description": "no worker", "content": {"application/json": {"schema": health}}}}}}
               for path in ("/healthz", "/health")},
        },
    }

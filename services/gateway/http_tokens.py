"""vLLM's token endpoints: POST /tokenize ({"model"?, "prompt" | "messages", "tools"?} → {"tokens", "count",
"max_model_len"}) and POST /detokenize ({"model"?, "tokens"} → {"prompt"}). A prompt is tokenized by a tokenizer
replica (request-reply on tb.tokenize), with the chat template the pipeline applies, so `count` is the
prompt_tokens a completion of the same prompt reports; detokenizing needs only the gateway's own tokenizer."""
import uuid

import nats.errors
from starlette.requests import Request as HttpRequest
from starlette.responses import Response

from schemas import subjects
from schemas.messages import GenerateRequest, Tokens, decode, encode
from schemas.sampling import MAX_TOKEN_ID, SamplingParams
from schemas.wire import WireError
from services.gateway import errors, frames, tools
from services.gateway.api import body
from services.gateway.errors import ApiError
from services.gateway.http_answer import json
from services.gateway.http_parse import bad, completion_prompt, messages, param_of
from services.gateway.session import Gateway

ASK_SECONDS = 10.0                                # a tokenizer's answer to tb.tokenize
FIELDS = {"tokenize": {"model", "prompt", "messages", "tools"},
          "detokenize": {"model", "tokens"}}


async def tokenize(request: HttpRequest) -> Response:
    gw: Gateway = request.app.state.gateway
    try:
        gw.authorize(request.headers, request.query_params)
        b = await checked(request, "tokenize")
        if ("prompt" in b) == ("messages" in b):
            raise bad("exactly one of prompt and messages is needed", "prompt")
        if "tools" in b:
            tools.checked(b["tools"])
        prompt = messages(b["messages"]) if "messages" in b else dict([completion_prompt(b["prompt"])])
        req = GenerateRequest(uuid.uuid4().hex, "default", SamplingParams(), **prompt, tools=b.get("tools"))
        try:
            req.check()
        except WireError as e:
            raise bad(str(e), param_of(str(e))) from None
        gw.choose(req, b.get("model"))
        got = await ask(gw, req)
    except ApiError as e:
        return e.response()
    return json({"tokens": got.token_ids, "count": len(got.token_ids), "max_model_len": got.max_model_len})


async def ask(gw: Gateway, req: GenerateRequest) -> Tokens:
    """A tokenizer replica's answer; 503 when none answers, the tokenizer's refusal as its error."""
    try:
        reply = await gw.nc.request(subjects.TOKENIZE, encode(req), timeout=ASK_SECONDS)
        got = decode(reply.data, Tokens)
    except (nats.errors.NoRespondersError, nats.errors.TimeoutError) as e:
        raise ApiError(503, f"no tokenizer answered ({type(e).__name__}); retry shortly", "unavailable",
                       retry_after=1) from None
    except WireError as e:
        raise ApiError(502, f"the tokenizer's answer was not a Tokens message: {e}", "bad_gateway") from None
    if got.code:
        raise errors.from_pipeline(got.code, got.message)
    return got


async def detokenize(request: HttpRequest) -> Response:
    gw: Gateway = request.app.state.gateway
    try:
        gw.authorize(request.headers, request.query_params)
        b = await checked(request, "detokenize")
        ids = b.get("tokens")
        if not frames.is_ints(ids) or (ids and not 0 <= min(ids) <= max(ids) <= MAX_TOKEN_ID):
            raise bad(f"tokens: required, an array of token ids in [0, {MAX_TOKEN_ID}]", "tokens")
        req = GenerateRequest("detokenize", "default", SamplingParams(), prompt_token_ids=ids)
        gw.choose(req, b.get("model"))
        _, revision = gw.served(req)
        tokenizer = revision.tokenizer if revision is not None else gw.tokenizer
        vocab = tokenizer.get_vocab_size(with_added_tokens=True)
        unknown = next((t for t in ids if t >= vocab), None)
        if unknown is not None:
            raise bad(f"tokens: {unknown} is outside the vocabulary [0, {vocab})", "tokens")
    except ApiError as e:
        return e.response()
    return json({"prompt": tokenizer.decode(ids, skip_special_tokens=False)})


async def checked(request: HttpRequest, kind: str) -> dict:
    """The body, its fields known and its model a string."""
    b = {k: v for k, v in (await body(request)).items() if v is not None}
    extra = sorted(b.keys() - FIELDS[kind])
    if extra:
        raise bad(f"{extra[0][:40]}: unknown or unsupported parameter", extra[0][:40])
    if not isinstance(b.get("model", ""), str):
        raise bad("model: expected a string", "model")
    return b

"""A tokenizer replica, a request-reply service in the tokenizers' queue group (one replica answers each
ask): tb.prepare tokenizes a request as the pipeline runs it (the chat template applied, then checked
against the model's context, vocabulary and what the engine can constrain) or names why not; the gateway
asks before it stores a request, the router when a stored request has no tokens. tb.tokenize answers
/tokenize: the tokens, whatever their count. It writes nothing to the bus."""
import argparse
import asyncio
import contextlib
import json
import os
import time
from pathlib import Path

import bus
from bus import lifecycle, tracing
from bus.lifecycle import Life
from bus.log import configure
from schemas import served, subjects
from schemas.messages import MAX_TEXT_CHARS, GenerateRequest, Tokens, decode, encode
from schemas.sampling import check_vocabulary, to_grammar
from schemas.served import SEPARATOR, Served
from schemas.wire import WireError
from services.tokenizer.segments import Segments
from text import toolcalls

LOG = configure("tokenizer")


class ContextTooLong(ValueError):
    """A prompt of at least the model's context: refused with code context_length_exceeded (HTTP 400)."""


class Tokenizer:
    """The model's tokenizer and the context limit it enforces."""

    def __init__(self, model_dir: str, max_model_len: int | None = None):
        from transformers import AutoTokenizer

        self.hf = AutoTokenizer.from_pretrained(model_dir)
        self.knows_tools = toolcalls.knows_tools(self.hf.chat_template if isinstance(self.hf.chat_template, str)
                                                 else None)
        config = json.loads((Path(model_dir) / "config.json").read_text())
        context = config.get("max_position_embeddings") or 1 << 30
        self.max_model_len = min(max_model_len or context, context)
        self.vocab_size = config.get("vocab_size") or len(self.hf)
        backend = getattr(self.hf, "backend_tokenizer", None)
        self.segments = Segments(backend) if backend is not None else None   # a chat's history, encoded once

    def encode(self, req: GenerateRequest) -> list[int]:
        """The prompt's token ids; ValueError naming the field or the limit."""
        check_vocabulary(req.sampling, self.vocab_size)
        to_grammar(req.sampling)                 # a constraint the engine cannot follow: refused before any worker
        ids = self.tokens(req)
        if len(ids) >= self.max_model_len:
            raise ContextTooLong(f"prompt has {len(ids)} tokens; the model's context is max_model_len="
                                 f"{self.max_model_len} tokens, which leaves no room for output")
        return ids

    def tokens(self, req: GenerateRequest) -> list[int]:
        """The prompt's token ids, whatever their count; ValueError naming the field."""
        if req.messages is not None:
            ids = self.chat(req.messages, req.tools)
        elif req.prompt is not None:
            ids = self.hf.encode(req.prompt)
        else:
            ids = req.prompt_token_ids
            bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                raise ValueError(f"prompt_token_ids: token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        if not ids:
            raise ValueError("prompt is empty: at least one token is needed")
        return ids

    def chat(self, messages: list[dict[str, str]], tools: list[dict] | None = None) -> list[int]:
        """The chat template's tokens. A template that renders tools is given them (and the history's tool calls
        as objects); one that does not gets text it can render: the default tool prompt, calls and results
        written as the hermes format (text/toolcalls.py)."""
        for i, m in enumerate(messages):
            if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise ValueError(f"messages[{i}]: needs a string role and a string content")
        if self.knows_tools:
            messages, kw = [with_calls(m) for m in messages], {"tools": tools} if tools else {}
        else:
            messages, kw = toolcalls.plain_history(messages, tools), {}
        try:
            text = self.hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kw)
        except Exception as e:                   # the template's own complaints (roles, order)
            raise ValueError(f"messages: the chat template refused them: {e}") from None
        if self.segments is None:
            return self.hf.encode(text, add_special_tokens=False)
        return self.segments(text)


def with_calls(m: dict[str, str]) -> dict:
    """A message as a tool-aware template takes it: tool_calls as objects, each call's arguments an object."""
    if "tool_calls" not in m:
        return m
    calls = json.loads(m["tool_calls"])
    for c in calls:
        with contextlib.suppress(ValueError):
            c["function"]["arguments"] = json.loads(c["function"]["arguments"])
    return {**m, "tool_calls": calls}


class Tokenizers:
    """A Tokenizer per served model and revision (one per directory of files); the first is the default,
    for a request that names no model. Made with one() it has one tokenizer, for whatever model is asked."""

    def __init__(self, models: list[Served], max_model_len: int | None = None):
        by_dir: dict[str, Tokenizer] = {}
        for m in models:
            if m.files not in by_dir:
                by_dir[m.files] = Tokenizer(m.files, max_model_len)
        self.of = {(m.name, m.revision): by_dir[m.files] for m in models}
        self.default, self.any = next(iter(self.of), ("", "")), False

    @classmethod
    def one(cls, tok: Tokenizer) -> "Tokenizers":
        toks = cls([])
        toks.of, toks.default, toks.any = {("", ""): tok}, ("", ""), True
        return toks

    def pick(self, req: GenerateRequest) -> Tokenizer:
        """The request's model's tokenizer; ValueError naming the model when it is not served here."""
        if not req.model or self.any:
            return self.of[self.default]
        tok = self.of.get((req.model, req.revision))
        if tok is None and not req.revision:
            tok = next((t for (name, _), t in self.of.items() if name == req.model), None)
        if tok is None:
            served = ", ".join(f"{n}{SEPARATOR}{r}" for n, r in self.of)
            raise ValueError(f"model {req.model}{SEPARATOR * bool(req.revision)}{req.revision} is not served by this "
                             f"tokenizer (it serves {served})")
        return tok


class TokenizerService:
    def __init__(self, nc, tokenizer: Tokenizer | Tokenizers, life: Life | None = None):
        self.nc = nc
        self.toks = tokenizer if isinstance(tokenizer, Tokenizers) else Tokenizers.one(tokenizer)
        self.log = LOG
        self.life = life or Life("tokenizer", f"t-{os.getpid()}", LOG)   # SIGTERM, tokenbus drain

    @property
    def tok(self) -> Tokenizer:
        return self.toks.of[self.toks.default]

    async def run(self) -> None:
        """Answers until asked to stop or drain. Draining, it leaves the queue group (the other replicas
        answer what comes) and answers what it had received."""
        subs = [await self.nc.subscribe(subjects.PREPARE, queue=subjects.TOKENIZE_QUEUE, cb=self.prepare),
                await self.nc.subscribe(subjects.TOKENIZE, queue=subjects.TOKENIZE_QUEUE, cb=self.tokenize)]
        await self.life.listen(self.nc)
        self.log.info("tokenizer ready", max_model_len=self.tok.max_model_len,
                      models=[f"{n}{SEPARATOR}{r}" for n, r in self.toks.of])
        self.life.ready = True
        await self.life.asked.wait()
        if not self.life.stopping.is_set():
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.gather(*(sub.drain() for sub in subs)),
                                       max(0.0, self.life.deadline - time.monotonic()))
        await self.life.left()

    async def prepare(self, msg) -> None:
        """tb.prepare: the request's tokens as the pipeline runs them, or its refusal (code, message); with
        tracing on, in a span `tokenize` of the request's trace (the asker's headers carry it)."""
        if not tracing.ON:
            await msg.respond(encode(self.prepared(msg.data)))
            return
        rid = (msg.headers or {}).get(subjects.REQUEST_ID, "")
        with tracing.span("tokenize", tracing.context_of(msg.headers), {"tokenbus.request_id": rid},
                          tracing.SpanKind.SERVER) as span:
            got = self.prepared(msg.data)
            span.set_attribute("gen_ai.usage.input_tokens", len(got.token_ids))
            if got.code:
                tracing.error(span, got.code)
            await msg.respond(encode(got))

    def prepared(self, data: bytes) -> Tokens:
        try:
            req = decode(data, GenerateRequest)
        except WireError as e:
            return refused("invalid_request", str(e))
        try:
            tok = self.toks.pick(req)
        except ValueError as e:
            return refused("model_not_found", str(e), req.id)
        try:
            ids = tok.encode(req)
        except ValueError as e:
            return refused("context_length_exceeded" if isinstance(e, ContextTooLong) else "invalid_request", str(e),
                           req.id)
        self.log.info("tokenized", request_id=req.id, tenant=req.tenant, prompt_tokens=len(ids))
        return Tokens(ids, tok.max_model_len)

    async def tokenize(self, msg) -> None:
        """tb.tokenize: the tokens of a GenerateRequest's prompt, as the pipeline would run it (/tokenize)."""
        try:
            req = decode(msg.data, GenerateRequest)
            tok = self.toks.pick(req)
        except (WireError, ValueError) as e:
            await msg.respond(encode(Tokens([], 0, "invalid_request", str(e)[:MAX_TEXT_CHARS])))
            return
        try:
            out = Tokens(tok.tokens(req), tok.max_model_len)
        except ValueError as e:
            out = Tokens([], tok.max_model_len, "invalid_request", str(e)[:MAX_TEXT_CHARS])
        await msg.respond(encode(out))


def refused(code: str, message: str, rid: str | None = None) -> Tokens:
    LOG.error("request refused", request_id=rid, code=code, error=message)
    return Tokens([], 0, code, message[:MAX_TEXT_CHARS])


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m services.tokenizer", description="A tokenbus tokenizer replica.")
    p.add_argument("--nats-url", default="nats://127.0.0.1:4222")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--model", help="HF checkpoint directory (its tokenizer and config.json)")
    which.add_argument("--models", metavar="FILE", help="a served models file (schemas/served.py, written by "
                       "tokenbus up): a tokenizer for each model and revision")
    p.add_argument("--max-model-len", type=int)
    p.add_argument("--id", help="tokenizer id, a subject token (default t-<pid>)")
    lifecycle.add_arguments(p)
    return p


def tokenizers(args) -> Tokenizers:
    if args.models:
        return Tokenizers(served.load(args.models), args.max_model_len)
    return Tokenizers.one(Tokenizer(args.model, args.max_model_len))


async def serve(args) -> None:
    name = subjects.token("tokenizer id", args.id or f"t-{os.getpid()}")
    tracing.setup("tokenizer", name, args.otlp_endpoint)
    life = Life("tokenizer", name, LOG.bind(tokenizer=name), args.drain_timeout)
    life.on_signals()
    await life.serve_probes(args.health_host, args.health_port)
    service = TokenizerService(await bus.connect(args.nats_url, "tokenizer", LOG), tokenizers(args), life)
    try:
        await service.run()
    finally:
        await bus.close(service.nc)
        await life.close()


def main(argv=None) -> None:
    bus.run(serve(parser().parse_args(argv)))

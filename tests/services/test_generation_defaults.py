"""The served model's sampling defaults at the gateway: every API fills the fields a request leaves unset before
the request is stored in the request log (what the fake pipeline reads back), a field a request sets keeps its
value, a greedy request stays plain greedy, GET /v1/models shows them, and --generation-config none or a file
replaces them."""
import asyncio
import json
import urllib.request
from pathlib import Path

import orjson
import pytest
from tokenizers import Tokenizer
from websockets.asyncio.client import connect

from schemas import generation
from schemas.sampling import SamplingParams
from services.gateway.app import main, parser
from tests.services.fake_pipeline import gateway

DEFAULTS = {"temperature": 0.3, "top_p": 0.8, "top_k": 40, "repetition_penalty": 1.2}
PLAIN = SamplingParams()                          # what a field gets without defaults


@pytest.fixture(scope="module")
def tok(tiny_model) -> Tokenizer:
    return Tokenizer.from_file(f"{tiny_model}/tokenizer.json")


@pytest.fixture
def recommended(tiny_model, tmp_path) -> str:
    """The tiny model (its files linked) whose generation_config.json recommends DEFAULTS."""
    for f in Path(tiny_model).iterdir():
        (tmp_path / f.name).symlink_to(f)
    config = json.loads((Path(tiny_model) / generation.CONFIG).read_text())
    (tmp_path / generation.CONFIG).unlink()
    (tmp_path / generation.CONFIG).write_text(json.dumps({**config, **DEFAULTS}))
    return str(tmp_path)


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, orjson.dumps(body), {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return orjson.loads(r.read())


def get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as r:
        return orjson.loads(r.read())


async def ws_turn(url: str, **fields) -> None:
    async with connect(url) as ws:
        await ws.send(orjson.dumps({"type": "generate", "id": "g", "prompt": "hi", "max_tokens": 4, **fields}).decode())
        while orjson.loads(await asyncio.wait_for(ws.recv(), 30))["type"] not in ("done", "error"):
            pass


def sampled(p: SamplingParams) -> dict:
    return {k: getattr(p, k) for k in generation.FIELDS}


def run(nats_url, model, tok, body, **options) -> None:
    """body(down) against a gateway of `model` (create_app's options) and the fake pipeline."""
    async def main():
        async with gateway(nats_url, model, tok, **options) as down:
            await body(down)

    asyncio.run(asyncio.wait_for(main(), 60))


def test_every_api_logs_a_request_without_sampling_fields_with_the_model_s_defaults(nats_url, recommended, tok):
    async def body(down):
        await ws_turn(down.ws)
        await asyncio.to_thread(post, down.http + "/v1/chat/completions",
                                {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
        await asyncio.to_thread(post, down.http + "/v1/completions", {"model": "tiny", "prompt": "hi", "n": 2})
        await asyncio.to_thread(post, down.http + "/v1/responses",
                                {"model": "tiny", "input": "hi", "max_output_tokens": 4, "store": False})
        assert [r.meter.api for r in down.requests] == ["ws", "chat", "completions", "completions", "responses"]
        assert all(sampled(r.sampling) == {**sampled(PLAIN), **DEFAULTS} for r in down.requests), down.requests
        card = await asyncio.to_thread(get, down.http + "/v1/models/tiny")
        assert card["sampling_defaults"] == DEFAULTS
        assert (await asyncio.to_thread(get, down.http + "/v1/models"))["data"] == [card]

    run(nats_url, recommended, tok, body)


def test_a_field_a_request_sets_wins_even_at_the_plain_default_and_greedy_stays_plain_greedy(nats_url, recommended,
                                                                                            tok):
    async def body(down):
        await ws_turn(down.ws, temperature=0.9, top_p=1.0)
        await asyncio.to_thread(post, down.http + "/v1/chat/completions",
                                {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                                 "repetition_penalty": 1.0, "temperature": None})
        await ws_turn(down.ws, temperature=0)
        await asyncio.to_thread(post, down.http + "/v1/completions", {"model": "tiny", "prompt": "hi",
                                                                      "temperature": 0, "top_k": 5})
        own, chat, greedy, greedy_k = (sampled(r.sampling) for r in down.requests)
        assert own == {**DEFAULTS, "temperature": 0.9, "top_p": 1.0, "min_p": 0.0}
        assert chat == {**DEFAULTS, "repetition_penalty": 1.0, "min_p": 0.0}      # null is "not given"
        assert greedy == sampled(SamplingParams(temperature=0))
        assert greedy_k == sampled(SamplingParams(temperature=0, top_k=5))

    run(nats_url, recommended, tok, body)


def test_generation_config_none_restores_sampling_params_own_and_a_file_replaces_the_model_s(nats_url, recommended,
                                                                                          tok, tmp_path):
    async def body(down):
        await ws_turn(down.ws)
        assert sampled(down.requests[0].sampling) == sampled(PLAIN)
        assert (await asyncio.to_thread(get, down.http + "/v1/models/tiny"))["sampling_defaults"] == {}

    run(nats_url, recommended, tok, body, generation_config="none")
    mine = tmp_path / "mine.json"
    mine.write_text(json.dumps({"min_p": 0.05}))

    async def replaced(down):
        await ws_turn(down.ws)
        assert sampled(down.requests[-1].sampling) == {**sampled(PLAIN), "min_p": 0.05}   # the log holds both

    run(nats_url, recommended, tok, replaced, generation_config=str(mine))


def test_the_gateway_takes_generation_config_auto_by_default_and_a_bad_file_stops_it_naming_it(tiny_model,
                                                                                             tmp_path):
    assert parser().parse_args(["--model", tiny_model]).generation_config == "auto"
    bad = tmp_path / "bad.json"
    bad.write_text('{"top_p": 0}')
    with pytest.raises(SystemExit, match=f"gateway: generation config {bad}: top_p must be in"):
        main(["--model", tiny_model, "--generation-config", str(bad)])

"""Several models in one stack: two tiny models with different weights served at once, each request answered
by its own model (the offline engine's greedy tokens of that model); /v1/models with every revision; a
pinned revision and a wrong one; a 30% canary of the second model decided per request id, its revision in
every response and usage record."""
import asyncio
import math

import pytest
import websockets

from ops import usage
from ops.procs import free_port
from ops.status import read_registry
from ops.up import Entry, Stack
from schemas.messages import Usage
from schemas.revision import revision
from services.gateway.models import fraction
from services.recorder.store import Window
from tests.e2e.conftest import WORKER_ARGS, collect, get, post, running, send

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

PROMPT = [5, 17, 99, 230, 41, 7, 300, 12]
SHARE = 0.3


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    """Three tiny checkpoints, each with weights of its own seed."""
    from workers.models.builder import build_tiny_model

    root = tmp_path_factory.mktemp("models")
    return {name: str(build_tiny_model(root / name, seed=seed)) for name, seed in (("a", 0), ("b", 1), ("b2", 2))}


@pytest.fixture(scope="module")
def stack(models, tmp_path_factory):
    """alpha (model a), beta (model b) and beta's canary (model b2, SHARE of beta's requests): a worker each."""
    entries = [Entry(models["a"], "alpha"), Entry(models["b"], "beta"), Entry(models["b2"], "beta", share=SHARE)]
    with running(Stack(models["a"], free_port(), tmp_path_factory.mktemp("stack"), nats_port=free_port(),
                       worker_args=[*WORKER_ARGS, "--threads", "1"], models=entries)) as s:
        yield s


def greedy(model: str) -> list[int]:
    from workers import LLM, SamplingParams

    with LLM(model, num_kv_blocks=64) as llm:
        return llm.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0].token_ids


def test_two_models_served_at_once_each_request_answered_by_its_own_model(stack, models):
    rev = {name: revision(path) for name, path in models.items()}
    expected = {"alpha": greedy(models["a"]), f"beta@{rev['b']}": greedy(models["b"]),
                f"beta@{rev['b2']}": greedy(models["b2"])}
    assert len({tuple(t) for t in expected.values()}) == 3           # different weights, different answers

    async def ask() -> dict:
        async with websockets.connect(stack.url) as ws:
            for i, model in enumerate(expected):
                await send(ws, {"type": "generate", "id": str(i), "model": model, "prompt_token_ids": PROMPT,
                                "max_tokens": 8, "temperature": 0, "ignore_eos": True})
            return await collect(ws, {str(i) for i in range(len(expected))})

    got = asyncio.run(ask())
    for i, (model, tokens) in enumerate(expected.items()):
        assert got[str(i)]["token_ids"] == tokens, model
        assert got[str(i)]["end"]["model"] == model.split("@")[0]
    assert got["0"]["end"]["revision"] == rev["a"] and got["2"]["end"]["revision"] == rev["b2"]
    beats = {hb.worker: (hb.model, hb.revision) for hb in asyncio.run(read_registry(stack.nats_url))}
    assert beats == {"w0": ("alpha", rev["a"]), "w1": ("beta", rev["b"]), "w2": ("beta", rev["b2"])}


def test_v1_models_lists_every_model_with_its_revisions_and_a_wrong_revision_is_a_404(stack, models):
    rev = {name: revision(path) for name, path in models.items()}
    status, body = get(stack.http + "/v1/models")
    assert status == 200
    cards = {c["id"]: c for c in body["data"]}
    assert list(cards) == ["alpha", "beta"] and cards["alpha"]["revision"] == rev["a"]
    assert cards["beta"]["revision"] == rev["b"] and cards["beta"]["object"] == "model"
    assert cards["beta"]["revisions"] == [{"revision": rev["b"], "share": 1 - SHARE},
                                          {"revision": rev["b2"], "share": SHARE}]
    assert get(f"{stack.http}/v1/models/beta@{rev['b2']}")[1]["revision"] == rev["b2"]
    status, body = post(stack.http + "/v1/completions", {"model": "beta@0123456789ab", "prompt": PROMPT})
    assert (status, body["error"]["code"]) == (404, "model_not_found")
    assert f"model 'beta' has no revision '0123456789ab'; it serves beta@{rev['b']}, beta@{rev['b2']}" \
        in body["error"]["message"]
    status, body = post(stack.http + "/v1/completions", {"model": "gamma", "prompt": PROMPT})
    assert status == 404 and "this server serves 'alpha', 'beta'" in body["error"]["message"]


def test_a_canary_takes_its_share_by_request_id_with_the_revision_in_every_response_and_usage_record(stack, models):
    rev = {revision(models["b"]): False, revision(models["b2"]): True}
    n = 40
    answers = [post(stack.http + "/v1/completions", {"model": "beta", "prompt": PROMPT, "max_tokens": 1})
               for _ in range(n)]
    assert all(status == 200 for status, _ in answers)
    canary = 0
    for _, body in answers:
        rid, fp = body["id"].removeprefix("cmpl-"), body["system_fingerprint"]
        assert rev[fp] == (fraction(rid) < SHARE), body                # the split is the request id's
        canary += rev[fp]
    assert abs(canary - n * SHARE) <= 4 * math.sqrt(n * SHARE * (1 - SHARE)), canary
    records = asyncio.run(usage_records(stack))
    served = {body["id"].removeprefix("cmpl-"): body["system_fingerprint"] for _, body in answers}
    assert {r.id: r.revision for r in records if r.id in served} == served
    assert {r.model for r in records if r.id in served} == {"beta"}


async def usage_records(stack, wait: float = 2.0) -> list[Usage]:
    """Every usage record, from the recorder's database and the bus, once the last has had `wait` s to land."""
    await asyncio.sleep(wait)
    return await usage.requests(stack.nats_url, stack.database_url, Window())

"""A tenant's weight (the fair scheduling policy's share) at the gateway: from the keys file, the same
for every key of a tenant, set on each request from its key and never from the client. And admission
in front of fair workers: another tenant's burst at the queue watermark does not keep a tenant out."""
import dataclasses
import json

import orjson
import pytest
from websockets.asyncio.client import connect

from services.gateway import keys
from services.gateway.admission import Admission
from services.gateway.errors import ApiError
from tests.services.fake_pipeline import gateway, heartbeat
from tests.services.test_gateway_api import chat, error_of, post, run

KEYS = {"sk-heavy": {"tenant": "acme", "weight": 2.5}, "sk-heavy-batch": {"tenant": "acme", "weight": 2.5,
                                                                         "class": "batch"},
        "sk-plain": {"tenant": "globex"}, "sk-null": {"tenant": "initech", "weight": None}}


def test_a_tenant_s_weight_comes_from_the_keys_file_default_1_and_bad_ones_are_named(tmp_path, keys_file):
    loaded = {k.tenant + ":" + k.traffic_class: k.weight for k in keys.load(keys_file).values()}
    assert loaded == {"acme:interactive": 2.5, "acme:batch": 2.5, "globex:interactive": 1.0,
                      "initech:interactive": 1.0}
    for weight in (0, -1, 1001, "2", True, [2]):
        path = tmp_path / "bad.json"
        path.write_text(json.dumps({"sk-x": {"tenant": "a", "weight": weight}}))
        with pytest.raises(ValueError, match=r"key \w{12}: weight must be a number in \[0\.001, 1000\] "
                                             rf"\(got {weight!r}\)".replace("[2]", r"\[2\]")):
            keys.load(path)
    path.write_text(json.dumps({"sk-x": {"tenant": "a", "weight": 2}, "sk-y": {"tenant": "a", "weight": 3}}))
    with pytest.raises(ValueError, match=r"tenant 'a': keys \w{12} and \w{12} give different weight \(2\.0 and "
                                         r"3\.0\); weights are per tenant"):
        keys.load(path)
    path.write_text(json.dumps({"sk-x": {"tenant": "a", "weight": 1}, "sk-y": {"tenant": "a"}}))
    assert {k.weight for k in keys.load(path).values()} == {1.0}      # 1 is the default: they agree


def test_each_request_carries_its_key_s_weight_on_both_apis_and_a_client_cannot_set_one(
        nats_url, tiny_model, tok, keys_file):
    async def body():
        async with gateway(nats_url, tiny_model, tok, api_keys=keys_file) as down:
            for key in ("sk-heavy", "sk-plain", "sk-null"):
                status, _, got = await post(down, "/v1/chat/completions", chat("q"), key=key)
                assert status == 200, got
            status, _, got = await post(down, "/v1/completions", {"model": "tiny", "prompt": "q"}, key="sk-heavy")
            assert status == 200, got
            assert [(r.tenant, r.weight) for r in down.requests] == [("acme", 2.5), ("globex", 1.0),
                                                                      ("initech", 1.0), ("acme", 2.5)]
            status, _, got = await post(down, "/v1/chat/completions", chat("q", weight=100), key="sk-plain")
            error_of(status, got, 400, "weight: unknown or unsupported parameter")
            async with connect(down.ws + "?api_key=sk-heavy") as ws:
                await ws.send(orjson.dumps({"type": "generate", "id": "g", "prompt": "q"}).decode())
                while orjson.loads(await ws.recv())["type"] != "done":
                    pass
                await ws.send(orjson.dumps({"type": "generate", "id": "w", "prompt": "q", "weight": 9}).decode())
                f = orjson.loads(await ws.recv())
            assert f["type"] == "error" and "weight: unknown field in a generate frame" in f["message"]
            assert [(r.tenant, r.weight) for r in down.requests[4:]] == [("acme", 2.5)]
    run(body())


@pytest.mark.parametrize("policy", ["fair", "fcfs"])
def test_on_a_fair_worker_past_the_queue_watermark_a_tenant_with_nothing_in_flight_still_gets_one_request_in(policy):
    a = Admission()
    a.cluster.update(dataclasses.replace(heartbeat("w0", max_num_seqs=2), scheduling_policy=policy))
    flood, steady = keys.Key("k1", "flood"), keys.Key("k2", "steady")
    tickets = [a.admit(flood, 1, 1, now=0.0) for _ in range(4)]      # 2 running + 2 queued: the watermark
    with pytest.raises(ApiError, match="QUEUE_WATERMARK"):
        a.admit(flood, 1, 1, now=0.0)
    if policy == "fcfs":                                            # FCFS would queue it behind the flood
        with pytest.raises(ApiError, match="QUEUE_WATERMARK"):
            a.admit(steady, 1, 1, now=0.0)
        return
    ticket = a.admit(steady, 1, 1, now=0.0)
    with pytest.raises(ApiError, match="QUEUE_WATERMARK"):          # one: the queue stays bounded
        a.admit(steady, 1, 1, now=0.0)
    a.settle(ticket, 2, now=0.0)
    a.admit(steady, 1, 1, now=0.0)                                   # idle again
    a.settle(tickets[0], 2, now=0.0)
    with pytest.raises(ApiError, match="QUEUE_WATERMARK"):          # the flood is still held to it
        a.admit(flood, 1, 1, now=0.0)

"""Traffic classes and priorities at the gateway: a key's class and priority in the keys file, batch
requests admitted only into spare capacity, and a request's priority (asked, clamped to its key's, or
its key's default) carried into the GenerateRequest on both APIs."""
import json
import time

import orjson
import pytest
from websockets.asyncio.client import connect

from schemas.messages import MAX_PRIORITY
from services.gateway import keys
from services.gateway.admission import BATCH_KV_FREE, BATCH_WATERMARK, Admission
from services.gateway.errors import ApiError
from tests.services.fake_pipeline import gateway, heartbeat
from tests.services.test_gateway_api import chat, error_of, post, run

KEYS = {"sk-live": {"tenant": "acme"}, "sk-nightly": {"tenant": "acme", "class": "batch"},
        "sk-low": {"tenant": "globex", "priority": 5}}


def test_a_key_s_class_and_priority_come_from_the_keys_file_and_bad_ones_are_named(tmp_path, keys_file):
    loaded = {k.tenant + ":" + k.traffic_class: k for k in keys.load(keys_file).values()}
    assert (loaded["acme:interactive"].priority, loaded["acme:batch"].priority) == (0, keys.BATCH_PRIORITY)
    assert loaded["acme:batch"].batch and not loaded["acme:interactive"].batch
    assert loaded["globex:interactive"].priority == 5
    for entry, words in [({"tenant": "a", "class": "bulk"}, "class must be one of interactive, batch (got 'bulk')"),
                         ({"tenant": "a", "priority": "high"}, "priority must be an integer in"),
                         ({"tenant": "a", "priority": MAX_PRIORITY + 1}, "priority must be an integer in")]:
        path = tmp_path / "bad.json"
        path.write_text(json.dumps({"sk-x": entry}))
        with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
            keys.load(path)


def admission(**worker) -> Admission:
    a = Admission()
    a.cluster.update(heartbeat("w0", **worker))
    return a


LIVE, NIGHTLY = keys.Key("k1", "acme"), keys.Key("k2", "acme", traffic_class="batch", priority=100)


@pytest.mark.parametrize(("worker", "spare"), [
    ({"running": 10, "max_num_seqs": 16}, True),
    ({"running": 12, "max_num_seqs": 16}, False),               # 12 = BATCH_WATERMARK × 16: no spare room
    ({"running": 1, "waiting": 1, "max_num_seqs": 16}, False),  # anything waiting: none
    ({"running": 1, "max_num_seqs": 16, "kv_blocks": 100}, True),
])
def test_a_batch_request_is_admitted_only_into_spare_capacity_and_interactive_ones_still_are(worker, spare):
    assert BATCH_WATERMARK * 16 == 12
    a = admission(**worker)
    a.admit(LIVE, 10, 10)                                   # interactive: the usual rules
    if spare:
        a.admit(NIGHTLY, 10, 10)
        return
    with pytest.raises(ApiError) as e:
        a.admit(NIGHTLY, 10, 10)
    assert e.value.status == 503 and e.value.code == "overloaded" and e.value.retry_after == 5.0
    assert f"BATCH_WATERMARK={BATCH_WATERMARK}" in e.value.message


def test_a_worker_with_little_kv_free_has_no_room_for_batch_requests():
    a = admission(running=1, max_num_seqs=16, kv_blocks=100)
    hb = a.cluster.workers["w0"]
    hb.kv_blocks_free = int(BATCH_KV_FREE * 100) - 1
    with pytest.raises(ApiError, match=r"BATCH_KV_FREE=0\.25"):
        a.admit(NIGHTLY, 10, 10)
    a.admit(LIVE, 10, 10)
    hb.kv_blocks_free, hb.ts = int(BATCH_KV_FREE * 100), time.time()
    a.admit(NIGHTLY, 10, 10)


def test_a_request_s_priority_is_asked_clamped_to_its_key_s_or_its_key_s_default_on_both_apis(
        nats_url, tiny_model, tok, keys_file):
    async def body():
        async with gateway(nats_url, tiny_model, tok, api_keys=keys_file) as down:
            asked = [("sk-live", 7, 7), ("sk-live", -3, 0), ("sk-live", None, 0), ("sk-low", 2, 5),
                     ("sk-low", 9, 9), ("sk-low", None, 5), ("sk-nightly", None, keys.BATCH_PRIORITY)]
            for key, priority, _ in asked:
                b = chat("q") if priority is None else chat("q", priority=priority)
                status, _, got = await post(down, "/v1/chat/completions", b, key=key)
                assert status == 200, got
            assert [r.priority for r in down.requests] == [want for *_, want in asked]
            status, _, got = await post(down, "/v1/completions", {"model": "tiny", "prompt": "q", "priority": "x"},
                                        key="sk-live")
            error_of(status, got, 400, "priority: must be an integer in")
            assert got["error"]["param"] == "priority"
            async with connect(down.ws + "?api_key=sk-low") as ws:
                for i, p in enumerate((1, 8)):
                    await ws.send(orjson.dumps({"type": "generate", "id": f"p{i}", "prompt": "q",
                                                "priority": p}).decode())
                    while orjson.loads(await ws.recv())["type"] != "done":
                        pass
                await ws.send(orjson.dumps({"type": "generate", "id": "bad", "prompt": "q",
                                            "priority": 2**40}).decode())
                f = orjson.loads(await ws.recv())
            assert [r.priority for r in down.requests[-2:]] == [5, 8]
            assert f["type"] == "error" and f["id"] == "bad" and "priority: must be an integer in" in f["message"]
    run(body())

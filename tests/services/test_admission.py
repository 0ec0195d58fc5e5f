"""Keys files, token buckets and cluster admission, in memory."""
import dataclasses
import hashlib
import json
import time

import pytest

from schemas.messages import GenerateRequest
from schemas.sampling import SamplingParams
from schemas.subjects import WORKER_TTL
from services.gateway import keys
from services.gateway.admission import Admission, TokenBucket, estimate
from services.gateway.errors import ApiError
from tests.services.fake_pipeline import heartbeat


def write(tmp_path, obj) -> str:
    path = tmp_path / "keys.json"
    path.write_text(json.dumps(obj) if not isinstance(obj, str) else obj)
    return str(path)


def test_a_keys_file_maps_keys_and_their_sha256_to_tenants(tmp_path):
    digest = hashlib.sha256(b"sk-two").hexdigest()
    table = keys.load(write(tmp_path, {"sk-one": {"tenant": "a", "tokens_per_minute": 10},
                                       f"sha256:{digest.upper()}": {"tenant": "b", "max_concurrent_requests": 2}}))
    one = table[hashlib.sha256(b"sk-one").hexdigest()]
    assert (one.tenant, one.tokens_per_minute, one.max_concurrent_requests) == ("a", 10, None)
    assert one.id == hashlib.sha256(b"sk-one").hexdigest()[:12] and "sk-one" not in repr(table)
    assert table[digest] == keys.Key(digest[:12], "b", None, 2)


@pytest.mark.parametrize(("content", "message"), [
    ("{", "api keys"),
    ({}, "non-empty JSON object"),
    ({"sk-secret": "acme"}, "expected an object"),
    ({"sk-secret": {"tenant": "a.b"}}, "tenant 'a.b' must be 1-64 characters"),
    ({"sk-secret": {"tenant": "a", "tokens_per_minute": 0}}, "tokens_per_minute must be a positive integer"),
    ({"sk-secret": {"tenant": "a", "rpm": 5}}, "unknown field 'rpm'"),
    ({"sha256:abc": {"tenant": "a"}}, "needs 64 hex digits"),
    ({"sk-secret": {"tenant": "a", "tokens_per_minute": 5}, "sk-secret2": {"tenant": "a", "tokens_per_minute": 6}},
     "limits are per tenant"),
])
def test_a_bad_keys_file_is_refused_naming_the_field_but_never_the_key(tmp_path, content, message):
    with pytest.raises(ValueError, match="api keys") as e:
        keys.load(write(tmp_path, content))
    assert message in str(e.value) and "sk-secret" not in str(e.value)


def test_serving_beyond_loopback_needs_keys():
    keys.check_exposure("127.0.0.1", None)
    keys.check_exposure("localhost", None)
    keys.check_exposure("0.0.0.0", "keys.json")
    for host in ("0.0.0.0", "::", "10.1.2.3"):
        with pytest.raises(ValueError, match="without --api-keys"):
            keys.check_exposure(host, None)


def test_a_token_bucket_refills_at_its_rate_and_says_how_long_to_wait():
    b = TokenBucket(600, now=0.0)                  # 10 tokens a second
    assert b.wait(600, 0.0) == 0
    b.take(550, 0.0)
    assert b.wait(100, 0.0) == pytest.approx(5.0)
    assert b.wait(100, 5.0) == 0
    b.take(-1000, 5.0)                            # a refund never lifts it above its capacity
    assert b.level == 600


def admission_with_worker(**hb) -> Admission:
    a = Admission()
    a.cluster.update(heartbeat(**hb))
    return a


def test_admission_charges_prompt_and_max_tokens_and_settles_with_what_was_used():
    a = admission_with_worker()
    key = keys.Key("id", "t", tokens_per_minute=1000, max_concurrent_requests=5)
    ticket = a.admit(key, 100, 800, now=0.0)
    with pytest.raises(ApiError) as refused:
        a.admit(key, 100, 800, now=0.0)
    assert refused.value.status == 429 and 47 <= refused.value.retry_after <= 49   # 800 more at 1000/min
    a.settle(ticket, 150, now=0.0)                # used 150 of the 900 charged
    a.settle(ticket, 150, now=0.0)                # once only
    assert a.tenants["t"].bucket.level == pytest.approx(850) and a.tenants["t"].active == 0
    a.admit(key, 100, 700, now=0.0)


def test_admission_refuses_everything_while_the_metering_backlog_is_full_and_not_after():
    a = admission_with_worker()
    a.backlog = "metering backlog full: TB_USAGE holds 9.0 MiB of records the recorder has not taken"
    for place in (True, False):                   # the cluster's requests and the fallback's alike
        with pytest.raises(ApiError) as refused:
            a.admit(keys.OPEN, 1, 1, now=0.0, place=place)
        assert (refused.value.status, refused.value.code) == (503, "unavailable")
        assert str(refused.value).startswith("metering backlog full") and refused.value.retry_after == 5.0
    assert a.tenants == {}                        # nothing charged
    a.backlog = ""
    a.settle(a.admit(keys.OPEN, 1, 1, now=0.0), 2)


def test_admission_refuses_when_every_worker_is_past_the_watermark_and_counts_what_it_sent():
    a = admission_with_worker(max_num_seqs=2)
    key = keys.OPEN
    for _ in range(4):                            # 2 running + 2 queued: the watermark
        a.admit(key, 1, 1, now=0.0)
    with pytest.raises(ApiError) as busy:
        a.admit(key, 1, 1, now=0.0)
    assert busy.value.status == 503 and busy.value.retry_after == 1.0
    a.cluster.update(heartbeat(max_num_seqs=2))   # the same counts again (a stand-in beat): still busy
    with pytest.raises(ApiError):
        a.admit(key, 1, 1, now=0.0)
    a.cluster.update(dataclasses.replace(heartbeat(max_num_seqs=2), requests_finished=4))   # the queue drained
    a.admit(key, 1, 1, now=0.0)


def test_a_request_that_ends_no_longer_loads_its_worker_whichever_heartbeat_counted_it():
    a = admission_with_worker(max_num_seqs=2)
    key = keys.OPEN
    tickets = [a.admit(key, 1, 1, now=0.0) for _ in range(4)]       # at the watermark
    a.settle(tickets[0], 2, now=0.0)                                # ended: room for one more
    a.settle(tickets[0], 2, now=0.0)                                # once only
    assert a.cluster.added["fake"] == 3
    tickets.append(a.admit(key, 1, 1, now=0.0))
    with pytest.raises(ApiError):
        a.admit(key, 1, 1, now=0.0)
    a.cluster.update(heartbeat(max_num_seqs=2, running=2, waiting=2))   # the heartbeat counts those in flight
    a.settle(tickets[1], 2, now=0.0)              # sent before that heartbeat, which counted it: room again
    assert a.cluster.added["fake"] == -1
    a.admit(key, 1, 1, now=0.0)
    with pytest.raises(ApiError):
        a.admit(key, 1, 1, now=0.0)
    a.cluster.update(heartbeat(max_num_seqs=2))   # a heartbeat that missed them: more end than it counted
    for t in tickets[2:]:
        a.settle(t, 2, now=0.0)
    assert a.cluster.added["fake"] == -3 and a.cluster.load(a.cluster.workers["fake"]) == 0


def test_only_workers_that_decode_count_as_room_a_prefill_worker_cannot_finish_a_request_alone():
    a = Admission()
    a.cluster.update(dataclasses.replace(heartbeat("p0", max_num_seqs=2), role="prefill"))
    with pytest.raises(ApiError) as alone:
        a.admit(keys.OPEN, 1, 1, now=0.0)
    assert alone.value.status == 503 and "no decode worker is registered (role both or decode)" in alone.value.message
    a.cluster.update(dataclasses.replace(heartbeat("d0", max_num_seqs=2), role="decode"))
    a.cluster.update(heartbeat("w0", max_num_seqs=2, running=4))      # colocated, at the watermark already
    for _ in range(4):                            # the decode worker's 2 running + 2 queued
        assert a.cluster.place(2, time.time()) == "d0"
    with pytest.raises(ApiError) as busy:         # the idle prefill worker is no room
        a.cluster.place(2, time.time())
    assert busy.value.code == "overloaded" and a.cluster.added["p0"] == 0
    a.cluster.update(heartbeat("w0", max_num_seqs=2))                 # a colocated worker decodes too
    assert a.cluster.place(2, time.time()) == "w0"


def test_a_gateway_that_was_stopped_trusts_the_heartbeats_it_could_not_refresh_for_one_ttl():
    a = admission_with_worker()
    later = time.time() + WORKER_TTL + 2          # the gateway was SIGSTOPped past the TTL
    with pytest.raises(ApiError) as gone:
        a.cluster.place(10, later)
    assert gone.value.code == "unavailable"
    a.cluster.stalled(later)
    assert a.cluster.place(10, later) == "fake"
    with pytest.raises(ApiError):                 # a TTL later, an old heartbeat means a worker gone again
        a.cluster.place(10, later + WORKER_TTL)


def test_a_prompt_is_estimated_without_tokenizing():
    params = SamplingParams()
    assert estimate(GenerateRequest("r", "t", params, prompt_token_ids=[1, 2, 3])) == 3
    assert estimate(GenerateRequest("r", "t", params, prompt="x" * 41)) == 11
    assert estimate(GenerateRequest("r", "t", params, messages=[{"role": "user", "content": "x" * 8}] * 2)) == 4 + 8

"""Several models in one stack, without processes: revisions, the served models file's rules, the gateway's
model lookup and canary split, and the router's and admission's choice of workers by model."""
import dataclasses
import math
import time
import uuid

import pytest

from schemas.messages import GenerateRequest, Heartbeat
from schemas.revision import CACHE, revision
from schemas.sampling import SamplingParams
from schemas.served import Served, check, dump, load
from services.gateway.admission import Admission
from services.gateway.errors import ApiError
from services.gateway.keys import OPEN
from services.gateway.models import Model, Models, Revision, fraction
from services.gateway.session import Gateway
from services.router.policy import Registry


def beat(worker: str, model: str, rev: str = "") -> Heartbeat:
    return Heartbeat(worker, time.time(), model, 16, 8, 0, 0, 100, 100, 0, 0, 0, revision=rev)


def canary(share: float) -> Model:
    return Model("chat", [Revision("stable", 0.0, None, 4096), Revision("new", share, None, 4096)])


@pytest.mark.parametrize("share", [0.05, 0.3])
def test_the_canary_split_lands_within_four_sigma_of_its_share_and_is_the_same_for_the_same_id(share):
    n = 2000
    ids = [uuid.uuid4().hex for _ in range(n)]
    model = canary(share)
    got = sum(model.split(rid).revision == "new" for rid in ids)
    assert abs(got - n * share) <= 4 * math.sqrt(n * share * (1 - share)), got
    assert [model.split(rid).revision for rid in ids[:50]] == [model.split(rid).revision for rid in ids[:50]]
    assert all((model.split(rid).revision == "new") == (fraction(rid) < share) for rid in ids)


def test_two_hundred_routing_decisions_of_a_five_percent_canary_land_within_the_binomial_bound():
    model, n, p = canary(0.05), 200, 0.05
    got = sum(model.split(f"req-{i}").revision == "new" for i in range(n))
    assert abs(got - n * p) <= 4 * math.sqrt(n * p * (1 - p)), got


def test_two_canaries_take_their_shares_and_the_stable_revision_the_rest():
    model = Model("chat", [Revision("a", 0.0, None, 1), Revision("b", 0.2, None, 1), Revision("c", 0.1, None, 1)])
    n = 4000
    counts = {"a": 0, "b": 0, "c": 0}
    for i in range(n):
        counts[model.split(f"r{i}").revision] += 1
    for rev, p in (("a", 0.7), ("b", 0.2), ("c", 0.1)):
        assert abs(counts[rev] - n * p) <= 4 * math.sqrt(n * p * (1 - p)), counts


@pytest.fixture(scope="module")
def two(tiny_model) -> Models:
    return Models([Served("chat", "r1", tiny_model), Served("code", "r2", tiny_model),
                   Served("chat", "r3", tiny_model, share=0.25)])


def test_a_name_a_pinned_revision_and_a_wrong_one_or_an_unknown_name_are_told_apart(two):
    assert two.default == "chat" and list(two.by_name) == ["chat", "code"]
    assert [r.revision for r in two.by_name["chat"].revisions] == ["r1", "r3"]
    assert two.find("chat@r3", "any")[1].revision == "r3" and two.find("code")[1].revision == "r2"
    with pytest.raises(ApiError) as e:
        two.find("chat@r9")
    assert (e.value.status, e.value.code) == (404, "model_not_found")
    assert "model 'chat' has no revision 'r9'; it serves chat@r1, chat@r3" in e.value.message
    with pytest.raises(ApiError) as e:
        two.find("poem")
    assert e.value.status == 404 and "this server serves 'chat', 'code'" in e.value.message
    assert two.ids() == ["chat", "code", "chat@r1", "chat@r3", "code@r2"]


def test_a_canary_no_worker_serves_leaves_its_share_to_the_stable_revision_until_one_does(two):
    gw = Gateway.__new__(Gateway)
    gw.models, gw.admission = two, Admission()
    ids = [f"r{i}" for i in range(400)]
    canary = {rid for rid in ids if fraction(rid) < 0.25}

    def chosen() -> dict[str, str]:
        reqs = {rid: GenerateRequest(rid, "default", SamplingParams(), prompt="p") for rid in ids}
        for req in reqs.values():
            gw.choose(req, "chat")
        return {rid: req.revision for rid, req in reqs.items()}

    gw.admission.cluster.update(beat("w0", "chat", "r1"))
    assert set(chosen().values()) == {"r1"}                        # no worker serves r3 yet
    pinned = GenerateRequest("p", "default", SamplingParams(), prompt="p")
    gw.choose(pinned, "chat@r3")
    assert pinned.revision == "r3"                                # pinned: it waits for one
    gw.admission.cluster.update(beat("w1", "chat", "r3"))
    got = chosen()
    assert {rid for rid, rev in got.items() if rev == "r3"} == canary and len(canary) > 50
    gw.admission.cluster.update(dataclasses.replace(beat("w1", "chat", "r3"), draining=True))
    assert set(chosen().values()) == {"r1"}                        # its only worker drains


@pytest.mark.parametrize(("models", "message"), [
    ([Served("a", "r1", "d"), Served("a", "r2", "d")], "model 'a' has 2 entries without a share"),
    ([Served("a", "r1", "d", 0.5)], "model 'a' has 0 entries without a share"),
    ([Served("a", "r1", "d"), Served("a", "r2", "d", 0.6), Served("a", "r3", "d", 0.4)],
     "the canaries of 'a' share 1 of its requests"),
    ([Served("a", "r1", "d"), Served("a", "r1", "d", 0.1)], "models[1]: a@r1 is served twice"),
    ([Served("a", "r1", "d"), Served("a", "r2", "d", 1.5)], "models[1].share: 1.5 must be in (0, 1)"),
    ([Served("a@b", "r1", "d")], "models[0].name: 'a@b' must be non-empty and without '@'"),
    ([], "no model to serve"),
])
def test_a_served_models_file_that_breaks_a_rule_is_refused_naming_it(models, message):
    with pytest.raises(ValueError) as e:
        check(models)
    assert message in str(e.value)


def test_the_served_models_file_reads_back_what_was_written(tmp_path):
    models = [Served("a", "r1", "/m/a"), Served("a", "r2", "/m/b", 0.05)]
    dump(models, tmp_path / "s.json")
    assert load(tmp_path / "s.json") == models
    (tmp_path / "bad.json").write_text('{"models": [{"name": "a"}]}')
    with pytest.raises(ValueError, match=r"bad\.json: not a served models file"):
        load(tmp_path / "bad.json")


def test_a_revision_hashes_the_weights_is_cached_beside_them_and_changes_with_them(tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    (d / "model.safetensors").write_bytes(b"weights one")
    (d / "config.json").write_text("{}")
    first = revision(d)
    assert len(first) == 12 and (d / CACHE).is_file() and revision(d) == first
    (d / "config.json").write_text('{"other": 1}')                  # not a weight file
    assert revision(d) == first
    (d / "model.safetensors").write_bytes(b"weights two")
    assert revision(d) != first
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"weights one")
    assert len(revision(gguf)) == 12 and (tmp_path / f".m.gguf.{CACHE}").is_file()
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="empty: no weight files"):
        revision(tmp_path / "empty")


def test_a_cached_revision_is_not_trusted_once_a_weight_file_changed_size_or_time(tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    (d / "a.safetensors").write_bytes(b"1")
    first = revision(d)
    (d / CACHE).write_text((d / CACHE).read_text().replace(first, "forged"))
    assert revision(d) == "forged"                                  # the cache is what is read when it matches
    (d / "a.safetensors").write_bytes(b"22")
    assert revision(d) not in ("forged", first)


def test_the_router_picks_only_workers_serving_the_model_and_the_pinned_revision():
    reg = Registry()
    for hb in (beat("w0", "chat", "r1"), beat("w1", "chat", "r3"), beat("w2", "code", "r2")):
        reg.update(hb)
    now = time.time()
    assert {reg.pick(now, [1, 2, 3], model="code").worker for _ in range(4)} == {"w2"}
    assert {reg.pick(now, [1, 2, 3], model="chat").worker for _ in range(4)} == {"w0", "w1"}
    assert {reg.pick(now, [1, 2, 3], model="chat", revision="r3").worker for _ in range(4)} == {"w1"}
    assert reg.pick(now, [1, 2, 3], model="poem") is None
    assert reg.pick(now, [1, 2, 3], model="chat", revision="r2") is None
    assert reg.pick(now, [1, 2, 3]) is not None                     # a request naming no model: any worker


def test_admission_refuses_a_model_with_no_live_worker_with_503_naming_it():
    adm = Admission()
    adm.cluster.update(beat("w0", "chat", "r1"))
    adm.admit(OPEN, 10, 10, model="chat")
    with pytest.raises(ApiError) as e:
        adm.admit(OPEN, 10, 10, model="code")
    assert (e.value.status, e.value.param) == (503, "model")
    assert "no worker serving model 'code' is registered" in e.value.message
    with pytest.raises(ApiError, match="no worker serving model 'chat' revision 'r3'"):
        adm.admit(OPEN, 10, 10, model="chat", revision="r3")

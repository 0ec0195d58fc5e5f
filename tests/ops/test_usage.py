"""`tokenbus usage` sums the metering log (TB_USAGE) per tenant, key, model and revision, fallback requests
apart, filtered by tenant and by time, as a table or JSON."""
import asyncio
import csv
import datetime
import json
import time

import pytest

import bus
from ops.cli import main
from ops.usage import since
from schemas import subjects
from schemas.messages import Usage, encode


def record(rid: str, tenant: str, key: str, prompt: int, cached: int, completion: int, revision: str = "r1",
           fallback: bool = False) -> Usage:
    return Usage(rid, tenant, key, "tiny", "chat", "stop", prompt, cached, completion, {"e2e_ms": 1.0}, 1.0, 2.0,
                 revision, fallback)


async def store(nats_url: str, records: list[Usage]) -> None:
    nc = await bus.connect(nats_url, "test-usage")
    js = nc.jetstream()
    await bus.ensure_streams(js)
    for u in records:
        await js.publish(subjects.usage(u.tenant, u.id), encode(u), headers=subjects.msg_id(u.id))
    await nc.close()


def usage(capsys, *args: str) -> str:
    main(["usage", *args])
    return capsys.readouterr().out


def test_usage_sums_per_tenant_and_key_filters_by_tenant_and_time_and_prints_table_or_json(nats_url, capsys):
    assert usage(capsys, "--nats-url", nats_url).strip() == "no usage recorded"
    asyncio.run(store(nats_url, [record("a", "acme", "k1", 10, 4, 5), record("b", "acme", "k1", 20, 0, 7),
                                 record("c", "acme", "k2", 1, 0, 1), record("a", "acme", "k1", 10, 4, 5)]))  # a again:
    between = time.time()                                                          # deduplicated by its id
    time.sleep(0.05)
    asyncio.run(store(nats_url, [record("d", "globex", "k3", 100, 50, 30)]))

    got = json.loads(usage(capsys, "--nats-url", nats_url, "--json"))
    assert got["rows"] == [
        {"tenant": "acme", "key_id": "k1", "model": "tiny", "revision": "r1", "fallback": False, "requests": 2,
         "prompt_tokens": 30, "cached_tokens": 4, "completion_tokens": 12, "total_tokens": 42},
        {"tenant": "acme", "key_id": "k2", "model": "tiny", "revision": "r1", "fallback": False, "requests": 1,
         "prompt_tokens": 1, "cached_tokens": 0, "completion_tokens": 1, "total_tokens": 2},
        {"tenant": "globex", "key_id": "k3", "model": "tiny", "revision": "r1", "fallback": False, "requests": 1,
         "prompt_tokens": 100, "cached_tokens": 50, "completion_tokens": 30, "total_tokens": 130}]
    assert got["total"] == {"requests": 4, "prompt_tokens": 131, "cached_tokens": 54, "completion_tokens": 43,
                            "total_tokens": 174}
    assert [r["tenant"] for r in json.loads(usage(capsys, "--nats-url", nats_url, "--json", "--tenant", "globex"))[
        "rows"]] == ["globex"]
    iso = datetime.datetime.fromtimestamp(between, datetime.UTC).isoformat()
    assert [r["key_id"] for r in json.loads(usage(capsys, "--nats-url", nats_url, "--json", "--since", iso))[
        "rows"]] == ["k3"]
    assert json.loads(usage(capsys, "--nats-url", nats_url, "--json", "--since", "1h"))["total"]["requests"] == 4

    lines = usage(capsys, "--nats-url", nats_url).splitlines()
    assert lines[0].split() == ["tenant", "key", "model", "revision", "served", "requests", "prompt", "cached",
                                "completion", "total"]
    assert lines[1].split() == ["acme", "k1", "tiny", "r1", "cluster", "2", "30", "4", "12", "42"]
    assert lines[-2].split() == ["total", "4", "131", "54", "43", "174"]
    assert lines[-1] == "(4 requests above not yet in the database: read from the bus's TB_USAGE)"


def test_usage_keeps_each_revision_and_the_fallback_s_requests_in_rows_of_their_own(nats_url, capsys):
    asyncio.run(store(nats_url, [record("a", "acme", "k1", 10, 0, 5), record("b", "acme", "k1", 20, 0, 7, "r2"),
                                 record("c", "acme", "k1", 30, 0, 9, "", fallback=True),
                                 record("d", "acme", "k1", 40, 0, 1, "r2")]))
    rows = json.loads(usage(capsys, "--nats-url", nats_url, "--json"))["rows"]
    assert [(r["revision"], r["fallback"], r["requests"], r["prompt_tokens"]) for r in rows] == [
        ("", True, 1, 30), ("r1", False, 1, 10), ("r2", False, 2, 60)]
    lines = usage(capsys, "--nats-url", nats_url).splitlines()
    assert [line.split()[3:6] for line in lines[1:4]] == [["-", "fallback", "1"], ["r1", "cluster", "1"],
                                                         ["r2", "cluster", "2"]]


def test_since_takes_ages_and_dates_and_names_what_it_wants():
    assert abs(since("30m") - (time.time() - 1800)) < 2
    assert since("2026-11-01") == datetime.datetime(2026, 11, 1, tzinfo=datetime.UTC).timestamp()
    with pytest.raises(ValueError, match="expected an age like 30m"):
        since("yesterday")


def test_usage_reads_the_database_and_the_unrecorded_tail_once_each_and_exports_a_tenant_as_csv(nats_url, capsys,
                                                                                                 tmp_path):
    """Three records in the recorder's database, two on the bus (one of them recorded already): four requests,
    one of them marked unrecorded; --csv writes a tenant's requests of the period, one row each."""
    from services.recorder.store import Database

    db_url = f"sqlite:///{tmp_path / 'records.db'}"
    db = Database.open(db_url)
    db.write([record("a", "acme", "k1", 10, 4, 5), record("b", "acme", "k1", 20, 0, 7),
              record("c", "globex", "k3", 100, 50, 30)], [])
    db.close()
    asyncio.run(store(nats_url, [record("b", "acme", "k1", 20, 0, 7), record("d", "acme", "k2", 1, 0, 1)]))
    got = json.loads(usage(capsys, "--nats-url", nats_url, "--database", db_url, "--json"))
    assert got["total"] == {"requests": 4, "prompt_tokens": 131, "cached_tokens": 54, "completion_tokens": 43,
                            "total_tokens": 174}
    assert got["unrecorded"]["requests"] == 1 and got["unrecorded"]["prompt_tokens"] == 1
    assert [(r["tenant"], r["key_id"], r["requests"]) for r in got["rows"]] == [("acme", "k1", 2), ("acme", "k2", 1),
                                                                                ("globex", "k3", 1)]
    assert usage(capsys, "--nats-url", nats_url, "--database", db_url).splitlines()[-1] == (
        "(1 request above not yet in the database: read from the bus's TB_USAGE)")

    out = tmp_path / "acme.csv"
    said = usage(capsys, "--nats-url", nats_url, "--database", db_url, "--tenant", "acme", "--since", "1970-01-01",
                 "--until", "2100-01-01", "--csv", str(out))
    assert said.strip() == f"exported 3 requests of acme to {out}"
    rows = list(csv.DictReader(out.open()))
    assert [(r["request_id"], r["key_id"], r["prompt_tokens"]) for r in rows] == [("a", "k1", "10"), ("b", "k1", "20"),
                                                                                ("d", "k2", "1")]
    with pytest.raises(SystemExit, match="--csv exports one tenant's requests: give --tenant"):
        usage(capsys, "--nats-url", nats_url, "--database", db_url, "--csv", str(out))

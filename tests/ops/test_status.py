"""`tokenbus status`: each worker's role, and for a disaggregated worker its KV transfers, in the table and
in --json (from heartbeats, without a bus)."""
import time

from ops.status import as_json, size, table
from schemas.messages import Heartbeat, KvTransfer

PREFILL = KvTransfer(handoffs=5, leases=2, served_blocks=40, served_bytes=12_000_000)
DECODE = KvTransfer(transfers=5, pulled_blocks=40, pulled_bytes=12_000_000, cached_blocks=3, failures=1,
                    recomputes=1, transfer_ms_p99=12.4)


def beat(worker: str, role: str = "both", kv_transfer: KvTransfer | None = None) -> Heartbeat:
    return Heartbeat(worker, time.time(), "tiny", 16, 8, 0, 0, 64, 64, 0, 0, 0, role=role, kv_transfer=kv_transfer)


def test_status_shows_each_workers_role_and_no_kv_transfer_column_on_a_colocated_stack():
    head, w0 = table([beat("w0")]).splitlines()
    assert head.split()[:2] == ["worker", "role"] and head.split()[-1] == "speculation"
    assert w0.split()[:2] == ["w0", "both"]


def test_status_shows_what_prefill_workers_served_and_decode_workers_pulled():
    head, d0, p0, w0 = table([beat("d0", "decode", DECODE), beat("p0", "prefill", PREFILL), beat("w0")]).splitlines()
    assert head.endswith("speculation  kv transfer")
    assert d0.split()[1] == "decode" and d0.endswith("off          pulled 40 blk / 12 MB, p99 12 ms, 1 failed, "
                                                     "1 recomputed")
    assert p0.split()[1] == "prefill" and p0.endswith(" handed off 5, served 40 blk, 2 leases")
    assert w0.split()[1] == "both" and w0.endswith(" -")
    assert table([beat("d1", "decode", KvTransfer())]).endswith(" nothing pulled yet")


def test_status_json_carries_role_and_kv_transfer():
    workers = as_json([beat("d0", "decode", DECODE), beat("w0")])["workers"]
    assert (workers[0]["role"], workers[0]["kv_transfer"]["pulled_blocks"]) == ("decode", 40)
    assert workers[0]["kv_transfer"]["transfer_ms_p99"] == 12.4 and workers[0]["id"] == "d0"
    assert (workers[1]["role"], workers[1]["kv_transfer"]) == ("both", None)


def test_sizes_read_in_the_largest_unit_they_fill():
    assert [size(n) for n in (512, 1_500, 12_000_000, 3_210_000_000)] == ["512 B", "1.5 kB", "12 MB", "3.2 GB"]


def test_status_shows_each_tier_below_the_pool_only_for_workers_with_tiers():
    tiers = {"host_hits": 31.0, "host_blocks": 12.0, "host_bytes": 9.4e6, "host_seconds": 0.012,
             "disk_hits": 2.0, "disk_blocks": 40.0, "disk_bytes": 4e7, "disk_seconds": 0.5}
    tiered = Heartbeat("w1", time.time(), "tiny", 16, 8, 0, 0, 64, 64, 0, 0, 0, kv_tiers=tiers)
    assert "kv tiers" not in table([beat("w0")])
    head, w1, w0 = table([tiered, beat("w0")]).splitlines()
    assert head.endswith("speculation  kv tiers")
    assert w1.endswith("host 12 blk / 9.4 MB, 31 hits, 12 ms; disk 40 blk / 40 MB, 2 hits, 500 ms")
    assert w0.endswith(" -")
    assert as_json([tiered])["workers"][0]["kv_tiers"]["disk_hits"] == 2

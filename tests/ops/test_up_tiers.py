"""`tokenbus up` and the worker take the prefix cache's tiers: sizes as up reads them, each worker its own
disk directory, the worker's EngineConfig built from its flags, a disk tier without its size refused."""
import pytest

from ops import up
from ops.cli import parser as tokenbus
from tests.ops.test_up_roles import started
from workers.service import engine_config
from workers.service import parser as worker


def test_up_gives_every_worker_the_tiers_and_its_own_disk_directory(monkeypatch, tmp_path):
    args = tokenbus().parse_args(["up", "--kv-host-memory", "2GiB", "--kv-disk-dir", "/cache",
                                  "--kv-disk-size", "100GiB", "--workers", "2"])
    argv = up.worker_args(args)
    assert argv == ["--kv-host-memory", str(2 << 30), "--kv-disk-size", str(100 << 30), "--kv-disk-dir",
                    "/cache/{worker}"]
    children = started(monkeypatch, tmp_path, workers=2, worker_args=argv)
    dirs = {n: a[a.index("--kv-disk-dir") + 1] for n, a in children.items() if "--kv-disk-dir" in a}
    assert dirs == {"w0": "/cache/w0", "w1": "/cache/w1"}
    config = engine_config(worker().parse_args(["--model", "m", *children["w1"]]))
    assert (config.kv_host_memory, config.kv_disk_dir, config.kv_disk_size) == (2 << 30, "/cache/w1", 100 << 30)
    assert up.worker_args(tokenbus().parse_args(["up"])) == []


def test_a_disk_tier_without_its_size_is_refused_by_up_and_by_the_engine():
    with pytest.raises(ValueError, match="--kv-disk-dir and --kv-disk-size go together"):
        up.worker_args(tokenbus().parse_args(["up", "--kv-disk-dir", "/cache"]))
    with pytest.raises(ValueError, match="kv_disk_size is given with kv_disk_dir"):
        engine_config(worker().parse_args(["--model", "m", "--kv-disk-dir", "/cache"]))

"""The bus's retention sized from the data dir's free space and stated; a disk too small for the minimum is
one line naming the path, its free space and the minimum, and nothing starts."""
import shutil
import subprocess
import sys

import pytest

from ops import retention
from schemas import subjects


@pytest.fixture
def small_disk(tmp_path):
    """A 4 MiB tmpfs (a real small filesystem, unmounted after)."""
    where = tmp_path / "small"
    where.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(where)], capture_output=True)
    assert mounted.returncode == 0, f"cannot mount a tmpfs here: {mounted.stderr.decode()}"
    yield where
    subprocess.run(["umount", "-l", str(where)], check=False)


@pytest.mark.timeout(60)
def test_up_on_a_disk_too_small_says_so_in_one_line_and_starts_nothing(small_disk, tiny_model):
    data = small_disk / "data"
    proc = subprocess.run([sys.executable, "-m", "ops.cli", "up", "--model", tiny_model, "--data-dir", str(data),
                           "--port", "1", "--nats-port", "1"], capture_output=True, text=True, timeout=50)
    assert proc.returncode == 1 and "starting" not in proc.stdout
    [line] = proc.stderr.splitlines()
    need = retention.gib(retention.minimum(1))
    assert line.startswith(f"tokenbus: {data} has 4.0 MiB free; the stack needs at least {need} there"), line
    assert not data.exists()                           # no nats-server store, no logs: nothing started


def test_the_streams_get_half_the_free_space_split_by_share_and_partition(tmp_path):
    free = shutil.disk_usage(tmp_path).free
    storage = retention.sized(tmp_path, None, partitions=1)
    assert abs(storage - free * retention.FREE_SHARE) < 64 << 20          # the disk moves a little meanwhile
    assert retention.sized(tmp_path, None, partitions=2, nodes=3) == pytest.approx(storage / 3, rel=0.01)
    assert retention.sized(tmp_path, 1 << 30, partitions=2) == 1 << 30
    assert retention.sized(tmp_path / "not" / "yet", None, 1) > 0        # measured where it will be made
    assert retention.sized(tmp_path, None, 1, embedded=False) == subjects.DEFAULT_BUS_STORAGE
    with pytest.raises(retention.DiskTooSmall, match=r"--bus-storage 100\.0 MiB is below the minimum of 512\.0 MiB"):
        retention.sized(tmp_path, 100 << 20, partitions=2)
    assert sum(subjects.SHARES.values()) == pytest.approx(1.0)
    lines = retention.lines(8 << 30, 2)
    assert [line.split()[0] for line in lines] == list(subjects.STREAM_NAMES)
    assert lines[4].split()[1:] == ["1.2", "GiB", "until", "recorded"]

"""How much the bus keeps, sized before the stack starts and stated: `tokenbus up` gives the streams half
the data dir's free space (shared by a local cluster's nodes, each holding a copy of every stream) or
--bus-storage, refuses in one line a disk too small for the minimum, and prints each stream's share and
how long it keeps a record; `tokenbus status` prints the same with what each holds now."""
import shutil
from pathlib import Path

from schemas import subjects

FREE_SHARE = 0.5                         # of the data dir's free space, for the bus's streams
KEEPS = {subjects.REQUESTS_STREAM: f"{subjects.QUEUE_MAX_AGE / 3600:g} h",
         subjects.ROUTE_STREAM: "until routed", subjects.WORK_STREAM: "until run",
         subjects.RESULTS_STREAM: f"until archived + {subjects.ENDS_KEEP / 3600:g} h",
         subjects.USAGE_STREAM: "until recorded", subjects.DEAD_STREAM: f"{subjects.LOG_MAX_AGE / 86400:g} d"}


class DiskTooSmall(ValueError):
    """The data dir cannot hold the bus's minimum: one line naming the path, the free space and the minimum."""


def gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def minimum(partitions: int, nodes: int = 1) -> int:
    """The free space a data dir needs: the streams' minimum, for each node's copy, at FREE_SHARE."""
    return int(subjects.MIN_BUS_STORAGE * partitions * nodes / FREE_SHARE)


def sized(data_dir: Path, given: int | None, partitions: int, nodes: int = 1, embedded: bool = True) -> int:
    """The bytes the bus's streams may hold: `given` (--bus-storage), else FREE_SHARE of data_dir's free space
    over the `nodes` started there (embedded), else the default. DiskTooSmall when it falls below the minimum
    or the data dir cannot hold it."""
    free = shutil.disk_usage(existing(data_dir)).free
    need = minimum(partitions, nodes)
    if embedded and free < need:
        raise DiskTooSmall(f"{data_dir} has {gib(free)} free; the stack needs at least {gib(need)} there: "
                           f"{gib(subjects.MIN_BUS_STORAGE * partitions)} for the bus's streams"
                           f"{f' on each of {nodes} nodes' if nodes > 1 else ''}, as much again for the database, "
                           f"archive and logs; free some, or give --data-dir on a larger disk")
    if given is not None:
        if given < subjects.MIN_BUS_STORAGE * partitions:
            raise DiskTooSmall(f"--bus-storage {gib(given)} is below the minimum of "
                               f"{gib(subjects.MIN_BUS_STORAGE * partitions)} ({gib(subjects.MIN_BUS_STORAGE)} a "
                               f"partition)")
        if embedded and given * nodes > free * 0.75:     # nats-server reserves at most 75% of the free space
            raise DiskTooSmall(f"--bus-storage {gib(given)} × {nodes} cop{'ies' if nodes > 1 else 'y'} "
                               f"does not fit the {gib(free)} free in {data_dir} (nats-server takes up to 75%)")
        return given
    return int(free * FREE_SHARE / nodes) if embedded else subjects.DEFAULT_BUS_STORAGE


def existing(path: Path) -> Path:
    """The path, or its nearest parent that exists (the data dir may not be made yet)."""
    path = Path(path).absolute()
    while not path.exists():
        path = path.parent
    return path


def lines(storage: int, partitions: int) -> list[str]:
    """Each stream's size (all its partitions) and how long it keeps a record."""
    return [f"{name:<12} {gib(subjects.stream_bytes(name, storage, partitions) * partitions):>10}  {KEEPS[name]}"
            for name in subjects.STREAM_NAMES]

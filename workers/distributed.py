"""The tensor-parallel group every layer is built with, and the processes behind it.

A worker is one model replica over N ranks. Rank 0 is the worker process itself: it schedules,
samples and sends each step's inputs to ranks 1..N-1, the followers, which it starts as child
processes (`python -m workers.follower`). A size-1 group needs no torch.distributed at all: its
collectives are the identity.

Two process groups: the device group (NCCL on CUDA, gloo on CPU) carries the all-reduces; the
step inputs, small integer tensors, go over gloo on the CPU (the same group on a CPU worker).
Rendezvous is a TCPStore that rank 0 opens on a free port of 127.0.0.1.
"""
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

HOST = "127.0.0.1"
STARTUP_TIMEOUT = timedelta(minutes=10)   # a follower's imports and connect; model loading comes after
HEADER = 6                                # a step header: a command and five sizes
STEP, STOP, TIMING, REPORT = 0, -1, -2, -3  # its commands: run a step, exit, time collectives, send their times


class WorkerFailure(RuntimeError):
    """A rank of the tensor-parallel group is gone: the replica cannot compute another step."""


@dataclass(slots=True)
class TPGroup:
    rank: int = 0
    size: int = 1
    group: object = None        # the device ProcessGroup when size > 1
    cpu_group: object = None    # gloo, for step inputs and start-up figures
    device_type: str = "cpu"
    timed: bool = False         # when set, every collective's seconds go to comm_log
    comm_log: list[float] = field(default_factory=list)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            self.collective(dist.all_reduce, x, group=self.group)
        return x

    def gather_to_first(self, x: torch.Tensor) -> torch.Tensor | None:
        """Every rank's shard of the last dimension, concatenated on rank 0; None on the others."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else None
        self.collective(dist.gather, x.contiguous(), parts, dst=0, group=self.group)
        return torch.cat(parts, dim=-1) if self.rank == 0 else None

    def collective(self, op, *args, **kwargs) -> None:
        if not self.timed:
            op(*args, **kwargs)
            return
        sync = torch.cuda.synchronize if self.device_type == "cuda" else lambda: None
        sync()
        start = time.perf_counter()
        op(*args, **kwargs)
        sync()
        self.comm_log.append(time.perf_counter() - start)

    # -- the CPU group: step inputs and start-up figures -------------------------------------------

    def send_step(self, header: list[int], payload: torch.Tensor) -> None:
        """Rank 0: one step's sizes, then its inputs as one int64 tensor."""
        self.collective(dist.broadcast, torch.tensor(header, dtype=torch.int64), src=0, group=self.cpu_group)
        if payload.numel():
            self.collective(dist.broadcast, payload, src=0, group=self.cpu_group)

    def recv_step(self) -> tuple[list[int], torch.Tensor] | None:
        """Followers: the next step's header and payload; None when rank 0 says stop. Timing
        commands are handled on the way."""
        while True:
            header = torch.empty(HEADER, dtype=torch.int64)
            self.collective(dist.broadcast, header, src=0, group=self.cpu_group)
            sizes = header.tolist()
            if sizes[0] == STEP:
                break
            if sizes[0] == STOP:
                return None
            if sizes[0] == TIMING:
                self.timed, self.comm_log = bool(sizes[1]), []
            elif sizes[0] == REPORT:
                self.send_comm_log(sizes[1])
        payload = torch.empty(payload_size(sizes), dtype=torch.int64)
        if payload.numel():
            self.collective(dist.broadcast, payload, src=0, group=self.cpu_group)
        return sizes, payload

    def command(self, *values: int) -> None:
        header = torch.tensor([*values] + [0] * (HEADER - len(values)), dtype=torch.int64)
        dist.broadcast(header, src=0, group=self.cpu_group)

    def stop_followers(self) -> None:
        self.command(STOP)

    def time_collectives(self, on: bool) -> None:
        """Rank 0: every rank starts (or stops) logging its collectives' times, from empty logs."""
        if self.size > 1:
            self.command(TIMING, int(on))
        self.timed, self.comm_log = on, []

    def comm_logs(self) -> list[list[float]]:
        """Rank 0: every rank's log, in rank order. The ranks run the same collectives in the same
        order, so entry i is the same collective everywhere; the rank that arrived last waited
        least, so the minimum over ranks is the transfer itself, without the wait for a slower rank."""
        if self.size == 1:
            return [list(self.comm_log)]
        self.command(REPORT, len(self.comm_log))
        return self.send_comm_log(len(self.comm_log))

    def send_comm_log(self, n: int) -> list[list[float]] | None:
        mine = torch.tensor((self.comm_log + [0.0] * n)[:n], dtype=torch.float64)
        parts = [torch.empty(n, dtype=torch.float64) for _ in range(self.size)] if self.rank == 0 else None
        dist.gather(mine, parts, dst=0, group=self.cpu_group)
        return [p.tolist() for p in parts] if self.rank == 0 else None

    def min_over_ranks(self, n: int) -> int:
        if self.size == 1:
            return n
        t = torch.tensor([n], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return int(t.item())

    def all_gather_ints(self, values: list[int]) -> list[list[int]]:
        """Each rank's `values`, in rank order, on every rank."""
        if self.size == 1:
            return [values]
        parts = [torch.empty(len(values), dtype=torch.int64) for _ in range(self.size)]
        dist.all_gather(parts, torch.tensor(values, dtype=torch.int64), group=self.cpu_group)
        return [p.tolist() for p in parts]


SINGLE = TPGroup()


def payload_size(header: list[int]) -> int:
    """int64s of a step's inputs: ids, positions, slots [T]; cu_seqlens [B+1]; seq_lens [B];
    block tables [B, W]; logit rows [R]; block copies [C, 2]."""
    t, b, w, r, c = header[1:]
    return 3 * t + (b + 1) + b + b * w + r + 2 * c


def join(rank: int, size: int, store: dist.Store, device_type: str) -> TPGroup:
    """Joins the group (every rank calls it with the same store) and returns this rank's view."""
    backend = "nccl" if device_type == "cuda" else "gloo"
    dist.init_process_group(backend, store=store, rank=rank, world_size=size)
    cpu_group = dist.new_group(backend="gloo") if backend != "gloo" else dist.group.WORLD
    if device_type == "cpu":
        THREADS_BEFORE[:] = [torch.get_num_threads()]
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))  # the ranks share the cores
    return TPGroup(rank, size, dist.group.WORLD, cpu_group, device_type)


THREADS_BEFORE: list[int] = []    # torch's thread count before join, restored by leave


def leave() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
    if THREADS_BEFORE:
        torch.set_num_threads(THREADS_BEFORE.pop())


# -- rank 0's side: starting and watching the followers --------------------------------------------

@dataclass(slots=True)
class Followers:
    """Ranks 1..N-1 as child processes. A watcher thread per follower notices its exit; rank 0
    checks `error` before every step, and its collectives fail once a peer's connection closes."""
    procs: dict[int, subprocess.Popen] = field(default_factory=dict)
    error: str | None = None
    closing: bool = False
    on_failure: object = None    # called (from a watcher thread) with the error, e.g. to stop a service

    @classmethod
    def start(cls, size: int, device_type: str, model_dir: str, config_json: str) -> tuple["Followers", TPGroup]:
        if dist.is_initialized():
            raise RuntimeError("this process already holds a tensor-parallel group; close its LLM first")
        store = dist.TCPStore(HOST, 0, size, is_master=True, timeout=STARTUP_TIMEOUT, wait_for_workers=False)
        followers = cls()
        for rank in range(1, size):
            followers.procs[rank] = subprocess.Popen([
                sys.executable, "-m", "workers.follower", "--rank", str(rank), "--size", str(size),
                "--port", str(store.port), "--parent", str(os.getpid()), "--device-type", device_type,
                "--model", model_dir, "--config", config_json])
        for rank, proc in followers.procs.items():
            threading.Thread(target=followers.watch, args=(rank, proc), daemon=True).start()
        try:
            followers.wait_ready(store)
            tp = join(0, size, store, device_type)
        except BaseException:
            followers.close()
            raise
        return followers, tp

    def wait_ready(self, store: dist.Store) -> None:
        """Until every follower reached the store: one that dies while starting is an error now, not
        a hang in init_process_group."""
        keys = [f"ready/{rank}" for rank in self.procs]
        deadline = time.monotonic() + STARTUP_TIMEOUT.total_seconds()
        while not store.check(keys):
            self.check()
            if time.monotonic() > deadline:
                raise WorkerFailure(f"tensor-parallel followers did not start within {STARTUP_TIMEOUT}")
            time.sleep(0.05)

    def watch(self, rank: int, proc: subprocess.Popen) -> None:
        code = proc.wait()
        if self.closing or self.error:
            return
        how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
        self.error = f"tensor-parallel rank {rank} (pid {proc.pid}) {how}; this worker cannot go on"
        if self.on_failure is not None:
            self.on_failure(self.error)

    def check(self) -> None:
        if self.error:
            raise WorkerFailure(self.error)

    def explain(self, error: Exception, wait: float = 2.0) -> None:
        """A collective failed: raise WorkerFailure naming the dead rank if one died (its watcher may
        need a moment to see it); otherwise return and let the caller re-raise."""
        deadline = time.monotonic() + wait
        while not self.error and time.monotonic() < deadline:
            time.sleep(0.02)
        if self.error:
            raise WorkerFailure(self.error) from error

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs.values()]

    def close(self, timeout: float = 5.0) -> None:
        """Waits for the followers to exit (after rank 0 sent stop), killing any that do not."""
        self.closing = True
        deadline = time.monotonic() + timeout
        for proc in self.procs.values():
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def die_with_parent(parent: int) -> None:
    """Linux: the kernel sends this process SIGKILL when its parent exits, however it exits, so a
    killed worker leaves no follower behind. (The parent is the thread that started us; the engine
    starts followers from the thread that builds it.)"""
    libc = ctypes.CDLL(None, use_errno=True)
    PR_SET_PDEATHSIG = 1
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:   # the parent died before prctl took effect
        os._exit(1)

from schemas.messages import Heartbeat
from schemas.subjects import WORKER_TTL
from services.router.service import Registry


def beat(worker: str, running: int = 0, waiting: int = 0, ts: float = 100.0, max_num_seqs: int = 8) -> Heartbeat:
    return Heartbeat(worker, ts, "tiny", 16, max_num_seqs, running, waiting, 100, 100, 0, 0, 0)


def test_equal_workers_are_taken_in_turn():
    reg = Registry()
    for w in ("w0", "w1", "w2"):
        reg.update(beat(w))
    assert [reg.pick(100.0) for _ in range(6)] == ["w0", "w1", "w2", "w0", "w1", "w2"]


def test_the_least_loaded_worker_wins_counting_what_was_routed_since_its_heartbeat():
    reg = Registry()
    reg.update(beat("w0", running=4))
    reg.update(beat("w1", running=1, waiting=1))
    assert [reg.pick(100.0) for _ in range(2)] == ["w1", "w1"]   # w1: 2 then 3, w0: 4
    assert [reg.pick(100.0) for _ in range(4)] == ["w0", "w1", "w0", "w1"]   # equal: in turn
    reg.update(beat("w1", running=8))                                    # a fresh heartbeat replaces the guess
    assert reg.pick(100.0) == "w0"


def test_load_is_relative_to_capacity():
    reg = Registry()
    reg.update(beat("small", running=2, max_num_seqs=4))
    reg.update(beat("big", running=4, max_num_seqs=64))
    assert reg.pick(100.0) == "big"


def test_a_worker_whose_heartbeat_lapsed_is_never_picked():
    reg = Registry()
    reg.update(beat("old", ts=100.0))
    reg.update(beat("new", running=7, ts=100.0 + WORKER_TTL))
    assert reg.pick(100.0 + WORKER_TTL + 0.1) == "new"
    reg.remove("new")
    assert reg.pick(100.0 + WORKER_TTL + 0.1) is None

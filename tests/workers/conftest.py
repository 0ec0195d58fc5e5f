import pytest

from tests.workers.checkpoints import make_checkpoint


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny random llama checkpoint, one per module."""
    return str(make_checkpoint(tmp_path_factory.mktemp("ckpt"), "llama"))

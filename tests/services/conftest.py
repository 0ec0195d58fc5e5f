"""Fixtures of the service tests: the tiny model's tokenizer, and a keys file of the test module's KEYS."""
import json

import pytest
from tokenizers import Tokenizer


@pytest.fixture(scope="module")
def tok(tiny_model) -> Tokenizer:
    return Tokenizer.from_file(f"{tiny_model}/tokenizer.json")


@pytest.fixture
def keys_file(request, tmp_path) -> str:
    """The module's KEYS written as a keys file (`--api-keys`)."""
    path = tmp_path / "keys.json"
    path.write_text(json.dumps(request.module.KEYS))
    return str(path)

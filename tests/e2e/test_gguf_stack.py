"""`tokenbus up --model FILE.gguf`: the worker loads the GGUF, the tokenizer service and the gateway
read the tokenizer and chat template from its metadata; a chat answer through the OpenAI API is the
one the offline engine gives on the source checkpoint."""
from pathlib import Path

import openai
import pytest

from ops.procs import free_port
from ops.up import Stack
from tests.e2e.conftest import WORKER_ARGS, running
from tests.workers.gguf_files import write_gguf
from workers import LLM, SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


@pytest.fixture(scope="module")
def gguf_file(tiny_model, tmp_path_factory):
    return write_gguf(Path(tiny_model), tmp_path_factory.mktemp("gguf") / "tiny.gguf")


@pytest.fixture(scope="module")
def stack(gguf_file, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("stack")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TOKENBUS_HOME", str(tmp / "home"))
        stack = Stack(str(gguf_file), free_port(), tmp, nats_port=free_port(), workers=1, worker_args=WORKER_ARGS)
        with running(stack) as s:
            yield s


def test_a_stack_on_a_gguf_answers_as_the_engine_does_on_the_source_checkpoint(stack, gguf_file, tiny_model):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a block?"}]
    with LLM(tiny_model, num_kv_blocks=64) as llm:
        want = llm.chat(messages, SamplingParams(max_tokens=16, temperature=0))[0]
    api = openai.OpenAI(api_key="unused", base_url=stack.http + "/v1", max_retries=0, timeout=60)
    assert [m.id for m in api.models.list()] == [gguf_file.name]
    got = api.chat.completions.create(model=gguf_file.name, messages=messages, max_tokens=16, temperature=0)
    assert got.choices[0].message.content == want.text
    assert got.usage.prompt_tokens == len(want.prompt_token_ids)
    assert got.usage.completion_tokens == len(want.token_ids)

"""The terminal chat client against a real gateway (uvicorn in the test's event loop) and a fake
pipeline on a real nats-server that answers " you said <last message>" one token per chunk."""
import asyncio
import contextlib
import re

import pytest
from tokenizers import Tokenizer

from ops.chat import chat, run
from ops.procs import free_port
from schemas.messages import ErrorChunk, GenerateRequest
from tests.services.fake_pipeline import gateway

STATS = re.compile(r"\[ttft [\d.]+ ms · [\d.]+ tok/s · (\d+) tokens · finish length\]")


@pytest.fixture(scope="module")
def tok(tiny_model) -> Tokenizer:
    return Tokenizer.from_file(f"{tiny_model}/tokenizer.json")


class Output:
    """A terminal that remembers each write, to see the reply arrive in pieces."""

    def __init__(self):
        self.writes: list[str] = []

    def write(self, s: str) -> None:
        self.writes.append(s)

    def flush(self) -> None:
        pass

    @property
    def text(self) -> str:
        return "".join(self.writes)


def scripted(*lines: str):
    """An input() that types these lines, then Ctrl-D."""
    it = iter(lines)

    def input_fn(prompt: str) -> str:
        assert prompt == "you> "
        with contextlib.suppress(StopIteration):
            return next(it)
        raise EOFError

    return input_fn


async def answer(down, req: GenerateRequest) -> None:
    """" you said <the last message>", or an error for "fail"."""
    said = req.messages[-1]["content"]
    if said == "fail":
        await down.publish(req.id, ErrorChunk(req.id, "invalid_request", "prompt too long"))
    else:
        await down.reply(req, f" you said {said}")


def drive(nats_url, tiny_model, tok, *lines, **kw) -> tuple[Output, list[GenerateRequest]]:
    out = Output()

    async def body():
        async with gateway(nats_url, tiny_model, tok, answer) as down:
            await asyncio.wait_for(chat(down.ws, input_fn=scripted(*lines), output=out, **kw), 20)
            return down.requests

    return out, asyncio.run(body())


def test_replies_stream_in_pieces_with_a_stats_line_and_each_turn_sends_the_whole_history(nats_url, tiny_model,
                                                                                           tok):
    out, requests = drive(nats_url, tiny_model, tok, "hello", "and again", "/quit", "never read",
                          system="Be brief.", max_tokens=32, temperature=0.5)
    assert " you said hello\n" in out.text and " you said and again\n" in out.text
    pieces = [tok.decode([t]) for t in tok.encode(" you said hello").ids]
    assert out.writes[out.writes.index(pieces[0]):][:len(pieces)] == pieces   # one write per delta
    assert [int(n) for n in STATS.findall(out.text)] == [len(tok.encode(" you said hello").ids),
                                                         len(tok.encode(" you said and again").ids)]
    assert len(requests) == 2
    assert requests[1].messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"},
                                    {"role": "assistant", "content": " you said hello"},
                                    {"role": "user", "content": "and again"}]
    assert (requests[1].sampling.max_tokens, requests[1].sampling.temperature) == (32, 0.5)


def test_n_choices_are_all_shown_and_the_first_is_kept_in_the_history(nats_url, tiny_model, tok):
    out, requests = drive(nats_url, tiny_model, tok, "hello", "again", n=3)
    assert out.text.count("[choice 1]  you said hello\n") == out.text.count("[choice 2]  you said hello\n") == 1
    assert len(STATS.findall(out.text)) == 6 and len(requests) == 6
    assert len({r.group for r in requests[:3]}) == 1 and requests[0].group == requests[0].id
    assert requests[3].messages == [{"role": "user", "content": "hello"},
                                    {"role": "assistant", "content": " you said hello"},
                                    {"role": "user", "content": "again"}]


def test_the_chat_shows_the_model_s_sampling_defaults_and_sets_only_the_fields_given(nats_url, tiny_model, tok,
                                                                                    tmp_path):
    defaults = tmp_path / "generation_config.json"
    defaults.write_text('{"temperature": 0.3, "top_p": 0.8, "repetition_penalty": 1.2}')
    out = Output()

    async def body():
        async with gateway(nats_url, tiny_model, tok, answer, generation_config=str(defaults)) as down:
            await asyncio.wait_for(chat(down.ws, input_fn=scripted("hi"), output=out), 20)
            await asyncio.wait_for(chat(down.ws, input_fn=scripted("hi"), output=Output(), temperature=0.9,
                                        sampling={"top_p": None, "repetition_penalty": 1.0}), 20)
            return down.requests

    unset, given = asyncio.run(body())
    first = out.text.splitlines()[0]
    assert first.startswith("[connected to ws://") and first.endswith(
        "/ws · model defaults temperature 0.3, top_p 0.8, repetition_penalty 1.2 · /reset clears the history, /quit "
        "or Ctrl-D exits]")
    assert (unset.sampling.temperature, unset.sampling.top_p, unset.sampling.repetition_penalty) == (0.3, 0.8, 1.2)
    assert (given.sampling.temperature, given.sampling.top_p, given.sampling.repetition_penalty) == (0.9, 0.8, 1.0)


def test_reset_clears_the_history_and_eof_ends_the_chat(nats_url, tiny_model, tok):
    out, requests = drive(nats_url, tiny_model, tok, "one", "/reset", "", "two")
    assert "[history cleared]" in out.text
    assert [r.messages for r in requests] == [[{"role": "user", "content": "one"}],
                                              [{"role": "user", "content": "two"}]]


def test_an_error_frame_is_printed_and_the_failed_turn_leaves_no_trace_in_the_history(nats_url, tiny_model, tok):
    out, requests = drive(nats_url, tiny_model, tok, "fail", "ok")
    assert "[error invalid_request: prompt too long]" in out.text and " you said ok" in out.text
    assert requests[1].messages == [{"role": "user", "content": "ok"}]


def test_a_gateway_with_keys_takes_the_api_key_and_refuses_a_chat_without_one(nats_url, tiny_model, tok, tmp_path,
                                                                             capsys):
    keys = tmp_path / "keys.json"
    keys.write_text('{"sk-term": {"tenant": "term"}}')
    out = Output()

    async def body():
        async with gateway(nats_url, tiny_model, tok, answer, api_keys=str(keys)) as down:
            await asyncio.wait_for(chat(down.ws, input_fn=scripted("hi"), output=out, api_key="sk-term"), 20)
            assert await asyncio.to_thread(run, down.ws, input_fn=scripted("hi")) == 1
            return down.requests

    requests = asyncio.run(body())
    assert " you said hi" in out.text and [r.tenant for r in requests] == ["term"]
    assert "401" in capsys.readouterr().err


def test_run_reports_an_unreachable_gateway_with_exit_status_1(capsys):
    assert run(f"ws://127.0.0.1:{free_port()}/ws", input_fn=scripted()) == 1
    assert "chat: ws://127.0.0.1:" in capsys.readouterr().err


def test_a_reply_cut_off_by_its_gateway_resumes_on_the_next_one(nats_url, tiny_model, tok):
    slow = " a reply long enough to be cut off by its gateway and resumed on the next"
    out = Output()

    async def answer_slowly(down, req: GenerateRequest) -> None:
        await down.stream(req, slow, 0.05)

    async def body():
        async with gateway(nats_url, tiny_model, tok, answer_slowly) as two:
            first = gateway(nats_url, tiny_model, tok, requests=False)
            one = await first.__aenter__()
            talk = asyncio.create_task(chat([one.ws, two.ws], input_fn=scripted("slow"), output=out))
            while len(out.writes) < 5:                    # a few deltas in
                await asyncio.sleep(0.01)
            await first.__aexit__(None, None, None)       # the gateway stops: its connections close
            await asyncio.wait_for(talk, 20)
            return two

    two = asyncio.run(body())
    assert out.text.count(slow) == 1 and f"{slow}\n" in out.text      # printed once, whole
    assert "resumed 1×]" in out.text and two.cancels == [] and len(two.requests) == 1

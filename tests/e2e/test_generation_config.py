"""A model's sampling defaults through the real stack (every service its own process): a request that sets no
sampling field runs with them, one that sets fields keeps its own, and a greedy one stays plain greedy; both logs
(TB_REQUESTS, TB_RESULTS) hold what each request ran with, so replay and the offline engine reproduce it."""
import asyncio
import json
import time
from pathlib import Path

import pytest

import bus
from ops import replay
from ops.cli import parser
from ops.procs import free_port
from ops.up import Stack
from schemas import generation, subjects
from schemas.messages import GenerateRequest, decode
from schemas.sampling import SamplingParams
from tests.e2e.conftest import WORKER_ARGS, collect, completions, connect, running, send
from workers import LLM

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

DEFAULTS = {"temperature": 0.3, "top_p": 0.8, "top_k": 40, "repetition_penalty": 1.2}
CASES = {  # client id -> (frame fields, the sampling fields the request runs with)
    "unset": ({"prompt_token_ids": [40, 41, 42, 43], "max_tokens": 16}, {**DEFAULTS, "min_p": 0.0}),
    "own": ({"prompt_token_ids": [44, 45, 46, 47], "max_tokens": 16, "temperature": 0.9, "top_k": 7, "seed": 3},
            {**DEFAULTS, "temperature": 0.9, "top_k": 7, "min_p": 0.0}),
    "greedy": ({"prompt_token_ids": [48, 49, 50, 51], "max_tokens": 16, "temperature": 0},
               {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}),
}


@pytest.fixture(scope="module")
def recommended(tiny_model, tmp_path_factory) -> str:
    """The tiny model (its files linked) whose generation_config.json recommends DEFAULTS."""
    out = tmp_path_factory.mktemp("recommended")
    for f in Path(tiny_model).iterdir():
        if f.name != generation.CONFIG:
            (out / f.name).symlink_to(f)
    config = json.loads((Path(tiny_model) / generation.CONFIG).read_text())
    (out / generation.CONFIG).write_text(json.dumps({**config, **DEFAULTS}))
    return str(out)


async def logged(nats_url: str, wait: float = 1.0) -> list[GenerateRequest]:
    """Every request in the request log (TB_REQUESTS)."""
    nc = await bus.connect(nats_url, "test-requests")
    sub = await nc.jetstream().subscribe(subjects.REQUESTS_SUBJECTS, ordered_consumer=True)
    out = []
    try:
        while True:
            out.append(decode((await sub.next_msg(timeout=wait)).data, GenerateRequest))
    except (TimeoutError, asyncio.TimeoutError):
        return out
    finally:
        await nc.close()


def sampled(p: SamplingParams) -> dict:
    return {k: getattr(p, k) for k in generation.FIELDS}


def test_the_stack_runs_unset_fields_with_the_model_s_defaults_logs_them_and_replays_them(recommended, tmp_path,
                                                                                         capsys):
    with running(Stack(recommended, free_port(), tmp_path, nats_port=free_port(), workers=1,
                       worker_args=WORKER_ARGS)) as stack:
        async def run():
            async with connect(stack) as ws:
                for cid, (fields, _) in CASES.items():
                    await send(ws, {"type": "generate", "id": cid, **fields})
                return await collect(ws, set(CASES))

        got = asyncio.run(run())
        time.sleep(0.5)
        requests, records = asyncio.run(logged(stack.nats_url)), asyncio.run(completions(stack.nats_url))
        llm = LLM(recommended)
        for cid, (fields, want) in CASES.items():
            req = next(r for r in requests if r.prompt_token_ids == fields["prompt_token_ids"])
            rec = next(r for r in records if r.prompt_token_ids == fields["prompt_token_ids"])
            assert sampled(req.sampling) == sampled(rec.sampling) == want, cid
            assert rec.output_token_ids == got[cid]["token_ids"]
            assert llm.generate([rec.prompt_token_ids], rec.sampling)[0].token_ids == rec.output_token_ids, cid
        assert replay.main(parser().parse_args(["replay", "--last", "3", "--json", "--nats-url", stack.nats_url,
                                                "--timeout", "60"])) == 0
        assert json.loads(capsys.readouterr().out) == {"replayed": 3, "identical": 3, "skipped": 0, "diffs": []}

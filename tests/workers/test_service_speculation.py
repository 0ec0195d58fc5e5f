"""A worker started with `--speculative ngram:2 --no-speculative-adaptive` on the tiny model, in-process on a
real nats-server: its heartbeat carries the engine's drafting counts, the gateway's /metrics exports them
per worker, a request that opts out drafts nothing, and the worker logs its k when it changes, not at
every look."""
import asyncio
import contextlib
import time

import nats
import pytest
from prometheus_client.parser import text_string_to_metric_families

import bus
from schemas import subjects
from schemas.messages import FinalChunk, Heartbeat, Speculation, TokenChunk, TokenizedRequest, WorkItem, decode, encode
from schemas.sampling import SamplingParams
from services.gateway.metrics import Metrics
from tests.workers.service_helpers import worker
from workers.engine.engine import LLMEngine
from workers.service import engine_config, parser, speculation_of

PROMPT = [5, 6, 7, 8] * 6            # every 2-gram repeats: the n-gram proposer drafts from the first step
STEP_PAUSE = 0.05                    # seconds added to each step: a request spans several heartbeats


class Recorder:
    """A logger that keeps each event with its fields."""

    def __init__(self):
        self.events: list[tuple[str, dict]] = []

    def bind(self, **_):
        return self

    def __getattr__(self, level):
        return lambda event, **fields: self.events.append((event, fields))

    def changes(self) -> list[dict]:
        return [fields for event, fields in self.events if event == "speculation changed"]


@pytest.fixture(scope="module")
def engine(tiny_model):
    args = parser().parse_args(["--model", tiny_model, "--num-kv-blocks", "256", "--speculative", "ngram:2",
                                "--no-speculative-adaptive"])
    return LLMEngine(tiny_model, engine_config(args))


async def generate(js, nc, rid: str, speculative: bool) -> FinalChunk:
    """Runs one greedy request through worker w0; its final chunk."""
    q = asyncio.Queue()
    await nc.subscribe(subjects.out(rid), cb=q.put)
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True, speculative=speculative)
    item = WorkItem(TokenizedRequest(rid, "t", params, PROMPT), "w0", time.time())
    await js.publish(subjects.work("w0", rid), encode(item), headers=subjects.msg_id(rid))
    async with asyncio.timeout(60):
        while type(chunk := decode((await q.get()).data, TokenChunk, FinalChunk)) is TokenChunk:
            pass
    return chunk


async def beat(service, js) -> Heartbeat:
    """The heartbeat the worker writes now, as the registry holds it."""
    await service.registry.heartbeat()
    return decode((await (await bus.registry(js)).get("w0")).value, Heartbeat)


@contextlib.contextmanager
def slow_steps(engine: LLMEngine, monkeypatch):
    step = engine.step

    def slow():
        time.sleep(STEP_PAUSE)
        return step()
    monkeypatch.setattr(engine, "step", slow)
    yield


def test_a_speculating_worker_reports_its_drafts_in_its_heartbeat_and_metrics_and_an_opt_out_drafts_none(
        nats_url, engine, monkeypatch):
    log = Recorder()

    async def main():
        nc = await nats.connect(nats_url)
        js = nc.jetstream()
        await bus.ensure_streams(js)
        async with worker(nats_url, engine, log=log) as service:
            with slow_steps(engine, monkeypatch):
                steps = engine.num_steps
                final = await generate(js, nc, "spec", speculative=True)
                steps = engine.num_steps - steps
            after_spec, counted = await beat(service, js), speculation_of(engine.stats())
            scraped = await Metrics().render(await bus.registry(js), log)
            await generate(js, nc, "plain", speculative=False)
            after_plain = await beat(service, js)
        await nc.close()
        return final, steps, after_spec, counted, scraped.decode(), after_plain

    final, steps, hb, counted, text, hb_plain = asyncio.run(asyncio.wait_for(main(), 120))
    s = hb.speculation
    assert final.finish_reason == "length" and final.offset + len(final.token_ids) == 64
    assert s == counted                                # what the engine counted, through the registry
    assert (s.method, s.k_max, s.adaptive) == ("ngram", 2, False)
    assert s.drafts >= 1 and s.drafts <= s.draft_tokens <= 2 * s.drafts and s.accepted_tokens <= s.draft_tokens
    assert steps == 64 - s.accepted_tokens            # each step gave one token, and one more per accepted draft
    assert s.acceptance_rate == round(s.accepted_tokens / s.draft_tokens, 4)
    assert len(s.acceptance_per_position) == 2

    samples = {(x.name, tuple(sorted(x.labels.items()))): x.value
               for family in text_string_to_metric_families(text) for x in family.samples}
    w0 = (("worker", "w0"),)
    assert samples[("tokenbus_spec_decode_drafts_total", w0)] == s.drafts
    assert samples[("tokenbus_spec_decode_draft_tokens_total", w0)] == s.draft_tokens
    assert samples[("tokenbus_spec_decode_accepted_tokens_total", w0)] == s.accepted_tokens
    assert samples[("tokenbus_spec_decode_k", w0)] == s.k
    assert samples[("tokenbus_spec_decode_acceptance_rate", w0)] == s.acceptance_rate
    assert samples[("tokenbus_spec_decode_mean_acceptance_length", w0)] == s.mean_acceptance_length
    assert samples[("tokenbus_spec_decode_acceptance_estimate", w0)] == s.acceptance_estimate
    assert [samples[("tokenbus_spec_decode_acceptance_by_position", (("position", str(i)), *w0))]
            for i in range(2)] == s.acceptance_per_position

    plain = hb_plain.speculation                       # the request that opted out verified no draft
    assert (plain.drafts, plain.draft_tokens, plain.accepted_tokens) == (s.drafts, s.draft_tokens, s.accepted_tokens)

    assert steps * STEP_PAUSE >= 2 * subjects.HEARTBEAT_SECONDS      # the loop looked more than once meanwhile
    assert len(log.changes()) == 1                    # k stayed 2 while the request drafted: one line, at first
    assert log.changes()[0]["k"] == 2 and log.changes()[0]["previous_k"] is None
    assert log.changes()[0]["spec_rows"] == 1 and 0 <= log.changes()[0]["spec_acceptance_estimate"] <= 1


def test_the_worker_logs_k_when_it_changes_between_looks_and_not_after_a_step_where_nobody_could_draft(
        nats_url, engine):
    log = Recorder()

    def look(k: int, rows: int) -> Speculation:
        return Speculation("ngram", k, 4, True, rows, 0.5, 0, 0, 0, 0.0, 0.0, [])

    async def main():
        async with worker(nats_url, engine, log=log) as service:
            for k, rows in [(2, 1), (2, 3), (1, 3), (0, 0), (1, 2), (0, 5)]:
                service.registry.watch_k(look(k, rows))

    asyncio.run(asyncio.wait_for(main(), 30))
    assert [(c["previous_k"], c["k"], c["spec_rows"]) for c in log.changes()] == [(None, 2, 1), (2, 1, 3), (1, 0, 5)]

"""A request's ends, stored: its Outcome in tb_outcomes (the first end of a request id wins, so a
redelivered item is not run twice), its completion record in TB_RESULTS, its usage record in TB_USAGE
(a backup for the gateway's), then its work item acked. A request that ends for good with an error
(intake's checks refused it, or the engine failed it): an error chunk, an Outcome "error", and for
one dead-lettered a DeadLetter in TB_DEAD naming the reason.

Runs on the event loop. The stores run in tasks of their own (`State.spawn`), retried through a
broker restart, so they never hold the step loop; `already_ended` runs in a work item's intake task.

Given the shared State (state.py): the bus, the worker id, the log, `spawn`, and the counts, whose
`finished` it adds to. It owns the tb_outcomes bucket (`open`). It calls no other part: intake.py
and streaming.py call it."""
import asyncio
import time

import nats.errors
import nats.js.errors

import bus
from schemas import subjects
from schemas.messages import (
    Completion,
    DeadLetter,
    ErrorChunk,
    Outcome,
    TokenizedRequest,
    Usage,
    WorkItem,
    decode,
    encode,
    ending,
)
from text.detokenizer import PROMPT_CONTEXT
from workers.engine.request import Request
from workers.service.state import Running, State

USAGE_BACKUP_SECONDS = 5.0     # the worker's usage record waits for the gateway's (same message id) to win


class Records:
    """A request's ends, stored: outcomes, completion and usage records, dead letters."""

    def __init__(self, state: State):
        self.nc, self.js, self.id, self.log = state.nc, state.js, state.id, state.log
        self.spawn, self.counts = state.spawn, state.counts
        self.outcomes = None                     # tb_outcomes, once open()

    async def open(self) -> None:
        self.outcomes = await bus.outcomes(self.js)

    def store_end(self, run: Running, req: Request, usage: dict, timing: dict) -> None:
        """The records of a request that finished (its final chunk is out), stored in a task of their own."""
        rid, r = req.request_id, run.item.request
        record = Completion(rid, r.tenant, self.id, r.sampling, r.prompt_token_ids, req.output_token_ids,
                            req.finish_reason, req.stop_reason, usage, timing, r.created)
        outcome = Outcome(rid, r.tenant, self.id, req.finish_reason, list(req.output_token_ids), req.stop_reason,
                          usage, timing, r.prompt_token_ids[-PROMPT_CONTEXT:], ts=time.time())
        self.spawn(self.record(record, outcome, run.msg, metered(r, record, time.time())))
        self.counts.finished += 1
        self.log.info("request finished", request_id=rid, tenant=r.tenant, finish_reason=req.finish_reason,
                      resumed=req.num_resumed_tokens, generated=req.num_output_tokens - req.num_resumed_tokens,
                      **usage, **timing)

    async def record(self, record: Completion, outcome: Outcome, msg, usage: Usage | None = None) -> None:
        """Creates the request's Outcome (the first end of a request id wins), stores the completion record
        if this end won, then acks the work item (not acked: JetStream redelivers, and already_ended()
        finds the Outcome). The publishes are retried under the request id through a broker restart.
        The usage record follows USAGE_BACKUP_SECONDS later: the gateway's, stored first under the same
        message id, wins; the worker's counts only where the gateway died with the request."""
        rid = record.id
        try:
            if await self.create_outcome(outcome):
                await bus.publish(self.js, subjects.done(record.tenant, rid), encode(record), subjects.msg_id(rid),
                                  self.log)
                if usage is not None:
                    self.spawn(self.meter_later(usage))
            else:
                self.log.warning("request ended before: completion not recorded again", request_id=rid)
            await msg.ack()
        except (nats.errors.Error, asyncio.TimeoutError, bus.NotStored) as e:
            self.log.error("completion not stored", request_id=rid, error=str(e) or type(e).__name__)

    async def meter_later(self, usage: Usage) -> None:
        await asyncio.sleep(USAGE_BACKUP_SECONDS)
        try:
            await bus.publish(self.js, subjects.usage(usage.tenant, usage.id), encode(usage), subjects.msg_id(usage.id),
                              self.log)
        except (nats.errors.Error, asyncio.TimeoutError, bus.NotStored) as e:
            self.log.error("usage record not stored", request_id=usage.id, error=str(e) or type(e).__name__)

    async def create_outcome(self, outcome: Outcome) -> bool:
        """True if this end of the request is the first (created now, or by an earlier attempt of this
        call whose ack was lost: same worker, same tokens)."""
        deadline = time.monotonic() + bus.PUBLISH_DEADLINE
        while True:
            try:
                await self.outcomes.create(outcome.id, encode(outcome))
                return True
            except nats.js.errors.KeyWrongLastSequenceError:
                first = decode((await self.outcomes.get(outcome.id)).value, Outcome)
                return first.worker == outcome.worker and first.output_token_ids == outcome.output_token_ids
            except (nats.errors.Error, asyncio.TimeoutError) as e:
                if time.monotonic() >= deadline:
                    raise
                self.log.warning("outcome not stored; retrying", request_id=outcome.id,
                                 error=str(e) or type(e).__name__)
                if isinstance(e, nats.js.errors.NoStreamResponseError):
                    self.outcomes = await bus.outcomes(self.js)
                await asyncio.sleep(bus.PUBLISH_RETRY)

    async def already_ended(self, item: WorkItem, msg) -> bool:
        """A work item whose request has an Outcome (a redelivery after its ack was lost, however late):
        not run again; its final chunk goes out again from the Outcome, for a gateway still waiting."""
        rid = item.request.id
        try:
            entry = await self.outcomes.get(rid)
        except nats.js.errors.KeyNotFoundError:
            return False
        except (nats.errors.Error, asyncio.TimeoutError) as e:   # run it: record() still writes one Outcome
            self.log.warning("outcome not read", request_id=rid, error=str(e) or type(e).__name__)
            return False
        o = decode(entry.value, Outcome)
        await self.nc.publish(subjects.out(rid), encode(ending(o)))
        await msg.ack()
        self.log.warning("redelivered request had ended: not run again", request_id=rid, tenant=item.request.tenant,
                         attempt=item.attempt, finish_reason=o.finish_reason, ended_on=o.worker)
        return True

    # -- ends for good --------------------------------------------------------------------------

    async def dead_letter(self, item: WorkItem, msg, code: str, reason: str, strikes: int,
                          output: list[int] = ()) -> None:
        """Ends a request with an error for good, with a DeadLetter in TB_DEAD naming the reason."""
        letter = DeadLetter(item.request, reason, strikes, self.id, time.time())
        await self.give_up(item, msg, code, reason, output, letter)

    async def give_up(self, item: WorkItem, msg, code: str, reason: str, output: list[int] = (),
                      letter: DeadLetter | None = None) -> None:
        """Ends a request with an error: ErrorChunk on tb.out, an Outcome "error" in tb_outcomes, the
        dead letter if any, then the work item is acked."""
        r = item.request
        await self.nc.publish(subjects.out(r.id), encode(ErrorChunk(r.id, code, reason)))
        self.spawn(self.bury(r, msg, code, reason, list(output), letter))

    async def bury(self, r: TokenizedRequest, msg, code: str, reason: str, output: list[int],
                   letter: DeadLetter | None) -> None:
        """Stores the end (the first end of a request is the one kept) and the dead letter, each retried
        through a broker restart, then acks; not stored: not acked, so it comes again and ends again."""
        outcome = Outcome(r.id, r.tenant, self.id, "error", output, error_code=code, error_message=reason,
                          ts=time.time())
        try:
            await self.create_outcome(outcome)
            if letter is not None:
                await bus.publish(self.js, subjects.dead(r.tenant, r.id), encode(letter),
                                  subjects.msg_id(r.id, f"{r.id}.dead"), self.log)
            await msg.ack()
        except (nats.errors.Error, asyncio.TimeoutError, bus.NotStored) as e:
            self.log.error("request end not stored", request_id=r.id, code=code, error=str(e) or type(e).__name__)
            return
        self.log.warning("request dead-lettered" if letter else "request given up", request_id=r.id,
                         tenant=r.tenant, code=code, strikes=letter.strikes if letter else None, reason=reason)


def metered(r: TokenizedRequest, done: Completion, now: float) -> Usage | None:
    """The usage record of a request as the worker saw it; None for one that names no API (offline use)."""
    m, u = r.meter, done.usage
    if m is None or not m.api:
        return None
    timing = {"queue_ms": done.timing["queue_ms"]} if "queue_ms" in done.timing else {}
    return Usage(r.id, r.tenant, m.key_id, m.model, m.api, done.finish_reason, u.get("prompt_tokens", 0),
                 u.get("cached_tokens", 0), u.get("completion_tokens", 0), timing, r.created, now, r.revision)

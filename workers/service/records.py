"""A request's ends, stored: its end record in TB_RESULTS (bus.store_end: the first end of a request id
wins, so a redelivered item is not run twice, and the record is the completions log's entry too), its
usage record in TB_USAGE (a backup for the gateway's), then its work item acked. A request that ends
for good with an error (intake's checks refused it, or the engine failed it): an error chunk, an end
record "error", and for one dead-lettered a DeadLetter in TB_DEAD naming the reason.

Runs on the event loop. The stores run in tasks of their own (`State.spawn`), retried through a
broker restart, so they never hold the step loop; `already_ended` runs in a work item's intake task.

Given the shared State (state.py): the bus, the worker id, the log, `spawn`, and the counts, whose
`finished` it adds to. It calls no other part: intake.py and streaming.py call it."""
import asyncio
import time

import nats.errors

import bus
from schemas import subjects
from schemas.messages import (
    Completion,
    DeadLetter,
    ErrorChunk,
    TokenizedRequest,
    Usage,
    WorkItem,
    decode,
    encode,
    ending,
)
from schemas.wire import WireError
from text.detokenizer import PROMPT_CONTEXT
from workers.engine.request import Request
from workers.service.state import Running, State

USAGE_BACKUP_SECONDS = 5.0     # the worker's usage record waits for the gateway's (same message id) to win


class Records:
    """A request's ends, stored: end records, usage records, dead letters."""

    def __init__(self, state: State):
        self.nc, self.js, self.id, self.log = state.nc, state.js, state.id, state.log
        self.spawn, self.counts = state.spawn, state.counts

    def store_end(self, run: Running, req: Request, usage: dict, timing: dict) -> None:
        """The records of a request that finished (its final chunk is out), stored in a task of their own."""
        rid, r, now = req.request_id, run.item.request, time.time()
        record = Completion(rid, r.tenant, self.id, r.sampling, r.prompt_token_ids, req.output_token_ids,
                            req.finish_reason, req.stop_reason, usage, timing, r.created, ended=now)
        self.spawn(self.record(record, run.msg, metered(r, record, now)))
        self.counts.finished += 1
        self.log.info("request finished", request_id=rid, tenant=r.tenant, finish_reason=req.finish_reason,
                      resumed=req.num_resumed_tokens, generated=req.num_output_tokens - req.num_resumed_tokens,
                      **usage, **timing)

    async def record(self, record: Completion, msg, usage: Usage | None = None) -> None:
        """Stores the request's end record unless an end of it was stored first, then acks the work item
        (not acked: JetStream redelivers, and already_ended() finds the record). The publish is retried
        under the request id through a broker restart. The usage record follows USAGE_BACKUP_SECONDS
        later: the gateway's, stored first under the same message id, wins; the worker's counts only
        where the gateway died with the request."""
        rid = record.id
        try:
            first = await bus.store_end(self.js, record.tenant, rid, bus.partition(msg), encode(record), self.log)
            if first is None:
                if usage is not None:
                    self.spawn(self.meter_later(usage))
            else:
                self.log.warning("request ended before: its end not recorded again", request_id=rid)
            await msg.ack()
        except (nats.errors.Error, asyncio.TimeoutError, bus.NotStored) as e:
            self.log.error("end record not stored", request_id=rid, error=str(e) or type(e).__name__)

    async def meter_later(self, usage: Usage) -> None:
        await asyncio.sleep(USAGE_BACKUP_SECONDS)
        try:
            await bus.publish(self.js, subjects.usage(usage.tenant, usage.id), encode(usage),
                              subjects.msg_id(usage.id), self.log)
        except (nats.errors.Error, asyncio.TimeoutError, bus.NotStored) as e:
            self.log.error("usage record not stored", request_id=usage.id, error=str(e) or type(e).__name__)

    async def already_ended(self, item: WorkItem, msg) -> bool:
        """A work item whose request has an end record (a redelivery after its ack was lost, however
        late): not run again; its final chunk goes out again from the record, for a gateway still waiting."""
        rid = item.request.id
        try:
            data = await bus.ended(self.js, item.request.tenant, rid, bus.partition(msg))
            if data is None:
                return False
            c = decode(data, Completion)
        except (nats.errors.Error, asyncio.TimeoutError, WireError) as e:   # run it: only one end is stored
            self.log.warning("end record not read", request_id=rid, error=str(e) or type(e).__name__)
            return False
        await self.nc.publish(subjects.out(rid), encode(ending(c, 0, PROMPT_CONTEXT)))
        await msg.ack()
        self.log.warning("redelivered request had ended: not run again", request_id=rid, tenant=item.request.tenant,
                         attempt=item.attempt, finish_reason=c.finish_reason, ended_on=c.worker)
        return True

    # -- ends for good --------------------------------------------------------------------------

    async def dead_letter(self, item: WorkItem, msg, code: str, reason: str, strikes: int,
                          output: list[int] = ()) -> None:
        """Ends a request with an error for good, with a DeadLetter in TB_DEAD naming the reason."""
        letter = DeadLetter(item.request, reason, strikes, self.id, time.time())
        await self.give_up(item, msg, code, reason, output, letter)

    async def give_up(self, item: WorkItem, msg, code: str, reason: str, output: list[int] = (),
                      letter: DeadLetter | None = None) -> None:
        """Ends a request with an error: ErrorChunk on tb.out, an end record "error" in TB_RESULTS, the
        dead letter if any, then the work item is acked."""
        r = item.request
        await self.nc.publish(subjects.out(r.id), encode(ErrorChunk(r.id, code, reason)))
        self.spawn(self.bury(r, msg, code, reason, list(output), letter))

    async def bury(self, r: TokenizedRequest, msg, code: str, reason: str, output: list[int],
                   letter: DeadLetter | None) -> None:
        """Stores the end (the first end of a request is the one kept) and the dead letter, each retried
        through a broker restart, then acks; not stored: not acked, so it comes again and ends again."""
        record = Completion(r.id, r.tenant, self.id, r.sampling, r.prompt_token_ids, output, "error",
                            created=r.created, error_code=code, error_message=reason, ended=time.time())
        try:
            await bus.store_end(self.js, r.tenant, r.id, bus.partition(msg), encode(record), self.log)
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

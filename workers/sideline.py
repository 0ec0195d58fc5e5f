"""The worker's side thread: an event loop and a NATS connection of its own, for what must not wait
for an engine step.

The worker's engine steps on a thread of its own (workers/stepper.py), and whatever reads the
engine on the event loop, the heartbeat's counts among it, waits for the step under way (the engine
lock). On a GPU that is milliseconds; on a CPU, a step full of a long prompt's chunks takes seconds.
Two things cannot wait that long. The heartbeat: one older than WORKER_TTL and the router takes the
worker's work away. And a KV fetch a decode worker sent (disaggregated serving): answered only
between steps, a transfer moves one window per step. Both run here; they are rare and short, so
they cost the step next to nothing. The heartbeat is the one the step loop last built, sent with a
fresh time, and only while the loop builds one at least every MAX_STEP_SECONDS: a hung engine still
lapses.
"""
import asyncio
import threading

import bus

MAX_STEP_SECONDS = 60.0        # a step loop silent this long is hung: the side thread stops vouching for it


class Sideline:
    def __init__(self, servers: str, name: str, log):
        self.servers, self.name, self.log = servers, name, log
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name=f"{name}-side", daemon=True)
        self.nc = None

    async def start(self) -> None:
        self.thread.start()
        self.nc = await self.run(bus.connect(self.servers, self.name, self.log, role="worker"))

    async def run(self, coro):
        """Runs coro on the side thread's loop and waits for it from the caller's."""
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self.loop))

    def spawn(self, coro) -> None:
        """Starts coro on the side thread's loop, not waiting for it."""
        asyncio.run_coroutine_threadsafe(coro, self.loop)

    async def stop(self) -> None:
        """Closes the side connection (its subscriptions end) and the thread."""
        if self.nc is not None:
            try:
                await asyncio.wait_for(self.run(bus.close(self.nc)), 5)
            except Exception as e:               # the server may be gone already
                self.log.warning("side connection not closed cleanly", error=str(e) or type(e).__name__)
        try:
            await asyncio.wait_for(self.run(cancel_others()), 5)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
        await asyncio.to_thread(self.thread.join, 5)


async def cancel_others() -> None:
    """Cancels every task of the running loop but this one (and lets them end)."""
    others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for t in others:
        t.cancel()
    await asyncio.gather(*others, return_exceptions=True)

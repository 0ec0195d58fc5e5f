"""The step thread: calls run there one at a time, their results and errors come back to the awaiting
coroutine, a cancelled caller does not cut a call short, and close ends the thread."""
import asyncio
import threading
import time

import pytest

from workers.stepper import Stepper


def test_calls_run_on_the_thread_one_at_a_time_with_their_results_and_errors():
    async def main():
        stepper = Stepper(name="test-steps")
        inside, done, peak = [], [], [0]

        def work(x):
            inside.append(threading.current_thread())
            peak[0] = max(peak[0], len(inside) - len(done))
            time.sleep(0.02)
            done.append(x)
            return x * 2
        assert await asyncio.gather(*(stepper.call(work, i) for i in range(4))) == [0, 2, 4, 6]
        assert set(inside) == {stepper.thread} and peak[0] == 1     # its own thread, never two at once

        def fails():
            raise ValueError("bad step")
        with pytest.raises(ValueError, match="bad step"):
            await stepper.call(fails)
        assert await stepper.call(work, 5) == 10                     # the thread goes on after an error
        stepper.close()
        assert not stepper.thread.is_alive()
    asyncio.run(main())


def test_a_cancelled_caller_leaves_the_call_to_finish_and_finish_waits_for_it():
    async def main():
        stepper, ended = Stepper(name="test-steps"), threading.Event()

        def slow():
            time.sleep(0.3)
            ended.set()
        task = asyncio.create_task(stepper.call(slow))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert not ended.is_set()                                    # still running on the thread
        await stepper.finish(5)
        assert ended.is_set()
        stepper.close()
    asyncio.run(main())

"""bus.consume on a real nats-server."""
import asyncio

import nats

import bus
from bus.log import configure
from schemas import subjects


def test_a_consumer_deleted_under_a_running_stage_is_made_again_and_its_messages_keep_coming(nats_url):
    """A router that takes a slow but live worker for gone deletes its consumer; the worker must not
    spin on 'no responders' but create it again and go on taking work."""
    async def main():
        nc = await nats.connect(nats_url)
        js = nc.jetstream()
        await bus.ensure_streams(js)
        got = asyncio.Queue()

        async def handle(msg):
            await msg.ack_sync()     # acked before the deletion below: a plain ack may race it (then "1" comes again)
            got.put_nowait(msg.data)

        config = bus.worker_consumer("w0")
        task = asyncio.create_task(bus.consume(nc, subjects.WORK_STREAM, config, handle, configure("test")))
        await js.publish(subjects.work("w0", "r1"), b"1")
        assert await asyncio.wait_for(got.get(), 5) == b"1"
        await js.delete_consumer(subjects.WORK_STREAM, config.durable_name)
        await asyncio.sleep(0.2)
        await js.publish(subjects.work("w0", "r2"), b"2")
        assert await asyncio.wait_for(got.get(), 10) == b"2"
        task.cancel()
        await nc.close()

    asyncio.run(asyncio.wait_for(main(), 30))

"""A request's end record is stored once: the first end of a request id wins, whether a later end comes
within the duplicate window (the same Nats-Msg-Id) or after it (the subject already holds a record), and
an end that is retried after its ack was lost is still its own."""
import asyncio

import nats

import bus
from bus.log import configure
from schemas import subjects
from schemas.messages import Completion, decode, encode
from schemas.sampling import SamplingParams

LOG = configure("test")


def record(worker: str, tokens: list[int]) -> bytes:
    return encode(Completion("r1", "acme", worker, SamplingParams(), [1, 2], tokens, "length", None,
                             {"prompt_tokens": 2, "completion_tokens": len(tokens)}))


def test_the_first_end_of_a_request_is_the_one_stored(nats_url):
    async def main():
        nc = await nats.connect(nats_url)
        js = nc.jetstream()
        await bus.ensure_streams(js)
        assert await bus.ended(js, "acme", "r1", None) is None
        first = record("w0", [7, 8])
        assert await bus.store_end(js, "acme", "r1", None, first, LOG) is None            # stored: ours
        assert await bus.store_end(js, "acme", "r1", None, first, LOG) is None            # a retry: still ours
        assert await bus.store_end(js, "acme", "r1", None, record("w1", [9]), LOG) == first   # a second end
        await js.publish(subjects.done("acme", "r2"), record("w0", [3]), headers={"Nats-Msg-Id": "other"})
        late = encode(Completion("r2", "acme", "w1", SamplingParams(), [1], [4], "stop"))
        assert await bus.store_end(js, "acme", "r2", None, late, LOG) == record("w0", [3])   # past the window
        assert decode(await bus.ended(js, "acme", "r1", None), Completion).output_token_ids == [7, 8]
        assert (await js.stream_info(subjects.RESULTS_STREAM)).state.messages == 2       # one per request id
        await nc.close()

    asyncio.run(main())

"""Property: a stream resumed at any point a client can be at (after any delta frame) continues an
uninterrupted run exactly. The gateway's own Request delivers random token streams in random chunks
(characters split across tokens, stop strings found or held back), once whole and once resumed from
the end record or from the worker's Resend plus live chunks; the text before the cut plus the deltas
after it is the uninterrupted text, token for token, with the same end."""
import asyncio

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bus.log import configure
from schemas.messages import FinalChunk, TokenChunk
from services.gateway import keys
from services.gateway.admission import Ticket
from services.gateway.owners import Exchange
from services.gateway.session import Gateway
from services.gateway.stream import Request

TEXT = " Héllo wörld 🙂 and more words xyz end, ünïcödé 日本語 ok"
STOPS = [(), ("xy",), (" w",), ("never written",), ("🙂",), ("d 日",)]


class Quiet(Gateway):
    """A gateway with no bus: cancels and usage records go nowhere."""

    async def publish_cancel(self, rid: str, reason: str) -> None:
        pass

    def spawn(self, coro) -> None:
        coro.close()


class Subscription:
    async def unsubscribe(self) -> None:
        pass


def stream(gw: Gateway, stop: tuple, chunks: list, replay: int = 0) -> list[dict]:
    """The frames a client gets for these chunks (a resumed stream when replay is given)."""
    ex = Exchange(gw)
    r = Request(ex, "c", "rid", stop, 0.0, Ticket(keys.OPEN, 0, settled=True), "ws", replay=replay,
                resumed=bool(replay), sub=Subscription())
    ex.inflight["c"] = r

    async def run():
        for c in chunks:
            await r.take(c)
    asyncio.run(run())
    frames = []
    while not ex.frames.empty():
        frames.append(ex.frames.get_nowait())
    return frames


def chunked(ids: list[int], sizes: list[int], start: int = 0) -> list:
    """ids from `start` in chunks of the given sizes (cycled), the last one final with at least a token."""
    out, at, i = [], start, 0
    while len(ids) - at > 1:
        n = min(sizes[i % len(sizes)], len(ids) - at - 1)
        out.append(TokenChunk("rid", len(out), at, ids[at:at + n], 9, [1, 2] if at == 0 else []))
        at, i = at + n, i + 1
    out.append(FinalChunk("rid", len(out), at, ids[at:], "length", prompt_tail=[1, 2] if at == 0 else []))
    return out


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_resumed_stream_continues_the_uninterrupted_text_exactly(tok, data):
    pool = sorted(set(tok.encode(TEXT).ids))
    ids = data.draw(st.lists(st.sampled_from(pool), min_size=1, max_size=24), label="ids")
    stop = data.draw(st.sampled_from(STOPS), label="stop")
    sizes = data.draw(st.lists(st.integers(1, 4), min_size=1, max_size=4), label="sizes")
    gw = Quiet(None, None, None, tok, configure("test"))
    whole = stream(gw, stop, chunked(ids, sizes))
    deltas = [f for f in whole if f["type"] == "delta"]
    points = [(0, "")]                                     # (tokens, text) after each delta
    for f in deltas:
        points.append((points[-1][0] + len(f["token_ids"]), points[-1][1] + f["text"]))
    k, before = data.draw(st.sampled_from(points), label="cut")
    sent = sum(len(f["token_ids"]) for f in deltas)
    if data.draw(st.booleans(), label="from the outcome"):
        resumed = stream(gw, stop, [FinalChunk("rid", -1, 0, ids, "length", prompt_tail=[1, 2])], replay=k)
    else:                                                  # Resend from 0 (what the worker had), then live chunks
        m = data.draw(st.integers(0, len(ids) - 1), label="resent")
        live = [c for c in chunked(ids, sizes) if c.offset + len(c.token_ids) > m]
        resumed = stream(gw, stop, [TokenChunk("rid", -1, 0, ids[:m], 9, [1, 2]), *live], replay=k)
    after = [f for f in resumed if f["type"] == "delta"]
    assert before + "".join(f["text"] for f in after) == points[-1][1]
    got = [t for f in after for t in f["token_ids"]]
    # No gap, no repeat, no other token. Where a stop string cut the stream, the tokens around the cut go
    # with their chunk (a live stream in other chunks ends a token earlier or later, with the same text),
    # and a resume reads them in other chunks than the live stream did: there only the text is exact.
    assert got == ids[k:k + len(got)]
    stopped = whole[-1]["finish_reason"] == "stop"
    assert stopped or k + len(got) == sent
    assert resumed[-1]["type"] == whole[-1]["type"] == "done"
    assert resumed[-1]["finish_reason"] == whole[-1]["finish_reason"]
    assert whole[-1]["usage"]["completion_tokens"] == sent
    assert stopped or resumed[-1]["usage"]["completion_tokens"] == sent

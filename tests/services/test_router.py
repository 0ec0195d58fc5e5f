"""The routing policies on hand-built worker states: heartbeats, and prefix indexes filled with events."""
import math

import pytest

from schemas.hashing import hash_blocks
from schemas.messages import Heartbeat, KvEvent
from schemas.subjects import BATCH_PRIORITY, WORKER_TTL
from services.router.policy import Options, Registry

BS = 16
NOW = 100.0


def beat(worker: str, running: int = 0, waiting: int = 0, ts: float = NOW, max_num_seqs: int = 8,
         total: int = 100, free: int = 100, queued: int = 0, finished: int = 0) -> Heartbeat:
    return Heartbeat(worker, ts, "tiny", BS, max_num_seqs, running, waiting, total, free, 0, 0, finished,
                     kv_blocks_queued=queued)


def registry(*beats: Heartbeat, **options) -> Registry:
    reg = Registry(Options(**options))
    for hb in beats:
        reg.update(hb)
    return reg


def holds(reg: Registry, worker: str, tokens: list[int], salt: str | None = None) -> None:
    """The worker stored the full blocks of tokens (one KV event)."""
    held = reg.index.workers[worker]
    held.seq = max(held.seq, 0)
    assert not reg.index.apply(KvEvent(worker, held.seq + 1, hash_blocks(tokens, BS, salt), []))


def picks(reg: Registry, n: int, prompt=(), salt=None) -> list[str]:
    return [reg.pick(NOW, list(prompt), salt).worker for _ in range(n)]


SYSTEM = list(range(1000, 1000 + 8 * BS))          # a hot system prompt: 8 blocks


def prompt(i: int, extra: int = BS) -> list[int]:
    return SYSTEM + [2000 + i] * extra


# -- least-loaded and round-robin ----------------------------------------------------------------

def test_equal_workers_are_taken_in_turn_under_every_policy():
    for policy in ("prefix", "least-loaded", "round-robin"):
        reg = registry(beat("w0"), beat("w1"), beat("w2"), policy=policy)
        assert picks(reg, 3) == ["w0", "w1", "w2"], policy


def test_least_loaded_counts_what_was_routed_since_the_heartbeat():
    reg = registry(beat("w0", running=4), beat("w1", running=1, waiting=1), policy="least-loaded")
    assert picks(reg, 2) == ["w1", "w1"]                 # w1: 2 then 3, w0: 4
    assert picks(reg, 4) == ["w0", "w1", "w0", "w1"]     # equal: in turn
    reg.update(beat("w1", running=8))                    # a fresh heartbeat replaces the guess
    assert picks(reg, 1) == ["w0"]


def test_a_stand_in_beat_keeps_what_was_routed_since_the_last_real_one():
    """While a long step holds a worker's loop, its side thread sends the last heartbeat again with a fresh
    time: the counts in it are the step's start's, so what was routed since still loads the worker."""
    reg = registry(beat("w0"), beat("w1"), policy="least-loaded")
    assert picks(reg, 2) == ["w0", "w1"]
    assert picks(reg, 2) == ["w0", "w1"]
    reg.update(beat("w0", ts=NOW + 0.5))                   # stand-ins: w0 and w1 still carry 2 each
    reg.update(beat("w1", ts=NOW + 0.5, running=1, finished=1))     # w1's step ended: a new count, 1 running
    assert (reg.workers["w0"].routed, reg.workers["w1"].routed) == (2, 0)
    assert picks(reg, 1) == ["w1"]


def test_least_loaded_is_relative_to_capacity():
    reg = registry(beat("small", running=2, max_num_seqs=4), beat("big", running=4, max_num_seqs=64),
                   policy="least-loaded")
    assert picks(reg, 1) == ["big"]


def test_a_request_that_ends_before_the_next_heartbeat_stops_counting_as_load():
    reg = registry(beat("w0"), beat("w1"))
    first = reg.pick(NOW, prompt(0))
    assert (reg.workers["w0"].routed, reg.workers["w0"].routed_blocks) == (1, 9)
    reg.finished(first)
    assert (reg.workers["w0"].routed, reg.workers["w0"].routed_blocks) == (0, 0)
    second = reg.pick(NOW, prompt(1))
    reg.update(beat("w1", running=1))                      # the heartbeat counts it from now on
    reg.finished(second)
    assert reg.workers["w1"].routed == 0 and reg.workers["w1"].hb.running == 1


def test_round_robin_ignores_load_and_cache():
    reg = registry(beat("w0", running=8), beat("w1"), beat("w2"), policy="round-robin")
    holds(reg, "w1", prompt(0))
    assert picks(reg, 4, prompt(0)) == ["w0", "w1", "w2", "w0"]


def test_a_worker_whose_heartbeat_lapsed_is_never_picked():
    reg = registry(beat("old"), beat("new", running=7, ts=NOW + WORKER_TTL))
    assert reg.pick(NOW + WORKER_TTL + 0.1).worker == "new"
    reg.remove("new")
    assert reg.pick(NOW + WORKER_TTL + 0.1) is None
    assert "new" not in reg.index.workers


def test_unknown_policy_and_bad_options_are_refused():
    with pytest.raises(ValueError, match="policy 'random' is not one of prefix, least-loaded, round-robin"):
        Options("random")
    with pytest.raises(ValueError, match="alpha"):
        Options(alpha=-1)


# -- the prefix cost -----------------------------------------------------------------------------

def test_cost_is_alpha_uncached_and_pending_blocks_plus_active_plus_new_blocks():
    reg = registry(beat("w0", free=60), beat("w1", free=90, queued=5), alpha=2.0)
    p = list(range(10 * BS + 4))                           # 10 full blocks + 4 tokens: 11 blocks
    holds(reg, "w0", p[:6 * BS])
    choice = reg.pick(NOW, p)
    # w0: 6 blocks cached: 2·(164 − 96)/16 + 40 active + 5 new = 53.5
    # w1: nothing cached:  2·(164/16 + 5 queued) + (10 active + 5 queued) + 11 new = 56.5
    assert choice.costs == {"w0": 53.5, "w1": 56.5}
    assert (choice.worker, choice.hit_tokens, choice.cost) == ("w0", 6 * BS, 53.5)
    assert reg.workers["w0"].routed_blocks == 5 and reg.workers["w0"].routed == 1
    again = reg.pick(NOW, list(range(1000, 1000 + 4 * BS)))   # w0's 5 routed blocks are prefill to come
    # w0: 2·(4 + 5 routed) + (40 + 5 routed) + 4 = 67; w1: 2·(4 + 5) + 15 + 4 = 37
    assert again.costs == {"w0": 67.0, "w1": 37.0}


def test_prompts_waiting_to_prefill_weigh_as_prefill_not_as_kv_held():
    """A worker with a queue of long prompts is busier than one holding the same KV for decodes:
    the queue is prefill still to run (NVIDIA Dynamo counts a worker's pending prefill)."""
    reg = registry(beat("w0", free=100, queued=30), beat("w1", free=68))
    choice = reg.pick(NOW, list(range(2 * BS)))
    # w0: 4·(2 + 30) + 30 + 2 = 160 (counted as KV held, it would be 40); w1: 4·2 + 32 + 2 = 42
    assert choice.costs == {"w0": 160.0, "w1": 42.0} and choice.worker == "w1"


def test_a_routed_prompt_is_prefill_to_come_until_its_worker_stores_its_last_full_block():
    """The KV event is the first sign that a prefill is done. A conversation's next turn can come before
    its worker's next heartbeat; counted as still to prefill, its last turn would outweigh the very
    history it hits."""
    reg = registry(beat("w0"), beat("w1"), beat("w2"))
    turn = list(range(12 * BS + 4))                        # 12 full blocks (+ the last prompt token's): 13 new
    assert reg.pick(NOW, turn).worker == "w0"
    assert reg.pending(reg.workers["w0"]) == 13
    holds(reg, "w0", turn[:6 * BS])
    assert reg.pending(reg.workers["w0"]) == 13            # half of it stored: still prefilling
    holds(reg, "w0", turn)
    assert reg.pending(reg.workers["w0"]) == 0
    following = reg.pick(NOW, turn + [5] * 32)             # 228 tokens, 192 of them held by w0: 3 new blocks
    # w0: 4·(36/16 + 0) + 13 routed + 3 new = 25 (with the last turn as prefill to come: 77);
    # w1, w2: 4·228/16 + 0 + 15 = 72
    assert following.costs == {"w0": 25.0, "w1": 72.0, "w2": 72.0} and following.worker == "w0"
    reg.finished(following)
    assert reg.workers["w0"].prefills == [(hash_blocks(turn[:-1], BS)[-1], 13)]


def test_a_conversation_goes_back_to_the_worker_holding_its_history():
    reg = registry(beat("w0", free=90), beat("w1"), beat("w2"))
    history = list(range(12 * BS))
    holds(reg, "w0", history)
    choice = reg.pick(NOW, history + [7] * 20)
    assert (choice.worker, choice.hit_tokens) == ("w0", 12 * BS)


def test_the_prediction_leaves_the_last_prompt_token_to_compute_as_the_engine_does():
    reg = registry(beat("w0"))
    p = list(range(4 * BS))
    holds(reg, "w0", p)
    assert reg.pick(NOW, p).hit_tokens == 3 * BS          # the 4th block holds the last token
    assert reg.pick(NOW, p + [1]).hit_tokens == 4 * BS


def test_a_hit_needs_the_same_salt():
    reg = registry(beat("w0"), beat("w1"))
    holds(reg, "w0", prompt(0), salt="tenant-a")
    assert reg.pick(NOW, prompt(0), "tenant-a").hit_tokens == 8 * BS
    assert reg.pick(NOW, prompt(0), "tenant-b").hit_tokens == 0


def test_a_hot_system_prompt_held_everywhere_spreads_requests_evenly():
    reg = registry(beat("w0"), beat("w1"), beat("w2"))
    for w in ("w0", "w1", "w2"):
        holds(reg, w, SYSTEM)
    got = [reg.pick(NOW, prompt(i)).worker for i in range(30)]
    assert {w: got.count(w) for w in ("w0", "w1", "w2")} == {"w0": 10, "w1": 10, "w2": 10}
    assert all(reg.pick(NOW, prompt(i)).hit_tokens == 8 * BS for i in range(3))


def test_a_hot_system_prompt_held_by_one_worker_draws_requests_until_its_load_outweighs_the_prefill():
    reg = registry(beat("w0", total=1000, free=1000), beat("w1", total=1000, free=1000),
                   beat("w2", total=1000, free=1000), alpha=1.0, queue_watermark=100, load_cap=100)
    holds(reg, "w0", SYSTEM)
    got = []
    for i in range(90):
        got.append(reg.pick(NOW, prompt(i)).worker)
        holds(reg, got[-1], prompt(i))                    # the worker caches what it computed
    # w0 saves 8 prefill blocks and 8 new blocks per request (16); each adds 1 block to its load (its
    # prefill is done: the worker stored its blocks)
    assert got[:16] == ["w0"] * 16 and got[16] == "w1"
    counts = [got.count(w) for w in ("w0", "w1", "w2")]
    assert min(counts) >= 15 and max(counts) <= 40, counts


def test_new_conversations_drawn_to_the_worker_holding_their_system_prompt_spread_once_it_took_its_share():
    """Between turns a conversation holds no KV, so the load does not see it; the recent-request
    count does. Without the cap every new conversation goes where its system prompt is cached."""
    def place(load_cap: float) -> list[int]:
        reg = registry(*(beat(w, total=5000, free=5000) for w in ("w0", "w1", "w2")), queue_watermark=100,
                       load_cap=load_cap)
        holds(reg, "w0", SYSTEM)
        got = []
        for i in range(90):                     # ten a second, each done before the next: all idle again
            for w in ("w0", "w1", "w2"):
                reg.update(beat(w, ts=NOW + i / 10, total=5000, free=5000, finished=got.count(w)))
            got.append(reg.pick(NOW + i / 10, prompt(i)).worker)
            holds(reg, got[-1], prompt(i))
        return [got.count(w) for w in ("w0", "w1", "w2")]

    assert place(load_cap=100) == [90, 0, 0]
    counts = place(load_cap=1.25)
    assert max(counts) <= 1.5 * min(counts), counts                # [30, 30, 30]: w0 takes 3 (1.25 × (0 + 2)),
                                                                    # then the others get the prompt too


def test_recent_requests_fade():
    reg = registry(beat("w0", ts=NOW + 60), beat("w1", ts=NOW + 60))
    for _ in range(5):
        reg.pick(NOW, prompt(0))
    assert reg.taken("w0", NOW) + reg.taken("w1", NOW) == 5
    assert reg.taken("w0", NOW + 10) == pytest.approx(reg.taken("w0", NOW) / math.e)


def test_a_hot_system_prompt_on_a_worker_over_its_queue_watermark_goes_elsewhere():
    reg = registry(beat("w0", running=8, waiting=5), beat("w1"), beat("w2"))  # w0 queues 5 of 8: over 0.5
    holds(reg, "w0", SYSTEM)
    choice = reg.pick(NOW, prompt(0))
    assert (choice.worker, choice.guarded, choice.hit_tokens, choice.best_hit_tokens) == ("w1", True, 0, 8 * BS)
    assert choice.costs["w0"] < choice.costs["w1"]


def test_the_guard_rules_out_a_worker_above_its_kv_watermark_while_another_has_room():
    reg = registry(beat("w0", total=100, free=12), beat("w1", total=100, free=100), alpha=10.0)
    holds(reg, "w0", prompt(0, extra=4 * BS))
    p = prompt(0, extra=5 * BS)                            # w0 holds 12 of its 13 blocks
    choice = reg.pick(NOW, p)                              # w0: 88 + 1 new = 89% of its pool: room
    assert (choice.worker, choice.guarded) == ("w0", False)
    reg.update(beat("w0", total=100, free=10))             # 90 + 1 = 91% > 90%, though still the cheapest
    choice = reg.pick(NOW, p)
    assert (choice.worker, choice.guarded) == ("w1", True)


def test_when_every_worker_is_over_a_watermark_the_cheapest_still_gets_it():
    reg = registry(beat("w0", running=8, waiting=6), beat("w1", running=8, waiting=8))
    holds(reg, "w1", prompt(0))
    choice = reg.pick(NOW, prompt(0))
    assert (choice.worker, choice.guarded) == ("w1", False)


def test_equal_costs_go_to_the_least_loaded():
    reg = registry(beat("w0", running=3, total=100, free=90), beat("w1", running=1, total=100, free=90),
                   beat("w2", running=2, total=100, free=90))
    assert picks(reg, 1, prompt(0)) == ["w1"]


# -- traffic classes --------------------------------------------------------------------------------

def test_a_batch_request_takes_the_worker_with_spare_room_while_an_interactive_one_follows_the_prefix():
    reg = registry(beat("w0", running=6), beat("w1"))      # w0 runs 6 of 8: at BATCH_WATERMARK, no spare room
    holds(reg, "w0", SYSTEM)
    assert reg.pick(NOW, prompt(0)).worker == "w0"
    assert reg.pick(NOW, prompt(1), priority=BATCH_PRIORITY).worker == "w1"
    assert reg.pick(NOW, prompt(2), priority=BATCH_PRIORITY - 1).worker == "w0"
    reg.update(beat("w0", running=5))                      # 5 of 8: spare room again
    assert reg.pick(NOW, prompt(3), priority=BATCH_PRIORITY).worker == "w0"


def test_a_batch_request_counts_kv_and_what_was_routed_since_the_heartbeat_as_used_room():
    reg = registry(beat("w0", running=5, free=30, queued=6), beat("w1", running=3), alpha=10.0)
    holds(reg, "w0", SYSTEM)
    assert reg.pick(NOW, prompt(0), priority=BATCH_PRIORITY).worker == "w1"   # 24 of 100 blocks free
    assert reg.pick(NOW, prompt(1)).worker == "w0"                           # the prefix outweighs them
    reg.update(beat("w0", running=5))
    assert reg.pick(NOW, prompt(2)).worker == "w0"                           # now 6 running with this one
    assert reg.pick(NOW, prompt(3), priority=BATCH_PRIORITY).worker == "w1"


def test_a_batch_request_with_no_spare_room_anywhere_is_placed_as_any_request():
    reg = registry(beat("w0", running=7), beat("w1", running=6, waiting=1))
    holds(reg, "w0", SYSTEM)
    assert reg.pick(NOW, prompt(0), priority=BATCH_PRIORITY).worker == "w0"


# -- disaggregated serving --------------------------------------------------------------------------

def role(hb: Heartbeat, r: str) -> Heartbeat:
    hb.role = r
    return hb


def test_a_long_uncached_prompt_goes_to_a_prefill_worker_and_a_short_one_or_a_cached_one_stays_local():
    reg = registry(role(beat("p0"), "prefill"), role(beat("d0"), "decode"), max_local_prefill=4 * BS)
    long, short = prompt(0, extra=2 * BS), [5] * (3 * BS)          # 10 blocks; 3
    choice = reg.pick(NOW, long)
    assert (choice.worker, choice.prefill, choice.why) == ("p0", True, "remote:long")
    choice = reg.pick(NOW, short)
    assert (choice.worker, choice.prefill, choice.why) == ("d0", False, "local:short")
    holds(reg, "d0", SYSTEM)                     # d0 holds 8 of the 10 blocks: 2 blocks (+1 token) to prefill
    choice = reg.pick(NOW, prompt(1, extra=2 * BS))
    assert (choice.worker, choice.why) == ("d0", "local:short")


def test_a_long_prompt_stays_local_while_every_prefill_worker_has_its_queue_full():
    reg = registry(role(beat("p0", waiting=2), "prefill"), role(beat("p1", waiting=1), "prefill"),
                   role(beat("d0"), "decode"), max_local_prefill=0, max_prefill_queue=1)
    got = [reg.pick(NOW, prompt(i)) for i in range(3)]
    assert [(c.worker, c.why) for c in got] == [("p1", "remote:long"), ("d0", "local:prefill_queue"),
                                                ("d0", "local:prefill_queue")]   # p1: 1 waiting + 1 routed


def test_without_a_decode_capable_worker_every_request_is_prefilled_remotely_and_a_handoff_waits():
    reg = registry(role(beat("p0"), "prefill"), max_local_prefill=10_000)
    choice = reg.pick(NOW, [5] * 3)
    assert (choice.worker, choice.prefill, choice.why) == ("p0", True, "remote:no_decode_workers")
    assert reg.pick(NOW, [5] * 3, handoff=True) is None


def test_a_handoff_goes_to_a_decode_capable_worker_preferring_the_one_holding_the_prompt():
    reg = registry(role(beat("p0"), "prefill"), role(beat("d0"), "decode"), beat("w0"))
    holds(reg, "p0", SYSTEM)
    holds(reg, "w0", SYSTEM)
    choice = reg.pick(NOW, prompt(0), handoff=True)
    assert (choice.worker, choice.prefill, choice.why, choice.hit_tokens) == ("w0", False, "handoff", 8 * BS)


def test_colocated_workers_alone_decide_as_before():
    reg = registry(beat("w0"), beat("w1"), max_local_prefill=0)
    assert [(c.prefill, c.why) for c in (reg.pick(NOW, prompt(i)) for i in range(2))] == [(False, "")] * 2


# -- request groups (n > 1) ---------------------------------------------------------------------

@pytest.mark.parametrize("policy", ["prefix", "least-loaded", "round-robin"])
def test_the_choices_of_one_prompt_follow_the_first_until_its_worker_leaves(policy):
    reg = registry(beat("w0"), beat("w1"), beat("w2"), policy=policy)
    first = reg.pick(NOW, prompt(1), group="g1").worker
    assert [reg.pick(NOW, prompt(1), group="g1").worker for _ in range(7)] == [first] * 7
    assert reg.pick(NOW, prompt(2), group="g2").worker != first         # another group is placed as any
    reg.update(beat(first, ts=NOW - WORKER_TTL))
    moved = reg.pick(NOW, prompt(1), group="g1").worker
    assert moved != first and reg.pick(NOW, prompt(1), group="g1").worker == moved


def test_a_handoff_of_a_group_is_placed_as_any_handoff():
    reg = registry(beat("w0"), beat("w1"))
    first = reg.pick(NOW, prompt(1), group="g").worker
    assert reg.pick(NOW, prompt(1), group="g").worker == first
    assert {reg.pick(NOW, prompt(1), handoff=True, group="g").worker for _ in range(4)} == {"w0", "w1"}

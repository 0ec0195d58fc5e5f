"""One token budget per step, no phases: running requests first, then waiting ones (vLLM V1).

Each scheduled request gets min(tokens it has not computed, budget left) new tokens, so a long
prompt is chunked across steps and a decode gets its one token. When a running request cannot
get a block, the last running request is preempted by recompute: its blocks are freed (they stay
in the prefix cache, so the resume is cheap) and it goes back to the waiting queue.

Three policies order the queues (SchedulerConfig.policy):
- fcfs (the default): waiting requests in arrival order, running ones in admission order; a
  preempted request goes back to the head of the queue. Waiting requests never preempt.
- priority: both queues by (priority, arrival), lower first, so the last running request is the
  lowest-priority latest arrival and a preempted request goes back to its own place. A waiting
  request that finds no seat (max_num_seqs) or no blocks preempts running requests of a strictly
  lower priority (a larger number), the last first, until it fits.
- fair: priority first, then each tenant's share of the engine by weight (workers.engine.fair: a
  virtual token counter per tenant). Running requests are sorted, most deserving first, at the start
  of each step, so the last is the one preempted for a block.

The choices of one prompt (n > 1: requests of one `group` with the same prompt) share its prefill: the
first to arrive computes the prompt, the others are held until it has, then admitted onto its KV (a
fork): they take references to its full blocks, a copy of its last partial block (Batch.copies, done
before the step's forward), and compute only the prompt's last token, whose logits each samples with
its own seed. A held choice whose sibling ended or left first is admitted as any request is.

Speculative draft tokens are extra tokens of the same step (workers.engine.speculative): they take
only the budget and the uncached free blocks left once running and waiting requests are scheduled,
and the slots of those the model rejects are rolled back by num_computed_tokens.
"""
import bisect
import heapq
from collections import deque
from dataclasses import dataclass, field

from schemas.messages import SCHEDULING_POLICIES
from workers.engine.fair import FairQueue
from workers.engine.kv_cache import KVCacheManager
from workers.engine.request import Request, Status, TokenLogprobs
from workers.engine.roofline import StepShape


@dataclass(slots=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    max_model_len: int = 4096
    enable_chunked_prefill: bool = True
    eos_token_ids: frozenset[int] = frozenset()
    policy: str = "fcfs"                      # or "priority", "fair" (the module's docstring)


@dataclass(slots=True)
class Batch:
    """What one step computes: requests[i] gets num_new_tokens[i] more tokens, and samples a token
    when they bring it to the end of its known tokens (a prefill chunk short of the end does not).
    A sampling request may also verify draft tokens: drafts[i] are the last of its num_new_tokens,
    and the step samples a token after each of them too."""
    requests: list[Request] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    samples: list[bool] = field(default_factory=list)
    drafts: list[list[int]] = field(default_factory=list)
    num_accepted: list[int] = field(default_factory=list)  # after update(): drafts[i] kept, up to the first rejected
    preempted: list[Request] = field(default_factory=list)
    copies: list[tuple[Request, int, int]] = field(default_factory=list)   # (forked request, source block,
    #                                                         its own block): KV copied before the forward

    @property
    def block_copies(self) -> list[tuple[int, int]]:
        return [(src, dst) for _, src, dst in self.copies]

    def shape(self) -> StepShape:
        """The step's shape for a cost model (the mock engine's roofline, the simulator's fit), before it runs."""
        shape = StepShape()
        for req, n, samples, drafts in zip(self.requests, self.num_new_tokens, self.samples, self.drafts):
            shape.add(n, req.num_computed_tokens + n, samples * (1 + len(drafts)))
        return shape

    def add(self, req: Request, n: int, drafts: list[int] = ()) -> None:
        self.requests.append(req)
        self.num_new_tokens.append(n + len(drafts))
        self.samples.append(req.num_computed_tokens + n == req.num_tokens)
        self.drafts.append(list(drafts))

    def remove(self, req: Request) -> int:
        """Takes req's row out, if it has one (a request preempted after it was scheduled); returns
        the tokens it had."""
        i = next((i for i, r in enumerate(self.requests) if r is req), None)
        if i is None:
            return 0
        n = self.num_new_tokens[i]
        for rows in (self.requests, self.num_new_tokens, self.samples, self.drafts):
            del rows[i]
        self.copies = [c for c in self.copies if c[0] is not req]
        return n

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)


def rank(req: Request) -> tuple[int, int]:
    """The priority policy's order: lower priority numbers first, then earlier arrivals."""
    return req.priority, req.arrival


class PriorityQueue:
    """The waiting requests of the priority policy, by rank: the deque operations the scheduler uses.
    Every place is a request's own, so a preempted request "appended left" goes back to its place."""

    def __init__(self):
        self.heap: list[tuple[int, int, Request]] = []   # arrivals are unique: requests are never compared

    def append(self, req: Request) -> None:
        heapq.heappush(self.heap, (*rank(req), req))

    appendleft = append

    def popleft(self) -> Request:
        return heapq.heappop(self.heap)[-1]

    def __getitem__(self, i: int) -> Request:
        assert i == 0, "only the head of the queue is looked at"
        return self.heap[0][-1]

    def remove(self, req: Request) -> None:
        self.heap = [e for e in self.heap if e[-1] is not req]
        heapq.heapify(self.heap)

    def __len__(self) -> int:
        return len(self.heap)

    def __iter__(self):
        """In the order they will be admitted."""
        return (e[-1] for e in sorted(self.heap, key=lambda e: e[:2]))


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager):
        assert config.policy in SCHEDULING_POLICIES, config.policy
        self.config, self.kv = config, kv
        self.by_priority, self.fair = config.policy == "priority", config.policy == "fair"
        self.waiting: deque[Request] | PriorityQueue | FairQueue = \
            PriorityQueue() if self.by_priority else FairQueue() if self.fair else deque()
        self.running: list[Request] = []  # fcfs: in admission order; priority: by rank; fair: by FairQueue.rank
        #                                   at the start of a step. The last is preempted first
        self.num_preemptions = 0
        self.num_arrivals = 0
        self.counted: dict[str, tuple[int, int]] = {}   # waiting request -> (its tokens, its new blocks) when counted
        self.leaders: dict[str, Request] = {}           # group -> the choice that computes its prompt
        self.held: list[Request] = []                   # choices waiting for their leader's prefill, by arrival
        self.copies: list[tuple[Request, int, int]] = []   # the forks admit() made, for the step's batch
        self.num_forks = 0

    def add(self, req: Request) -> None:
        req.arrival = self.num_arrivals
        self.num_arrivals += 1
        if req.group:
            leader = self.leaders.setdefault(req.group, req)
            if leader is not req and same_prompt(leader, req):
                if not forkable(leader, req):
                    self.held.append(req)
                    return
                req.fork_from = leader
        self.waiting.append(req)

    def release_held(self) -> None:
        """Queues the held choices whose leader has computed their prompt (forked at admission), in arrival
        order ahead of later arrivals. A leader that ended first is succeeded by its first held choice."""
        ready = []
        for req in self.held:
            leader = self.leaders.setdefault(req.group, req)
            if leader is req or forkable(leader, req):
                req.fork_from = None if leader is req else leader
                ready.append(req)
        if not ready:
            return
        self.held = [r for r in self.held if r not in ready]
        if isinstance(self.waiting, deque):
            self.waiting.extendleft(reversed(ready))
        else:
            for req in ready:
                self.waiting.append(req)

    def queued_blocks(self) -> int:
        """The KV blocks the waiting requests will add: each one's blocks less its prefix cached when it
        was first counted (what the router counts for a request it routes). A prefix evicted since is
        not noticed: the figure is a heartbeat's estimate, and counting each request once keeps a long
        queue cheap to count."""
        kv, counted = self.kv, {}
        for req in self.waiting:
            seen = self.counted.get(req.request_id)
            if seen is None or seen[0] != req.num_tokens:
                seen = req.num_tokens, kv.new_blocks(req.block_hashes, req.num_tokens)
            counted[req.request_id] = seen
        self.counted = counted
        return sum(n for _, n in counted.values())

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.held)

    def schedule(self) -> Batch:
        if self.held:
            self.release_held()
        if self.fair:
            self.running.sort(key=self.waiting.rank)
        alone = self.schedule_alone()
        if alone is not None:
            return alone
        batch = Batch()
        budget = self.schedule_running(batch, self.config.max_num_batched_tokens)
        if not batch.preempted:
            self.schedule_waiting(batch, budget)
        elif self.fair and self.waiting.returned():      # another tenant's shortage does not keep it out
            self.schedule_waiting(batch, budget, most=len(batch.requests) + 1)
        return batch

    def suspect(self) -> Request | None:
        """The request to run alone next: one marked `isolate` that is running, or heads the queue."""
        running = next((r for r in self.running if r.isolate), None)
        if running is not None:
            return running
        if self.waiting and self.waiting[0].isolate and len(self.running) < self.config.max_num_seqs:
            return self.waiting[0]
        return None

    def schedule_alone(self) -> Batch | None:
        """A step of the suspect alone (the others wait one step), so a crash in it blames only it;
        None to schedule as usual (no suspect, or no blocks for it alone)."""
        req = self.suspect()
        if req is None:
            return None
        batch, budget = Batch(), self.config.max_num_batched_tokens
        if req.status == Status.RUNNING:
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if self.kv.allocate_slots(req, n):
                batch.add(req, n)
        else:
            self.schedule_waiting(batch, budget, most=1)
        return batch if batch.requests else None

    def schedule_running(self, batch: Batch, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            while not self.kv.allocate_slots(req, n):
                victim = self.running.pop()
                self.preempt(victim)
                batch.preempted.append(victim)
                if victim is req:
                    return budget
            batch.add(req, n)
            budget -= n
            i += 1
        return budget

    def schedule_waiting(self, batch: Batch, budget: int, most: int | None = None) -> None:
        while self.waiting and budget > 0 and (most is None or len(batch.requests) < most):
            req = self.waiting[0]
            n = self.admit(req, budget) if len(self.running) < self.config.max_num_seqs else 0
            if n is None:                          # without chunked prefill, it waits for a budget its prompt fits
                return
            if n:
                batch.add(req, n)
                batch.copies += self.copies
                self.copies.clear()
                budget -= n
                continue
            victim = self.victim_for(req)
            if victim is None:
                return
            self.running.remove(victim)
            budget += batch.remove(victim)         # scheduled already this step: its tokens go back
            self.kv.uncache_uncomputed(victim)     # and the blocks it named for them hold no KV
            self.preempt(victim)
            batch.preempted.append(victim)

    def admit(self, req: Request, budget: int) -> int | None:
        """Moves the head of the queue to running, with its prefix-cache hits and slots for its next
        min(uncached tokens, budget) tokens, and returns how many; 0 when they do not fit the free
        blocks, None when they do not fit the budget (without chunked prefill)."""
        leader, req.fork_from = req.fork_from, None
        if leader is not None and forkable(leader, req):
            return self.fork(req, leader)
        hits = self.kv.get_computed_blocks(req)
        num_hit = len(hits) * self.kv.block_size
        n = req.num_tokens - num_hit
        if n > budget and not self.config.enable_chunked_prefill:
            return None
        n = min(n, budget)
        if not self.kv.allocate_slots(req, n, hits):
            return 0
        self.running_now(req, num_hit, n)
        return n

    def fork(self, req: Request, leader: Request) -> int:
        """Admits the head of the queue onto its leader's computed prompt: its full blocks shared, the
        partial one after them copied, the prompt's last token to compute (1 token); 0 when the blocks
        do not fit."""
        last = req.num_tokens - 1
        full, partial = divmod(last, self.kv.block_size)
        blocks = self.kv.req_blocks[leader.request_id]
        if not self.kv.allocate_slots(req, req.num_tokens - full * self.kv.block_size, blocks[:full]):
            req.fork_from = leader
            return 0
        if partial:
            self.copies.append((req, blocks[full].block_id, self.kv.req_blocks[req.request_id][full].block_id))
        self.num_forks += 1
        self.running_now(req, last, 1)
        return 1

    def running_now(self, req: Request, num_computed: int, n: int) -> None:
        """The head of the queue admitted with num_computed tokens already in its blocks and n to compute."""
        self.waiting.popleft()
        self.kv.unpin(req.request_id)              # KV pulled for it (disaggregated): its own blocks hold it now
        self.kv.record_prefix_query(req.num_tokens, num_computed)
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = num_computed
        req.num_computed_tokens = num_computed
        req.status = Status.RUNNING
        if self.by_priority:
            bisect.insort(self.running, req, key=rank)
        else:
            self.running.append(req)
        if self.fair:
            self.waiting.admitted(req, n)

    def victim_for(self, req: Request) -> Request | None:
        """The running request a waiting one that does not fit may preempt: under the priority policy,
        the last running request when its priority is strictly lower (a larger number); under the fair
        policy, FairQueue.victim's; else none."""
        if self.fair:
            return self.waiting.victim(req, self.running)
        if self.by_priority and self.running and self.running[-1].priority > req.priority:
            return self.running[-1]
        return None

    def add_drafts(self, batch: Batch, i: int, drafts: list[int]) -> int:
        """Schedules draft tokens after batch row i (a sampling request) with what the step has left:
        the token budget and free blocks that hold no cached KV. Returns how many were scheduled."""
        req = batch.requests[i]
        budget = self.config.max_num_batched_tokens - batch.num_tokens
        end = req.num_computed_tokens + batch.num_new_tokens[i]
        room = self.kv.allocate_draft_slots(req, end + min(len(drafts), budget)) - end
        if room <= 0:
            return 0
        batch.drafts[i] = drafts[:room]
        batch.num_new_tokens[i] += room
        return room

    def preempt(self, req: Request) -> None:
        if self.fair:
            self.waiting.stopped(req)
        self.kv.free_request(req)
        req.status = Status.PREEMPTED
        req.num_computed_tokens = 0
        self.waiting.appendleft(req)
        self.num_preemptions += 1

    def requeue(self, req: Request, batch: Batch) -> None:
        """Takes a request admitted in this step out of it before it runs and back to the head of the queue:
        a prefix hit it was given could not be restored from a lower tier, so it is computed again."""
        self.running.remove(req)
        batch.remove(req)
        self.kv.uncache_uncomputed(req)
        self.preempt(req)

    def update(self, batch: Batch, tokens: list[list[int]],
               logprobs: list[list[TokenLogprobs | None]]) -> list[Request]:
        """Applies a step's results: tokens[k] (and logprobs[k]) belong to the k-th request of the
        batch that samples, one per row it sampled (1 + its drafts). A request keeps its drafts up to
        the first the model did not sample, then the model's own token after them; the KV of the
        rejected drafts is rolled back. Returns the requests that got a token."""
        sampled = iter(zip(tokens, logprobs, strict=True))
        batch.num_accepted = [0] * len(batch.requests)
        updated = []
        for i, (req, n, samples, drafts) in enumerate(zip(batch.requests, batch.num_new_tokens, batch.samples,
                                                          batch.drafts)):
            req.num_computed_tokens += n
            if not samples:
                continue
            row_tokens, row_logprobs = next(sampled)
            accepted = 0
            while accepted < len(drafts) and drafts[accepted] == row_tokens[accepted]:
                accepted += 1
            if drafts:
                batch.num_accepted[i] = accepted
                req.num_computed_tokens -= len(drafts) - accepted
                self.kv.rollback(req)
            req.isolate = False
            reason = None
            for token, lp in zip(row_tokens[:accepted + 1], row_logprobs):
                req.append(token)
                if lp is not None:
                    req.logprobs.append(lp)
                reason = self.stop_reason(req, token)
                if reason is not None:
                    break
            if accepted:                  # blocks the accepted drafts filled hold final tokens now
                self.kv.hash_full_blocks(req, req.num_computed_tokens)
            if reason is not None:
                self.finish(req, reason)
            updated.append(req)
        if any(r.finished for r in updated):
            self.running = [r for r in self.running if not r.finished]
        if self.fair:
            self.waiting.served(batch.requests)
        return updated

    def stop_reason(self, req: Request, token: int) -> str | None:
        if req.matcher is not None and (not req.matcher.accept_token(token) or req.matcher.is_terminated()):
            req.stop_reason = token      # its grammar is complete (a rejected token cannot be sampled)
            return "stop"
        if ((token in self.config.eos_token_ids and not req.params.ignore_eos) or token in req.params.stop_token_ids) \
                and req.num_output_tokens > req.params.min_tokens:
            req.stop_reason = token
            return "stop"
        if req.num_output_tokens >= req.params.max_tokens or req.num_tokens >= self.config.max_model_len:
            return "length"
        return None

    def finish(self, req: Request, reason: str) -> None:
        """Ends req and frees its blocks (the caller drops it from `running`)."""
        if self.fair and req.status == Status.RUNNING:
            self.waiting.stopped(req)
        req.status, req.finish_reason = Status.FINISHED, reason
        req.fork_from = None
        self.kv.free_request(req)
        if req.group and self.leaders.get(req.group) is req:
            del self.leaders[req.group]            # its held choices are admitted as any request

    def abort(self, req: Request, reason: str = "abort") -> None:
        if req.status == Status.RUNNING:
            self.running.remove(req)
        elif req in self.held:
            self.held.remove(req)
        elif req.status in (Status.WAITING, Status.PREEMPTED):
            self.waiting.remove(req)
        self.finish(req, reason)

    def fail(self, req: Request, error: str) -> None:
        """Ends req with finish_reason "error" after a step it was in failed: the blocks that step
        registered in the prefix cache hold no KV, so they are forgotten before being freed."""
        self.kv.uncache_uncomputed(req)
        req.error = error
        self.abort(req, "error")


def same_prompt(leader: Request, req: Request) -> bool:
    """Whether req is a fresh choice of leader's prompt (not a request resumed after output of its own)."""
    return (req.num_tokens == req.num_prompt_tokens == leader.num_prompt_tokens
            and req.cache_salt == leader.cache_salt and req.token_ids == leader.prompt_token_ids)


def forkable(leader: Request, req: Request) -> bool:
    """Whether req can be admitted onto leader's KV now: leader runs with all but req's last token computed."""
    return leader.status == Status.RUNNING and leader.num_computed_tokens >= req.num_tokens - 1

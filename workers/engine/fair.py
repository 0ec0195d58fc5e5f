"""The fair policy's waiting queue: a virtual token counter per tenant (VTC, after Sheng et al., "Fairness
in Serving Large Language Models", OSDI 2024), so each tenant's share of a busy engine follows its weight.

- A tenant's counter grows by the work the engine does for it, divided by its weight: W_INPUT per input
  token computed (once: prefix-cache hits and recomputation after a preemption are free) and W_OUTPUT
  per token generated.
- Admission takes, at the most urgent priority waiting, the tenant with the smallest counter, its
  earliest request. On equal counters the tenant running fewer requests goes first.
- A tenant whose queue was empty is lifted on arrival to the smallest counter of the tenants with
  requests waiting (of the last tenant whose queue emptied when none has), so idle time banks no credit.
- The least deserving running request is the one of the highest (priority, counter, arrival): it is
  preempted first for a block.
- A waiting request that does not fit preempts, as under the priority policy, a running request of a
  less urgent priority. And a tenant that was idle (nothing waiting or running) when its request
  arrived takes a seat, or blocks, from a tenant running two or more of its priority whose counter is
  not below its own: the latter's latest request. Such a preemption never leaves the victim's tenant
  idle, and there is at most one per request that finds its tenant idle: backlogged tenants share by
  admission order alone, so they never preempt each other.
- Tenants with nothing waiting or running for FORGET_STEPS steps are forgotten.
"""
import heapq
from dataclasses import dataclass, field

from workers.engine.request import Request

W_INPUT, W_OUTPUT = 1.0, 2.0   # VTC's w_p and w_q (the paper's): an output token costs two input tokens
FORGET_STEPS = 10_000          # a tenant idle this many steps is forgotten (checked every FORGET_STEPS steps)


@dataclass(slots=True)
class Tenant:
    counter: float                 # the work done for it, over its weight
    weight: float = 1.0
    queue: list[tuple[int, int, Request]] = field(default_factory=list)   # heap of (priority, arrival, request)
    running: int = 0
    returned: bool = False         # it was idle when its request arrived and has not run since: may preempt
    seen: int = 0                  # the step it last got a request or was served


class FairQueue:
    """The waiting requests of the fair policy: the deque operations the scheduler uses, and the counters."""

    def __init__(self):
        self.tenants: dict[str, Tenant] = {}
        self.active: dict[str, Tenant] = {}   # the tenants with requests waiting
        self.left = 0.0                       # the counter of the last tenant whose queue emptied
        self.size = 0
        self.steps = 0

    def append(self, req: Request) -> None:
        """An arrival: its tenant, if it had nothing waiting, is lifted to the active floor."""
        t = self.tenants.get(req.tenant)
        if t is None or not t.queue:
            floor = min((u.counter for u in self.active.values()), default=self.left)
            if t is None:
                t = self.tenants[req.tenant] = Tenant(floor)
            t.counter, t.returned = max(t.counter, floor), not t.running
        t.weight, t.seen = req.weight, self.steps
        self.push(t, req)

    def appendleft(self, req: Request) -> None:
        """A preempted request: back to its own place in its tenant's queue, no lift."""
        self.push(self.tenants[req.tenant], req)

    def push(self, t: Tenant, req: Request) -> None:
        heapq.heappush(t.queue, (req.priority, req.arrival, req))
        self.active[req.tenant] = t
        self.size += 1

    def head(self) -> Tenant:
        return min(self.active.values(), key=lambda t: (t.queue[0][0], t.counter, t.running, t.queue[0][1]))

    def returned(self) -> bool:
        """Whether the head of the queue is the request of a tenant that was idle when it arrived."""
        return bool(self.active) and self.head().returned

    def __getitem__(self, i: int) -> Request:
        assert i == 0, "only the head of the queue is looked at"
        return self.head().queue[0][-1]

    def popleft(self) -> Request:
        req = heapq.heappop(self.head().queue)[-1]
        self.size -= 1
        if not self.tenants[req.tenant].queue:
            del self.active[req.tenant]
        return req

    def remove(self, req: Request) -> None:
        t = self.tenants[req.tenant]
        t.queue = [e for e in t.queue if e[-1] is not req]
        heapq.heapify(t.queue)
        self.size -= 1
        if not t.queue:
            del self.active[req.tenant]

    def __len__(self) -> int:
        return self.size

    def __iter__(self):
        """In the order they would be admitted if no counter moved."""
        entries = [e for t in self.active.values() for e in t.queue]
        return (e[-1] for e in sorted(entries, key=lambda e: self.rank(e[-1])))

    def rank(self, req: Request) -> tuple[int, float, int]:
        """How deserving a request is, most first: (priority, its tenant's counter, arrival)."""
        return req.priority, self.tenants[req.tenant].counter, req.arrival

    def admitted(self, req: Request, n: int) -> None:
        """req (popped) runs, its prefix-cache hits computed and n more tokens scheduled: charged now, so
        the next admission of the step sees its tenant's counter grown."""
        t = self.tenants[req.tenant]
        t.running, t.returned = t.running + 1, False
        req.billed_input = max(req.billed_input, min(req.num_computed_tokens, req.num_input_tokens))
        self.bill(req, req.num_computed_tokens + n)
        if not t.queue:
            self.left = t.counter

    def stopped(self, req: Request) -> None:
        """req leaves the running requests (preempted, finished or aborted)."""
        self.tenants[req.tenant].running -= 1

    def victim(self, req: Request, running: list[Request]) -> Request | None:
        """The running request the waiting req, which does not fit, may preempt (the module's rule):
        the least deserving of those it may; None when it may preempt none."""
        mine = self.tenants[req.tenant]

        def fair_game(r: Request) -> bool:
            if r.priority != req.priority:
                return r.priority > req.priority
            theirs = self.tenants[r.tenant]
            return mine.returned and theirs.running > 1 and theirs.counter >= mine.counter

        return max(filter(fair_game, running), key=self.rank, default=None)

    def served(self, requests: list[Request]) -> None:
        """After a step: each request's tenant charged for what the step computed and generated."""
        for req in requests:
            self.bill(req, req.num_computed_tokens)
        self.steps += 1
        if self.steps % FORGET_STEPS == 0:
            self.forget()

    def bill(self, req: Request, computed: int) -> None:
        """Charges req's tenant for its input tokens up to `computed` not yet charged and the tokens it
        generated since its last bill."""
        inputs = req.num_input_tokens
        computed = max(min(computed, inputs), req.billed_input)
        generated = req.num_tokens - inputs
        t = self.tenants[req.tenant]
        t.counter += (W_INPUT * (computed - req.billed_input) + W_OUTPUT * (generated - req.billed_output)) / t.weight
        req.billed_input, req.billed_output, t.seen = computed, generated, self.steps

    def forget(self) -> None:
        """Drops the tenants with nothing waiting or running for FORGET_STEPS steps."""
        idle = [name for name, t in self.tenants.items()
                if not t.queue and not t.running and self.steps - t.seen >= FORGET_STEPS]
        for name in idle:
            del self.tenants[name]

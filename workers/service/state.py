"""What the worker's parts share: the bus, the engine and its lock, the table of requests running
here, the counts the heartbeat reports, and the tasks that store what must outlive a step.

Built once by WorkerService (worker.py) and given to each part; everything a part keeps for itself
is set up in that part's own `__init__`. Used on the event loop only."""
import asyncio
from dataclasses import dataclass, field

from schemas.messages import WorkItem
from text.detokenizer import PROMPT_CONTEXT


@dataclass(slots=True)
class Running:
    """What the service knows of a request in the engine."""
    item: WorkItem
    msg: object                     # the JetStream message, acked when the request ends
    received: float                 # time.time() it arrived
    first_token: float = 0.0
    sent: int = 0                   # output tokens published
    seq: int = 0                    # chunks published
    published: float = 0.0          # time.time() of its last chunk
    subject: str = ""               # tb.out.<request id>
    strikes: int = 0                # workers it failed or crashed before this one (redeliveries included)
    cached_tokens: int = -1         # a handed-off request: the prefill worker's prefix hit (-1: the engine's)
    stored: float = 0.0             # time.time() its work item was stored in the stream (0: not known)
    entered: float = 0.0            # time.time() it entered the engine here
    trace: object = None            # with tracing on: its trace context, from its work item (bus/tracing.py)

    @property
    def tail(self) -> list[int]:
        """The detokenizer's context, sent with the first chunk only."""
        return self.item.request.prompt_token_ids[-PROMPT_CONTEXT:] if self.seq == 0 else []


@dataclass(slots=True)
class Counts:
    """The worker's totals the heartbeat reports (metrics): requests finished, prompt tokens taken in
    (intake), output tokens published (streaming)."""
    finished: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0


@dataclass(slots=True, eq=False)
class State:
    """The few things every part uses. `running` is written by intake (a request enters) and streaming
    (it ends or is handed off), read by the step loop and the in-progress acks."""
    nc: object
    js: object
    engine: object                  # workers/engine/engine.py's LLMEngine
    engine_lock: asyncio.Lock       # held for each step; taken by whatever else touches the engine
    id: str                         # the worker id (a subject token)
    log: object
    running: dict[str, Running] = field(default_factory=dict)
    counts: Counts = field(default_factory=Counts)
    tasks: set[asyncio.Task] = field(default_factory=set)   # what leaving waits for (registry.py)

    def spawn(self, coro) -> None:
        """Runs `coro` in a task of its own, kept until it ends (a store retried through a broker restart)."""
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

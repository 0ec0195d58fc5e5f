import enum
from dataclasses import dataclass, field

from schemas.hashing import hash_blocks
from schemas.sampling import SamplingParams


class Status(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED = 3


@dataclass(slots=True)
class TokenLogprobs:
    logprob: float                         # of the sampled token
    top: list[tuple[int, float]]           # the `logprobs` most likely tokens, best first


@dataclass(slots=True, eq=False)
class Request:
    """A sequence and how far its KV has been computed. There are no prefill or decode phases:
    each step the scheduler lets num_computed_tokens catch up with len(token_ids)."""
    request_id: str
    token_ids: list[int]                    # prompt then output: the whole sequence
    num_prompt_tokens: int
    params: SamplingParams
    seed: int
    block_size: int
    cache_salt: str | None = None
    status: Status = Status.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1             # prefix-cache hit when first scheduled
    block_hashes: list[int] = field(default_factory=list)   # of the full blocks of token_ids (given: of its head)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None        # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None    # the stop token id or stop string that ended it
    error: str = ""                         # what failed, for finish_reason "error"
    isolate: bool = False                   # run alone until its first token (a suspect: it has a strike)
    num_resumed_tokens: int = 0             # output tokens it came with (a migrated request)
    priority: int = 0                       # the priority policy runs lower numbers first (vLLM's rule)
    arrival: int = 0                        # the scheduler's count of requests added before it: breaks ties
    tenant: str = ""                        # the fair policy shares the engine between tenants by weight
    weight: float = 1.0
    billed_input: int = 0                   # fair: of its input tokens, how many were charged to its tenant
    billed_output: int = 0                  # fair: of the tokens it generated, how many were charged
    matcher: object | None = None           # its grammar's xgrammar GrammarMatcher (structured output)
    min_ban: tuple[int, ...] = ()           # the tokens min_tokens holds back: EOS (unless ignored), stop ids
    group: str = ""                         # n > 1: the group of one prompt's choices (the scheduler forks them)
    fork_from: "Request | None" = None      # the sibling whose computed prompt it is admitted onto

    def __post_init__(self):
        self.block_hashes = hash_blocks(self.token_ids, self.block_size, self.cache_salt, self.block_hashes)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_input_tokens(self) -> int:
        """Tokens it came with: its prompt, and the output of a request resumed here."""
        return self.num_prompt_tokens + self.num_resumed_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[:self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def finished(self) -> bool:
        return self.status == Status.FINISHED

    def append(self, token: int) -> None:
        self.token_ids.append(token)
        if self.num_tokens % self.block_size == 0:
            self.block_hashes = hash_blocks(self.token_ids, self.block_size, self.cache_salt, self.block_hashes)

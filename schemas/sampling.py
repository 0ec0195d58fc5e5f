"""How to sample each output token and when to stop: validated where a request enters (the gateway)
and again where it runs (the engine), so it is part of the wire format. Every field is bounded here:
no value that passes reaches the engine as something it cannot take (an integer past int64, a NaN)."""
import functools
import json
import math
import re
from dataclasses import dataclass

MAX_TOKENS_BOUND = 1 << 20       # max_tokens of any request (the gateway's own cap is lower)
MAX_TOP_K = 1 << 20              # top_k; the engine and tokenizer also hold it to the vocabulary
MAX_LOGPROBS = 20
MAX_STOP = 16                    # stop strings
MAX_STOP_CHARS = 1024            # characters of one stop string
MAX_STOP_TOKEN_IDS = 256
MAX_TOKEN_ID = (1 << 31) - 1     # any token id of any vocabulary
SEED_BOUND = 1 << 64             # seeds are unsigned 64-bit
MAX_TEMPERATURE = 100.0
MIN_TEMPERATURE = 1e-5           # below this (but not 0) float32 logits / temperature overflow
MIN_REPETITION_PENALTY = 0.01    # it divides positive logits: below this they overflow float32
MAX_REPETITION_PENALTY = 100.0
MAX_LOGIT_BIAS = 300             # token ids in one logit_bias map
LOGIT_BIAS_BOUND = 100.0         # each bias is in [-100, 100], as OpenAI's
MAX_SCHEMA_CHARS = 1 << 16       # characters of a json_schema or an EBNF grammar
MAX_SCHEMA_DEPTH = 32            # nesting of objects and arrays in a json_schema
MAX_REGEX_CHARS = 4096
MAX_CHOICES = 256                # strings of one choice constraint
MAX_CHOICE_CHARS = 1024          # characters of one choice
MAX_COMPILE_SECONDS = 10.0       # a worker fails a request whose grammar takes more CPU seconds to compile
LOOSE_STRING_CHAR = r'[^\"\\\r\n]'     # a length-bounded string's character in xgrammar's EBNF (json_grammar)
JSON_STRING_CHAR = r'[^\0-\x1f\"\\\r\n]'   # JSON's: no control character unescaped
JSON_OBJECT = '{"type":"object"}'  # json_object: any object (xgrammar's builtin JSON grammar allows arrays too)
CONSTRAINTS = ("json_schema", "json_object", "regex", "choice", "grammar")
MAX_CONVERTED = 256              # constraints whose conversion (to_grammar) a process keeps, least recent dropped


@dataclass(slots=True)
class SamplingParams:
    """How to pick each output token and when to stop. temperature 0 is greedy; top_k 0 (or -1)
    and top_p 1 and min_p 0 disable those filters; `seed` fixes the randomness (without one the
    engine draws a seed when the request is added, so every request's randomness is still a
    pure function of its seed and output position)."""
    max_tokens: int = 16
    min_tokens: int = 0          # output tokens before EOS or a stop token id may be sampled (vLLM's)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] | list[str] | str | None = None
    stop_token_ids: tuple[int, ...] | list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # how many top alternatives to return beside the sampled token
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    speculative: bool = True     # false: this request never verifies draft tokens (its output is the same either way)
    logit_bias: dict[str, float] | None = None   # token id (decimal, as OpenAI's JSON keys) -> added to its logit
    # structured output, at most one: the output is text the constraint accepts (xgrammar, in the engine)
    json_schema: str | None = None   # a JSON schema (a dict is taken too: kept as its JSON text)
    json_object: bool = False        # any JSON object
    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None   # exactly one of these strings
    grammar: str | None = None       # an EBNF grammar (xgrammar's GBNF dialect, rule `root`)

    def __post_init__(self):
        self.stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        self.stop_token_ids = tuple(self.stop_token_ids or ())
        check_types(self)
        if self.top_k == -1:
            self.top_k = 0
        check(1 <= self.max_tokens <= MAX_TOKENS_BOUND, "max_tokens", f"must be in [1, {MAX_TOKENS_BOUND}]",
              self.max_tokens)
        check(0 <= self.min_tokens <= self.max_tokens, "min_tokens", f"must be in [0, max_tokens={self.max_tokens}]",
              self.min_tokens)
        check(self.temperature == 0 or MIN_TEMPERATURE <= self.temperature <= MAX_TEMPERATURE, "temperature",
              f"must be 0 (greedy) or in [{MIN_TEMPERATURE}, {MAX_TEMPERATURE}]", self.temperature)
        check(0 < self.top_p <= 1, "top_p", "must be in (0, 1]", self.top_p)
        check(0 <= self.top_k <= MAX_TOP_K, "top_k", f"must be in [1, {MAX_TOP_K}], or 0 / -1 to disable", self.top_k)
        check(0 <= self.min_p <= 1, "min_p", "must be in [0, 1]", self.min_p)
        check(MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY, "repetition_penalty",
              f"must be in [{MIN_REPETITION_PENALTY}, {MAX_REPETITION_PENALTY}]", self.repetition_penalty)
        check(-2 <= self.presence_penalty <= 2, "presence_penalty", "must be in [-2, 2]", self.presence_penalty)
        check(-2 <= self.frequency_penalty <= 2, "frequency_penalty", "must be in [-2, 2]", self.frequency_penalty)
        check(self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS, "logprobs",
              f"must be in [0, {MAX_LOGPROBS}]", self.logprobs)
        check(self.seed is None or 0 <= self.seed < SEED_BOUND, "seed", "must be in [0, 2**64)", self.seed)
        check_stops(self)
        self.logit_bias = checked_bias(self.logit_bias)
        check_constraint(self)

    @property
    def constraint(self) -> tuple[str, str] | None:
        """(kind, text): the request's structured-output constraint, its grammar cache key; None without one."""
        if self.json_object:
            return "json_object", ""
        if self.choice is not None:
            return "choice", json.dumps(self.choice, ensure_ascii=False)
        kind = next((k for k in ("json_schema", "regex", "grammar") if getattr(self, k) is not None), None)
        return None if kind is None else (kind, getattr(self, kind))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0


INTS = ("max_tokens", "min_tokens", "top_k")
FLOATS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")


def check_types(p: SamplingParams) -> None:
    """Integers are ints (not bools), floats are finite numbers: NaN and ±inf pass no range check."""
    for name in INTS + ("seed", "logprobs"):
        v = getattr(p, name)
        if not (v is None and name in ("seed", "logprobs")):
            check(isinstance(v, int) and not isinstance(v, bool), name, "must be an integer", v)
    for name in FLOATS:
        v = getattr(p, name)
        check(isinstance(v, int | float) and not isinstance(v, bool), name, "must be a number", v)
        check(math.isfinite(v), name, "must be a finite number", v)
    for name in ("ignore_eos", "speculative"):
        check(isinstance(getattr(p, name), bool), name, "must be true or false", getattr(p, name))


def check_stops(p: SamplingParams) -> None:
    check(len(p.stop) <= MAX_STOP, "stop", f"has more than MAX_STOP={MAX_STOP} strings", len(p.stop))
    check(all(isinstance(s, str) for s in p.stop), "stop", "must be strings", p.stop)
    check(all(s for s in p.stop), "stop", "must not contain an empty string", p.stop)
    long = next((s for s in p.stop if len(s) > MAX_STOP_CHARS), None)
    check(long is None, "stop", f"strings must be at most MAX_STOP_CHARS={MAX_STOP_CHARS} characters",
          f"{len(long or '')} characters")
    n = len(p.stop_token_ids)
    check(n <= MAX_STOP_TOKEN_IDS, "stop_token_ids", f"has more than MAX_STOP_TOKEN_IDS={MAX_STOP_TOKEN_IDS} ids", n)
    bad = next((t for t in p.stop_token_ids if not (isinstance(t, int) and not isinstance(t, bool)
                                                     and 0 <= t <= MAX_TOKEN_ID)), None)
    check(bad is None, "stop_token_ids", f"must be token ids in [0, {MAX_TOKEN_ID}]", bad)


def check_constraint(p: SamplingParams) -> None:
    """At most one constraint, each within its limits; a json_schema is a JSON object, kept as compact text."""
    if isinstance(p.json_schema, dict):
        p.json_schema = json.dumps(p.json_schema, ensure_ascii=False, separators=(",", ":"))
    check(isinstance(p.json_object, bool), "json_object", "must be true or false", p.json_object)
    given = [k for k in CONSTRAINTS if getattr(p, k) not in (None, False)]
    check(len(given) <= 1, "structured output", "takes at most one of " + ", ".join(CONSTRAINTS), given)
    for name, limit in (("json_schema", MAX_SCHEMA_CHARS), ("grammar", MAX_SCHEMA_CHARS), ("regex", MAX_REGEX_CHARS)):
        v = getattr(p, name)
        check(v is None or isinstance(v, str), name, "must be a string", v)
        check(v is None or 0 < len(v) <= limit, name, f"must have 1 to {limit} characters",
              f"{len(v or '')} characters")
    if p.json_schema is not None:
        p.json_schema = checked_schema(p.json_schema)
    if p.choice is not None:
        check(isinstance(p.choice, list | tuple) and 1 <= len(p.choice) <= MAX_CHOICES, "choice",
              f"must be a list of 1 to MAX_CHOICES={MAX_CHOICES} strings", p.choice)
        check(all(isinstance(c, str) and 0 < len(c) <= MAX_CHOICE_CHARS for c in p.choice), "choice",
              f"strings must have 1 to MAX_CHOICE_CHARS={MAX_CHOICE_CHARS} characters", p.choice)
        p.choice = tuple(p.choice)


def checked_schema(text: str) -> str:
    """A JSON schema's text, checked to be a JSON object nested at most MAX_SCHEMA_DEPTH deep."""
    try:
        schema = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise ValueError(f"json_schema is not valid JSON: {str(e)[:200]}") from None
    check(isinstance(schema, dict), "json_schema", "must be a JSON object", schema)
    depth, level = 0, [schema]
    while level:
        depth += 1
        check(depth <= MAX_SCHEMA_DEPTH, "json_schema", f"nests deeper than MAX_SCHEMA_DEPTH={MAX_SCHEMA_DEPTH}",
              f"more than {MAX_SCHEMA_DEPTH} levels")
        level = [c for v in level for c in (v.values() if isinstance(v, dict) else v) if isinstance(c, dict | list)]
    return text


def to_grammar(p: SamplingParams):
    """The xgrammar Grammar of p's constraint (None without one); ValueError naming the field and xgrammar's
    complaint for one it cannot convert. Needs no tokenizer: the tokenizer stage checks with it. An
    unconstrained request returns before xgrammar is loaded."""
    return None if p.constraint is None else grammar_of(*p.constraint)


@functools.lru_cache(maxsize=MAX_CONVERTED)
def grammar_of(kind: str, text: str):
    """to_grammar's conversion, once per constraint text in a process: the tokenizer stage, the engine's
    check and its compile thread each ask for it, and a 26 kB schema takes about 30 ms to convert (on the
    tokenizer's event loop and the engine's step loop). A constraint that fails is not kept: it raises again."""
    import xgrammar as xgr

    try:
        if kind == "json_schema":
            return json_grammar(xgr.Grammar.from_json_schema(text, any_whitespace=False))
        if kind == "json_object":
            return json_grammar(xgr.Grammar.from_json_schema(JSON_OBJECT, any_whitespace=False, strict_mode=False))
        if kind == "regex":
            return xgr.Grammar.from_regex(text)
        if kind == "choice":
            return xgr.Grammar.from_ebnf(choice_ebnf(json.loads(text)))
        return xgr.Grammar.from_ebnf(text)                 # grammar
    except (RuntimeError, ValueError) as e:
        raise ValueError(f"{kind} is not one the engine can follow: {xgrammar_message(e)}") from None


def json_grammar(grammar):
    """xgrammar's grammar of a JSON schema, its strings' characters held to JSON's. xgrammar (0.2) writes a
    string with minLength or maxLength as characters of LOOSE_STRING_CHAR, which lets control characters
    (U+0000-U+001F) through unescaped, invalid in JSON: measured, a streamed schema's "unit" field came
    back with a raw \x18 that no JSON parser takes."""
    import xgrammar as xgr

    ebnf = str(grammar)
    return grammar if LOOSE_STRING_CHAR not in ebnf else xgr.Grammar.from_ebnf(
        ebnf.replace(LOOSE_STRING_CHAR, JSON_STRING_CHAR))


def choice_ebnf(choices) -> str:
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def xgrammar_message(e: Exception) -> str:
    """xgrammar's error without its timestamp and C++ source location."""
    return re.sub(r"^\[[^\]]*\] \S+:\d+: ", "", str(e)).strip()[:300]


def check_vocabulary(p: SamplingParams, vocab_size: int) -> None:
    """ValueError naming the field when a field is outside a vocabulary of vocab_size tokens (where the
    vocabulary is known: the tokenizer stage and the engine)."""
    if p.top_k > vocab_size:
        raise ValueError(f"top_k {p.top_k} is more than the vocabulary ({vocab_size} tokens)")
    bad = next((k for k in p.logit_bias or () if int(k) >= vocab_size), None)
    if bad is not None:
        raise ValueError(f"logit_bias: token id {bad} is outside the vocabulary [0, {vocab_size})")


def checked_bias(bias) -> dict[str, float] | None:
    """logit_bias with its keys as decimal strings (a Python caller may give ints) and its values as floats;
    None when empty."""
    if bias is None:
        return None
    check(isinstance(bias, dict), "logit_bias", "must be a map of token id to bias", bias)
    check(len(bias) <= MAX_LOGIT_BIAS, "logit_bias", f"has more than MAX_LOGIT_BIAS={MAX_LOGIT_BIAS} token ids",
          len(bias))
    out = {}
    for k, v in bias.items():
        t = k if isinstance(k, int) and not isinstance(k, bool) else (int(k) if isinstance(k, str)
                                                                       and k.isascii() and k.isdigit() else -1)
        check(0 <= t <= MAX_TOKEN_ID, "logit_bias", f"keys must be token ids in [0, {MAX_TOKEN_ID}]", k)
        check(isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
              and -LOGIT_BIAS_BOUND <= v <= LOGIT_BIAS_BOUND, f"logit_bias[{t}]",
              f"must be a number in [-{LOGIT_BIAS_BOUND:g}, {LOGIT_BIAS_BOUND:g}]", v)
        out[str(t)] = float(v)
    return out or None


def check(ok: bool, field: str, rule: str, value) -> None:
    if not ok:
        raise ValueError(f"{field} {rule} (got {shown(value)})")


def shown(value) -> str:
    s = repr(value)
    return s if len(s) <= 80 else s[:80] + "…"

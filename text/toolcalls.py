"""Tool calls in model output: the text each model family writes them as, turned into OpenAI tool calls for
a whole answer (`parse`) and while it streams (`StreamParser`); and tools shown to chat templates that know
nothing about them (`default_system`, `plain_history`).

The families (`PARSERS`; `pick` guesses one from a chat template):
- hermes: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` blocks, with text before them
  (Qwen2/2.5/3, Hermes 2/3, SmolLM, and the default tool prompt below).
- llama3_json: the whole answer is `{"name": ..., "parameters": {...}}`, calls joined by `;`, maybe after
  `<|python_tag|>` (Llama 3.1-3.3).
- mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (v3 tokenizers) or `[TOOL_CALLS]name[ARGS]{...}`
  once per call; an answer that starts `[{"name"` is a call list whose `[TOOL_CALLS]` the detokenizer stripped.

A call object holds its arguments under "arguments" or "parameters" (either, in every family), which must be a
JSON object; other keys (Llama 3.2's "type") are allowed. `parse` is the stream parser run over the whole text,
so the two never disagree on a well-formed answer.
"""
import json
import re
import secrets
from dataclasses import dataclass

import orjson

PARSERS = ("hermes", "llama3_json", "mistral")
MARKERS = {"hermes": "<tool_call>", "llama3_json": "<|python_tag|>", "mistral": "[TOOL_CALLS]"}
HERMES_END = "</tool_call>"
MISTRAL_ARGS = "[ARGS]"
MISTRAL_BARE = '[{"name"'                      # a call list whose [TOOL_CALLS] the detokenizer stripped
ARG_KEYS = ("arguments", "parameters")
SPACE = " \t\r\n"
STRING_BODY = re.compile(r'[^"\\]*')
FUNCTION_NAME = re.compile(r"[\w.\-]*")        # the name in mistral's name[ARGS]{...}


@dataclass(slots=True)
class ToolCall:
    """One call of a whole answer, as OpenAI's message.tool_calls holds it."""
    id: str                                       # "call_" + 24 hex characters
    name: str
    arguments: str                                # a JSON object's text, compact


@dataclass(slots=True)
class Content:
    """Streamed answer text outside the calls."""
    text: str


@dataclass(slots=True)
class CallDelta:
    """A piece of call `index`: the first carries its id and name, the rest only more of its arguments' JSON."""
    index: int
    id: str | None
    name: str | None
    arguments: str


def new_id() -> str:
    return "call_" + secrets.token_hex(12)


def loads(text: str):
    """The JSON value of text, None when it is not JSON."""
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError:
        return None


def call_arguments(obj) -> dict | None:
    """The arguments of a parsed call object; None unless it has a string name and, under exactly one of
    "arguments" and "parameters", an object."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    keys = [k for k in ARG_KEYS if k in obj]
    return obj[keys[0]] if len(keys) == 1 and isinstance(obj[keys[0]], dict) else None


def parse(parser: str, text: str, names: set[str] | None = None) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a whole answer: content is the text outside the calls, stripped, None if empty.
    A call that does not parse, or (names given) names no tool of the request, makes the whole answer content:
    (text, []). Never raises on model output."""
    stream = StreamParser(parser, names)
    events = stream.feed(text) + stream.finish()
    if stream.failed:
        return text, []
    content = "".join(e.text for e in events if isinstance(e, Content)).strip()
    return content or None, stream.calls


@dataclass(slots=True)
class Scan:
    """A resumable scan of one call object as its text arrives, JSON-aware (strings, escapes, depth): where its
    top-level "name" and arguments values lie, without parsing the object until it has ended. `bare`: the object
    is itself the arguments (mistral's name[ARGS]{...}), its name already known."""
    start: int                                    # offset of the object's "{" in the answer
    pos: int                                      # the next character to scan
    name: str | None = None
    args: int | None = None                       # offset of the arguments value's "{"
    args_end: int | None = None                   # offset after its "}"
    streamed: int = 0                             # arguments text sent up to here
    bare: bool = False
    depth: int = 0
    in_string: bool = False
    escape: bool = False
    expect: str = "key"                           # at depth 1: key, colon, value or next (a "," or the "}")
    key: str | None = None                        # the top-level key whose value is being scanned
    mark: int = 0                                 # where the current top-level key or value began

    def run(self, text: str) -> str | None:
        """Scans what has arrived: "name" once the name is known, "end" once the object has closed (at pos - 1),
        "bad" when it cannot be a call object, None when it needs more text."""
        status = None
        while status is None and self.pos < len(text):
            status = self.string(text) if self.in_string else self.token(text)
        return status

    def string(self, text: str) -> str | None:
        if self.escape:
            self.escape, self.pos = False, self.pos + 1
            return None
        self.pos = STRING_BODY.match(text, self.pos).end()
        if self.pos == len(text):
            return None
        self.pos += 1
        if text[self.pos - 1] == "\\":
            self.escape = True
            return None
        self.in_string = False
        return self.closed(text) if self.depth == 1 and not self.bare else None

    def token(self, text: str) -> str | None:
        c = text[self.pos]
        self.pos += 1
        if c in SPACE:
            return None
        if self.depth == 1 and not self.bare:
            return self.top(text, c)
        if c == '"':
            self.in_string = True
        elif c in "{[":
            self.depth += 1
        elif c in "}]":
            self.depth -= 1
            if self.depth == 0:
                return "end"
            if self.depth == 1 and not self.bare:
                return self.closed(text)
        return None

    def top(self, text: str, c: str) -> str | None:
        """A character between the object's own keys and values."""
        if c == ":" and self.expect == "colon":
            self.expect = "value"
        elif c == "," and self.expect == "next":
            self.expect = "key"
        elif c == "}" and self.expect in ("key", "next"):
            self.depth = 0
            return "end"
        elif c == '"' and self.expect == "key":
            self.in_string, self.mark = True, self.pos - 1
        elif self.expect == "value":
            return self.value(c)
        elif c not in '"{}[]:,' and self.expect == "next":
            pass                                  # more of a number, true, false or null
        else:
            return "bad"
        return None

    def value(self, c: str) -> str | None:
        """The first character of a top-level value: the name must be a string, the arguments an object."""
        self.mark = self.pos - 1
        bad_name = self.key == "name" and c != '"'
        bad_args = self.key in ARG_KEYS and (c != "{" or self.args is not None)   # an object, given once
        if bad_name or bad_args:
            return "bad"
        if c == '"':
            self.in_string = True
        elif c in "{[":
            self.depth = 2
            if self.key in ARG_KEYS:
                self.args = self.mark
        elif c in "}]:,":
            return "bad"
        else:
            self.expect = "next"                  # a number, true, false or null
        return None

    def closed(self, text: str) -> str | None:
        """A top-level key or value has just closed (at pos - 1)."""
        if self.expect == "key":
            self.key, self.expect = loads(text[self.mark:self.pos]), "colon"
            return None if self.key is not None else "bad"
        self.expect = "next"
        if self.key == "name":
            if self.name is not None:
                return "bad"
            self.name = loads(text[self.mark:self.pos])
            return "name" if self.name is not None else "bad"   # the header may go out before what follows
        if self.key in ARG_KEYS:
            self.args_end = self.pos
        return None


class StreamParser:
    """A streamed answer's tool calls: feed(text) and finish() give Content and CallDelta events.

    Text that may be the start of a call (a tail like `<tool_`, or a llama3_json answer that starts with `{`) is
    held back until it is known; plain text goes out as soon as it is known not to be one. A call's header goes
    out once its name is parsed (and, with names given, is one of them), then its arguments' JSON text as it
    arrives. Output that turns out malformed (a block that does not parse, an unknown name) releases what was
    held back as content, and the rest of the answer is content too; `failed` is then set. A call cut off by the
    end of the answer (max_tokens) keeps what was streamed of it, as vLLM does. A missing `</tool_call>` or `]`
    after a whole call is forgiven (the model stopped there)."""

    def __init__(self, parser: str, names: set[str] | None = None):
        if parser not in PARSERS:
            raise ValueError(f"tool call parser {parser!r} is not one of {', '.join(PARSERS)}")
        self.parser, self.names = parser, names
        self.text = ""                            # the answer so far
        self.pos = 0                              # the next character to look at
        self.sent = 0                             # text before this went out, as content or as a call
        self.step = self.in_text if parser == "hermes" else self.at_start
        self.scan: Scan | None = None             # the call object being read
        self.call_id: str | None = None           # its id, once its header went out
        self.pending: str | None = None           # mistral: the name read before [ARGS]
        self.in_list = False                      # mistral: inside [...]
        self.calls: list[ToolCall] = []
        self.failed = False
        self.done = False
        self.events: list = []

    def feed(self, text: str) -> list:
        """The events the answer's next piece of text makes known."""
        self.text += text
        return self.advance()

    def finish(self) -> list:
        """The last events: held-back text, or, inside an unfinished call, nothing more of it."""
        self.done = True
        self.advance()
        if self.step not in (self.in_text, self.plain, self.closing):
            self.failed = True
            if self.call_id is None:
                self.release(len(self.text))
        return self.events

    def advance(self) -> list:
        self.events = []
        while self.step():
            pass
        return self.events

    def emit(self, event) -> None:
        last = self.events[-1] if self.events else None
        if isinstance(event, Content) and isinstance(last, Content):
            last.text += event.text
        elif isinstance(event, CallDelta) and isinstance(last, CallDelta) and last.index == event.index:
            last.arguments += event.arguments
        else:
            self.events.append(event)

    def release(self, end: int) -> None:
        """The text from `sent` to end, as content."""
        if end > self.sent:
            self.emit(Content(self.text[self.sent:end]))
            self.sent = end

    def fail(self) -> bool:
        self.failed, self.step = True, self.plain
        return True

    def plain(self) -> bool:
        self.release(len(self.text))
        return False

    def skip_space(self) -> bool:
        """Moves past whitespace; whether a character follows."""
        while self.pos < len(self.text) and self.text[self.pos] in SPACE:
            self.pos += 1
        return self.pos < len(self.text)

    def at_start(self) -> bool:
        """The answer's beginning, where llama3_json's calls and mistral's stripped marker are recognised;
        leading whitespace waits with them."""
        if not self.skip_space():
            if self.done:
                self.step = self.plain
            return self.done
        return self.start_llama() if self.parser == "llama3_json" else self.start_mistral()

    def start_llama(self) -> bool:
        """llama3_json: calls when the answer starts with `{` or <|python_tag|>, else it is all content."""
        tag = MARKERS["llama3_json"]
        rest = self.text[self.pos:self.pos + len(tag)]
        if rest.startswith("{") or rest == tag:
            self.pos += len(tag) if rest == tag else 0
            self.step = self.opened
        elif tag.startswith(rest) and not self.done:
            return False
        else:
            self.step = self.plain
        return True

    def start_mistral(self) -> bool:
        """mistral: an answer that starts `[{"name"` is a call list whose [TOOL_CALLS] was stripped."""
        rest = self.text[self.pos:self.pos + len(MISTRAL_BARE)]
        if rest == MISTRAL_BARE:
            self.pos, self.in_list, self.step = self.pos + 1, True, self.opened
        elif MISTRAL_BARE.startswith(rest) and not self.done:
            return False
        else:
            self.pos, self.step = self.sent, self.in_text
        return True

    def in_text(self) -> bool:
        """Content, up to the family's call marker; a tail that may be the marker's beginning waits."""
        marker = MARKERS[self.parser]
        i = self.text.find(marker, self.pos)
        if i < 0:
            end = len(self.text) if self.done else len(self.text) - held(self.text, self.pos, marker)
            self.release(end)
            self.pos = self.sent
            return False
        self.release(i)
        self.pos = i + len(marker)
        self.step = self.after_marker if self.parser == "mistral" else self.opened
        return True

    def after_marker(self) -> bool:
        """Mistral, after [TOOL_CALLS]: a call list, a call object, or a function name and [ARGS]."""
        if not self.skip_space():
            return False
        c = self.text[self.pos]
        if c == "[":
            self.pos, self.in_list = self.pos + 1, True
        self.step = self.opened if c in "[{" else self.named
        return True

    def named(self) -> bool:
        """Mistral's name[ARGS]{...}: the function name, up to [ARGS]."""
        end = FUNCTION_NAME.match(self.text, self.pos).end()
        rest = self.text[end:end + len(MISTRAL_ARGS)]
        if not MISTRAL_ARGS.startswith(rest) or (rest and end == self.pos):
            return self.fail()
        if len(rest) < len(MISTRAL_ARGS):
            return False
        self.pending, self.pos, self.step = self.text[self.pos:end], end + len(MISTRAL_ARGS), self.opened
        return True

    def opened(self) -> bool:
        """A call object must begin here."""
        if not self.skip_space():
            return False
        if self.text[self.pos] != "{":
            return self.fail()
        bare = self.pending is not None
        self.scan = Scan(self.pos, self.pos, name=self.pending, args=self.pos if bare else None, bare=bare)
        self.step = self.in_call
        return True

    def in_call(self) -> bool:
        """Inside a call object: its header goes out once the name is known, its arguments as they arrive."""
        scan = self.scan
        status = scan.run(self.text)
        if status == "bad":
            return self.fail()
        if scan.name is not None and self.call_id is None:
            if self.names is not None and scan.name not in self.names:
                return self.fail()
            self.call_id = new_id()
            self.emit(CallDelta(len(self.calls), self.call_id, scan.name, ""))
            self.sent = scan.pos
        if self.call_id is not None:
            self.stream_arguments(scan)
        return self.ended() if status == "end" else status == "name"

    def stream_arguments(self, scan: Scan) -> None:
        """The arguments' text that arrived since the last piece (the raw JSON, up to the value's end)."""
        if scan.args is None:
            return
        end = scan.pos if scan.args_end is None else scan.args_end
        start = max(scan.streamed, scan.args)
        if end > start:
            self.emit(CallDelta(len(self.calls), None, None, self.text[start:end]))
            scan.streamed, self.sent = end, max(self.sent, end)

    def ended(self) -> bool:
        """The call object has closed: it must parse as a call, with the name that went out."""
        scan = self.scan
        obj = loads(self.text[scan.start:scan.pos])
        args = (obj if isinstance(obj, dict) else None) if scan.bare else call_arguments(obj)
        if args is None or self.call_id is None or (not scan.bare and obj["name"] != scan.name):
            return self.fail()
        self.calls.append(ToolCall(self.call_id, scan.name, orjson.dumps(args).decode()))
        self.scan, self.call_id, self.pending = None, None, None
        self.pos = self.sent = scan.pos
        self.step = self.in_text if self.parser == "mistral" and not self.in_list else self.closing
        return True

    def closing(self) -> bool:
        """After a call object: hermes wants </tool_call>, llama3_json a `;` or the end, mistral's list `,` or `]`.
        At the end of the answer, whatever is missing is forgiven."""
        if not self.skip_space():
            return False
        if self.parser == "hermes":
            rest = self.text[self.pos:self.pos + len(HERMES_END)]
            if not HERMES_END.startswith(rest):
                return self.fail()
            if len(rest) < len(HERMES_END):
                return False
            self.pos, self.step = self.pos + len(HERMES_END), self.in_text
        elif self.text[self.pos] == (";" if self.parser == "llama3_json" else ","):
            self.pos, self.step = self.pos + 1, self.opened
        elif self.parser == "mistral" and self.text[self.pos] == "]":
            self.pos, self.in_list, self.step = self.pos + 1, False, self.in_text
        else:
            return self.fail()
        self.sent = self.pos
        return True


def held(text: str, start: int, marker: str) -> int:
    """How many characters at the end of text[start:] may be the beginning of marker."""
    for n in range(min(len(marker) - 1, len(text) - start), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


def pick(chat_template: str | None) -> str:
    """The parser for a model, from its chat template: the format the template writes calls in, else hermes
    (the default tool prompt's)."""
    template = chat_template or ""
    if "<tool_call>" in template:
        return "hermes"
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3_json"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    return "hermes"


JINJA = re.compile(r"\{%(.*?)%\}|\{\{(.*?)\}\}", re.S)
TOOLS_VAR = re.compile(r"\btools\b")


def knows_tools(chat_template: str | None) -> bool:
    """Whether a chat template renders a `tools` variable (one used inside a {% %} or {{ }} expression)."""
    return any(TOOLS_VAR.search(m[1] or m[2]) for m in JINJA.finditer(chat_template or ""))


def default_system(tools: list[dict]) -> str:
    """The tool prompt for a template without tools support: Qwen2.5's (hermes format), which the hermes, Qwen and
    SmolLM families were trained on. Tools are OpenAI's {"type": "function", "function": {...}}, one a line, in
    the spacing Jinja's tojson gives."""
    lines = "\n".join(json.dumps({"type": "function", "function": t["function"]}, ensure_ascii=False) for t in tools)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            f"You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{lines}\n</tools>"
            "\n\nFor each function call, return a json object with function name and arguments within "
            "<tool_call></tool_call> XML tags:\n<tool_call>\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


def plain_history(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """Messages a tool-unaware template can render, each only a string role and content: the default tool prompt
    in the first system message (or one put first), an assistant's tool_calls as <tool_call> blocks after its
    text, and tool results as a user message of <tool_response> blocks (consecutive ones merged into one)."""
    out, last = [], None
    for m in messages:
        if m["role"] == "tool" and last == "tool":
            out[-1]["content"] += "\n" + plain_content(m)
        else:
            out.append({"role": "user" if m["role"] == "tool" else m["role"], "content": plain_content(m)})
        last = m["role"]
    if tools:
        prompt = default_system(tools)
        if out and out[0]["role"] == "system":
            out[0]["content"] = f"{out[0]['content']}\n\n{prompt}" if out[0]["content"] else prompt
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def plain_content(m: dict) -> str:
    """A message's content as text, a tool message's in <tool_response>, an assistant's calls in <tool_call>."""
    content = text_of(m.get("content"))
    if m["role"] == "tool":
        return f"<tool_response>\n{content}\n</tool_response>"
    calls = m.get("tool_calls") or []
    calls = (loads(calls) or []) if isinstance(calls, str) else calls   # the wire carries them as JSON text
    blocks = [tool_call_block(c["function"]) for c in calls]
    return "\n".join([content, *blocks] if content else blocks)


def tool_call_block(function: dict) -> str:
    """A call as hermes writes it: the arguments as an object when their JSON text parses, else as the string."""
    args = function.get("arguments", "{}")
    parsed = loads(args) if isinstance(args, str) else args
    call = {"name": function["name"], "arguments": args if parsed is None else parsed}
    return f"<tool_call>\n{json.dumps(call, ensure_ascii=False)}\n</tool_call>"


def text_of(content) -> str:
    """A message's content as one string: None is "", a list of text parts is their texts joined."""
    if content is None:
        return ""
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return str(content)

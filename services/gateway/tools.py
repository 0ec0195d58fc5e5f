"""Tool calling on /v1/chat/completions: the request's `tools`, `tool_choice` and `parallel_tool_calls` checked
into a Tools (what the answer is parsed with), and, for `required` or a named function, the JSON schema that
constrains the output (xgrammar in the engine), so the arguments always parse and validate whatever the model.

- `auto`: the model writes calls in its family's format (text/toolcalls.py: hermes, llama3_json, mistral), which
  the answer parses; text that holds no call, or a call that does not parse, is the answer's content.
- `required`: the output is a JSON array of `{"name", "parameters"}`, one item per call (one at most without
  `parallel_tool_calls`), each item's parameters valid for its function's schema.
- a named function: the output is that function's arguments, a JSON object valid for its schema.
- `none`: the tools are not shown to the model, and the answer is text."""
from dataclasses import dataclass

import orjson

from schemas.messages import MAX_TOOLS
from services.gateway import frames
from services.gateway.errors import ApiError
from text import toolcalls

MAX_TOOL_NAME_CHARS = 64
CHOICES = ("none", "auto", "required")
MAX_PARALLEL_CALLS = 16                           # calls of one `required` answer (a small model may loop)


@dataclass(slots=True)
class Tools:
    """How an answer's tool calls are found."""
    mode: str                                     # auto | required | named
    parser: str                                   # the model family's format (auto)
    names: set[str]
    named: str | None = None                      # the function of tool_choice {"type": "function", ...}

    def parse(self, text: str) -> tuple[str | None, list[toolcalls.ToolCall]]:
        """(content, calls) of a whole answer."""
        if self.mode == "auto":
            return toolcalls.parse(self.parser, text, self.names)
        try:
            value = orjson.loads(text)
        except orjson.JSONDecodeError:               # cut off by max_tokens: the text as it is
            return text or None, []
        if self.mode == "named":
            return None, [call(self.named, value)]
        return None, [call(item["name"], item["parameters"]) for item in value]


def call(name: str, arguments) -> toolcalls.ToolCall:
    return toolcalls.ToolCall(toolcalls.new_id(), name, orjson.dumps(arguments).decode())


def parse(b: dict, parser: str) -> tuple[Tools | None, list[dict] | None, dict]:
    """(Tools, the tools the prompt shows, the sampling constraint) of a chat body; (None, None, {}) for none."""
    tools = b.get("tools")
    choice = b.get("tool_choice", "auto" if tools else "none")
    parallel = b.get("parallel_tool_calls", True)
    if not frames.is_bool(parallel):
        raise bad(f"parallel_tool_calls: expected true or false, got {frames.kind(parallel)}", "parallel_tool_calls")
    if tools is None:
        if choice != "none":
            raise bad(f"tool_choice: {frames.show(choice)} needs tools", "tool_choice")
        return None, None, {}
    functions = checked(tools)
    if choice == "none":
        return None, None, {}
    if choice == "auto":
        return Tools("auto", parser, set(functions)), tools, {}
    if choice == "required":
        return Tools("required", parser, set(functions)), tools, {"json_schema": required(functions, parallel)}
    name = named(choice)
    if name not in functions:
        raise bad(f"tool_choice.function.name: {name[:64]!r} is not one of the tools ({', '.join(functions)})",
                  "tool_choice")
    return Tools("named", parser, set(functions), name), tools, {"json_schema": functions[name]}


def checked(tools) -> dict[str, dict]:
    """Each function's name → its parameters' schema; 400 naming the tool and field otherwise."""
    if not isinstance(tools, list) or not tools:
        raise bad(f"tools: expected a non-empty array of tool objects, got {frames.kind(tools)}", "tools")
    if len(tools) > MAX_TOOLS:
        raise bad(f"tools: {len(tools)} tools is more than MAX_TOOLS={MAX_TOOLS}", "tools")
    out = {}
    for i, t in enumerate(tools):
        f = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(f, dict):
            raise bad(f'tools[{i}]: expected {{"type": "function", "function": {{...}}}}', "tools")
        name = f.get("name")
        if not isinstance(name, str) or not 0 < len(name) <= MAX_TOOL_NAME_CHARS:
            raise bad(f"tools[{i}].function.name: must be a string of 1 to {MAX_TOOL_NAME_CHARS} characters", "tools")
        if name in out:
            raise bad(f"tools[{i}].function.name: {name!r} is given twice", "tools")
        params = f.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise bad(f"tools[{i}].function.parameters: expected an object (a JSON schema), got "
                      f"{frames.kind(params)}", "tools")
        if not isinstance(f.get("description", ""), str):
            raise bad(f"tools[{i}].function.description: expected a string", "tools")
        out[name] = params
    return out


def named(choice) -> str:
    if isinstance(choice, str):
        raise bad(f"tool_choice: must be one of {', '.join(CHOICES)} or {{\"type\": \"function\", \"function\": "
                  f"{{\"name\": ...}}}} (got {frames.show(choice)})", "tool_choice")
    f = choice.get("function") if isinstance(choice, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(f, dict) \
            or not isinstance(f.get("name"), str):
        raise bad('tool_choice: expected {"type": "function", "function": {"name": ...}}', "tool_choice")
    return f["name"]


def required(functions: dict[str, dict], parallel: bool) -> dict:
    """The schema of `required`'s output: an array of calls, each a function's name and its parameters."""
    items = [{"type": "object", "properties": {"name": {"const": name}, "parameters": params},
              "required": ["name", "parameters"]} for name, params in functions.items()]
    return {"type": "array", "items": items[0] if len(items) == 1 else {"anyOf": items}, "minItems": 1,
            "maxItems": MAX_PARALLEL_CALLS if parallel else 1}


def bad(message: str, param: str) -> ApiError:
    return ApiError(400, message, "invalid_request", param)


class ToolStream:
    """A streamed answer's deltas (OpenAI's `delta` objects) as its text comes: content, and tool calls with
    their id and name first and their arguments as they come. `required` is parsed when the answer ends."""

    def __init__(self, tools: Tools):
        self.tools, self.called, self.text = tools, False, []
        self.parser = toolcalls.StreamParser(tools.parser, tools.names) if tools.mode == "auto" else None
        self.header = None if tools.mode != "named" else call(tools.named, {})

    def feed(self, text: str) -> list[dict]:
        if self.parser is not None:
            return self.deltas(self.parser.feed(text))
        if self.tools.mode == "required":
            self.text.append(text)
            return []
        out = []
        if self.header is not None:               # named: the call's header, then its arguments as they come
            out.append(piece(0, self.header.id, self.header.name, ""))
            self.header, self.called = None, True
        return [*out, piece(0, None, None, text)] if text else out

    def finish(self) -> list[dict]:
        if self.parser is not None:
            return self.deltas(self.parser.finish())
        if self.tools.mode == "named":
            return self.feed("")
        content, calls = self.tools.parse("".join(self.text))
        self.called = self.called or bool(calls)
        out = [{"content": content}] if content else []
        return out + [piece(i, c.id, c.name, c.arguments) for i, c in enumerate(calls)]

    def deltas(self, events: list) -> list[dict]:
        self.called = self.called or any(not isinstance(e, toolcalls.Content) for e in events)
        return [delta(e) for e in events]


def delta(e) -> dict:
    if isinstance(e, toolcalls.Content):
        return {"content": e.text}
    return piece(e.index, e.id, e.name, e.arguments)


def piece(index: int, id: str | None, name: str | None, arguments: str) -> dict:
    """A delta with one tool call's piece: the first carries its id and name."""
    head = {"id": id, "type": "function"} if id is not None else {}
    fn = {"name": name, "arguments": arguments} if name is not None else {"arguments": arguments}
    return {"tool_calls": [{"index": index, **head, "function": fn}]}


def message(tools: Tools, text: str) -> tuple[dict, bool]:
    """The non-streaming answer's message, and whether it calls tools."""
    content, calls = tools.parse(text)
    if not calls:
        return {"role": "assistant", "content": text}, False
    return {"role": "assistant", "content": content, "tool_calls": [
        {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in calls]}, True

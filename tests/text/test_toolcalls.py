"""Tool calls in model output: recorded answers of each family parse to the right calls; streamed in any chunking
they give the same content and calls; malformed output falls back to content; templates without tools get a
history they can render."""
import json
import random
import re

import pytest

from text.toolcalls import CallDelta, Content, StreamParser, knows_tools, parse, pick, plain_history

WEATHER = {"city": "Paris", "unit": "celsius"}
NAMES = {"get_weather", "get_time", "search", "run_code"}

# (case, parser, model output, content, [(name, arguments)])
SAMPLES = [
    ("qwen2.5 one call", "hermes",
     '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>',
     None, [("get_weather", WEATHER)]),
    ("hermes text before", "hermes",
     "I'll check the weather in Paris for you.\n<tool_call>\n"
     '{"arguments": {"city": "Paris", "unit": "celsius"}, "name": "get_weather"}\n</tool_call>',
     "I'll check the weather in Paris for you.", [("get_weather", WEATHER)]),
    ("qwen2.5 two parallel calls", "hermes",
     '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>\n'
     '<tool_call>\n{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}\n</tool_call>',
     None, [("get_weather", WEATHER), ("get_time", {"tz": "Europe/Paris"})]),
    ("hermes nested arguments", "hermes",
     '<tool_call>\n{"name": "search", "arguments": {"query": {"text": "kv cache", "filter": {"tags": ["gpu", "llm"], '
     '"year": {"gte": 2023, "lte": 2025}}}, "limit": 5, "exact": false, "cursor": null}}\n</tool_call>',
     None, [("search", {"query": {"text": "kv cache", "filter": {"tags": ["gpu", "llm"], "year": {"gte": 2023,
                                                                                               "lte": 2025}}},
                        "limit": 5, "exact": False, "cursor": None})]),
    ("hermes escaped quotes and braces in strings", "hermes",
     'Running it.\n<tool_call>\n{"name": "run_code", "arguments": {"code": "print(\\"}{\\")\\nd = {\'a\': [1]}", '
     '"path": "C:\\\\tmp\\\\x.py"}}\n</tool_call>',
     "Running it.", [("run_code", {"code": "print(\"}{\")\nd = {'a': [1]}", "path": "C:\\tmp\\x.py"})]),
    ("hermes unicode", "hermes",
     '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich", "note": "日本語 🙂 \\u00e9"}}\n</tool_call>',
     None, [("get_weather", {"city": "Zürich", "note": "日本語 🙂 é"})]),
    ("qwen3 think block before", "hermes",
     "<think>\nThe user wants the weather, so I call get_weather.\n</think>\n\n<tool_call>\n"
     '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>',
     "<think>\nThe user wants the weather, so I call get_weather.\n</think>", [("get_weather", WEATHER)]),
    ("hermes text with < and <tool-like words", "hermes",
     "Since 3 < 5 and <toolbox> is not a tag:\n<tool_call>\n"
     '{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>\n',
     "Since 3 < 5 and <toolbox> is not a tag:", [("get_time", {"tz": "UTC"})]),
    ("hermes stopped before </tool_call>", "hermes",
     '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n',
     None, [("get_time", {"tz": "UTC"})]),
    ("hermes plain answer", "hermes", "The capital of France is Paris.", "The capital of France is Paris.", []),
    ("llama3.1 json call", "llama3_json",
     '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}',
     None, [("get_weather", WEATHER)]),
    ("llama3.1 python_tag", "llama3_json",
     '<|python_tag|>{"name": "search", "parameters": {"query": "say \\"hi\\" {now}"}}',
     None, [("search", {"query": 'say "hi" {now}'})]),
    ("llama3.1 two calls with ;", "llama3_json",
     '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}; '
     '{"name": "get_time", "parameters": {"tz": "Europe/Paris"}}',
     None, [("get_weather", WEATHER), ("get_time", {"tz": "Europe/Paris"})]),
    ("llama3.2 type key and arguments", "llama3_json",
     '\n{"type": "function", "name": "get_time", "arguments": {"tz": "Asia/Tokyo", "fmt": {"h24": true}}}',
     None, [("get_time", {"tz": "Asia/Tokyo", "fmt": {"h24": True}})]),
    ("llama3 plain answer", "llama3_json", "Paris is the capital of France {and its largest city}.",
     "Paris is the capital of France {and its largest city}.", []),
    ("llama3 plain answer starting with <", "llama3_json", "<b>Paris</b>", "<b>Paris</b>", []),
    ("mistral v3 list", "mistral",
     '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, '
     '{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}]',
     None, [("get_weather", WEATHER), ("get_time", {"tz": "Europe/Paris"})]),
    ("mistral [ARGS] form", "mistral",
     '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}[TOOL_CALLS]run_code[ARGS]'
     '{"code": "s = \\"[TOOL_CALLS]\\"; x = {1: [2]}"}',
     None, [("get_weather", WEATHER), ("run_code", {"code": 's = "[TOOL_CALLS]"; x = {1: [2]}'})]),
    ("mistral marker stripped", "mistral",
     '[{"name": "search", "arguments": {"query": "Zürich 🙂", "limit": 3}}]',
     None, [("search", {"query": "Zürich 🙂", "limit": 3})]),
    ("mistral text before", "mistral",
     'Let me look that up.[TOOL_CALLS][{"name": "search", "arguments": {"query": "tokenbus"}}]',
     "Let me look that up.", [("search", {"query": "tokenbus"})]),
    ("mistral plain answer with brackets", "mistral", "[1, 2] sorted is [1, 2]; see [TOOL",
     "[1, 2] sorted is [1, 2]; see [TOOL", []),
]

# (case, parser, model output, whether a call's header goes out before the output turns out malformed)
MALFORMED = [
    ("hermes unterminated JSON", "hermes", 'Sure.\n<tool_call>\n{"name": "get_wea', False),
    ("hermes garbage in the block", "hermes", "<tool_call>\nI will call get_weather now\n</tool_call>", False),
    ("hermes unknown name", "hermes", '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>', False),
    ("hermes name not a string", "hermes", '<tool_call>\n{"name": 42, "arguments": {}}\n</tool_call>', False),
    ("hermes arguments not an object", "hermes",
     '<tool_call>\n{"name": "get_time", "arguments": "UTC"}\n</tool_call>', True),
    ("hermes text instead of the end tag", "hermes",
     '<tool_call>\n{"name": "get_time", "arguments": {}}\nand more', True),
    ("llama3 unterminated JSON", "llama3_json", '{"name": "get_wea', False),
    ("llama3 JSON that is not a call", "llama3_json", '{"city": "Paris", "unit": "celsius"}', False),
    ("llama3 unknown name", "llama3_json", '{"name": "rm_rf", "parameters": {}}', False),
    ("llama3 name not a string", "llama3_json", '{"name": ["get_time"], "parameters": {}}', False),
    ("llama3 python_tag with python", "llama3_json", '<|python_tag|>brave_search.call(query="x")', False),
    ("llama3 text after the call", "llama3_json", '{"name": "get_time", "parameters": {}} done', True),
    ("mistral not a call", "mistral", "[TOOL_CALLS]not json at all", False),
    ("mistral unterminated list", "mistral", '[TOOL_CALLS][{"name": "get_t', False),
    ("mistral unknown name", "mistral", "[TOOL_CALLS]rm_rf[ARGS]{}", False),
    ("mistral name not a string", "mistral", '[TOOL_CALLS][{"name": null, "arguments": {}}]', False),
    ("mistral garbage in the list", "mistral", '[TOOL_CALLS][{"name": "get_time", "arguments": {}} oops]', True),
]


def chunkings(text: str) -> list[list[str]]:
    """The text whole, a character at a time, in fixed sizes, and cut at random points (fixed seed)."""
    out = [[text], list(text)] + [[text[i:i + n] for i in range(0, len(text), n)] for n in (2, 3, 7)]
    rng = random.Random(len(text))
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
        out.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])])
    return out


def stream(parser: str, chunks: list[str], names=NAMES) -> tuple[str, list[tuple[str, str, str]]]:
    """The streamed content, joined, and each call's (id, name, arguments joined), checking the delta order."""
    s = StreamParser(parser, names)
    events = [e for c in chunks for e in s.feed(c)] + s.finish()
    calls = []
    for e in events:
        assert isinstance(e, Content | CallDelta)
        if isinstance(e, CallDelta) and e.id is not None:
            assert e.index == len(calls) and e.name is not None
            calls.append([e.id, e.name, e.arguments])
        elif isinstance(e, CallDelta):
            assert e.index == len(calls) - 1 and e.name is None
            calls[-1][2] += e.arguments
    return "".join(e.text for e in events if isinstance(e, Content)), [tuple(c) for c in calls]


@pytest.mark.parametrize(("parser", "text", "content", "calls"), [s[1:] for s in SAMPLES], ids=[s[0] for s in SAMPLES])
def test_recorded_answers_parse_to_their_content_and_calls(parser, text, content, calls):
    got_content, got = parse(parser, text, NAMES)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls
    assert all(re.fullmatch(r"call_[0-9a-f]{24}", c.id) for c in got) and len({c.id for c in got}) == len(got)
    assert all(c.arguments == json.dumps(json.loads(c.arguments), separators=(",", ":"), ensure_ascii=False)
               for c in got)                                          # compact
    assert [(c.name, json.loads(c.arguments)) for c in parse(parser, text)[1]] == calls   # names=None: any name


@pytest.mark.parametrize(("parser", "text"), [s[1:3] for s in SAMPLES], ids=[s[0] for s in SAMPLES])
def test_any_chunking_streams_the_same_content_and_calls_as_the_whole_parse(parser, text):
    content, calls = parse(parser, text, NAMES)
    for chunks in chunkings(text):
        got_content, got = stream(parser, chunks)
        assert got_content.strip() == (content or "")
        assert [(name, json.loads(args)) for _id, name, args in got] == [(c.name, json.loads(c.arguments))
                                                                          for c in calls]
        assert all(re.fullmatch(r"call_[0-9a-f]{24}", i) for i, _, _ in got)


@pytest.mark.parametrize(("parser", "text", "header"), [m[1:] for m in MALFORMED], ids=[m[0] for m in MALFORMED])
def test_malformed_output_is_content_whole_and_what_was_held_back_in_any_chunking(parser, text, header):
    assert parse(parser, text, NAMES) == (text, [])
    whole, whole_calls = stream(parser, [text])
    assert bool(whole_calls) == header and (header or whole == text)
    for chunks in chunkings(text):
        content, calls = stream(parser, chunks)
        assert content == whole and [c[1:] for c in calls] == [c[1:] for c in whole_calls]


def test_a_call_cut_off_by_max_tokens_keeps_what_was_streamed_and_leaks_no_content():
    text = 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'
    assert parse("hermes", text, NAMES) == (text, [])
    for chunks in chunkings(text):
        content, calls = stream("hermes", chunks)
        assert content.strip() == "Checking." and [c[1:] for c in calls] == [("get_weather", '{"city": "Par')]


def test_the_header_goes_out_with_the_name_and_the_arguments_as_they_arrive():
    s = StreamParser("hermes", NAMES)
    assert s.feed('<tool_call>\n{"name": "get_wea') == []
    [head] = s.feed('ther", "arguments": {"ci')
    assert (head.index, head.name, head.arguments) == (0, "get_weather", '{"ci') and head.id.startswith("call_")
    assert s.feed('ty": "Paris"}') == [CallDelta(0, None, None, 'ty": "Paris"}')]
    assert s.feed("}\n</tool_call>") + s.finish() == []


@pytest.mark.parametrize(("parser", "first", "out", "rest", "then"), [
    ("hermes", "Hello <tool", "Hello ", "box>!", "<toolbox>!"),
    ("hermes", "a <", "a ", " b", "< b"),
    ("llama3_json", "  {", "", '"a": 1} is JSON', '  {"a": 1} is JSON'),
    ("llama3_json", "<|python", "", "ic|> hi", "<|pythonic|> hi"),
    ("llama3_json", "Hi", "Hi", " there", " there"),
    ("mistral", "See [TOOL", "See ", "S]", "[TOOLS]"),
    ("mistral", "[{", "", "1, 2}]", "[{1, 2}]"),
])
def test_text_that_may_start_a_call_waits_and_plain_text_goes_out_at_once(parser, first, out, rest, then):
    s = StreamParser(parser, NAMES)
    assert "".join(e.text for e in s.feed(first)) == out
    assert "".join(e.text for e in s.feed(rest) + s.finish()) == then


def test_an_unknown_parser_is_refused():
    with pytest.raises(ValueError, match="hermes, llama3_json, mistral"):
        parse("qwen", "hi")


@pytest.mark.parametrize(("template", "parser", "tools"), [
    ("{%- if tools %}{{- '<tool_call>' }}{% for tool in tools %}{{ tool | tojson }}{% endfor %}{% endif %}",
     "hermes", True),
    ("{%- if tools is not none %}{{- '<|python_tag|>' }}{% endif %}", "llama3_json", True),
    ("{%- if message.role == 'ipython' %}{{ message.content }}{% endif %}", "llama3_json", False),
    ("{%- if message.tool_calls %}[TOOL_CALLS]{{ message.tool_calls | tojson }}{% endif %}", "mistral", False),
    ("{% for m in messages %}{{ m.content }} (no tools here){% endfor %}", "hermes", False),
    ("{{ custom_tools }}{% set tools_in_user_message = true %}", "hermes", False),
    (None, "hermes", False),
])
def test_pick_and_knows_tools_read_the_chat_template(template, parser, tools):
    assert pick(template) == parser
    assert knows_tools(template) is tools


def test_plain_history_writes_a_tool_round_trip_as_hermes_text():
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                               "parameters": {"type": "object", "properties": {"city": {}}}}}]
    calls = [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}},
             {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Rome"}'}}]
    out = plain_history([
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": "Checking both.", "tool_calls": json.dumps(calls)},   # as the wire has it
        {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
        {"role": "tool", "tool_call_id": "call_2", "content": "24C"},
        {"role": "user", "content": "Thanks!"},
    ], tools)
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user", "user"]
    assert all(set(m) == {"role", "content"} and isinstance(m["content"], str) for m in out)
    system = out[0]["content"]
    assert system.startswith("Be brief.\n\n# Tools") and "<tool_call></tool_call>" in system
    assert json.loads(system.split("<tools>\n")[1].split("\n</tools>")[0]) == tools[0]
    assert out[2]["content"] == ('Checking both.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
                                 '\n</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}'
                                 "\n</tool_call>")
    assert out[3]["content"] == "<tool_response>\n18C\n</tool_response>\n<tool_response>\n24C\n</tool_response>"
    assert out[4]["content"] == "Thanks!"
    _, parsed = parse("hermes", out[2]["content"], {"get_weather"})     # what the model is shown, it can write
    assert [json.loads(c.arguments) for c in parsed] == [{"city": "Paris"}, {"city": "Rome"}]
    no_system = plain_history([{"role": "user", "content": "hi"}], tools)
    assert no_system[0]["role"] == "system" and no_system[0]["content"].startswith("# Tools")
    assert plain_history([{"role": "user", "content": "hi"}], None) == [{"role": "user", "content": "hi"}]

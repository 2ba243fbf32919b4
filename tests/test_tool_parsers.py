"""Tool-call parsers (jaxmtp.server.tool_parsers): real outputs of each format read into
hand-written calls, and the streaming contract: however an output is cut into deltas,
the streamed content and calls add up to what parse() gives for the whole output."""

import pytest

from conftest import fresh_rng
from jaxmtp.server.tool_parsers import TOOL_PARSERS, ParsedOutput, ToolCall, tool_parser

# the formats' markers, written out here so that the tests pin the models' real tokens
CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
FENCE = "```"

# (parser, output, expected content, expected calls)
EXAMPLES = [
    # Hermes / Qwen
    ("hermes",
     'Let me check the weather.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>',
     "Let me check the weather.\n",
     [ToolCall("get_weather", '{"city": "Paris", "unit": "celsius"}')]),
    ("hermes",
     '<tool_call>\n{"name": "add", "arguments": {"a":1,"b":2.5}}\n</tool_call>\n<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>\n',
     None,
     [ToolCall("add", '{"a": 1, "b": 2.5}'), ToolCall("now", "{}")]),
    ("hermes",
     ('<tool_call>\n{"name": "write_note", "arguments": {"title": "Caf\\u00e9 ☕ 東京", "body": "use <tool_call> or {braces} and \\"}\\"",'
      ' "meta": {"tags": ["a", {"b": null}], "ok": true}}}\n</tool_call>'),
     None,
     [ToolCall("write_note", '{"title": "Café ☕ 東京", "body": "use <tool_call> or {braces} and \\"}\\"", '
                             '"meta": {"tags": ["a", {"b": null}], "ok": true}}')]),
    ("hermes", "Paris is the capital of France. Tags look like <tool_ or <tool_call without a close.",
     "Paris is the capital of France. Tags look like <tool_ or <tool_call without a close.", []),
    ("hermes", 'Sure.\n<tool_call>\n{"name": "a", "arguments": {"x": 1}\n</tool_call>',
     'Sure.\n<tool_call>\n{"name": "a", "arguments": {"x": 1}\n</tool_call>', []),
    ("hermes", '<tool_call>\n{"name": "a", "arguments": {"x": NaN}}\n</tool_call>\n<tool_call>\n{"name": "b", "arguments": {"y": "z"}}\n</tool_call>',
     '<tool_call>\n{"name": "a", "arguments": {"x": NaN}}\n</tool_call>\n', [ToolCall("b", '{"y": "z"}')]),
    ("hermes", '<tool_call>\n{"result": 1}\n</tool_call>', '<tool_call>\n{"result": 1}\n</tool_call>', []),
    ("hermes", '<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\nDone.', "\nDone.", [ToolCall("a", "{}")]),
    ("hermes", '<tool_call>\n{"name": "a", "arguments": {"x": 1}}', None, [ToolCall("a", '{"x": 1}')]),  # cut off
    ("hermes", 'Hi <tool_call>\n{"name": "a", "argu', 'Hi <tool_call>\n{"name": "a", "argu', []),
    ("hermes", "\n  \n", None, []),
    # GLM-4.5
    ("glm45",
     ("I will search.\n<tool_call>search\n<arg_key>query</arg_key>\n<arg_value>jax pallas</arg_value>\n"
      "<arg_key>limit</arg_key>\n<arg_value>5</arg_value>\n</tool_call>"),
     "I will search.\n",
     [ToolCall("search", '{"query": "jax pallas", "limit": 5}')]),
    ("glm45",
     ("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>北京</arg_value>\n</tool_call>\n"
      '<tool_call>set_options\n<arg_key>opts</arg_key>\n<arg_value>{"verbose": true, "levels": [1, 2]}</arg_value>\n'
      "<arg_key>dry_run</arg_key>\n<arg_value>false</arg_value>\n<arg_key>note</arg_key>\n<arg_value>null</arg_value>\n</tool_call>"),
     None,
     [ToolCall("get_weather", '{"city": "北京"}'),
      ToolCall("set_options", '{"opts": {"verbose": true, "levels": [1, 2]}, "dry_run": false, "note": null}')]),
    ("glm45",
     ('<tool_call>run\n<arg_key>code</arg_key>\n<arg_value>if (a) { return "<tool_"; }\n</arg_value>\n'
      "<arg_key>id</arg_key>\n<arg_value>007</arg_value>\n<arg_key>x</arg_key>\n<arg_value>NaN</arg_value>\n</tool_call>"),
     None,
     [ToolCall("run", '{"code": "if (a) { return \\"<tool_\\"; }\\n", "id": "007", "x": "NaN"}')]),
    ("glm45", "<tool_call>get_time\n</tool_call>", None, [ToolCall("get_time", "{}")]),
    ("glm45", "<tool_call>get_time</tool_call>", None, [ToolCall("get_time", "{}")]),
    ("glm45", "No tools needed: 2 + 2 = 4 and 3 < 4.", "No tools needed: 2 + 2 = 4 and 3 < 4.", []),
    ("glm45", "<tool_call>broken\n<arg_key>x</arg_key>\n</tool_call>", "<tool_call>broken\n<arg_key>x</arg_key>\n</tool_call>", []),
    ("glm45", "<tool_call>\n</tool_call>", "<tool_call>\n</tool_call>", []),
    # DeepSeek-V3 / R1
    ("deepseek_v3",
     f'Checking.{CALLS_BEGIN}{CALL_BEGIN}function{SEP}get_weather\n{FENCE}json\n{{"location": "Beijing"}}\n{FENCE}{CALL_END}{CALLS_END}',
     "Checking.",
     [ToolCall("get_weather", '{"location": "Beijing"}')]),
    ("deepseek_v3",
     (f'{CALLS_BEGIN}{CALL_BEGIN}function{SEP}get_weather\n{FENCE}json\n{{"location": "Beijing"}}\n{FENCE}{CALL_END}\n'
      f'{CALL_BEGIN}function{SEP}get_time\n{FENCE}json\n{{"zone": "UTC+8"}}\n{FENCE}{CALL_END}{CALLS_END}'),
     None,
     [ToolCall("get_weather", '{"location": "Beijing"}'), ToolCall("get_time", '{"zone": "UTC+8"}')]),
    ("deepseek_v3",
     (f'{CALLS_BEGIN}{CALL_BEGIN}function{SEP}run\n{FENCE}json\n{{\n  "code": "{FENCE}py\\nprint(1)\\n{FENCE}",\n'
      f'  "note": "naïve <｜tool {{x}}",\n  "n": [1, {{"m": -2e3}}]\n}}\n{FENCE}{CALL_END}{CALLS_END}'),
     None,
     [ToolCall("run", '{"code": "```py\\nprint(1)\\n```", "note": "naïve <｜tool {x}", "n": [1, {"m": -2000.0}]}')]),
    ("deepseek_v3", "Hello! 你好 <｜tool", "Hello! 你好 <｜tool", []),
    ("deepseek_v3",
     f'{CALLS_BEGIN}{CALL_BEGIN}function{SEP}f\n{FENCE}json\n{{"a": }}\n{FENCE}{CALL_END}{CALLS_END}',
     f'{CALL_BEGIN}function{SEP}f\n{FENCE}json\n{{"a": }}\n{FENCE}{CALL_END}', []),
    # DeepSeek-V3.1
    ("deepseek_v31",
     f'Sure{CALLS_BEGIN}{CALL_BEGIN}get_weather{SEP}{{"location": "Tokyo"}}{CALL_END}{CALLS_END}',
     "Sure",
     [ToolCall("get_weather", '{"location": "Tokyo"}')]),
    ("deepseek_v31",
     f'{CALLS_BEGIN}{CALL_BEGIN}a{SEP}{{"q": "{{}} <｜tool▁call"}}{CALL_END}{CALL_BEGIN}b{SEP}{{}}{CALL_END}{CALLS_END}',
     None,
     [ToolCall("a", '{"q": "{} <｜tool▁call"}'), ToolCall("b", "{}")]),
    ("deepseek_v31", f"{CALLS_BEGIN}{CALL_BEGIN}a{SEP}[1]{CALL_END}{CALLS_END}", f"{CALL_BEGIN}a{SEP}[1]{CALL_END}", []),
    # Llama 3.1 / 3.2 JSON
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "San Francisco"}}',
     None, [ToolCall("get_weather", '{"city": "San Francisco"}')]),
    ("llama3_json", '<|python_tag|>{"name": "a", "arguments": {"x": [1, {"y": "}{"}]}}; {"name": "b", "parameters": {}}',
     None, [ToolCall("a", '{"x": [1, {"y": "}{"}]}'), ToolCall("b", "{}")]),
    ("llama3_json", '\n {"name": "überall", "parameters": {"q": "\\u4e2d"}}\n', None, [ToolCall("überall", '{"q": "中"}')]),
    ("llama3_json", "The weather is sunny {maybe}.", "The weather is sunny {maybe}.", []),
    ("llama3_json", '<|python_tag|>print("hi")', 'print("hi")', []),
    ("llama3_json", "<|python", "<|python", []),
    ("llama3_json", '{"name": "a", "parameters": {"x": 1}', '{"name": "a", "parameters": {"x": 1}', []),
    ("llama3_json", '{"result": 42}', '{"result": 42}', []),
    ("llama3_json", '{"name": "a", "parameters": {}} and more', " and more", [ToolCall("a", "{}")]),
    ("llama3_json", '{"name": "a", "parameters": {}}; {"oops": }', '{"oops": }', [ToolCall("a", "{}")]),
]


def stream(name: str, pieces: list[str]) -> ParsedOutput:
    """Feed pieces to a fresh parser, check each delta's shape, and add the deltas up."""
    parser = tool_parser(name)
    deltas = [parser.feed(piece) for piece in pieces] + [parser.finish()]
    content, calls = "", []
    for delta in deltas:
        content += delta.content
        for piece in delta.tool_calls:
            if piece.name is not None:  # a new call: named once, numbered in order
                assert piece.index == len(calls), (piece, calls)
                calls.append(ToolCall(piece.name, ""))
            assert piece.index < len(calls), (piece, calls)
            calls[piece.index].arguments += piece.arguments
    return ParsedOutput(content or None, calls)


def ids(example):
    return f"{example[0]}:{example[1][:24]!r}"


@pytest.mark.parametrize("name,text,content,calls", EXAMPLES, ids=[ids(e) for e in EXAMPLES])
def test_parse(name, text, content, calls):
    assert tool_parser(name).parse(text) == ParsedOutput(content, calls)


@pytest.mark.parametrize("name,text,content,calls", EXAMPLES, ids=[ids(e) for e in EXAMPLES])
def test_stream_every_cut(name, text, content, calls):
    expected = ParsedOutput(content, calls)
    assert stream(name, [text]) == expected
    assert stream(name, list(text)) == expected, "one character at a time"
    for cut in range(len(text) + 1):
        assert stream(name, [text[:cut], text[cut:]]) == expected, f"cut at {cut}: {text[:cut]!r}"


def test_stream_random_cuts():
    rng = fresh_rng()
    seed = rng.bit_generator.seed_seq.entropy
    for name, text, content, calls in EXAMPLES:
        for _ in range(20):
            cuts = sorted(rng.integers(0, len(text) + 1, size=rng.integers(1, 12)).tolist())
            pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
            assert stream(name, pieces) == ParsedOutput(content, calls), f"seed {seed}: {pieces}"


def test_parse_leaves_the_stream_alone():
    parser = tool_parser("hermes")
    first = parser.feed("Hi <tool_call>\n")
    assert parser.parse("other") == ParsedOutput("other", [])
    rest = parser.feed('{"name": "a", "arguments": {}}</tool_call>')
    assert (first.content, rest.tool_calls[0].name) == ("Hi ", "a")


def test_names():
    assert set(TOOL_PARSERS) == {"deepseek_v3", "deepseek_v31", "glm45", "hermes", "llama3_json"}
    with pytest.raises(ValueError, match="'nope'.*deepseek_v3, deepseek_v31, glm45, hermes, llama3_json"):
        tool_parser("nope")

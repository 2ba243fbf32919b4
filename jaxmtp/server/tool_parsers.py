"""Tool-call parsers: turn a model's generated text into OpenAI tool calls, as vLLM's
``--tool-call-parser NAME`` does, for a whole output (ToolParser.parse) and while it
streams (ToolParser.feed with each new piece of text, then ToolParser.finish).

Each parser is one incremental scanner, and parse() runs it over the whole text at once,
so a streamed output and a whole one are read by the same rules, however the stream is
cut. The scanner gives out text only once it is decided:

- a tool call whole, in one delta, when its end arrives (its end marker, or the end of
  the output), its arguments written canonically: json.dumps(..., ensure_ascii=False);
- content as it comes, except a tail that could still be the start of a marker, and the
  start of a stretch of content while that stretch is only whitespace.

Content is the text outside calls. A stretch of it (before the first call, between two,
after the last) that is only whitespace is dropped, so the newlines a model writes
between calls are no content; content that comes out empty is None. A call whose body
does not decode (malformed JSON, no name) is no call: its text, markers included, stays
content.
"""

from __future__ import annotations

import dataclasses
import json
import re


@dataclasses.dataclass
class ToolCall:
    """A finished call."""

    name: str
    arguments: str  # a JSON object, as text


@dataclasses.dataclass
class ParsedOutput:
    content: str | None  # the text that is not tool calls; None where there is none
    tool_calls: list[ToolCall]


@dataclasses.dataclass
class ToolCallDelta:
    """One streamed piece of call number `index`."""

    index: int
    name: str | None = None  # set in the first delta of that call only
    arguments: str = ""  # the next piece of its arguments text


@dataclasses.dataclass
class StreamDelta:
    content: str = ""
    tool_calls: list[ToolCallDelta] = dataclasses.field(default_factory=list)


def _reject_constant(name: str):
    # json accepts NaN and Infinity, and json.dumps would write them back: not JSON a client reads
    raise ValueError(f"{name} is not JSON")


def _loads(text: str):
    """Strict json.loads: ValueError for anything that is not JSON, NaN and Infinity included."""
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except RecursionError as e:
        raise ValueError("JSON nested too deeply") from e


def _dumps(value) -> str:
    return json.dumps(value, ensure_ascii=False)


def _json_call(name: str, arguments: str) -> ToolCall | None:
    """A call from its name and its arguments' JSON text; None unless both are sound."""
    try:
        value = _loads(arguments)
    except ValueError:
        return None
    return ToolCall(name, _dumps(value)) if name and isinstance(value, dict) else None


def _call_from_object(value) -> ToolCall | None:
    """{"name": ..., "arguments" (or "parameters"): {...}} as a call; None for any other value."""
    if not isinstance(value, dict):
        return None
    name = value.get("name")
    arguments = value["arguments"] if "arguments" in value else value.get("parameters")
    if not (isinstance(name, str) and name and isinstance(arguments, dict)):
        return None
    return ToolCall(name, _dumps(arguments))


def _partial_marker_len(text: str, markers: tuple[str, ...]) -> int:
    """The length of the longest tail of text that is a proper prefix of one of markers."""
    longest = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), longest, -1):
            if text.endswith(marker[:n]):
                longest = n
                break
    return longest


class ToolParser:
    """Reads one generated choice: feed() takes each new piece of text and returns what is
    decided so far, finish() ends the output and returns the rest. A subclass implements
    _advance, which consumes self._pending through _content and _emit_call."""

    def __init__(self):
        self._pending = ""  # text received and not yet decided
        self._num_calls = 0
        self._run = ""  # the current stretch of content, while it is only whitespace
        self._run_shown = False  # whether the current stretch has had non-whitespace

    def parse(self, text: str) -> ParsedOutput:
        """A whole output, read by a fresh parser (this one's streaming state is left alone)."""
        reader = type(self)()
        pieces = [reader.feed(text), reader.finish()]
        calls = [ToolCall(d.name, d.arguments) for piece in pieces for d in piece.tool_calls]  # each comes whole
        return ParsedOutput("".join(piece.content for piece in pieces) or None, calls)

    def feed(self, text: str) -> StreamDelta:
        out = StreamDelta()
        self._pending += text
        self._advance(out, final=False)
        return out

    def finish(self) -> StreamDelta:
        out = StreamDelta()
        self._advance(out, final=True)
        self._end_run()
        return out

    def _advance(self, out: StreamDelta, final: bool) -> None:
        """Consume what can be decided of self._pending (all of it where final)."""
        raise NotImplementedError

    def _content(self, out: StreamDelta, text: str) -> None:
        if self._run_shown:
            out.content += text
            return
        self._run += text
        if self._run.strip():
            out.content += self._run
            self._run, self._run_shown = "", True

    def _end_run(self) -> None:
        """A stretch of content ends (at a marker or a call, or the output's end): if it
        was only whitespace, it is dropped."""
        self._run, self._run_shown = "", False

    def _emit_call(self, out: StreamDelta, call: ToolCall) -> None:
        self._end_run()
        out.tool_calls.append(ToolCallDelta(self._num_calls, call.name, call.arguments))
        self._num_calls += 1


class _MarkerParser(ToolParser):
    """Calls written as CALL_BEGIN body CALL_END, anywhere in the output; _decode reads a
    body. The DROPPED markers (wrappers around a group of calls) are removed wherever they
    stand outside a call. A call's body ends at the first CALL_END: the formats have no
    escape for it (vLLM cuts there too)."""

    CALL_BEGIN: str
    CALL_END: str
    DROPPED: tuple[str, ...] = ()

    def __init__(self):
        super().__init__()
        self._in_call = False

    def _decode(self, body: str) -> ToolCall | None:
        raise NotImplementedError

    def _advance(self, out: StreamDelta, final: bool) -> None:
        markers = (self.CALL_BEGIN, *self.DROPPED)
        while True:
            if self._in_call:
                end = self._pending.find(self.CALL_END)
                if end < 0 and not final:
                    return
                # a call left open at the output's end is still a call if its body decodes, as in vLLM
                body, closing = (self._pending, "") if end < 0 else (self._pending[:end], self.CALL_END)
                self._pending = self._pending[len(body) + len(closing):]
                self._in_call = False
                call = self._decode(body)
                if call is None:
                    self._content(out, self.CALL_BEGIN + body + closing)
                else:
                    self._emit_call(out, call)
                continue
            found = [(at, marker) for marker in markers if (at := self._pending.find(marker)) >= 0]
            if not found:
                cut = len(self._pending) - (0 if final else _partial_marker_len(self._pending, markers))
                self._content(out, self._pending[:cut])
                self._pending = self._pending[cut:]
                return
            at, marker = min(found)
            self._content(out, self._pending[:at])
            self._end_run()
            self._pending = self._pending[at + len(marker):]
            self._in_call = marker == self.CALL_BEGIN


class DeepSeekV3Parser(_MarkerParser):
    """DeepSeek-V3 and R1: <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
    ```json ARGS ```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>, the fence's lines split by newlines."""

    CALL_BEGIN = "<｜tool▁call▁begin｜>"
    CALL_END = "<｜tool▁call▁end｜>"
    DROPPED = ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>")
    BODY = re.compile(r"[^\n]*?<｜tool▁sep｜>(?P<name>[^\n]*)\n```(?:json)?\n(?P<arguments>.*)\n```\s*", re.DOTALL)

    def _decode(self, body: str) -> ToolCall | None:
        match = self.BODY.fullmatch(body)
        return _json_call(match["name"].strip(), match["arguments"]) if match else None


class DeepSeekV31Parser(DeepSeekV3Parser):
    """DeepSeek-V3.1: <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS<｜tool▁call▁end｜>..."""

    BODY = re.compile(r"(?P<name>[^\n]*?)<｜tool▁sep｜>(?P<arguments>.*)", re.DOTALL)


def _glm_value(text: str):
    # GLM's chat template writes a string argument verbatim and any other value as JSON;
    # without the tool's schema, text that reads as JSON is taken for JSON
    try:
        return _loads(text)
    except ValueError:
        return text


class Glm45Parser(_MarkerParser):
    """GLM-4.5 and 4.6: <tool_call>NAME <arg_key>K</arg_key> <arg_value>V</arg_value> ...</tool_call>."""

    CALL_BEGIN, CALL_END = "<tool_call>", "</tool_call>"
    NAME = re.compile(r"\s*([^\n<]*)")  # to the end of its line or the first tag
    ARGUMENT = re.compile(r"\s*<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)

    def _decode(self, body: str) -> ToolCall | None:
        head = self.NAME.match(body)
        arguments, at = {}, head.end()
        while match := self.ARGUMENT.match(body, at):
            arguments[match[1].strip()] = _glm_value(match[2])
            at = match.end()
        name = head[1].strip()
        return ToolCall(name, _dumps(arguments)) if name and not body[at:].strip() else None


class HermesParser(_MarkerParser):
    """Hermes, Qwen2.5 and Qwen3: <tool_call>{"name": ..., "arguments": {...}}</tool_call>."""

    CALL_BEGIN, CALL_END = "<tool_call>", "</tool_call>"

    def _decode(self, body: str) -> ToolCall | None:
        try:
            return _call_from_object(_loads(body))
        except ValueError:
            return None


class Llama3JsonParser(ToolParser):
    """Llama 3.1 and 3.2 JSON tool calling: an output that starts, after an optional
    <|python_tag|> and whitespace, with {"name": ..., "parameters" (or "arguments"): {...}},
    maybe several separated by ";". An output that starts otherwise is all content; so is
    the rest of one from the first thing after a call that is not another call."""

    PYTHON_TAG = "<|python_tag|>"
    DECODER = json.JSONDecoder(parse_constant=_reject_constant)

    def __init__(self):
        super().__init__()
        # "tag" -> "lead" -> "call" <-> "between", and from any of them to "content" for good
        self._state = "tag"
        self._unscanned = 0  # in "call": where the text not yet tried as an object starts

    def _advance(self, out: StreamDelta, final: bool) -> None:
        while True:
            text = self._pending
            if self._state == "tag":
                if not final and len(text) < len(self.PYTHON_TAG) and self.PYTHON_TAG.startswith(text):
                    return
                self._pending = text.removeprefix(self.PYTHON_TAG)
                self._state = "lead"
            elif self._state in ("lead", "between"):
                rest = text.lstrip()
                if self._state == "between" and rest.startswith(";"):
                    rest = rest[1:].lstrip()
                if not rest and not final:
                    return
                if rest.startswith("{"):
                    self._pending, self._state, self._unscanned = rest, "call", 0
                else:
                    self._state = "content"
            elif self._state == "call":
                # an object can only close at a "}": try again only when one has come
                decoded = self._decode_object(text) if "}" in text[self._unscanned:] else None
                if decoded is None and not final:
                    self._unscanned = len(text)
                    return
                call = decoded and _call_from_object(decoded[0])
                if call is None:
                    self._state = "content"
                else:
                    self._emit_call(out, call)
                    self._pending, self._state = text[decoded[1]:], "between"
            else:
                self._content(out, text)
                self._pending = ""
                return

    def _decode_object(self, text: str) -> tuple[object, int] | None:
        """The JSON value text starts with, and where it ends; None while it is not whole."""
        try:
            return self.DECODER.raw_decode(text)
        except (ValueError, RecursionError):
            return None


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "deepseek_v3": DeepSeekV3Parser,
    "deepseek_v31": DeepSeekV31Parser,
    "glm45": Glm45Parser,
    "hermes": HermesParser,
    "llama3_json": Llama3JsonParser,
}


def tool_parser(name: str) -> ToolParser:
    """A fresh parser for one generated choice, by vLLM's --tool-call-parser name."""
    try:
        return TOOL_PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown tool-call parser {name!r}; known: {', '.join(sorted(TOOL_PARSERS))}") from None

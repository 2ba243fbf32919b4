"""A chat request's tools and tool_choice: the constraint a forced call puts on the output,
and the reader that turns each choice's output into OpenAI tool calls.

- "none": the output is text (the template still sees the tools, as vLLM's default);
- "auto": the model's own call format, read by the server's --tool-call-parser;
- "required": one call or more, the output constrained to a JSON array of
  {"name", "parameters"} objects of the offered tools (vLLM's form);
- {"type": "function", "function": {"name"}}: the output constrained to that function's
  parameters schema, and the whole output is its arguments.

Forced calls go through the structured-output path, so MTP's drafts are masked and
verified by the same grammar as the tokens: exact, as every constraint is.
"""

from __future__ import annotations

import dataclasses
import json

from jaxmtp.server.tool_parsers import ParsedOutput, StreamDelta, ToolCall, ToolCallDelta, tool_parser

EMPTY_PARAMETERS = {"type": "object", "properties": {}}


@dataclasses.dataclass(frozen=True)
class ToolChoice:
    mode: str  # "none", "auto", "required" or "function"
    function: str | None = None  # the function a "function" choice names


def parameters_schema(tool: dict) -> dict:
    return tool["function"].get("parameters") or EMPTY_PARAMETERS


def forced_call_constraint(choice: ToolChoice, tools: list[dict], parallel_tool_calls: bool) -> dict | None:
    """SamplingParams.structured_outputs for a forced call; None where the output is free."""
    if choice.mode == "function":
        tool = next(t for t in tools if t["function"]["name"] == choice.function)
        return {"json": parameters_schema(tool)}
    if choice.mode != "required":
        return None
    calls = [
        {
            "type": "object",
            "properties": {"name": {"type": "string", "enum": [t["function"]["name"]]}, "parameters": parameters_schema(t)},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not parallel_tool_calls:
        schema["maxItems"] = 1
    return {"json": schema}


class NamedFunctionReader:
    """The output of a "function" choice: all of it is that function's arguments, streamed
    as they come."""

    def __init__(self, name: str):
        self.name = name
        self._started = False

    def parse(self, text: str) -> ParsedOutput:
        return ParsedOutput(None, [ToolCall(self.name, text)])

    def feed(self, text: str) -> StreamDelta:
        if not text and self._started:
            return StreamDelta()
        delta = ToolCallDelta(0, None if self._started else self.name, text)
        self._started = True
        return StreamDelta(tool_calls=[delta])

    def finish(self) -> StreamDelta:
        return self.feed("")


class RequiredCallsReader:
    """The output of a "required" choice, a JSON array of calls: read whole, at its end
    (a call's arguments are only known to be complete with the array)."""

    def __init__(self):
        self._text = ""

    def parse(self, text: str) -> ParsedOutput:
        try:
            calls = json.loads(text)
        except ValueError:  # cut short by max_tokens: no call, the text is content
            return ParsedOutput(text or None, [])
        return ParsedOutput(None, [ToolCall(c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for c in calls])

    def feed(self, text: str) -> StreamDelta:
        self._text += text
        return StreamDelta()

    def finish(self) -> StreamDelta:
        parsed = self.parse(self._text)
        calls = [ToolCallDelta(i, c.name, c.arguments) for i, c in enumerate(parsed.tool_calls)]
        return StreamDelta(parsed.content or "", calls)


def output_reader(choice: ToolChoice, parser_name: str | None):
    """A factory of one reader per generated choice (parse / feed / finish), or None
    where the output is plain text."""
    if choice.mode == "auto":
        return lambda: tool_parser(parser_name)
    if choice.mode == "required":
        return RequiredCallsReader
    if choice.mode == "function":
        return lambda: NamedFunctionReader(choice.function)
    return None

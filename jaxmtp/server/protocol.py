"""The request bodies the server accepts (pydantic) and the errors it answers, both in
OpenAI's shapes."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, model_validator

from jaxmtp.loading.chat_template import conversation_of

# Counts and ids reach the device as int32: a larger value would overflow the batch
# array (and fail the step of every request in it), so it is refused here.
INT32_MAX = 2**31 - 1
DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default max_tokens of /v1/completions
TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]
Count = Annotated[int, Field(ge=1, le=INT32_MAX)]

# OpenAI fields the server does not implement, with what replaces them. A request that
# sets one gets a 400 naming it; the values that ask for nothing (null, and the listed
# ones) are accepted as if the field were absent.
NOT_SUPPORTED = {
    "functions": ("tools, which replace them", ([],)),
    "function_call": ("tools and tool_choice, which replace them", ("none",)),
}


def unsupported_field_message(name: str) -> str:
    """Why a field the request model does not have is refused."""
    if name in NOT_SUPPORTED:
        return f"{name} is not supported (use {NOT_SUPPORTED[name][0]})"
    return f"{name} is not a field this server implements"


class StrictModel(BaseModel):
    # a known field of the wrong type is an error ("5" is no int); an unknown field is
    # an error too (the server never ignores what a client asks); JSON's NaN and
    # Infinity are no numbers here
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


class StreamOptions(StrictModel):
    include_usage: bool = False
    continuous_usage_stats: bool = Field(False, description="vLLM's: with include_usage, every chunk's usage so far")


class JSONSchemaFormat(StrictModel):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = Field(None, description="accepted: the schema is always enforced")


class ResponseFormat(StrictModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StructuredOutputsFields(StrictModel):
    """vLLM's structured_outputs (extra_body); exactly one of them."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    # a JSON constraint's whitespace (jaxmtp.engine.structured_outputs.StructuredOutputsParams)
    disable_any_whitespace: bool | None = None
    whitespace_pattern: str | None = None


# the fields of GenerationFields that are SamplingParams' fields of the same name
SAMPLING_FIELDS = (
    "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos", "presence_penalty",
    "frequency_penalty", "repetition_penalty", "min_tokens", "bad_words", "allowed_token_ids",
    "include_stop_str_in_output", "skip_special_tokens",
)


class GenerationFields(StrictModel):
    """Fields both endpoints take; None means the default. Ranges are SamplingParams'."""

    model: str | None = None
    n: int = Field(1, ge=1, le=INT32_MAX, description="at most the server's --max-n")
    temperature: float | None = Field(None, ge=0, description="at most the server's --max-temperature")
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, le=INT32_MAX)
    min_p: float | None = Field(None, ge=0, le=1)
    seed: int | None = Field(None, ge=0, lt=2**63, description="choice j samples with seed + j, also < 2**63")
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    presence_penalty: float | None = Field(None, description="in [-2, 2]")
    frequency_penalty: float | None = Field(None, description="in [-2, 2]")
    repetition_penalty: float | None = Field(None, description="> 0; 1 changes nothing")
    logit_bias: dict[str, float] | None = Field(None, description="token id (a string, as OpenAI's) -> bias")
    min_tokens: int | None = Field(None, ge=0, le=INT32_MAX, description="at most max_tokens")
    bad_words: list[str] | None = None
    allowed_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    prompt_logprobs: int | None = Field(None, ge=0, le=INT32_MAX, description="vLLM's: each prompt token's and the top n")
    # structured outputs: OpenAI's response_format, vLLM's structured_outputs, or vLLM's
    # older guided_* fields; one of them at most
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsFields | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = Field(None, description="vLLM's: the whitespace a JSON constraint allows")
    # fields that describe the request and change nothing in the output: accepted
    user: str | None = Field(None, description="OpenAI's end-user id: accepted, and it changes nothing")
    safety_identifier: str | None = Field(None, description="OpenAI's: accepted, and it changes nothing")
    prompt_cache_key: str | None = Field(None, description="OpenAI's: accepted (the prefix cache needs no key)")
    metadata: dict[str, Any] | None = Field(None, description="OpenAI's: accepted, and it changes nothing")
    store: bool | None = Field(None, description="OpenAI's: accepted; this server stores no completions")
    service_tier: str | None = Field(None, description="OpenAI's: accepted; this server has one tier")
    request_id: str | None = Field(
        None, min_length=1, max_length=256, pattern=r"^[\x21-\x7e]+$",
        description="vLLM's: the response's id (after its prefix), echoed in X-Request-Id; printable ASCII",
    )
    return_token_ids: bool = Field(False, description="vLLM's: prompt_token_ids and each choice's token_ids")
    stream: bool = False
    stream_options: StreamOptions | None = None
    timeout: float | None = Field(
        None, gt=0, description="jaxmtp extension: seconds before the request is aborted (capped by --request-timeout)"
    )

    @model_validator(mode="before")
    @classmethod
    def _drop_what_asks_for_nothing(cls, data: Any) -> Any:
        if isinstance(data, dict):
            asks_nothing = {
                k for k, v in data.items() if k in NOT_SUPPORTED and v in (None, *NOT_SUPPORTED[k][1])
            }
            data = {k: v for k, v in data.items() if k not in asks_nothing}
        return data


class CompletionRequest(GenerationFields):
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    max_tokens: int | None = Field(
        DEFAULT_COMPLETION_TOKENS, ge=0, le=INT32_MAX,
        description="null: the rest of the context (vLLM's); 0 only with echo",
    )
    logprobs: int | None = Field(None, ge=0, le=INT32_MAX)
    echo: bool = Field(False, description="the prompt before the completion, with its logprobs when logprobs is set")


class TextPart(StrictModel):
    type: Literal["text"]
    text: str


class FunctionCall(StrictModel):
    name: str
    arguments: str = Field(description="a JSON object, as text")


class MessageToolCall(StrictModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(StrictModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = Field(None, description="passed to the chat template")
    tool_calls: list[MessageToolCall] | None = Field(None, description="an assistant's calls, for the chat template")
    tool_call_id: str | None = Field(None, description="the call a tool message answers")


class FunctionDefinition(StrictModel):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="a JSON schema of the arguments")
    strict: bool | None = Field(None, description="accepted: forced calls always follow the schema")


class ChatTool(StrictModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedToolChoice(StrictModel):
    class Function(StrictModel):
        name: str

    type: Literal["function"]
    function: Function


class ChatTemplateFields(StrictModel):
    """How messages become a prompt (vLLM's extensions)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = Field(False, description="the reply continues the last message (needs "
                                         "add_generation_prompt: false)")
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="more variables for the chat template")


class ChatCompletionRequest(GenerationFields, ChatTemplateFields):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="default: auto with tools (which needs --enable-auto-tool-choice), else none")
    parallel_tool_calls: bool = Field(True, description="false: at most one call")
    max_tokens: Count | None = Field(None, description="default: the rest of the context")
    max_completion_tokens: Count | None = Field(None, description="overrides max_tokens")
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=INT32_MAX)


class TokenizeRequest(ChatTemplateFields):
    """vLLM's /tokenize: a prompt, or messages rendered with the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool | None = Field(
        None, description="add BOS and the like to a prompt (default: true); messages get the template's own"
    )
    tools: list[dict[str, Any]] | None = Field(None, description="rendered with messages, as the chat template does")


class DetokenizeRequest(StrictModel):
    model: str | None = None
    tokens: list[TokenId]


ERROR_TYPES = {408: "timeout_error", 429: "rate_limit_error", 500: "server_error", 503: "server_error"}


class APIError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.body = {
            "error": {
                "message": message,
                "type": ERROR_TYPES.get(status, "invalid_request_error"),
                "param": param,
                "code": code,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body, status_code=self.status)


def bad_request(err: ValueError, body: type[BaseModel], prompt_field: str = "prompt") -> APIError:
    """An engine ValueError as a 400; its message starts with the parameter it is about."""
    message = str(err)
    param = re.split(r"[ :.\[]", message, maxsplit=1)[0]  # "messages[1].tool_calls: ..." is about messages
    if param == "prompt":
        param = prompt_field
    return APIError(400, message, param=param if param in body.model_fields else None)


def check_text(text: str, field: str) -> None:
    """A 400 naming `field` if `text` holds a lone surrogate (JSON's "\\ud800"), which no
    tokenizer can encode and no response can carry."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise APIError(
            400, f"{field} is not valid Unicode: a lone surrogate {text[err.start]!a} at character {err.start}",
            param=field,
        ) from None


def prompt_list(prompt: str | list) -> list[str | list[int]]:
    """OpenAI's prompt forms (a string, strings, token ids, lists of token ids) as a list."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        return [prompt]
    if not prompt:
        raise ValueError("prompt is empty")
    return list(prompt)


def check_prompt_texts(prompts: list[str | list[int]]) -> None:
    for prompt in prompts:
        if isinstance(prompt, str):
            check_text(prompt, "prompt")


def chat_conversation(messages: list[ChatMessage]) -> list[dict]:
    """The messages as the chat template reads them: text parts joined into one string."""
    conversation = conversation_of([message.model_dump(exclude_none=True) for message in messages])
    for turn in conversation:
        for text in (turn.get("content"), turn.get("name")):
            check_text(text or "", "messages")
    return conversation


def logit_bias_ids(logit_bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's logit_bias (token ids as JSON's string keys) with int keys."""
    if logit_bias is None:
        return None
    bad = [key for key in logit_bias if not re.fullmatch("[0-9]{1,10}", key)]
    if bad:
        raise APIError(400, f"logit_bias: keys must be token ids (decimal integers), got {bad[0]!r}", "logit_bias")
    return {int(key): bias for key, bias in logit_bias.items()}


GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def structured_outputs_of(body: GenerationFields) -> dict | None:
    """The request's constraint as SamplingParams.structured_outputs takes it, from
    whichever field gave it; two fields giving one are a 400 naming both."""
    given = {}
    fmt = body.response_format
    if fmt is not None and fmt.type == "json_object":
        given["response_format"] = {"json_object": True}
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise APIError(400, "response_format of type json_schema needs json_schema.schema", "response_format")
        given["response_format"] = {"json": fmt.json_schema.schema_}
    if body.structured_outputs is not None:
        fields = body.structured_outputs.model_dump(by_alias=True, exclude_none=True)
        given["structured_outputs"] = {k: v for k, v in fields.items() if v is not False}
    for name, kind in GUIDED.items():
        if getattr(body, name) is not None:
            given[name] = {kind: getattr(body, name)}
    if len(given) > 1:
        raise APIError(400, f"one constraint at most: {', '.join(given)} each give one", next(iter(given)))
    constraint = next(iter(given.values()), None)
    if body.guided_whitespace_pattern is not None:
        if constraint is None or not ({"json", "json_object"} & constraint.keys()):
            raise APIError(400, "guided_whitespace_pattern applies to a JSON constraint (guided_json, response_format)",
                           "guided_whitespace_pattern")
        constraint = {**constraint, "whitespace_pattern": body.guided_whitespace_pattern}
    return constraint

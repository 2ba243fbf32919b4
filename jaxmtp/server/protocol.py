"""The request bodies the server accepts (pydantic) and the errors it answers, both in
OpenAI's shapes."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

# Counts and ids reach the device as int32: a larger value would overflow the batch
# array (and fail the step of every request in it), so it is refused here.
INT32_MAX = 2**31 - 1
DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default max_tokens of /v1/completions
TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]
Count = Annotated[int, Field(ge=1, le=INT32_MAX)]


class StrictModel(BaseModel):
    # a known field of the wrong type is an error ("5" is no int); unknown fields are
    # ignored; JSON's NaN and Infinity are no numbers here
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class StreamOptions(StrictModel):
    include_usage: bool = False


class GenerationFields(StrictModel):
    """Fields both endpoints take; None means the default."""

    model: str | None = None
    n: int = Field(1, ge=1, le=INT32_MAX, description="at most the server's --max-n")
    temperature: float | None = Field(None, ge=0, description="at most the server's --max-temperature")
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, le=INT32_MAX)
    min_p: float | None = Field(None, ge=0, le=1)
    seed: int | None = Field(None, ge=0, lt=2**63, description="choice j samples with seed + j, also < 2**63")
    stop: str | list[str] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    timeout: float | None = Field(
        None, gt=0, description="jaxmtp extension: seconds before the request is aborted (capped by --request-timeout)"
    )


class CompletionRequest(GenerationFields):
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    max_tokens: Count | None = Field(DEFAULT_COMPLETION_TOKENS, description=f"null: {DEFAULT_COMPLETION_TOKENS}")
    logprobs: int | None = Field(None, ge=0, le=INT32_MAX)


class TextPart(StrictModel):
    type: Literal["text"]
    text: str


class ChatMessage(StrictModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None


class ChatCompletionRequest(GenerationFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Count | None = Field(None, description="default: the rest of the context")
    max_completion_tokens: Count | None = Field(None, description="overrides max_tokens")
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=INT32_MAX)


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
    param = message.split(" ", 1)[0]
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
    conversation = []
    for message in messages:
        content = message.content or ""
        if not isinstance(content, str):
            content = "".join(part.text for part in content)
        check_text(content, "messages")
        conversation.append({"role": message.role, "content": content})
    return conversation

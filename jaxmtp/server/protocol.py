"""The request bodies the server accepts (pydantic) and the errors it answers, both in
OpenAI's shapes."""

from __future__ import annotations

from typing import Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

MAX_N = 128  # OpenAI's limit on n


class StrictModel(BaseModel):
    # a known field of the wrong type is an error ("5" is no int); unknown fields are ignored
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(StrictModel):
    include_usage: bool = False


class GenerationFields(StrictModel):
    """Fields both endpoints take; None means the default."""

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    timeout: float | None = Field(
        None, gt=0, description="jaxmtp extension: seconds before the request is aborted (capped by --request-timeout)"
    )


class CompletionRequest(GenerationFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0)


class TextPart(StrictModel):
    type: Literal["text"]
    text: str


class ChatMessage(StrictModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None


class ChatCompletionRequest(GenerationFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, description="default: the rest of the context")
    max_completion_tokens: int | None = Field(None, ge=1, description="overrides max_tokens")
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0)


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


def prompt_list(prompt: str | list) -> list[str | list[int]]:
    """OpenAI's prompt forms (a string, strings, token ids, lists of token ids) as a list."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        return [prompt]
    if not prompt:
        raise ValueError("prompt is empty")
    return list(prompt)


def chat_conversation(messages: list[ChatMessage]) -> list[dict]:
    """The messages as the chat template reads them: text parts joined into one string."""
    conversation = []
    for message in messages:
        content = message.content or ""
        if not isinstance(content, str):
            content = "".join(part.text for part in content)
        conversation.append({"role": message.role, "content": content})
    return conversation

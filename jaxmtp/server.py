"""OpenAI-compatible HTTP server over one LLMEngine (`python server.py`, `jaxmtp serve`).

One engine thread runs engine.step() for every request the server holds (continuous
batching) and sleeps on an Event when there is no work. The asyncio event loop never
waits on a device step: the engine thread hands each step's outputs to the loop with
call_soon_threadsafe, and the loop routes them to per-request asyncio queues.

Each choice of a response (every prompt times n) is its own engine request, so each
has its own finish reason, speculative-decoding stats and abort.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import hmac
import json
import logging
import os
import threading
import time
import uuid
from pathlib import Path
from typing import Literal

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from pydantic import BaseModel, ConfigDict, Field
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException

from jaxmtp.cli import add_engine_args, engine_kwargs
from jaxmtp.outputs import RequestOutput
from jaxmtp.sampling_params import SamplingParams

log = logging.getLogger("jaxmtp.server")

MAX_N = 128  # OpenAI's limit on n


# ----- request bodies ---------------------------------------------------------------------


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


# ----- errors -------------------------------------------------------------------------------

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


# ----- the engine thread ------------------------------------------------------------------


class EngineLoop:
    """Steps the engine on its own thread and hands the outputs to the asyncio loop,
    which puts them on the queue of their engine request. Only the asyncio loop's thread
    touches the queues."""

    def __init__(self, engine, metrics: Metrics):
        self.engine = engine
        self.metrics = metrics
        self._queues: dict[str, asyncio.Queue] = {}
        self._wake = threading.Event()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread.start()

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        self._thread.join()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def add(self, request_id: str, prompt_ids: list[int], params: SamplingParams, queue: asyncio.Queue) -> None:
        self.engine.add_request(request_id, prompt_ids, params)
        self._queues[request_id] = queue
        self._wake.set()

    def abort(self, request_id: str) -> None:
        """Stop an unfinished request; its pages are freed at the start of the next step."""
        if self._queues.pop(request_id, None) is not None:
            self.engine.abort_request(request_id)
            self._wake.set()

    def _run(self) -> None:
        while not self._stopping:
            self._wake.wait()
            self._wake.clear()  # anything added before this is seen by the check below
            while self.engine.has_unfinished_requests() and not self._stopping:
                self._step()

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception:
            # The loop must outlive a failed step: fail what is in flight, keep serving.
            log.exception("engine step failed; failing the requests in flight")
            for request_id in list(self.engine.requests):
                self.engine.abort_request(request_id)  # before the next step can fail on them again
            self._loop.call_soon_threadsafe(self._fail_all)
            return
        for out in outputs:
            if out.finished:
                for completion in out.outputs:
                    self.metrics.requests_finished.labels(completion.finish_reason).inc()
        if outputs:
            self._loop.call_soon_threadsafe(self._deliver, outputs)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            queue = self._queues.get(out.request_id)
            if queue is None:  # aborted: nobody is listening
                continue
            if out.finished:
                del self._queues[out.request_id]
            queue.put_nowait(out)

    def _fail_all(self) -> None:
        # every request still listening, also one the failed step finished but never reported
        for request_id, queue in self._queues.items():
            self.engine.abort_request(request_id)
            queue.put_nowait(APIError(500, "the engine step failed (see the server log)"))
        self._queues.clear()
        self._wake.set()


# ----- metrics ------------------------------------------------------------------------------


class EngineCollector:
    """Engine gauges and counters, read at scrape time."""

    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        engine, stats = self.engine, self.engine.stats
        free = engine.allocator.num_free
        yield GaugeMetricFamily("jaxmtp_requests_running", "Requests being computed.", value=engine.num_running)
        yield GaugeMetricFamily("jaxmtp_requests_waiting", "Requests waiting to be admitted.", value=engine.num_waiting)
        yield GaugeMetricFamily("jaxmtp_kv_pages_used", "KV cache pages in use.", value=engine.allocator.num_pages - free)
        yield GaugeMetricFamily("jaxmtp_kv_pages_free", "KV cache pages free.", value=free)
        yield CounterMetricFamily("jaxmtp_prompt_tokens", "Prompt tokens of admitted requests.", value=stats.prompt_tokens)
        yield CounterMetricFamily("jaxmtp_generation_tokens", "Generated tokens.", value=stats.generation_tokens)
        yield CounterMetricFamily("jaxmtp_spec_decode_draft_tokens", "Draft tokens proposed.", value=stats.spec.drafted)
        yield CounterMetricFamily("jaxmtp_spec_decode_accepted_tokens", "Draft tokens accepted.", value=stats.spec.accepted)
        per_position = CounterMetricFamily(
            "jaxmtp_spec_decode_accepted_tokens_per_position",
            "Draft tokens accepted, by draft position (0 is the first draft).",
            labels=["position"],
        )
        for position, count in enumerate(list(stats.spec.accepted_per_position)):
            per_position.add_metric([str(position)], count)
        yield per_position
        cache = stats.prefix_cache
        yield CounterMetricFamily("jaxmtp_prefix_cache_queries", "Tokens looked up in the prefix cache.", value=cache.queries)
        yield CounterMetricFamily("jaxmtp_prefix_cache_hits", "Looked-up tokens whose KV was reused.", value=cache.hits)
        yield GaugeMetricFamily("jaxmtp_prefix_cache_hit_rate", "Prefix cache hits / queries so far.", value=cache.hit_rate)
        yield CounterMetricFamily("jaxmtp_prefix_cache_evictions", "Cached KV pages evicted.", value=cache.evictions)


class Metrics:
    """Prometheus metrics in a registry of their own."""

    def __init__(self, engine):
        self.registry = CollectorRegistry()
        self.registry.register(EngineCollector(engine))
        self.time_to_first_token = Histogram(
            "jaxmtp_time_to_first_token_seconds", "From arrival to the first generated token of a choice.",
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60), registry=self.registry,
        )
        self.inter_token_latency = Histogram(
            "jaxmtp_inter_token_latency_seconds", "Between generated tokens of a choice.",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5), registry=self.registry,
        )
        self.requests_finished = Counter(
            "jaxmtp_requests_finished", "Engine requests (one per choice) that finished, by reason.",
            ["finish_reason"], registry=self.registry,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)


# ----- one HTTP request's generation ------------------------------------------------------


@dataclasses.dataclass
class Choice:
    """One choice of a response, generated by one engine request."""

    index: int
    request_id: str
    stop_holdback: int  # characters a stop string could still cut: not streamed yet
    text: str = ""
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None
    spec_stats: dict | None = None
    streamed_chars: int = 0
    streamed_tokens: int = 0
    last_token_time: float | None = None

    def update(self, out: RequestOutput, arrival: float, metrics: Metrics) -> None:
        completion = out.outputs[0]
        now = time.monotonic()
        new_tokens = len(completion.token_ids) - len(self.token_ids)
        if new_tokens > 0:
            if self.last_token_time is None:
                metrics.time_to_first_token.observe(now - arrival)
            else:  # a step's tokens (speculation accepts several) share its wait
                for _ in range(new_tokens):
                    metrics.inter_token_latency.observe((now - self.last_token_time) / new_tokens)
            self.last_token_time = now
        self.text, self.token_ids, self.logprobs = completion.text, completion.token_ids, completion.logprobs
        self.finish_reason = completion.finish_reason
        self.spec_stats = out.spec_stats

    def take_delta(self) -> tuple[str, int, bool]:
        """The text and tokens not streamed yet: (text, first new token, done). While
        unfinished, hold back what a stop string or an incomplete UTF-8 character could
        still change, so that streamed text equals the final text."""
        done = self.finish_reason is not None
        end = len(self.text)
        if not done:
            end = max(self.streamed_chars, end - self.stop_holdback)
            while end > self.streamed_chars and self.text[end - 1] == "\ufffd":
                end -= 1
        text, self.streamed_chars = self.text[self.streamed_chars : end], end
        first_token, self.streamed_tokens = self.streamed_tokens, len(self.token_ids)
        return text, first_token, done


class Generation:
    """The choices of one HTTP request, each an engine request reporting to one queue."""

    def __init__(self, server: Server, prompts: list[list[int]], params: SamplingParams, n: int, timeout: float | None):
        self.server = server
        self.created = int(time.time())
        self.arrival = time.monotonic()
        self.timeout = min(timeout or server.request_timeout, server.request_timeout)
        self.prompt_tokens = sum(len(p) for p in prompts)
        self.queue: asyncio.Queue = asyncio.Queue()
        holdback = max((len(s) for s in params.stop), default=1) - 1
        self.choices = [
            Choice(index=i * n + j, request_id=f"{uuid.uuid4().hex}-{i * n + j}", stop_holdback=holdback)
            for i in range(len(prompts))
            for j in range(n)
        ]
        self._by_request_id = {c.request_id: c for c in self.choices}
        try:
            for i, prompt in enumerate(prompts):
                for j in range(n):
                    # the engine's own seeding for n > 1: sample j of a request uses seed + j
                    seed = None if params.seed is None else params.seed + j
                    choice_params = dataclasses.replace(params, seed=seed)
                    server.engine_loop.add(self.choices[i * n + j].request_id, prompt, choice_params, self.queue)
        except ValueError:
            self.cancel()
            raise

    @property
    def unfinished(self) -> bool:
        return any(c.finish_reason is None for c in self.choices)

    @property
    def completion_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.choices)

    def usage(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }

    async def next_update(self) -> Choice | None:
        """The choice that the next engine output advanced; None once the timeout passed."""
        remaining = self.arrival + self.timeout - time.monotonic()
        try:
            item = await asyncio.wait_for(self.queue.get(), max(remaining, 0))
        except TimeoutError:
            return None
        if isinstance(item, APIError):
            raise item
        if item.error:
            log.error("the engine failed request %s: %s", item.request_id, item.error)
            raise APIError(500, f"the engine failed this request: {item.error}")
        choice = self._by_request_id[item.request_id]
        choice.update(item, self.arrival, self.server.metrics)
        return choice

    async def run_to_end(self) -> None:
        try:
            while self.unfinished:
                if await self.next_update() is None:
                    raise APIError(408, f"request timed out after {self.timeout:g} s", code="timeout")
        finally:
            self.cancel()

    def cancel(self) -> list[Choice]:
        """Abort the unfinished choices (client gone, timeout, error); returns them."""
        cancelled = [c for c in self.choices if c.finish_reason is None]
        for choice in cancelled:
            self.server.engine_loop.abort(choice.request_id)
            choice.finish_reason = "abort"
        return cancelled


# ----- response shapes ----------------------------------------------------------------------


def token_text(tokenizer, previous: list[int], token: int) -> str:
    """The text `token` adds after `previous`, special tokens included."""
    return tokenizer.decode_continuation(previous, [token], skip_special_tokens=False)


def top_entries(entry: dict[int, float], n: int) -> list[tuple[int, float]]:
    # the engine's entry is the chosen token first, then the top n not already in it
    return sorted(entry.items(), key=lambda item: -item[1])[:n]


class CompletionFormat:
    object = chunk_object = "text_completion"
    id_prefix = "cmpl-"

    def __init__(self, tokenizer, num_logprobs: int | None):
        self.tokenizer = tokenizer
        self.num_logprobs = num_logprobs

    def choice(self, choice: Choice, text: str, first_token: int, done: bool, streaming: bool) -> dict:
        body = {"index": choice.index, "text": text, "logprobs": self.logprobs(choice, first_token)}
        return self.finish(body, choice, done)

    def finish(self, body: dict, choice: Choice, done: bool) -> dict:
        body["finish_reason"] = choice.finish_reason if done else None
        if done and choice.spec_stats is not None:
            body["spec_stats"] = choice.spec_stats
        return body

    def opening(self, choice: Choice) -> dict | None:
        return None

    def logprobs(self, choice: Choice, first_token: int) -> dict | None:
        if self.num_logprobs is None or choice.logprobs is None:
            return None
        ids = choice.token_ids
        result = {"tokens": [], "token_logprobs": [], "top_logprobs": []}
        for position in range(first_token, len(choice.logprobs)):
            entry, previous = choice.logprobs[position], ids[:position]
            result["tokens"].append(token_text(self.tokenizer, previous, ids[position]))
            result["token_logprobs"].append(entry[ids[position]])
            result["top_logprobs"].append(
                {token_text(self.tokenizer, previous, t): lp for t, lp in top_entries(entry, self.num_logprobs)}
            )
        return result


class ChatFormat(CompletionFormat):
    object, chunk_object = "chat.completion", "chat.completion.chunk"
    id_prefix = "chatcmpl-"

    def choice(self, choice: Choice, text: str, first_token: int, done: bool, streaming: bool) -> dict:
        message = {"content": text} if streaming else {"role": "assistant", "content": text}
        body = {"index": choice.index, "delta" if streaming else "message": message}
        body["logprobs"] = self.logprobs(choice, first_token)
        return self.finish(body, choice, done)

    def opening(self, choice: Choice) -> dict:
        delta = {"role": "assistant", "content": ""}
        return {"index": choice.index, "delta": delta, "logprobs": None, "finish_reason": None}

    def logprobs(self, choice: Choice, first_token: int) -> dict | None:
        if self.num_logprobs is None or choice.logprobs is None:
            return None
        ids, content = choice.token_ids, []
        for position in range(first_token, len(choice.logprobs)):
            entry, previous = choice.logprobs[position], ids[:position]
            token = token_text(self.tokenizer, previous, ids[position])
            top = []
            for t, lp in top_entries(entry, self.num_logprobs):
                text = token_text(self.tokenizer, previous, t)
                top.append({"token": text, "logprob": lp, "bytes": list(text.encode())})
            content.append(
                {"token": token, "logprob": entry[ids[position]], "bytes": list(token.encode()), "top_logprobs": top}
            )
        return {"content": content}


def sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


# ----- the server ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    api_key: str | None = None
    max_waiting: int = 256
    request_timeout: float = 600.0
    max_body_bytes: int = 1 << 20


class Server:
    """The state the routes share: the engine, its loop, metrics, limits."""

    def __init__(self, engine, model: str, config: ServerConfig):
        self.engine = engine
        self.model_id = Path(model).resolve().name
        self.model_names = {self.model_id, model, str(Path(model).resolve())}
        self.max_waiting = config.max_waiting
        self.request_timeout = config.request_timeout
        self.metrics = Metrics(engine)
        self.engine_loop = EngineLoop(engine, self.metrics)

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.model_names:
            raise APIError(
                404, f"model {name!r} does not exist; this server serves {self.model_id!r}",
                param="model", code="model_not_found",
            )

    def sampling_params(self, body: GenerationFields, max_tokens: int, logprobs: int | None) -> SamplingParams:
        given = dict(
            max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
            min_p=body.min_p, seed=body.seed, stop=body.stop, logprobs=logprobs,
        )
        return SamplingParams(ignore_eos=body.ignore_eos, **{k: v for k, v in given.items() if v is not None})

    def submit(self, body: GenerationFields, prompts: list[list[int]], params: SamplingParams) -> Generation:
        for prompt in prompts:
            self.engine.validate(prompt, params)
        waiting, new = self.engine.num_waiting, len(prompts) * body.n
        if waiting + new > self.max_waiting:
            raise APIError(
                429, f"the server is busy: {waiting} requests are waiting and this one adds {new} "
                f"(limit {self.max_waiting}); retry later", code="too_many_waiting_requests",
            )
        return Generation(self, prompts, params, body.n, body.timeout)

    async def respond(
        self, request: Request, generation: Generation, fmt: CompletionFormat, body: GenerationFields
    ) -> Response:
        header = {"id": fmt.id_prefix + uuid.uuid4().hex, "created": generation.created, "model": self.model_id}
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            return StreamingResponse(self.stream(generation, fmt, header, include_usage), media_type="text/event-stream")
        if not await finished_before_disconnect(request, generation.run_to_end()):
            return Response(status_code=499)  # nobody is there to read it
        choices = [fmt.choice(c, c.text, 0, True, False) for c in generation.choices]
        return JSONResponse({**header, "object": fmt.object, "choices": choices, "usage": generation.usage()})

    async def stream(self, generation: Generation, fmt: CompletionFormat, header: dict, include_usage: bool):
        """SSE chunks, one choice each. A client that disconnects cancels this generator,
        and `finally` aborts its engine requests."""
        header = {**header, "object": fmt.chunk_object}
        try:
            for choice in generation.choices:
                opening = fmt.opening(choice)
                if opening:
                    yield sse({**header, "choices": [opening]})
            while generation.unfinished:
                choice = await generation.next_update()
                if choice is None:  # timed out: the open choices end with finish_reason "abort"
                    for cancelled in generation.cancel():
                        yield sse({**header, "choices": [fmt.choice(cancelled, *cancelled.take_delta(), True)]})
                    break
                text, first_token, done = choice.take_delta()
                new_logprobs = fmt.num_logprobs is not None and first_token < len(choice.token_ids)
                if text or done or new_logprobs:
                    yield sse({**header, "choices": [fmt.choice(choice, text, first_token, done, True)]})
            if include_usage:
                yield sse({**header, "choices": [], "usage": generation.usage()})
        except APIError as err:  # the status line has gone out: the error goes in the stream
            yield sse(err.body)
        finally:
            generation.cancel()
        yield sse("[DONE]")


async def finished_before_disconnect(request: Request, work) -> bool:
    """Run `work`; if the client disconnects first, cancel it (which aborts its engine
    requests) and return False."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(client_gone(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
    if task.cancelled():
        return False
    task.result()  # raises the work's error
    return True


async def client_gone(request: Request) -> None:
    # the body has been read, so the next message is the disconnect
    while (await request.receive())["type"] != "http.disconnect":
        pass


class RequestGate:
    """ASGI middleware run before routing: checks the API key of /v1 requests (so a
    request without it gets 401 whatever its body) and caps the body size."""

    def __init__(self, app, api_key: str | None, max_body_bytes: int):
        self.app = app
        self.expected_authorization = f"Bearer {api_key}".encode() if api_key else None
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = Headers(scope=scope)
        if self.expected_authorization and scope["path"].startswith("/v1"):
            given = headers.get("authorization", "").encode()
            if not hmac.compare_digest(given, self.expected_authorization):
                message = "missing or wrong API key: send 'Authorization: Bearer <key>'"
                error = APIError(401, message, code="invalid_api_key")
                return await error.response()(scope, receive, send)
        too_large = APIError(413, f"request body over {self.max_body_bytes} bytes", code="request_too_large")
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > self.max_body_bytes:
            return await too_large.response()(scope, receive, send)
        received = 0

        async def receive_limited():  # for bodies sent without a Content-Length
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_body_bytes:
                raise HTTPException(413, str(too_large))
            return message

        await self.app(scope, receive_limited, send)


def create_app(engine, model: str, config: ServerConfig = ServerConfig()) -> FastAPI:
    """The FastAPI app serving `engine` (loaded and warmed up) under the name of `model`."""
    server = Server(engine, model, config)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        server.engine_loop.start()
        yield
        server.engine_loop.stop()

    app = FastAPI(title="jaxmtp", summary="OpenAI-compatible completions on a jaxmtp engine", lifespan=lifespan)
    app.add_middleware(RequestGate, api_key=config.api_key, max_body_bytes=config.max_body_bytes)

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, err: APIError):
        return err.response()

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, err: RequestValidationError):
        # OpenAI answers 400 where FastAPI would answer 422
        errors = err.errors()
        if errors[0]["type"] == "json_invalid":
            return APIError(400, f"invalid JSON: {errors[0]['ctx']['error']}").response()
        # a value that fits none of a union's forms gets an error per form: name a few
        problems = [f"{'.'.join(str(p) for p in e['loc'][1:]) or 'body'}: {e['msg']}" for e in errors[:3]]
        field = errors[0]["loc"][1] if len(errors[0]["loc"]) > 1 else None
        return APIError(400, "; ".join(problems), param=field if isinstance(field, str) else None).response()

    @app.exception_handler(HTTPException)
    async def on_http_error(request: Request, err: HTTPException):
        code = "request_too_large" if err.status_code == 413 else None
        return APIError(err.status_code, str(err.detail), code=code).response()

    @app.exception_handler(Exception)
    async def on_unexpected_error(request: Request, err: Exception):
        log.exception("unexpected error")
        return APIError(500, f"internal error: {type(err).__name__}").response()

    @app.get("/health")
    async def health():
        if not server.engine_loop.alive:
            raise APIError(503, "the engine thread has stopped")
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(server.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [{
                "id": server.model_id, "object": "model", "created": 0, "owned_by": "jaxmtp",
                "root": str(engine.model_dir), "max_model_len": engine.max_model_len,
            }],
        }

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        server.check_model(body.model)
        try:
            prompts = [engine.encode_prompt(p)[1] for p in prompt_list(body.prompt)]
            params = server.sampling_params(body, body.max_tokens, body.logprobs)
            generation = server.submit(body, prompts, params)
        except ValueError as err:
            raise bad_request(err, CompletionRequest) from None
        return await server.respond(request, generation, CompletionFormat(engine.tokenizer, body.logprobs), body)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        server.check_model(body.model)
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        if engine.tokenizer is None:
            raise APIError(400, f"{engine.model_dir!s} has no tokenizer.json, so no chat template")
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        try:
            prompt = chat_prompt_ids(engine.tokenizer, body.messages)
            # by default a reply may fill the context; a prompt that already does gets the context error
            max_tokens = body.max_completion_tokens or body.max_tokens or max(1, engine.max_model_len - len(prompt))
            params = server.sampling_params(body, max_tokens, logprobs)
            generation = server.submit(body, [prompt], params)
        except ValueError as err:
            raise bad_request(err, ChatCompletionRequest, prompt_field="messages") from None
        return await server.respond(request, generation, ChatFormat(engine.tokenizer, logprobs), body)

    return app


def prompt_list(prompt: str | list) -> list[str | list[int]]:
    """OpenAI's prompt forms (a string, strings, token ids, lists of token ids) as a list."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        return [prompt]
    if not prompt:
        raise ValueError("prompt is empty")
    return list(prompt)


def chat_prompt_ids(tokenizer, messages: list[ChatMessage]) -> list[int]:
    conversation = []
    for message in messages:
        content = message.content or ""
        if not isinstance(content, str):
            content = "".join(part.text for part in content)
        conversation.append({"role": message.role, "content": content})
    # the template writes its own special tokens (BOS), so none are added on encoding
    return tokenizer.encode(tokenizer.apply_chat_template(conversation), add_special_tokens=False)


# ----- command line -------------------------------------------------------------------------


def add_server_args(parser: argparse.ArgumentParser) -> None:
    add_engine_args(parser)
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s, this machine only)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--api-key", default=os.environ.get("JAXMTP_API_KEY"),
        help="require 'Authorization: Bearer KEY' on /v1 (default: $JAXMTP_API_KEY, else none)",
    )
    parser.add_argument("--max-waiting", type=int, default=256, help="waiting requests beyond which new ones get 429")
    parser.add_argument("--request-timeout", type=float, default=600.0, help="seconds before a request is aborted")
    parser.add_argument("--max-body-bytes", type=int, default=1 << 20, help="larger request bodies get 413")
    parser.add_argument(
        "--compilation-cache-dir", default=str(Path.home() / ".cache" / "jaxmtp" / "xla"),
        help="persistent XLA cache, so that later starts skip compiling ('' to disable; default: %(default)s)",
    )
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def serve(args: argparse.Namespace) -> int:
    import jax

    from jaxmtp.engine import LLMEngine

    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log.setLevel(args.log_level.upper())
    for name in ("max_waiting", "request_timeout", "max_body_bytes"):
        if getattr(args, name) <= 0:
            raise ValueError(f"{name} must be > 0, got {getattr(args, name)}")
    if args.compilation_cache_dir:
        jax.config.update("jax_compilation_cache_dir", args.compilation_cache_dir)
    engine = LLMEngine(args.model, **engine_kwargs(args))
    start = time.monotonic()
    shapes = engine.warmup()  # compile every batch shape before the port opens
    log.info("compiled the step for %d batch shapes in %.1f s", shapes, time.monotonic() - start)
    config = ServerConfig(args.api_key or None, args.max_waiting, args.request_timeout, args.max_body_bytes)
    app = create_app(engine, args.model, config)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=5)
    return 0

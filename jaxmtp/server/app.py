"""The FastAPI app: the state the routes share (Server) and the routes."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import uuid
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException

from jaxmtp.sampling_params import SamplingParams
from jaxmtp.server.config import ServerConfig
from jaxmtp.server.engine_loop import EngineLoop
from jaxmtp.server.formatting import ChatFormat, CompletionFormat, sse
from jaxmtp.server.gate import RequestGate
from jaxmtp.server.generation import Generation
from jaxmtp.server.metrics import Metrics
from jaxmtp.server.protocol import (
    APIError, ChatCompletionRequest, CompletionRequest, GenerationFields, bad_request, chat_conversation, prompt_list,
)

log = logging.getLogger("jaxmtp.server")


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
        timeout = min(body.timeout or self.request_timeout, self.request_timeout)
        return Generation(self.engine_loop, self.metrics, prompts, params, body.n, timeout)

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
            # the template writes its own special tokens (BOS), so none are added on encoding
            text = engine.tokenizer.apply_chat_template(chat_conversation(body.messages))
            prompt = engine.tokenizer.encode(text, add_special_tokens=False)
            # by default a reply may fill the context; a prompt that already does gets the context error
            max_tokens = body.max_completion_tokens or body.max_tokens or max(1, engine.max_model_len - len(prompt))
            params = server.sampling_params(body, max_tokens, logprobs)
            generation = server.submit(body, [prompt], params)
        except ValueError as err:
            raise bad_request(err, ChatCompletionRequest, prompt_field="messages") from None
        return await server.respond(request, generation, ChatFormat(engine.tokenizer, logprobs), body)

    return app

"""The FastAPI app and its routes. Tokenisation and validation of a request run on a
worker thread, so that a long prompt does not stall the event loop (and with it every
stream and /health) while the tokenizer releases the GIL."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException

import jaxmtp
from jaxmtp.engine.sampling_params import SamplingParams
from jaxmtp.server.config import ServerConfig
from jaxmtp.server.formatting import ChatFormat, CompletionFormat, EchoFormat
from jaxmtp.server.gate import RequestGate
from jaxmtp.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    bad_request,
    check_prompt_texts,
    prompt_list,
    unsupported_field_message,
)
from jaxmtp.server.serving import Server
from jaxmtp.server.stats_log import StatsLogger
from jaxmtp.server.tokenization import add_tokenization_routes
from jaxmtp.server.tool_choice import forced_call_constraint, output_reader

log = logging.getLogger("jaxmtp.server")

HEALTH_GENERATE_TIMEOUT = 30.0  # seconds /health_generate waits for its token


def create_app(engine, model: str, config: ServerConfig = ServerConfig()) -> FastAPI:
    """The FastAPI app serving `engine` (loaded and warmed up) under the name of `model`
    (or config.served_model_name); app.state.server is its Server."""
    server = Server(engine, model, config)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        server.engine_loop.start()
        stats_log = None
        if not config.disable_log_stats:
            stats_log = asyncio.create_task(StatsLogger(engine, config.log_stats_interval).run())
        yield
        if stats_log is not None:
            stats_log.cancel()
        server.engine_loop.stop()

    app = FastAPI(title="jaxmtp", summary="OpenAI-compatible completions on a jaxmtp engine", lifespan=lifespan)
    app.state.server = server
    app.add_middleware(
        RequestGate, api_keys=config.api_key, max_body_bytes=config.max_body_bytes, public_metrics=config.public_metrics
    )
    # outside the gate, so that a browser's preflight (OPTIONS, which carries no key) is
    # answered, as vLLM's is
    app.add_middleware(
        CORSMiddleware, allow_origins=config.allowed_origins or ["*"], allow_methods=config.allowed_methods or ["*"],
        allow_headers=config.allowed_headers or ["*"], allow_credentials=config.allow_credentials,
    )

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, err: APIError):
        return err.response()

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, err: RequestValidationError):
        # OpenAI answers 400 where FastAPI would answer 422
        errors = err.errors()
        if errors[0]["type"] == "json_invalid":
            return APIError(400, f"invalid JSON: {errors[0]['ctx']['error']}").response()
        # a field the server does not implement is refused, named, before anything else
        unsupported = [e["loc"][1:] for e in errors if e["type"] == "extra_forbidden"]
        if unsupported:
            message = "; ".join(unsupported_field_message(".".join(map(str, loc))) for loc in unsupported)
            return APIError(400, message, param=str(unsupported[0][0])).response()
        # a value that fits none of a union's forms gets an error per form: name a few,
        # a wrong value (out of range) before a wrong type, as its form is the one meant
        errors = sorted(errors, key=lambda e: e["type"].endswith("_type"))
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

    def bad(err: ValueError, body_type, prompt_field: str = "prompt") -> APIError:
        error = bad_request(err, body_type, prompt_field)
        error.body["error"]["message"] = server.public(error.body["error"]["message"])
        return error

    @app.get("/health")
    async def health():
        reason = server.unhealthy()
        if reason is not None:
            raise APIError(503, reason, code="service_unavailable")
        return {"status": "ok"}

    @app.get("/health_generate")
    async def health_generate():
        """/health, and the engine generates one token (as SGLang's /health_generate)."""
        await health()
        params = SamplingParams(max_tokens=1, temperature=0.0)
        generation = server.start([[0]], params, 1, min(HEALTH_GENERATE_TIMEOUT, config.request_timeout))
        try:
            await generation.run_to_end()
        except APIError as err:
            raise APIError(503, f"the engine could not generate a token: {err}", code="service_unavailable") from None
        finally:
            server.generations.discard(generation)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(server.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def version():
        return {"version": jaxmtp.__version__}

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [{
                "id": name, "object": "model", "created": 0, "owned_by": "jaxmtp",
                "root": server.model_id, "max_model_len": engine.max_model_len,
            } for name in server.listed_names],
        }

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        server.check_model(body.model)
        try:
            prompts = prompt_list(body.prompt)
        except ValueError as err:
            raise bad(err, CompletionRequest) from None
        check_prompt_texts(prompts)
        max_tokens = body.max_tokens  # null: the rest of the context, as vLLM's
        if max_tokens == 0 and not body.echo:
            raise APIError(400, "max_tokens must be >= 1 (0 only with echo)", "max_tokens")
        for name in ("echo", "prompt_logprobs"):
            if body.stream and getattr(body, name) not in (None, False):
                raise APIError(400, f"{name} with stream is not supported yet", name)
        server.check_limits(body, len(prompts), 1 if max_tokens is None else max_tokens, "max_tokens")
        server.check_admission(len(prompts) * body.n)
        # echo shows the prompt's logprobs with the completion's (lm-eval-harness's loglikelihood)
        echoed = body.logprobs if body.echo else None
        prompt_logprobs = max((x for x in (body.prompt_logprobs, echoed) if x is not None), default=None)

        def prepare():
            ids = [engine.encode_prompt(p)[1] for p in prompts]
            if max_tokens is None:  # the rest of the context of the longest prompt
                length = min(server.default_max_tokens(p, body.n, body.logprobs) for p in ids)
            else:
                length = max(max_tokens, 1)
            params = server.sampling_params(body, length, body.logprobs, prompt_logprobs)
            server.validate_prompts(ids, params, body.n)
            return ids, params

        try:
            ids, params = await asyncio.to_thread(prepare)
            generation = server.submit(body, ids, params, request.state.cache_salt, request.state.arrival)
        except ValueError as err:
            raise bad(err, CompletionRequest) from None
        with_prompt_logprobs = body.prompt_logprobs is not None
        fmt = (EchoFormat(body.logprobs, with_prompt_logprobs, body.return_token_ids, engine.tokenizer, max_tokens == 0)
               if body.echo else CompletionFormat(body.logprobs, with_prompt_logprobs, body.return_token_ids))
        return await server.respond(request, generation, fmt, body)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        server.check_model(body.model)
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        max_logprobs = engine.config.max_logprobs
        if body.top_logprobs is not None and body.top_logprobs > max_logprobs:
            raise APIError(400, f"top_logprobs must be <= {max_logprobs}, got {body.top_logprobs}", "top_logprobs")
        if engine.tokenizer is None:
            raise APIError(400, "the model has no tokenizer.json, so no chat template")
        if body.stream and body.prompt_logprobs is not None:
            raise APIError(400, "prompt_logprobs with stream is not supported yet", "prompt_logprobs")
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        max_tokens_given = body.max_completion_tokens or body.max_tokens
        field = "max_tokens" if body.max_completion_tokens is None else "max_completion_tokens"
        server.check_limits(body, 1, max_tokens_given or 1, field)  # a default max_tokens is made to fit
        server.check_admission(body.n)

        tool_choice = server.tool_choice(body)
        tools = [tool.model_dump(exclude_none=True) for tool in body.tools] if body.tools else None
        forced_call = forced_call_constraint(tool_choice, tools, body.parallel_tool_calls)

        def prepare():
            prompt = server.chat_prompt(body, body.messages, tools)
            # by default a reply may fill the context; a prompt that already does gets the context error
            max_tokens = max_tokens_given or server.default_max_tokens(prompt, body.n, logprobs)
            params = server.sampling_params(body, max_tokens, logprobs, body.prompt_logprobs, forced_call)
            server.validate_prompts([prompt], params, body.n)
            return prompt, params

        try:
            prompt, params = await asyncio.to_thread(prepare)
            generation = server.submit(body, [prompt], params, request.state.cache_salt, request.state.arrival)
        except ValueError as err:
            raise bad(err, ChatCompletionRequest, prompt_field="messages") from None
        fmt = ChatFormat(logprobs, body.prompt_logprobs is not None, body.return_token_ids,
                         output_reader(tool_choice, config.tool_call_parser),
                         tool_calls_finish=tool_choice.mode in ("auto", "required"),
                         max_tool_calls=None if body.parallel_tool_calls else 1)
        return await server.respond(request, generation, fmt, body)

    add_tokenization_routes(app, server, bad)

    return app

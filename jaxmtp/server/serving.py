"""Server: the state the routes share (engine, engine thread, metrics, limits) and what
they do with it: check a request against the limits, admit it, answer or stream it, and
drain on shutdown."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from jaxmtp.engine.sampling_params import SamplingParams
from jaxmtp.server.config import ServerConfig
from jaxmtp.server.engine_loop import EngineLoop
from jaxmtp.server.formatting import CompletionFormat, sse
from jaxmtp.server.generation import SHUTDOWN, Generation, Interrupted
from jaxmtp.server.metrics import Metrics
from jaxmtp.server.protocol import (
    SAMPLING_FIELDS,
    APIError,
    ChatCompletionRequest,
    ChatMessage,
    ChatTemplateFields,
    GenerationFields,
    NamedToolChoice,
    StreamOptions,
    chat_conversation,
    check_text,
    logit_bias_ids,
    structured_outputs_of,
)
from jaxmtp.server.tool_choice import ToolChoice

log = logging.getLogger("jaxmtp.server")

SEED_LIMIT = 2**63
CONNECT_GRACE = 0.5  # seconds a draining server still accepts connections, to answer them 503


class Server:
    def __init__(self, engine, model: str, config: ServerConfig):
        self.engine = engine
        self.config = config
        folder = Path(model).resolve()
        if config.served_model_name:
            self.model_names = set(config.served_model_name)
            self.model_id = config.served_model_name[0]
        elif Path(model).is_dir():  # the folder's name, or the path the server was started with
            self.model_id = folder.name
            self.model_names = {self.model_id, model, str(folder)}
        else:  # a Hugging Face id
            self.model_id = model
            self.model_names = {model}
        # /v1/models lists each served name, as vLLM's
        self.listed_names = list(config.served_model_name or [self.model_id])
        # where the model lies on this machine is nobody's business outside it
        self._paths = sorted({str(folder), str(model), str(engine.model_dir)}, key=len, reverse=True)
        self.metrics = Metrics(engine, self.model_id, config.metrics_names)
        self.engine_loop = EngineLoop(engine, self.metrics)
        self.draining = False
        self.generations: set[Generation] = set()

    # ----- health ---------------------------------------------------------------------

    def unhealthy(self) -> str | None:
        """Why the server cannot serve now, or None."""
        if self.draining:
            return "the server is shutting down"
        if not self.engine_loop.alive:
            return "the engine thread has stopped"
        if not getattr(self.engine, "usable", True):
            return "the engine is unusable after a failed step (see the server log)"
        return None

    def public(self, message: str) -> str:
        for path in self._paths:
            message = message.replace(path, self.model_id)
        return message

    # ----- admission ------------------------------------------------------------------

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.model_names:
            raise APIError(
                404, f"model {name!r} does not exist; this server serves {self.model_id!r}",
                param="model", code="model_not_found",
            )

    def check_limits(self, body: GenerationFields, num_prompts: int, max_tokens: int, max_tokens_field: str) -> None:
        """The server's per-request limits, each a 400 naming the field."""
        config = self.config
        stops = [body.stop] if isinstance(body.stop, str) else body.stop or []
        if len(stops) > config.max_stop_strings:
            raise APIError(400, f"stop: at most {config.max_stop_strings} stop strings, got {len(stops)}", "stop")
        for word in body.bad_words or []:
            check_text(word, "bad_words")
        for stop in stops:
            check_text(stop, "stop")
            if len(stop) > config.max_stop_string_length:
                message = f"stop: stop strings are at most {config.max_stop_string_length} characters, got {len(stop)}"
                raise APIError(400, message, "stop")
        if body.n > config.max_n:
            raise APIError(400, f"n must be <= {config.max_n}, got {body.n}", "n")
        if body.temperature is not None and body.temperature > config.max_temperature:
            raise APIError(400, f"temperature must be <= {config.max_temperature:g}, got {body.temperature:g}", "temperature")
        if body.seed is not None and body.seed + body.n - 1 >= SEED_LIMIT:
            message = f"seed must be < 2**63 - (n - 1) = {SEED_LIMIT - body.n + 1}: choice j samples with seed + j"
            raise APIError(400, message, "seed")
        if body.n * max_tokens > config.max_request_tokens:
            message = (
                f"n x {max_tokens_field} = {body.n} x {max_tokens} exceeds this server's limit of "
                f"{config.max_request_tokens} generated tokens per request"
            )
            raise APIError(400, message, max_tokens_field)
        if num_prompts * body.n > config.max_waiting:
            message = (
                f"this request's {num_prompts * body.n} choices (prompts x n) exceed the server's queue of "
                f"{config.max_waiting} (--max-waiting): it can never be admitted"
            )
            raise APIError(400, message, "n", code="request_too_large")

    def default_max_tokens(self, prompt: list[int], n: int, logprobs: int | None) -> int:
        """A reply's length where the request sets none (a chat's default, a completion's
        null): the rest of the context, within max_request_tokens and (with logprobs)
        max_logprob_entries."""
        limit = self.config.max_request_tokens // n
        if logprobs is not None:
            limit = min(limit, self.config.max_logprob_entries // (n * (logprobs + 1)))
        return max(1, min(self.engine.max_model_len - len(prompt), limit))

    def sampling_params(
        self, body: GenerationFields, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None = None,
        forced_call: dict | None = None,
    ) -> SamplingParams:
        """The request's SamplingParams: each sampling field under its own name, a field it
        leaves out the model's generation_config.json default (vLLM's --generation-config
        auto), else SamplingParams'; a value it refuses is a ValueError naming the field.
        max_tokens is capped by the generation config's max_new_tokens, as vLLM caps it.
        forced_call: a tool_choice's constraint, which takes the place of a structured
        output (tool_choice refuses both)."""
        defaults = dict(self.engine.generation_defaults)
        max_tokens = min(max_tokens, defaults.pop("max_tokens", max_tokens))
        given = {name: getattr(body, name) for name in SAMPLING_FIELDS}
        given.update(max_tokens=max_tokens, logprobs=logprobs, logit_bias=logit_bias_ids(body.logit_bias),
                     structured_outputs=forced_call or structured_outputs_of(body), prompt_logprobs=prompt_logprobs)
        return SamplingParams(**{**defaults, **{k: v for k, v in given.items() if v is not None}})

    def tool_choice(self, body: ChatCompletionRequest) -> ToolChoice:
        """The request's tool_choice (by default auto with tools, as OpenAI's), a 400 where
        it cannot be honoured."""
        given, names = body.tool_choice, [tool.function.name for tool in body.tools or []]
        if isinstance(given, NamedToolChoice):
            choice = ToolChoice("function", given.function.name)
        else:
            choice = ToolChoice(given or ("auto" if names else "none"))
        if choice.mode != "none" and not names:
            raise APIError(400, f"tool_choice {choice.mode!r} needs tools", "tool_choice")
        if choice.function is not None and choice.function not in names:
            raise APIError(400, f"tool_choice names the function {choice.function!r}, which tools does not offer",
                           "tool_choice")
        if choice.mode == "auto" and not self.config.enable_auto_tool_choice:  # (which needs tool_call_parser)
            message = ('"auto" tool choice (the default with tools) needs the server started with '
                       '--enable-auto-tool-choice and --tool-call-parser')
            raise APIError(400, message, "tool_choice")
        if choice.mode in ("required", "function") and structured_outputs_of(body) is not None:
            raise APIError(400, f"tool_choice {choice.mode!r} constrains the output itself: it cannot be combined "
                           "with response_format or structured outputs", "tool_choice")
        return choice

    def chat_prompt(self, body: ChatTemplateFields, messages: list[ChatMessage], tools: list[dict] | None = None):
        """The messages' token ids, rendered with the chat template as the request asks. The
        template writes its own special tokens (BOS); those typed in messages stay text."""
        return self.engine.tokenizer.apply_chat_template(
            chat_conversation(messages), tools, add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message, chat_template_kwargs=body.chat_template_kwargs,
            return_dict=False,
        )

    def check_admission(self, new: int) -> None:
        """503 while the server cannot serve, 429 while the queue has no room for `new`
        choices. Checked before a request is tokenised, and again when it is admitted."""
        reason = self.unhealthy()
        if reason is not None:
            raise APIError(503, reason, code=SHUTDOWN.code if self.draining else "service_unavailable")
        waiting = self.engine.num_waiting
        if waiting + new > self.config.max_waiting:
            raise APIError(
                429, f"the server is busy: {waiting} requests are waiting and this one adds {new} "
                f"(limit {self.config.max_waiting}); retry later", code="too_many_waiting_requests",
            )

    def submit(
        self, body: GenerationFields, prompts: list[list[int]], params: SamplingParams, cache_salt: str | None,
        arrival: float,
    ) -> Generation:
        """Admit a request already validated (validate_prompts) on the event loop's thread;
        arrival: when it came in (time.monotonic())."""
        self.check_admission(len(prompts) * body.n)
        timeout = min(body.timeout or self.config.request_timeout, self.config.request_timeout)
        return self.start(prompts, params, body.n, timeout, cache_salt, arrival)

    def start(
        self, prompts: list[list[int]], params: SamplingParams, n: int, timeout: float, cache_salt: str | None = None,
        arrival: float | None = None,
    ) -> Generation:
        generation = Generation(self.engine_loop, self.metrics, prompts, params, n, timeout, cache_salt, arrival)
        self.generations.add(generation)
        return generation

    def validate_prompts(self, prompts: list[list[int]], params: SamplingParams, n: int) -> None:
        """Each prompt as the engine checks it, and the request's logprob entries (n
        choices of each prompt) within max_logprob_entries."""
        for prompt in prompts:
            self.engine.validate(prompt, params)
        entries = n * sum(logprob_entries(len(prompt), params) for prompt in prompts)
        if entries > self.config.max_logprob_entries:
            field = "prompt_logprobs" if params.prompt_logprobs is not None else "logprobs"
            raise ValueError(
                f"{field}: this request returns {entries} logprob entries (n x (prompt tokens x (prompt_logprobs + 1) "
                f"+ max_tokens x (logprobs + 1))), past this server's limit of {self.config.max_logprob_entries} "
                "(--max-logprob-entries)"
            )

    # ----- answers --------------------------------------------------------------------

    async def respond(
        self, request: Request, generation: Generation, fmt: CompletionFormat, body: GenerationFields
    ) -> Response:
        # vLLM's: the X-Request-Id header's id, else the body's request_id, names the
        # response, and the header echoes it
        base_id = request.headers.get("X-Request-Id") or body.request_id or uuid.uuid4().hex
        # the name the request gave, where it is a served name (vLLM's); never a path
        model = body.model if body.model in self.listed_names else self.model_id
        header = {"id": fmt.id_prefix + base_id, "created": generation.created, "model": model}
        echo = {"X-Request-Id": base_id}
        if body.stream:
            chunks = self.stream(generation, fmt, header, body.stream_options or StreamOptions())
            return StreamingResponse(chunks, media_type="text/event-stream", headers=echo)
        try:
            if not await finished_before_disconnect(request, generation.run_to_end()):
                return Response(status_code=499)  # nobody is there to read it
        finally:
            self.generations.discard(generation)

        def body_of_the_response():  # off the event loop: logprobs of many tokens take a while
            choices = [fmt.choice(c, c.text, 0, True, False) for c in generation.choices]
            response = {**header, "object": fmt.object, "choices": choices, "usage": fmt.usage(generation)}
            return JSONResponse({**response, **fmt.response_fields(generation)}, headers=echo)

        return await asyncio.to_thread(body_of_the_response)

    async def stream(self, generation: Generation, fmt: CompletionFormat, header: dict, options: StreamOptions):
        """SSE chunks, one choice each; the usage after the last one (include_usage), and
        in every chunk as of it (continuous_usage_stats too). A client that disconnects
        cancels this generator, and `finally` aborts its engine requests."""
        header = {**header, "object": fmt.chunk_object}
        continuous_usage = options.include_usage and options.continuous_usage_stats

        def sse_chunk(body: dict) -> str:
            return sse({**body, "usage": generation.usage()} if continuous_usage else body)

        def chunk(choice, text, first_token, done):
            return sse_chunk({**header, "choices": [fmt.choice(choice, text, first_token, done, True)]})

        try:
            for choice in generation.choices:
                opening = fmt.opening(choice)
                if opening:  # the first one with the response's own fields
                    fields = fmt.response_fields(generation) if choice is generation.choices[0] else {}
                    yield sse_chunk({**header, "choices": [opening], **fields})
            while generation.unfinished:
                update = await generation.next_update()
                if isinstance(update, Interrupted):  # the open choices end with finish_reason "abort"
                    for cancelled in generation.cancel():
                        text, first_token, _ = cancelled.take_delta()
                        yield chunk(cancelled, text, first_token, True)
                    break
                text, first_token, done = update.take_delta()
                new_logprobs = fmt.num_logprobs is not None and first_token < len(update.token_ids)
                if new_logprobs:  # off the event loop, as the tokens' texts take a while
                    yield await asyncio.to_thread(chunk, update, text, first_token, done)
                elif text or done:
                    yield chunk(update, text, first_token, done)
            if options.include_usage:
                yield sse({**header, "choices": [], "usage": generation.usage()})
        except APIError as err:  # the status line has gone out: the error goes in the stream
            yield sse(err.body)
        finally:
            generation.cancel()
            self.generations.discard(generation)
        yield sse("[DONE]")

    # ----- shutdown -------------------------------------------------------------------

    async def drain(self, timeout: float, stop_listening: Callable[[], None]) -> None:
        """Admit nothing more (503; /health answers 503), give the running requests
        `timeout` seconds to finish, then interrupt the rest: streams end their open
        choices with finish_reason "abort" and [DONE], other requests get a 503.
        For the first CONNECT_GRACE seconds of it, connections are still accepted (their
        requests get the 503): closing the listening socket resets the connections the
        kernel has accepted for it but the event loop has not, those of clients that
        connected as the signal came."""
        self.draining = True
        log.info("draining: %d requests running, new ones get 503", len(self.generations))
        deadline = time.monotonic() + timeout
        await asyncio.sleep(min(CONNECT_GRACE, timeout))
        stop_listening()
        while self.generations and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.generations:
            log.warning("aborting %d requests still running after %g s", len(self.generations), timeout)
        for generation in list(self.generations):
            generation.interrupt(SHUTDOWN)


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
        # a task cancelled a moment ago is neither done nor cancelled until it has run
        await asyncio.wait({task, gone})
    if task.cancelled():
        return False
    task.result()  # raises the work's error
    return True


async def client_gone(request: Request) -> None:
    # the body has been read, so the next message is the disconnect
    while (await request.receive())["type"] != "http.disconnect":
        pass


def logprob_entries(prompt_len: int, params: SamplingParams) -> int:
    """The logprob entries one choice of a prompt returns: its prompt logprobs (every
    prompt token and its top ones) and its sampled tokens' logprobs."""
    entries = 0
    if params.prompt_logprobs is not None:
        entries += prompt_len * (params.prompt_logprobs + 1)
    if params.logprobs is not None:
        entries += params.max_tokens * (params.logprobs + 1)
    return entries

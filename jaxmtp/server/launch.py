"""`jaxmtp serve`: its command-line options, and the process that loads the engine,
compiles the step's largest shape, serves it with uvicorn while the other shapes
compile in the background, with a read timeout on every connection and a graceful
drain on SIGTERM."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from pathlib import Path

import h11
import jinja2
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from jaxmtp.args import add_engine_args, add_options, engine_kwargs, option_values, resolve_model
from jaxmtp.loading.chat_template import compile_template
from jaxmtp.server.app import create_app
from jaxmtp.server.config import ServerConfig
from jaxmtp.server.serving import Server

log = logging.getLogger("jaxmtp.server")

AFTER_DRAIN_TIMEOUT = 5.0  # seconds for interrupted responses to go out after the drain
# threads compiling shapes in the background: a quarter of the cores, as the engine
# thread steps (and the event loop answers) on the same ones meanwhile
COMPILE_THREADS = max(1, (os.cpu_count() or 1) // 4)


def add_server_args(parser: argparse.ArgumentParser) -> None:
    add_engine_args(parser, model_positional=True)
    key = os.environ.get("JAXMTP_API_KEY")
    add_options(parser, ServerConfig, defaults={"api_key": [key] if key else None})


def launch_settings(args: argparse.Namespace) -> tuple[ServerConfig, str, dict, str | None]:
    """What `jaxmtp serve`'s command line asks for, checked before any weights load: the
    server's config, the model, the engine's keyword arguments and the chat template."""
    config = ServerConfig(**option_values(args, ServerConfig))
    return config, resolve_model(args), engine_kwargs(args), chat_template_source(config.chat_template)


def chat_template_source(chat_template: str | None) -> str | None:
    """--chat-template as vLLM reads it: a file's text, or else, if it looks like a
    template (braces or a newline), the option's own text with its backslash escapes
    (\\n) decoded. A ValueError names a missing file or a template that does not compile."""
    if chat_template is None:
        return None
    path = os.path.expanduser(chat_template)
    if os.path.isfile(path):  # (False, not an error, for a template too long to be a file name)
        source = Path(path).read_text(encoding="utf-8")
    elif any(c in chat_template for c in "{}\n"):
        # unicode_escape reads bytes as Latin-1: what Latin-1 cannot hold goes in as \\u escapes
        source = chat_template.encode("latin-1", "backslashreplace").decode("unicode_escape")
    else:
        raise ValueError(f"chat_template file {chat_template} does not exist (and it is no template)")
    try:
        compile_template(source)
    except jinja2.TemplateError as err:
        raise ValueError(f"chat_template does not compile: {err}") from None
    return source


def load_engine(model: str, engine_kwargs: dict, chat_template: str | None):
    """The engine, whose tokenizer renders every chat with chat_template (a template's
    source) if one is given."""
    from jaxmtp.engine.llm_engine import LLMEngine

    engine = LLMEngine(model, **engine_kwargs)
    if chat_template is not None:
        if engine.tokenizer is None:
            raise ValueError("chat_template needs the model's tokenizer (tokenizer.json)")
        engine.tokenizer.chat_templates = {"default": chat_template}
    return engine


def timed_protocol(read_timeout: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol, where a client has read_timeout seconds to send a whole
    request (headers and body) from connecting or from the end of its last response,
    else the connection is closed. uvicorn alone times out only idle keep-alive
    connections, and any byte a client sends restarts that timer."""

    class TimedH11Protocol(H11Protocol):
        _read_timer = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE and self.conn.their_state is not h11.SEND_BODY:
                self._disarm()  # the whole request is in

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
                self._arm()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self._read_timer = self.loop.call_later(read_timeout, self._timed_out)

        def _disarm(self) -> None:
            if self._read_timer is not None:
                self._read_timer.cancel()
                self._read_timer = None

        def _timed_out(self) -> None:
            self._read_timer = None
            if not self.transport.is_closing():
                log.info("closing a connection that sent no whole request in %g s", read_timeout)
                self.transport.close()

    return TimedH11Protocol


class DrainingServer(uvicorn.Server):
    """uvicorn's server, which on SIGTERM (or Ctrl-C) stops listening, drains the app's
    Server (jaxmtp.server.serving.Server.drain) and then shuts down as uvicorn does."""

    def __init__(self, config: uvicorn.Config, app_server: Server, shutdown_timeout: float, programs):
        super().__init__(config)
        self.app_server = app_server
        self.shutdown_timeout = shutdown_timeout
        self.programs = programs  # the step's StepPrograms, compiling in the background

    def handle_exit(self, sig: int, frame) -> None:
        super().handle_exit(sig, frame)
        # uvicorn raises a caught signal again once it has shut down; after a drain the
        # server has done what SIGTERM asks, so it exits with status 0 instead
        captured = getattr(self, "_captured_signals", [])
        if sig == signal.SIGTERM and sig in captured:
            captured.remove(sig)

    async def shutdown(self, sockets=None) -> None:
        self.programs.stop(wait=False)  # the cores go to the requests draining
        await self.app_server.drain(self.shutdown_timeout, stop_listening=self.stop_listening)
        await super().shutdown(sockets)

    def stop_listening(self) -> None:
        for server in self.servers:
            server.close()


def serve(args: argparse.Namespace) -> int:
    from jaxmtp.worker.programs import use_persistent_cache

    config, model, kwargs, chat_template = launch_settings(args)
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("jaxmtp").setLevel(config.log_level.upper())
    if config.compilation_cache_dir:
        use_persistent_cache(config.compilation_cache_dir)
    engine = load_engine(model, kwargs, chat_template)
    # the largest shape holds any batch: requests run on it until theirs is compiled
    engine.warmup(COMPILE_THREADS, background=True)
    log.info("serving on the step's largest batch shape while %d more compile in the background",
             engine.runner.programs.num_left)
    app = create_app(engine, model, config)
    uvicorn_config = uvicorn.Config(
        app, host=config.host, port=config.port, log_level=config.log_level, http=timed_protocol(config.read_timeout),
        timeout_keep_alive=config.timeout_keep_alive, timeout_graceful_shutdown=AFTER_DRAIN_TIMEOUT,
    )
    programs = engine.runner.programs
    DrainingServer(uvicorn_config, app.state.server, config.shutdown_timeout, programs).run()
    log.info("shut down%s", ", abandoning the shape being compiled" if programs.compiling else "")
    # Drained, nothing is left to save. The process leaves without tearing the
    # interpreter down: that waits on a compile in progress (XLA cannot cancel one; on a
    # GPU it takes up to minutes) and takes seconds to free JAX and its threads.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)

"""`jaxmtp serve`: its command-line options, and the process that loads the engine,
compiles its step and serves it with uvicorn."""

from __future__ import annotations

import argparse
import logging
import os
import time

import uvicorn

from jaxmtp.args import add_engine_args, add_options, engine_kwargs, option_values, resolve_model
from jaxmtp.server.app import create_app
from jaxmtp.server.config import ServerConfig

log = logging.getLogger("jaxmtp.server")


def add_server_args(parser: argparse.ArgumentParser) -> None:
    add_engine_args(parser, model_positional=True)
    add_options(parser, ServerConfig, defaults={"api_key": os.environ.get("JAXMTP_API_KEY")})


def serve(args: argparse.Namespace) -> int:
    import jax

    from jaxmtp.engine import LLMEngine

    config = ServerConfig(**{**option_values(args, ServerConfig), "api_key": args.api_key or None})
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log.setLevel(config.log_level.upper())
    if config.compilation_cache_dir:
        jax.config.update("jax_compilation_cache_dir", config.compilation_cache_dir)
    model = resolve_model(args)
    engine = LLMEngine(model, **engine_kwargs(args))
    start = time.monotonic()
    shapes = engine.warmup()  # compile every batch shape before the port opens
    log.info("compiled the step for %d batch shapes in %.1f s", shapes, time.monotonic() - start)
    app = create_app(engine, model, config)
    uvicorn.run(app, host=config.host, port=config.port, log_level=config.log_level, timeout_graceful_shutdown=5)
    return 0

"""`jaxmtp serve`: its command-line options, and the process that loads the engine,
compiles its step and serves it with uvicorn."""

from __future__ import annotations

import argparse
import logging
import os
import time
from pathlib import Path

import uvicorn

from jaxmtp.cli import add_engine_args, engine_kwargs
from jaxmtp.server.app import create_app
from jaxmtp.server.config import ServerConfig

log = logging.getLogger("jaxmtp.server")


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

"""ServerConfig: every option of the HTTP server, its default and its help text,
written once (`jaxmtp serve`'s options derive from these fields, jaxmtp/args.py)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from jaxmtp.engine_config import option

LOG_LEVELS = ("debug", "info", "warning", "error")


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    host: str = option("127.0.0.1", "address to bind (127.0.0.1: this machine only)")
    port: int = option(8000, "port to listen on")
    api_key: str | None = option(
        None, "require 'Authorization: Bearer KEY' on /v1 (default: $JAXMTP_API_KEY, else none)"
    )
    max_waiting: int = option(256, "waiting requests (one per choice) beyond which new ones get 429")
    request_timeout: float = option(600.0, "seconds after its arrival before a request is aborted")
    max_body_bytes: int = option(1 << 20, "larger request bodies get 413")
    compilation_cache_dir: str = option(
        str(Path.home() / ".cache" / "jaxmtp" / "xla"),
        "persistent XLA cache, so that later starts skip compiling ('' to disable)",
    )
    log_level: str = option("info", "log level of the server and uvicorn", LOG_LEVELS)

    def __post_init__(self):
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.type in ("int", "float") and not value > 0:
                raise ValueError(f"{f.name} must be > 0, got {value!r}")
            if f.metadata["choices"] is not None and value not in f.metadata["choices"]:
                raise ValueError(f"{f.name} must be one of {f.metadata['choices']}, got {value!r}")

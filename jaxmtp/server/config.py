"""ServerConfig: the limits and options of the HTTP server."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    api_key: str | None = None
    max_waiting: int = 256
    request_timeout: float = 600.0
    max_body_bytes: int = 1 << 20

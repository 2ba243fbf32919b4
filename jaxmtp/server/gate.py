"""ASGI middleware run before routing: the API key, the Content-Type of request bodies
and the body size limit."""

from __future__ import annotations

import hashlib
import hmac
import time

from starlette.datastructures import Headers
from starlette.exceptions import HTTPException

from jaxmtp.server.protocol import APIError

OPEN_PATHS = frozenset({"/health", "/health_generate"})  # liveness probes send no key


class RequestGate:
    """Checks the API key (so a request without it gets 401 whatever its body) of every
    path but the probes' (and /metrics, if public), that a POST body is JSON, and caps
    the body size."""

    def __init__(self, app, api_keys: list[str] | None, max_body_bytes: int, public_metrics: bool = False):
        self.app = app
        # compared as the UTF-8 bytes a client sends, so that a non-ASCII key works
        self.authorizations = [f"Bearer {key}".encode() for key in api_keys or []]
        # a request's prefix-cache salt, so that one key's requests cannot time another's cache hits
        self.cache_salts = [hashlib.sha256(key.encode()).hexdigest() for key in api_keys or []]
        self.open_paths = OPEN_PATHS | {"/metrics"} if public_metrics else OPEN_PATHS
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        key = self.key_index(scope)
        error = self.refusal(scope, key)
        if error is not None:
            return await error.response()(scope, receive, send)
        state = scope.setdefault("state", {})
        state["cache_salt"] = None if key is None else self.cache_salts[key]
        state["arrival"] = time.monotonic()  # the request's latencies and timeout count from here
        too_large = APIError(413, f"request body over {self.max_body_bytes} bytes", code="request_too_large")
        received = 0

        async def receive_limited():  # for bodies sent without a Content-Length
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_body_bytes:
                raise HTTPException(413, str(too_large))
            return message

        await self.app(scope, receive_limited, send)

    def key_index(self, scope) -> int | None:
        """Which key the request sends, if any; every key is compared (in constant time)."""
        if not self.authorizations:
            return None
        given = b"".join(value for name, value in scope["headers"] if name == b"authorization")
        matches = [hmac.compare_digest(given, expected) for expected in self.authorizations]
        return matches.index(True) if any(matches) else None

    def refusal(self, scope, key: int | None) -> APIError | None:
        if self.authorizations and scope["path"] not in self.open_paths:
            if key is None:
                message = "missing or wrong API key: send 'Authorization: Bearer <key>'"
                return APIError(401, message, code="invalid_api_key")
        headers = Headers(scope=scope)
        if scope["method"] == "POST":
            media_type = headers.get("content-type", "").split(";", 1)[0].strip().lower()
            if media_type != "application/json":
                given = f"got {media_type!r}" if media_type else "none was sent"
                message = f"the body must be JSON with 'Content-Type: application/json' ({given})"
                return APIError(400, message, code="unsupported_content_type")
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > self.max_body_bytes:
            return APIError(413, f"request body over {self.max_body_bytes} bytes", code="request_too_large")
        return None

"""ASGI middleware run before routing: the API key and the body size limit."""

from __future__ import annotations

import hmac

from starlette.datastructures import Headers
from starlette.exceptions import HTTPException

from jaxmtp.server.protocol import APIError


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

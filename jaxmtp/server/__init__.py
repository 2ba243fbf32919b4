"""OpenAI-compatible HTTP server over one LLMEngine (`python server.py`, `jaxmtp serve`).

protocol.py    request bodies (pydantic) and OpenAI-shaped errors
engine_loop.py the engine thread: steps the engine, hands outputs to the asyncio loop
metrics.py     Prometheus metrics
generation.py  one HTTP request's choices, each an engine request
formatting.py  response bodies and stream chunks, one logprob loop for both endpoints
gate.py        ASGI middleware: API key, body size
app.py         the routes and the state they share
launch.py      `jaxmtp serve`: options, engine, uvicorn
"""

from jaxmtp.server.app import create_app
from jaxmtp.server.config import ServerConfig

__all__ = ["create_app", "ServerConfig"]

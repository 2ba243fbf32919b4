"""OpenAI-compatible HTTP server over one LLMEngine (`python server.py`, `jaxmtp serve`).

protocol.py    request bodies (pydantic; any field not implemented is refused) and OpenAI-shaped errors
engine_loop.py the engine thread: steps the engine, hands outputs to the asyncio loop
metrics.py     Prometheus metrics, under jaxmtp's or vLLM's names
stats_log.py   the periodic stats log line (throughput, requests, KV usage, acceptance)
generation.py  one HTTP request's choices, each an engine request
formatting.py  response bodies and stream chunks, one logprob loop for both endpoints
config.py      ServerConfig: every server option, its default and help text
gate.py        ASGI middleware: API keys, JSON Content-Type, body size
serving.py     the state the routes share: limits, admission, answers, drain
app.py         the routes
tokenization.py /tokenize and /detokenize, as vLLM's
launch.py      `jaxmtp serve`: options, engine, uvicorn with read timeouts and a drain on SIGTERM
"""

from jaxmtp.server.app import create_app
from jaxmtp.server.config import ServerConfig

__all__ = ["create_app", "ServerConfig"]

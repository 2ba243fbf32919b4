"""ServerConfig: every option of the HTTP server, its default and its help text,
written once (`jaxmtp serve`'s options derive from these fields, jaxmtp/args.py)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from jaxmtp.engine.engine_config import option
from jaxmtp.server.metrics import METRICS_NAMES
from jaxmtp.server.tool_parsers import TOOL_PARSERS

LOG_LEVELS = ("debug", "info", "warning", "error")


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    host: str = option("127.0.0.1", "address to bind (127.0.0.1: this machine only)")
    port: int = option(8000, "port to listen on")
    api_key: list[str] | None = option(
        None,
        "keys, one of which every path but /health and /health_generate then needs as 'Authorization: Bearer KEY'; "
        "requests share cached prompt prefixes only with requests of the same key (default: $JAXMTP_API_KEY, "
        "else none)",
    )
    public_metrics: bool = option(False, "serve /metrics without the API key")
    served_model_name: list[str] | None = option(
        None, "the names requests may give as `model`; responses report the first (default: the model folder's name)"
    )
    chat_template: str | None = option(
        None, "the chat template every chat is rendered with instead of the model's: a file, or the template itself "
        "(default: the model's)")
    max_waiting: int = option(256, "waiting requests (one per choice) beyond which new ones get 429")
    request_timeout: float = option(600.0, "seconds after its arrival before a request is aborted")
    max_body_bytes: int = option(1 << 20, "larger request bodies get 413")
    max_n: int = option(128, "most choices (n) a request may ask for")
    max_stop_strings: int = option(16, "most stop strings a request may give")
    max_stop_string_length: int = option(256, "longest stop string, in characters")
    max_request_tokens: int = option(
        131072, "most tokens one request may generate: n x max_tokens (a chat reply's default is capped to fit)"
    )
    max_logprob_entries: int = option(
        1 << 18,
        "most logprob entries one request may return: n x (prompt tokens x (prompt_logprobs + 1) + max_tokens x "
        "(logprobs + 1)), counting only what it asks for (each entry is a row of work and about 70 bytes of response)",
    )
    max_temperature: float = option(2.0, "highest temperature a request may ask for (OpenAI's limit)")
    shutdown_timeout: float = option(
        20.0, "on SIGTERM: seconds running requests may take to finish before they are aborted"
    )
    read_timeout: float = option(
        10.0, "seconds a client has to send a whole request (headers and body), from connecting or from its last response"
    )
    timeout_keep_alive: float = option(5.0, "seconds an idle keep-alive connection stays open")
    compilation_cache_dir: str = option(
        str(Path.home() / ".cache" / "jaxmtp" / "xla"),
        "persistent XLA cache, so that later starts skip compiling ('' to disable)",
    )
    log_level: str = option("info", "log level of the server and uvicorn", LOG_LEVELS)
    metrics_names: str = option(
        "jaxmtp",
        "names of the /metrics series: jaxmtp's (jaxmtp_requests_running, ...), or vLLM's for the series vLLM also "
        "has (vllm:num_requests_running, ...), so that dashboards made for vLLM read them",
        METRICS_NAMES,
    )
    log_stats_interval: float = option(
        10.0, "seconds between the stats lines the server logs (throughput, requests, KV cache usage, acceptance)"
    )
    disable_log_stats: bool = option(False, "log no stats lines")
    # CORS, with vLLM's options and defaults: any origin, method and header, no credentials
    allowed_origins: list[str] | None = option(None, "origins browsers may call from (default: any, *)")
    allowed_methods: list[str] | None = option(None, "methods browsers may use (default: any, *)")
    allowed_headers: list[str] | None = option(None, "headers browsers may send (default: any, *)")
    allow_credentials: bool = option(False, "whether browsers may send credentials (cookies) along")
    enable_auto_tool_choice: bool = option(
        False, "let chat requests with tools leave the choice to the model (tool_choice auto, the default with "
        "tools), whose output --tool-call-parser reads into tool calls")
    tool_call_parser: str | None = option(
        None, "the model's tool-call format: deepseek_v3 (DeepSeek-V3, R1), deepseek_v31, glm45 (GLM-4.5, 4.6), "
        "hermes (Hermes, Qwen2.5, Qwen3), llama3_json (Llama 3.1-3.3) (default: none)", tuple(sorted(TOOL_PARSERS)))

    def __post_init__(self):
        if isinstance(self.api_key, str):  # one key
            object.__setattr__(self, "api_key", [self.api_key])
        if self.api_key is not None and not all(self.api_key):
            raise ValueError("api_key must be non-empty keys")
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.type in ("int", "float") and not value > 0:
                raise ValueError(f"{f.name} must be > 0, got {value!r}")
            if f.metadata["choices"] is not None and value is not None and value not in f.metadata["choices"]:
                raise ValueError(f"{f.name} must be one of {f.metadata['choices']}, got {value!r}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("enable_auto_tool_choice needs tool_call_parser: the model's tool-call format")
        if self.served_model_name is not None and not all(self.served_model_name):
            raise ValueError("served_model_name must be non-empty names")

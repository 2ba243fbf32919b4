"""EngineConfig: every engine option, its default, its allowed values and its help text,
written once. The CLI (jaxmtp/args.py) derives its options from these fields, and the
config checks itself before any weights load (EngineConfig.validate)."""

from __future__ import annotations

import dataclasses

from jaxmtp.engine.prefix_cache import PREFIX_CACHE_BOUNDARIES
from jaxmtp.models.config import ATTENTION_BACKENDS, MODEL_DTYPES

MTP_BOUNDARIES = ("next_chunk", "sampled")
LOAD_FORMATS = ("auto", "safetensors", "orbax", "dummy")
DTYPES = ("auto", *MODEL_DTYPES)
MAX_SPECULATIVE_TOKENS = 4


# vLLM's speculative methods that are the model's own MTP layers, for the families this
# engine runs (vLLM reads the family names as aliases of "mtp"); drafting with another
# model (draft_model, eagle, eagle3, medusa) or with n-grams is not implemented here
SPECULATIVE_METHODS = ("mtp", "deepseek_mtp", "mimo_mtp", "glm4_moe_mtp")
# vLLM configs of MTP often name the served model as the draft "model"; LLMEngine checks it
SPECULATIVE_KEYS = ("method", "model", "num_speculative_tokens")
QUANTIZATIONS = ("auto", "fp8")


def speculative_tokens_of(config: EngineConfig) -> int:
    """num_speculative_tokens from speculative_config; what it does not implement is an error."""
    spec = config.speculative_config
    if not isinstance(spec, dict):
        raise ValueError(f"speculative_config must be a dict, got {spec!r}")
    unknown = sorted(set(spec) - set(SPECULATIVE_KEYS))
    if unknown:
        supported = ", ".join(SPECULATIVE_KEYS)
        raise ValueError(f"speculative_config keys {unknown} are not supported (supported: {supported})")
    method = spec.get("method") or "mtp"
    if method not in SPECULATIVE_METHODS:
        raise ValueError(
            f"speculative_config method {method!r} is not supported: this engine drafts with the model's own MTP "
            f"layers (supported methods: {', '.join(SPECULATIVE_METHODS)})"
        )
    if config.num_speculative_tokens and config.num_speculative_tokens != spec.get("num_speculative_tokens"):
        raise ValueError("num_speculative_tokens and speculative_config disagree; give one of them")
    if "num_speculative_tokens" not in spec:
        raise ValueError("speculative_config needs num_speculative_tokens")
    return spec["num_speculative_tokens"]


def option(default, help: str, choices: tuple | None = None, cli: bool = True, no_effect: str | None = None):
    """A field with the metadata the CLI reads: its help text, its choices, and whether
    it is a command-line option at all; no_effect: see no_effect_option."""
    metadata = {"help": help, "choices": choices, "cli": cli, "no_effect": no_effect}
    return dataclasses.field(default=default, metadata=metadata)


def no_effect_option(default, reason: str, cli: bool = True):
    """One of vLLM's options that changes no output of this engine: accepted, and logged
    at INFO when set (EngineConfig.ineffective). reason: why it changes nothing here."""
    text = f"vLLM's option, accepted with no effect here: {reason}" + (" (default: none)" if default is None else "")
    return option(default, text, cli=cli, no_effect=reason)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    dtype: str = option(
        "auto", "weights' and activations' dtype; auto: the checkpoint's (config.json's torch_dtype), float16 included",
        DTYPES)
    quantization: str | None = option(
        None, "the weights' quantization: auto (or none given), the checkpoint's; fp8 asserts an fp8 checkpoint "
        "(config.json's quantization_config), as this engine does not quantize weights while loading them "
        "(default: the checkpoint's)", QUANTIZATIONS)
    page_size: int = option(16, "tokens per KV cache page")
    num_pages: int | None = option(
        None, "KV pages in the pool (default: what gpu_memory_utilization or kv_cache_memory_bytes leaves room for, "
        "at most max_num_seqs requests of max_model_len)")
    gpu_memory_utilization: float = option(
        0.9, "on accelerators, the fraction of the memory JAX may use (its allocator's limit) that weights, "
        "activations and the KV cache may take")
    kv_cache_memory_bytes: int | None = option(
        None, "bytes for the KV cache, overriding gpu_memory_utilization (default on the CPU: 2 GiB)")
    max_model_len: int | None = option(None, "longest prompt + output (default: the model's max_position_embeddings)")
    max_num_seqs: int = option(16, "requests computed in one step")
    max_num_batched_tokens: int = option(256, "rows (tokens) computed in one step")
    prefill_chunk_size: int | None = option(None, "prompt tokens of one request per step (default: max_num_batched_tokens)")
    num_speculative_tokens: int = option(0, f"MTP draft tokens per step, 0..{MAX_SPECULATIVE_TOKENS} (needs MTP weights)")
    speculative_config: dict | None = option(
        None, 'vLLM\'s form of num_speculative_tokens, JSON on the command line: {"method": "mtp", '
        '"num_speculative_tokens": k}; the methods mtp, deepseek_mtp, mimo_mtp and glm4_moe_mtp all draft with the '
        'model\'s own MTP layers (default: none)')
    mtp_boundary: str = option(
        "next_chunk",
        "the token the MTP module reads after a non-final prefill chunk: the next prompt token (next_chunk), "
        "or the main model's sample, as the pre-fix engines did (sampled, for ablations)",
        MTP_BOUNDARIES,
    )
    enable_prefix_caching: bool = option(False, "reuse the KV pages of earlier requests' shared prefixes")
    num_state_snapshots: int | None = option(
        None, "with prefix caching, a hybrid model's linear-attention states kept at page boundaries, where a "
        "cached prefix can end; their memory comes out of the KV cache's (default: max_num_seqs)")
    prefix_cache_boundary: str = option(
        "exact",
        "the MTP draft row at the end of the last reused page: exact, or the ablations drop (vLLM) and stale "
        "(docs/prefix-cache.md)",
        PREFIX_CACHE_BOUNDARIES,
    )
    attention_backend: str = option("auto", "auto: the Pallas kernel on GPUs, the jnp reference elsewhere", ATTENTION_BACKENDS)
    tensor_parallel_size: int = option(
        1, "devices that split heads, MLP and vocabulary (docs/tensor-parallel.md); with num_nodes > 1, every "
        "node's devices together")
    num_nodes: int = option(1, "processes, one per host, that the engine spans on jax.distributed (docs/multi-host.md)")
    node_rank: int = option(
        0, "this process's rank, 0..num_nodes-1: rank 0 runs the scheduler, the tokenizer and the HTTP server, "
        "the others run rank 0's steps")
    coordinator: str | None = option(
        None, "HOST:PORT where rank 0 runs jax.distributed's coordinator, reachable from every node (num_nodes > 1 needs it; no default)")
    node_timeout: int = option(
        100, "seconds a node may go silent (no heartbeat) before every process ends with an error; also the most a "
        "clean shutdown waits for the other nodes")
    revision: str | None = option(
        None, "the Hugging Face revision (branch, tag or commit) of a model given by id (default: main)")
    tokenizer: str | None = option(
        None, "folder or Hugging Face id whose tokenizer.json, tokenizer_config.json and chat template are used "
        "instead of the model's (default: the model's)")
    tokenizer_revision: str | None = option(
        None, "the Hugging Face revision of a tokenizer given by id (default: revision)")
    generation_config: str = option(
        "auto", "where the default sampling parameters come from (temperature, top_p, top_k, min_p, "
        "repetition_penalty, and max_new_tokens as max_tokens): auto, the model's generation_config.json; vllm, "
        "none (SamplingParams' defaults); or a folder holding a generation_config.json")
    load_format: str = option("auto", "how to read the weights (dummy: random weights of the config's shapes)", LOAD_FORMATS)
    max_logprobs: int = option(20, "most top logprobs a request may ask for")
    seed: int = option(0, "seed of dummy weights and of requests that set none")
    async_scheduling: bool = option(
        True, "schedule and dispatch step N+1 before reading step N, so host work overlaps the device's"
    )
    # vLLM's options that change no output here
    trust_remote_code: bool = no_effect_option(
        False, "this engine runs no checkpoint's Python code; it implements each architecture it serves")
    enforce_eager: bool = no_effect_option(
        False, "every step runs compiled by XLA; there are no CUDA graphs to leave out")
    swap_space: float = no_effect_option(4.0, "a preempted request is recomputed, never swapped to CPU memory")
    disable_custom_all_reduce: bool = no_effect_option(False, "tensor parallelism's all-reduces are XLA's collectives")
    max_seq_len_to_capture: int = no_effect_option(8192, "no CUDA graphs are captured; every step shape is compiled")
    compilation_config: dict | None = no_effect_option(
        None, "XLA compiles every step; vLLM's torch.compile and CUDA graph settings do not apply (JSON on the "
        "command line)")
    disable_log_stats: bool = no_effect_option(  # LLM(...)'s: serve's --disable-log-stats is ServerConfig's
        True, "the engine logs no periodic stats (jaxmtp serve's --disable-log-stats turns off the server's)",
        cli=False)

    def __post_init__(self):
        if self.speculative_config is not None:
            object.__setattr__(self, "num_speculative_tokens", speculative_tokens_of(self))
        self.validate()

    @property
    def chunk_size(self) -> int:
        return self.prefill_chunk_size or self.max_num_batched_tokens

    def ineffective(self) -> dict[str, str]:
        """vLLM's options set here that change no output of this engine, each with why."""
        return {f.name: f.metadata["no_effect"] for f in dataclasses.fields(self)
                if f.metadata["no_effect"] and getattr(self, f.name) != f.default}

    def validate(self) -> None:
        """Everything that can be checked without the model; a ValueError names the option."""
        for f in dataclasses.fields(self):
            value, choices = getattr(self, f.name), f.metadata["choices"]
            if choices is not None and value is not None and value not in choices:
                raise ValueError(f"{f.name} must be one of {choices}, got {value!r}")
            kind = f.type.split(" ")[0]
            if kind == "bool" and not isinstance(value, bool):
                raise ValueError(f"{f.name} must be True or False, got {value!r}")
            if kind == "int" and value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise ValueError(f"{f.name} must be an integer, got {value!r}")
        for name in ("page_size", "max_num_seqs", "max_num_batched_tokens", "tensor_parallel_size", "num_pages",
                     "max_model_len", "prefill_chunk_size", "num_nodes", "node_timeout", "max_seq_len_to_capture",
                     "num_state_snapshots"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if isinstance(self.gpu_memory_utilization, bool) or not isinstance(self.gpu_memory_utilization, (int, float)) \
                or not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        if isinstance(self.swap_space, bool) or not isinstance(self.swap_space, (int, float)) or self.swap_space < 0:
            raise ValueError(f"swap_space must be a number >= 0 (GiB), got {self.swap_space!r}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes < 1:
            raise ValueError(f"kv_cache_memory_bytes must be >= 1, got {self.kv_cache_memory_bytes}")
        k = self.num_speculative_tokens
        if not 0 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens must be in 0..{MAX_SPECULATIVE_TOKENS}, got {k}")
        if self.max_num_batched_tokens < k + 1:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must hold a verify step of {k + 1} rows"
            )
        if self.max_logprobs < 0:
            raise ValueError(f"max_logprobs must be >= 0, got {self.max_logprobs}")
        self.validate_nodes()

    def validate_nodes(self) -> None:
        if not 0 <= self.node_rank < self.num_nodes:
            raise ValueError(f"node_rank must be in 0..num_nodes-1 = 0..{self.num_nodes - 1}, got {self.node_rank}")
        if self.num_nodes == 1:
            if self.coordinator is not None:
                raise ValueError("coordinator is for num_nodes > 1; with one node there is nothing to coordinate")
            return
        host, _, port = (self.coordinator or "").rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"num_nodes={self.num_nodes} needs coordinator as HOST:PORT, got {self.coordinator!r}")

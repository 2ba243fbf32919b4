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


SPECULATIVE_METHODS = ("mtp",)


def speculative_tokens_of(config: EngineConfig) -> int:
    """num_speculative_tokens from speculative_config; what it does not implement is an error."""
    spec = config.speculative_config
    if not isinstance(spec, dict):
        raise ValueError(f"speculative_config must be a dict, got {spec!r}")
    unknown = sorted(set(spec) - {"method", "num_speculative_tokens"})
    if unknown:
        raise ValueError(f"speculative_config keys {unknown} are not supported (supported: method, num_speculative_tokens)")
    if spec.get("method", "mtp") not in SPECULATIVE_METHODS:
        raise ValueError(f"speculative_config method {spec.get('method')!r} is not supported (supported: {SPECULATIVE_METHODS})")
    if config.num_speculative_tokens and config.num_speculative_tokens != spec.get("num_speculative_tokens"):
        raise ValueError("num_speculative_tokens and speculative_config disagree; give one of them")
    if "num_speculative_tokens" not in spec:
        raise ValueError("speculative_config needs num_speculative_tokens")
    return spec["num_speculative_tokens"]


def option(default, help: str, choices: tuple | None = None, cli: bool = True):
    """A field with the metadata the CLI reads: its help text, its choices, and whether
    it is a command-line option at all."""
    return dataclasses.field(default=default, metadata={"help": help, "choices": choices, "cli": cli})


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    dtype: str = option(
        "auto", "weights' and activations' dtype; auto: the checkpoint's (config.json's torch_dtype), float16 included",
        DTYPES)
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
        None, 'vLLM\'s form of num_speculative_tokens: {"method": "mtp", "num_speculative_tokens": k}', cli=False)
    mtp_boundary: str = option(
        "next_chunk",
        "the token the MTP module reads after a non-final prefill chunk: the next prompt token (next_chunk), "
        "or the main model's sample, as the pre-fix engines did (sampled, for ablations)",
        MTP_BOUNDARIES,
    )
    enable_prefix_caching: bool = option(False, "reuse the KV pages of earlier requests' shared prefixes")
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
    load_format: str = option("auto", "how to read the weights (dummy: random weights of the config's shapes)", LOAD_FORMATS)
    max_logprobs: int = option(20, "most top logprobs a request may ask for")
    seed: int = option(0, "seed of dummy weights and of requests that set none")
    async_scheduling: bool = option(
        True, "schedule and dispatch step N+1 before reading step N, so host work overlaps the device's"
    )

    def __post_init__(self):
        if self.speculative_config is not None:
            object.__setattr__(self, "num_speculative_tokens", speculative_tokens_of(self))
        self.validate()

    @property
    def chunk_size(self) -> int:
        return self.prefill_chunk_size or self.max_num_batched_tokens

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
                     "max_model_len", "prefill_chunk_size", "num_nodes", "node_timeout"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if isinstance(self.gpu_memory_utilization, bool) or not isinstance(self.gpu_memory_utilization, (int, float)) \
                or not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
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

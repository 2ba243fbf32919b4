"""The engine options only the model can check or resolve (vLLM's: max_model_len against
the model's positions, quantization, speculative_config's model, tokenizer,
generation_config), and the start-up log line that names what the engine serves."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from jaxmtp.engine.engine_config import EngineConfig
from jaxmtp.engine.sampling_params import SamplingParams
from jaxmtp.loading.hub import resolve_tokenizer
from jaxmtp.models.config import ModelConfig
from jaxmtp.models.registry import generation_defaults

log = logging.getLogger("jaxmtp.engine.model_options")

# either allows a max_model_len past the model's max_position_embeddings (vLLM's, and ours)
ALLOW_LONG_MAX_MODEL_LEN = ("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "JAXMTP_ALLOW_LONG_MAX_MODEL_LEN")


def max_model_len(config: EngineConfig, cfg: ModelConfig) -> int:
    """config.max_model_len, else the model's max_position_embeddings; past that only where
    the environment allows it, as vLLM does (ALLOW_LONG_MAX_MODEL_LEN)."""
    limit = cfg.max_position_embeddings
    if config.max_model_len is None or config.max_model_len <= limit:
        return config.max_model_len or limit
    allowed = [name for name in ALLOW_LONG_MAX_MODEL_LEN if os.environ.get(name, "").strip().lower() in ("1", "true")]
    if not allowed:
        raise ValueError(
            f"max_model_len={config.max_model_len} is more than the model's max_position_embeddings={limit} "
            f"(config.json); set {ALLOW_LONG_MAX_MODEL_LEN[0]}=1 (or {ALLOW_LONG_MAX_MODEL_LEN[1]}=1) to allow it "
            "for a model whose positions hold past that"
        )
    log.warning("max_model_len=%d is more than the model's max_position_embeddings=%d (allowed by %s): outputs past "
                "%d positions may be poor", config.max_model_len, limit, allowed[0], limit)
    return config.max_model_len


def check_model_options(config: EngineConfig, model: str | Path, model_dir: Path, cfg: ModelConfig) -> None:
    """The options only the model can check: a ValueError names the option."""
    if config.quantization == "fp8" and cfg.quantization is None:
        raise ValueError(
            f"quantization='fp8' needs an fp8 checkpoint, and {model_dir!s}'s config.json has no fp8 "
            "quantization_config: this engine does not quantize weights while loading them"
        )
    draft = (config.speculative_config or {}).get("model")
    served = isinstance(draft, (str, Path)) and (
        str(draft) == str(model) or Path(draft).expanduser().resolve() == model_dir.resolve()
    )
    if draft is not None and not served:
        raise ValueError(
            f"speculative_config model {draft!r} is not supported: MTP drafts with the served model's own MTP "
            "layers, so model may only name the served model (or be left out)"
        )
    check_hybrid_options(config, cfg)
    k = config.num_speculative_tokens
    if k and not cfg.num_mtp_modules:
        raise ValueError(
            f"num_speculative_tokens={k} needs MTP weights, and {model_dir!s} has none "
            "(no num_nextn_predict_layers in config.json)"
        )
    m = min(k, cfg.num_mtp_modules)  # the MTP modules drafting
    if config.enable_prefix_caching and m > 1 and (config.page_size < m or config.prefix_cache_boundary != "exact"):
        # the rows a step rewrites before its first (up to M-1) must lie in the private
        # copy-on-write page a cache hit ends with (docs/prefix-cache.md)
        raise ValueError(
            f"prefix caching with {m} MTP modules drafting needs page_size >= {m} and "
            f"prefix_cache_boundary='exact', got page_size={config.page_size} and "
            f"prefix_cache_boundary={config.prefix_cache_boundary!r}"
        )


def check_hybrid_options(config: EngineConfig, cfg: ModelConfig) -> None:
    """num_state_snapshots names a hybrid model's states (linear attention): refused for
    a model without them."""
    if cfg.hybrid is None and config.num_state_snapshots is not None:
        raise ValueError(f"num_state_snapshots is for hybrid models (linear attention), and {cfg.model_type} "
                         "has none")


def num_state_snapshots(config: EngineConfig, cfg: ModelConfig) -> int:
    """The recurrent-state snapshots the engine keeps: with prefix caching, for a hybrid
    model, config.num_state_snapshots or max_num_seqs; else none."""
    if cfg.hybrid is None or not config.enable_prefix_caching:
        return 0
    return config.num_state_snapshots or config.max_num_seqs


def sampling_defaults(config: EngineConfig, model_dir: Path) -> dict:
    """The sampling fields config.generation_config names (registry.generation_defaults),
    checked as SamplingParams checks them: a bad value is a ValueError at start-up."""
    defaults = generation_defaults(model_dir, config.generation_config)
    try:
        SamplingParams(**defaults)
    except (ValueError, TypeError) as err:
        raise ValueError(f"generation_config's sampling defaults {defaults}: {err}") from None
    return defaults


def tokenizer_folder(config: EngineConfig, model_dir: Path) -> Path:
    """The folder of the tokenizer and chat template: config.tokenizer's, else the model's."""
    if config.tokenizer is None:
        return model_dir
    revision = config.tokenizer_revision
    if revision is None and not Path(config.tokenizer).expanduser().is_dir():
        revision = config.revision  # as vLLM: the model's revision for a tokenizer given by id
    folder = resolve_tokenizer(config.tokenizer, revision)
    if not (folder / "tokenizer.json").is_file():
        raise FileNotFoundError(f"tokenizer folder {config.tokenizer!s} has no tokenizer.json")
    return folder


def log_start(config: EngineConfig, model: str | Path, cfg: ModelConfig, max_len: int, generation_defaults: dict):
    """One line naming what this engine serves, and a line per vLLM option that changes nothing here."""
    k = config.num_speculative_tokens
    log.info(
        "model %s%s, dtype %s%s, max_model_len %d, speculative decoding: %s", model,
        f" (revision {config.revision})" if config.revision else "", cfg.dtype,
        ", fp8 weights" if cfg.quantization else "", max_len,
        f"method mtp (the model's MTP layers), num_speculative_tokens {k}" if k else "off",
    )
    if generation_defaults:
        log.info("default sampling parameters from generation_config.json: %s (generation_config='vllm' leaves "
                 "them out)", generation_defaults)
    for name, reason in config.ineffective().items():
        log.info("%s=%r has no effect here: %s", name, getattr(config, name), reason)

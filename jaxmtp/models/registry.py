"""The model families by config.json's model_type, config.json parsing into a
ModelConfig, and generation_config.json's default sampling parameters. A family is a
row here: what its transformers modeling file hard-codes (the Llama block otherwise:
RMSNorm, RoPE, GQA attention, a gated MLP), plus, where it has fields of its own
(experts, MLA), the configure function of its file."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

from jaxmtp.models import deepseek_v3, glm4_moe, qwen3_next
from jaxmtp.models.config import HIDDEN_ACTIVATIONS, MODEL_DTYPES, MTP_LAYOUTS, ModelConfig
from jaxmtp.models.quantization import quantization_from_hf


# generation_config.json's sampling fields, each with the SamplingParams field it sets
# (vLLM's get_diff_sampling_param: transformers' max_new_tokens is max_tokens)
GENERATION_SAMPLING_FIELDS = {
    "temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
    "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens",
}


@dataclasses.dataclass(frozen=True)
class Family:
    qk_norm: bool = False  # per-head RMSNorm of q and k
    qkv_bias: bool | None = None  # None: config.json's attention_bias
    o_bias: bool | None = None  # None: config.json's attention_bias
    reads_mlp_bias: bool = False  # biases on gate, up and down when config.json's mlp_bias
    reads_sliding_window: bool = False  # config.json's sliding_window applies
    refuses_sliding_window: bool = False  # use_sliding_window=true is refused
    partial_rotary_factor: float | None = None  # the default where config.json reads one; None: refused if not 1
    mtp_layout: str = "deepseek"  # the MTP modules' layout when config.json names none (jaxmtp_mtp_layout)
    # the MTP layer's embed_tokens and shared_head.head are copies of the main model's
    # (DeepSeek-V3, GLM-4.5): the module runs the main model's
    mtp_head_is_a_copy: bool = False
    # every layer has experts and config.json names no dense intermediate_size (Qwen3.5-MoE)
    experts_only: bool = False
    configure: Callable[[ModelConfig, dict], ModelConfig] | None = None  # the family's own fields


# Qwen3-Next and Qwen3.5: q/k norms, no attention biases, rope over a quarter of each head
# by default, hybrid layers and the rest in jaxmtp/models/qwen3_next.py
HYBRID = dict(qk_norm=True, qkv_bias=False, o_bias=False, refuses_sliding_window=True, partial_rotary_factor=0.25,
              mtp_layout="qwen3_next")


FAMILIES = {
    "llama": Family(reads_mlp_bias=True),
    "mistral": Family(qkv_bias=False, o_bias=False, reads_sliding_window=True),
    "qwen2": Family(qkv_bias=True, o_bias=False, refuses_sliding_window=True),
    "qwen3": Family(qk_norm=True, refuses_sliding_window=True),
    "mimo": Family(qkv_bias=True, o_bias=False, refuses_sliding_window=True, mtp_layout="mimo"),  # Qwen2 + MTP (MiMo-7B)
    "deepseek_v3": Family(o_bias=False, mtp_head_is_a_copy=True, configure=deepseek_v3.configure),
    "glm4_moe": Family(o_bias=False, partial_rotary_factor=0.5, mtp_head_is_a_copy=True, configure=glm4_moe.configure),
    "qwen3_next": Family(**HYBRID, configure=qwen3_next.configure_qwen3_next),
    # Qwen3.5: the ...ForConditionalGeneration config nests the text model's fields
    # under text_config (its model_type the *_text one, which *ForCausalLM writes)
    "qwen3_5_moe": Family(**HYBRID, experts_only=True, configure=qwen3_next.configure_qwen3_5_moe),
    "qwen3_5_moe_text": Family(**HYBRID, experts_only=True, configure=qwen3_next.configure_qwen3_5_moe),
    "qwen3_5": Family(**HYBRID, configure=qwen3_next.configure_qwen3_5),
    "qwen3_5_text": Family(**HYBRID, configure=qwen3_next.configure_qwen3_5),
}


def load_config(model_dir: str | Path, dtype: str = "auto") -> ModelConfig:
    """Read a Hugging Face config.json into a ModelConfig, or explain what is unsupported.
    dtype "auto" is the checkpoint's (torch_dtype, or transformers 5's dtype)."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"model folder {model_dir!s} has no config.json")
    hf = _text_model(json.loads(path.read_text()))
    model_type = hf.get("model_type")
    family = FAMILIES.get(model_type)
    if family is None:
        raise ValueError(
            f"unsupported model_type {model_type!r} (architectures {hf.get('architectures')}); supported: {sorted(FAMILIES)}"
        )
    if hf.get("use_sliding_window") and family.refuses_sliding_window:
        raise ValueError(f"{model_type} with use_sliding_window=true is not supported")
    quantization = quantization_from_hf(hf)
    attention_bias = bool(hf.get("attention_bias", False))
    hidden_act = hf.get("hidden_act", "silu")
    if hidden_act not in HIDDEN_ACTIVATIONS:
        raise ValueError(f"hidden_act={hidden_act!r} is not supported (supported: {list(HIDDEN_ACTIVATIONS)})")
    num_heads = hf["num_attention_heads"]
    dtype = _dtype_from_hf(hf) if dtype == "auto" else dtype
    if dtype not in MODEL_DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; use 'auto' or one of {list(MODEL_DTYPES)}")
    mtp_layout, num_mtp = _detect_mtp(hf, family)
    # transformers 4 writes rope_theta and rope_scaling; 5 writes rope_parameters
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    rope_theta = rope.pop("rope_theta", hf.get("rope_theta", 10000.0))
    # transformers 5 keeps partial_rotary_factor in rope_parameters, 4 at the top level
    partial_rotary_factor = rope.pop("partial_rotary_factor", hf.get("partial_rotary_factor"))
    if family.partial_rotary_factor is not None:
        partial_rotary_factor = family.partial_rotary_factor if partial_rotary_factor is None else partial_rotary_factor
    elif partial_rotary_factor not in (None, 1.0):
        raise ValueError(f"partial_rotary_factor={partial_rotary_factor} is not supported for {model_type}")
    cfg = ModelConfig(
        model_type=model_type,
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=0 if family.experts_only else hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=hf.get("num_key_value_heads") or num_heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=rope_theta,
        max_position_embeddings=hf.get("max_position_embeddings", 2048),
        tie_word_embeddings=hf.get("tie_word_embeddings", False),
        qkv_bias=attention_bias if family.qkv_bias is None else family.qkv_bias,
        qk_norm=family.qk_norm,
        o_bias=attention_bias if family.o_bias is None else family.o_bias,
        hidden_act=hidden_act,
        mlp_bias=bool(hf.get("mlp_bias", False)) and family.reads_mlp_bias,
        dtype=dtype,
        rope_scaling=tuple(sorted(rope.items())),
        sliding_window=hf.get("sliding_window") if family.reads_sliding_window else None,
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=_eos_token_ids(Path(model_dir), hf),
        num_mtp_modules=num_mtp,
        mtp_layout=mtp_layout,
        quantization=quantization,
        partial_rotary_factor=1.0 if partial_rotary_factor is None else float(partial_rotary_factor),
    )
    if family.configure is not None:
        cfg = family.configure(cfg, hf)
    cfg.rope_inv_freq()  # an unsupported rope type fails here, before any weights load
    return cfg


def _text_model(hf: dict) -> dict:
    """A multimodal config.json's text model (Qwen3.5's text_config) as one flat config:
    text_config's fields over the top level's (quantization_config, dtype, tie_word_embeddings
    may sit there), the top level's model_type kept; vision_config is not read."""
    if not isinstance(hf.get("text_config"), dict):
        return hf
    top = {k: v for k, v in hf.items() if k not in ("text_config", "vision_config")}
    return {**top, **hf["text_config"], "model_type": hf.get("model_type")}


def _as_tuple(value) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, (list, tuple)) else (int(value),)


def _eos_token_ids(model_dir: Path, hf: dict) -> tuple[int, ...]:
    """config.json's eos ids plus generation_config.json's (which may list several)."""
    ids = list(_as_tuple(hf.get("eos_token_id")))
    generation = model_dir / "generation_config.json"
    if generation.is_file():
        ids += [i for i in _as_tuple(json.loads(generation.read_text()).get("eos_token_id")) if i not in ids]
    return tuple(ids)


def generation_defaults(model_dir: Path, generation_config: str | Path = "auto") -> dict:
    """The default sampling parameters (SamplingParams' field -> value) that
    EngineConfig.generation_config names: "auto", those the model folder's
    generation_config.json sets; "vllm", none; a folder, those of its
    generation_config.json. Only fields the file sets (not null) are in it."""
    if not isinstance(generation_config, (str, Path)):
        raise ValueError(f"generation_config must be 'auto', 'vllm' or a folder, got {generation_config!r}")
    if generation_config == "vllm":
        return {}
    folder = Path(model_dir) if generation_config == "auto" else Path(generation_config).expanduser()
    path = folder / "generation_config.json"
    if not path.is_file():
        if generation_config == "auto":
            return {}
        raise FileNotFoundError(f"generation_config {generation_config!s}: no such folder with a generation_config.json")
    fields = json.loads(path.read_text())
    return {ours: fields[theirs] for theirs, ours in GENERATION_SAMPLING_FIELDS.items()
            if fields.get(theirs) is not None}


def _dtype_from_hf(hf: dict) -> str:
    """The checkpoint's dtype; none written means float32, as transformers reads it."""
    name = hf.get("torch_dtype") or hf.get("dtype") or "float32"
    if name not in MODEL_DTYPES:
        raise ValueError(f"config.json's torch_dtype {name!r} is not supported; pass dtype= one of {list(MODEL_DTYPES)}")
    return name


def _detect_mtp(hf: dict, family: Family) -> tuple[str | None, int]:
    n = hf.get("num_nextn_predict_layers", 0)
    if not n:
        return None, 0
    layout = hf.get("jaxmtp_mtp_layout", family.mtp_layout)
    if layout not in MTP_LAYOUTS:
        raise ValueError(f"unknown jaxmtp_mtp_layout {layout!r}; supported: {sorted(MTP_LAYOUTS)}")
    return layout, n

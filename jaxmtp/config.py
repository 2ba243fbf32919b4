"""Model configuration: the static, hashable facts a jitted step is compiled for."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np

# model_type -> (qkv bias, per-head q/k RMSNorm). Everything else in these families
# is the Llama block: RMSNorm, RoPE, GQA attention, SwiGLU MLP.
SUPPORTED_MODEL_TYPES = {
    "llama": (False, False),
    "mistral": (False, False),
    "qwen2": (True, False),
    "qwen3": (False, True),
    "mimo": (True, False),  # Qwen2 body plus MTP layers (MiMo-7B)
}


@dataclasses.dataclass(frozen=True)
class MTPLayout:
    """How a checkpoint's MTP modules were trained (the tensor names are the loader's)."""

    name: str
    # Which main-model hidden state feeds the module: DeepSeek-V3 (as vLLM and SGLang
    # run it) takes the state after the final norm, MiMo the state before it.
    hidden_after_final_norm: bool


MTP_LAYOUTS = {
    "deepseek": MTPLayout("deepseek", hidden_after_final_norm=True),
    "mimo": MTPLayout("mimo", hidden_after_final_norm=False),
}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    dtype: str  # "float32" | "bfloat16"
    # rope_scaling as a sorted tuple of (key, value) so the config stays hashable.
    rope_scaling: tuple = ()
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # MTP: number of draft modules shipped with the checkpoint and the layout they
    # were trained under (see jaxmtp/mtp.py for what the layout decides).
    num_mtp_modules: int = 0
    mtp_layout: str | None = None

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def jnp_dtype(self):
        import jax.numpy as jnp

        return jnp.dtype(self.dtype)

    def rope_inv_freq(self) -> np.ndarray:
        """Inverse RoPE frequencies in float64, with Llama-3 scaling applied if configured."""
        dim = self.head_dim
        inv_freq = 1.0 / (self.rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
        scaling = dict(self.rope_scaling)
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind in (None, "default"):
            return inv_freq
        if kind == "linear":
            return inv_freq / scaling["factor"]
        if kind == "llama3":
            factor = scaling["factor"]
            low = scaling["low_freq_factor"]
            high = scaling["high_freq_factor"]
            old_len = scaling["original_max_position_embeddings"]
            wavelen = 2 * math.pi / inv_freq
            low_wavelen = old_len / low
            high_wavelen = old_len / high
            smooth = (old_len / wavelen - low) / (high - low)
            smoothed = (1 - smooth) * inv_freq / factor + smooth * inv_freq
            return np.where(
                wavelen > low_wavelen,
                inv_freq / factor,
                np.where(wavelen < high_wavelen, inv_freq, smoothed),
            )
        raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: default, linear, llama3)")


def _as_tuple(value) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, (list, tuple)) else (int(value),)


def load_config(model_dir: str | Path, dtype: str | None = None) -> ModelConfig:
    """Read a Hugging Face config.json into a ModelConfig, or explain what is unsupported."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"model folder {model_dir!s} has no config.json")
    hf = json.loads(path.read_text())
    model_type = hf.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"unsupported model_type {model_type!r} (architectures {hf.get('architectures')}); "
            f"supported: {sorted(SUPPORTED_MODEL_TYPES)}"
        )
    if hf.get("use_sliding_window") and model_type in ("qwen2", "qwen3", "mimo"):
        raise ValueError(f"{model_type} with use_sliding_window=true is not supported")
    default_bias, qk_norm = SUPPORTED_MODEL_TYPES[model_type]
    num_heads = hf["num_attention_heads"]
    dtype = dtype or _dtype_from_hf(hf)
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"unsupported dtype {dtype!r}; use 'float32' or 'bfloat16'")
    mtp_layout, num_mtp = _detect_mtp(hf, model_type)
    # transformers 4 writes rope_theta and rope_scaling; 5 writes rope_parameters
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    rope_theta = rope.pop("rope_theta", hf.get("rope_theta", 10000.0))
    return ModelConfig(
        model_type=model_type,
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=hf.get("num_key_value_heads") or num_heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=rope_theta,
        max_position_embeddings=hf.get("max_position_embeddings", 2048),
        tie_word_embeddings=hf.get("tie_word_embeddings", False),
        qkv_bias=hf.get("attention_bias", default_bias),
        qk_norm=qk_norm,
        dtype=dtype,
        rope_scaling=tuple(sorted(rope.items())),
        sliding_window=hf.get("sliding_window") if model_type == "mistral" else None,
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=_eos_token_ids(Path(model_dir), hf),
        num_mtp_modules=num_mtp,
        mtp_layout=mtp_layout,
    )


def _eos_token_ids(model_dir: Path, hf: dict) -> tuple[int, ...]:
    """config.json's eos ids plus generation_config.json's (which may list several)."""
    ids = list(_as_tuple(hf.get("eos_token_id")))
    generation = model_dir / "generation_config.json"
    if generation.is_file():
        ids += [i for i in _as_tuple(json.loads(generation.read_text()).get("eos_token_id")) if i not in ids]
    return tuple(ids)


def _dtype_from_hf(hf: dict) -> str:
    name = hf.get("torch_dtype") or hf.get("dtype") or "float32"
    return "bfloat16" if name in ("bfloat16", "float16") else "float32"


def _detect_mtp(hf: dict, model_type: str) -> tuple[str | None, int]:
    n = hf.get("num_nextn_predict_layers", 0)
    if not n:
        return None, 0
    default = "mimo" if model_type == "mimo" else "deepseek"
    layout = hf.get("jaxmtp_mtp_layout", default)
    if layout not in MTP_LAYOUTS:
        raise ValueError(f"unknown jaxmtp_mtp_layout {layout!r}; supported: {sorted(MTP_LAYOUTS)}")
    return layout, n

"""Model configuration: the static, hashable facts a jitted step is compiled for. Parsing
config.json into them is jaxmtp/models/registry.py's, over the model families."""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from jaxmtp.models.quantization import Fp8BlockConfig

MODEL_DTYPES = ("float32", "bfloat16", "float16")
# how attention (and the kernels that follow its choice: MLA, fp8 matmuls) runs: "auto"
# is the Pallas kernels on a GPU where they tile the shape, else the jnp references
ATTENTION_BACKENDS = ("auto", "reference", "pallas", "pallas_interpret")


def check_attention_backend(name: str) -> None:
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {ATTENTION_BACKENDS}")


# config.json's hidden_act values the engine implements (jaxmtp.models.layers.ACTIVATIONS), as
# transformers' ACT2FN defines them
HIDDEN_ACTIVATIONS = ("silu", "swish", "gelu", "gelu_new", "gelu_pytorch_tanh", "gelu_fast", "quick_gelu", "relu")


@dataclasses.dataclass(frozen=True)
class MTPLayout:
    """How a checkpoint's MTP modules were trained (the tensor names are the loader's)."""

    name: str
    # Which main-model hidden state feeds the module: DeepSeek-V3 (as vLLM and SGLang
    # run it) takes the state after the final norm, MiMo the state before it.
    hidden_after_final_norm: bool
    # Which output of a module its next chained draft step reads (k > modules): vLLM's
    # qwen3_next_mtp returns it after the module's final norm, deepseek_mtp before it
    chain_after_module_norm: bool = False


MTP_LAYOUTS = {
    "deepseek": MTPLayout("deepseek", hidden_after_final_norm=True),
    "mimo": MTPLayout("mimo", hidden_after_final_norm=False),
    # Qwen3-Next and Qwen3.5 (mtp.fc over concat(embedding, hidden), as vLLM's
    # qwen3_next_mtp.py): the main model's output after its final norm, as vLLM passes it
    "qwen3_next": MTPLayout("qwen3_next", hidden_after_final_norm=True, chain_after_module_norm=True),
}


@dataclasses.dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2/V3): K and V are expanded per head from a
    compressed latent of kv_lora_rank values, plus one shared rope key of
    qk_rope_head_dim values; the paged cache holds only those two."""

    q_lora_rank: int | None  # None: q_proj straight from the hidden state
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @classmethod
    def from_hf(cls, hf: dict) -> MLAConfig:
        mla = cls(
            q_lora_rank=hf.get("q_lora_rank"),
            kv_lora_rank=hf["kv_lora_rank"],
            qk_nope_head_dim=hf["qk_nope_head_dim"],
            qk_rope_head_dim=hf["qk_rope_head_dim"],
            v_head_dim=hf["v_head_dim"],
        )
        if mla.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim={mla.qk_rope_head_dim} must be even")
        return mla


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """A mixture of experts: routed experts, k of them per token, plus shared experts.
    Routing is DeepSeek-V3's noaux_tc (sigmoid scores, a correction bias for selection
    only, group-limited top-k) or Qwen's softmax (Qwen3-Next, Qwen3.5: softmax over
    every expert, the k best, no bias, no groups); see jaxmtp.models.moe.route."""

    num_experts: int  # n_routed_experts
    num_experts_per_tok: int
    num_shared_experts: int
    moe_intermediate_size: int
    first_k_dense_replace: int  # layers before this index keep a dense MLP
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    norm_topk_prob: bool
    routing: str = "noaux_tc"  # or "softmax"
    # Qwen's one shared expert has a width of its own (shared_expert_intermediate_size);
    # None: DeepSeek's, moe_intermediate_size per shared expert
    shared_expert_intermediate_size: int | None = None
    # Qwen's shared expert output is scaled by sigmoid(x @ shared_expert_gate), a [H] -> 1 gate
    shared_expert_gate: bool = False

    @property
    def shared_intermediate_size(self) -> int:
        if self.shared_expert_intermediate_size is not None:
            return self.shared_expert_intermediate_size
        return self.moe_intermediate_size * self.num_shared_experts

    @classmethod
    def from_hf(cls, hf: dict, model_type: str) -> MoEConfig:
        """config.json's MoE fields; what the engine does not implement is refused by name."""
        refused = {
            "topk_method": (hf.get("topk_method"), (None, "noaux_tc")),
            "scoring_func": (hf.get("scoring_func"), (None, "sigmoid")),
            "hidden_act": (hf.get("hidden_act", "silu"), ("silu",)),
            "moe_layer_freq": (hf.get("moe_layer_freq"), (None, 1)),
        }
        for field, (value, supported) in refused.items():
            if value not in supported:
                raise ValueError(f"{model_type} with {field}={value!r} is not supported (supported: {list(supported)})")
        moe = cls(
            num_experts=hf["n_routed_experts"],
            num_experts_per_tok=hf["num_experts_per_tok"],
            num_shared_experts=hf.get("n_shared_experts") or 0,
            moe_intermediate_size=hf["moe_intermediate_size"],
            first_k_dense_replace=hf.get("first_k_dense_replace") or 0,
            n_group=hf.get("n_group") or 1,
            topk_group=hf.get("topk_group") or 1,
            routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
            norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
        )
        per_group, rem = divmod(moe.num_experts, moe.n_group)
        if rem or per_group < 2:
            raise ValueError(f"n_routed_experts={moe.num_experts} must split into n_group={moe.n_group} groups of at least 2")
        if not 1 <= moe.topk_group <= moe.n_group:
            raise ValueError(f"topk_group={moe.topk_group} must lie in 1..n_group={moe.n_group}")
        if not 1 <= moe.num_experts_per_tok <= moe.topk_group * per_group:
            raise ValueError(
                f"num_experts_per_tok={moe.num_experts_per_tok} must lie in 1..{moe.topk_group * per_group} "
                f"(the experts of topk_group={moe.topk_group} groups)"
            )
        return moe


@dataclasses.dataclass(frozen=True)
class HybridConfig:
    """Qwen3-Next's and Qwen3.5's hybrid decoder: most layers mix tokens by gated DeltaNet
    linear attention, the others by full attention with a sigmoid output gate per head
    (attn_output_gate; q_norm and k_norm, rope over partial_rotary_factor of each head).
    The linear layers' heads: Hk key heads (q and k, linear_key_head_dim each) and
    Hv = r * Hk value heads (linear_value_head_dim each), value heads g*r .. g*r + r - 1
    reading key head g; their inputs pass a causal depthwise conv of
    linear_conv_kernel_dim taps. MTP layers are full attention."""

    layer_types: tuple[str, ...]  # per main-model layer: "linear_attention" or "full_attention"
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int

    @property
    def value_heads_per_key(self) -> int:
        return self.linear_num_value_heads // self.linear_num_key_heads

    @property
    def conv_group_width(self) -> int:
        """One key head's conv channels: its q and k, and its value heads' v."""
        return 2 * self.linear_key_head_dim + self.value_heads_per_key * self.linear_value_head_dim

    @property
    def qkvz_group_width(self) -> int:
        """One key head's columns of the input projection: q, k, v, then z (the output gate)."""
        return self.conv_group_width + self.value_heads_per_key * self.linear_value_head_dim


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
    dtype: str  # one of MODEL_DTYPES
    # rope_scaling as a sorted tuple of (key, value) so the config stays hashable.
    rope_scaling: tuple = ()
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # MTP: number of draft modules shipped with the checkpoint and the layout they
    # were trained under (see jaxmtp/worker/mtp.py for what the layout decides).
    num_mtp_modules: int = 0
    mtp_layout: str | None = None
    # RoPE over the first partial_rotary_factor of each head (GLM-4.5: 0.5); with
    # rope_interleave the rotated dims pair up (x0, x1), (x2, x3), ... (DeepSeek)
    partial_rotary_factor: float = 1.0
    rope_interleave: bool = False
    mla: MLAConfig | None = None
    moe: MoEConfig | None = None
    o_bias: bool = False  # a bias on o_proj (Llama's and Qwen3's attention_bias)
    hidden_act: str = "silu"  # the gated MLP's activation, one of HIDDEN_ACTIVATIONS
    mlp_bias: bool = False  # biases on gate, up and down (Llama's mlp_bias)
    quantization: Fp8BlockConfig | None = None  # fp8 linear weights with block scales (jaxmtp/models/quantization.py)
    hybrid: HybridConfig | None = None  # linear-attention layers among the full ones (Qwen3-Next, Qwen3.5)
    # RMSNorms that scale by 1 + w (Qwen3-Next, Qwen3.5: every RMSNorm but the linear
    # attention's gated one). The loader folds the 1 in: those weights are 1 + w in
    # float32, exact as transformers computes it (1.0 + w.float()); a forward in bfloat16
    # then multiplies the float32 normed rows by them and rounds once, transformers'
    # order, where the Llama norm rounds the normed rows first (layers.rms_norm)
    zero_centred_norm: bool = False

    def layer_is_moe(self, layer: int) -> bool:
        """Whether decoder layer `layer` (MTP layers continue the numbering) has experts."""
        return self.moe is not None and layer >= self.moe.first_k_dense_replace

    def layer_is_linear(self, layer: int) -> bool:
        """Whether decoder layer `layer` mixes tokens by linear attention (MTP layers,
        numbered after the main model's, are full attention)."""
        return (self.hybrid is not None and layer < self.num_layers
                and self.hybrid.layer_types[layer] == "linear_attention")

    @property
    def num_kv_layers(self) -> int:
        """The main model's layers with paged KV: all but the linear-attention ones."""
        return sum(not self.layer_is_linear(i) for i in range(self.num_layers))

    @property
    def norm_dtype(self) -> str:
        """The dtype the RMSNorm weights are kept in: float32 where folded (zero_centred_norm)."""
        return "float32" if self.zero_centred_norm else self.dtype

    @property
    def rotary_dim(self) -> int:
        if self.mla is not None:
            return self.mla.qk_rope_head_dim
        return int(self.head_dim * self.partial_rotary_factor)

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
        """Inverse RoPE frequencies in float64, with Llama-3 or YaRN scaling applied if configured."""
        dim = self.rotary_dim
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
        if kind == "yarn":
            return _yarn_inv_freq(inv_freq, dim, self.rope_theta, scaling, self.max_position_embeddings)
        raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: default, linear, llama3, yarn)")

    def rope_attention_factor(self) -> float:
        """YaRN's scale on cos and sin (1 for every other rope type)."""
        scaling = dict(self.rope_scaling)
        if scaling.get("rope_type", scaling.get("type")) != "yarn":
            return 1.0
        if scaling.get("attention_factor") is not None:
            return float(scaling["attention_factor"])
        factor = _yarn_factor(scaling, self.max_position_embeddings)
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            return _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        return _yarn_mscale(factor)

    def mla_softmax_scale(self) -> float:
        """DeepSeek's softmax scale: qk_head_dim ** -0.5, times mscale(factor,
        mscale_all_dim) squared under YaRN (the long-context correction)."""
        scale = self.mla.qk_head_dim**-0.5
        scaling = dict(self.rope_scaling)
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        if kind != "default" and scaling.get("mscale_all_dim"):
            mscale = _yarn_mscale(_yarn_factor(scaling, self.max_position_embeddings), scaling["mscale_all_dim"])
            scale *= mscale * mscale
        return scale


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_factor(scaling: dict, max_position_embeddings: int) -> float:
    factor = scaling.get("factor")
    return max_position_embeddings / scaling["original_max_position_embeddings"] if factor is None else factor


def _yarn_inv_freq(inv_freq: np.ndarray, dim: int, base: float, scaling: dict, max_position_embeddings: int) -> np.ndarray:
    """YaRN (arXiv 2309.00071) as transformers computes it: interpolated frequencies
    below the correction range, the original ones above it, a linear ramp between."""
    factor = _yarn_factor(scaling, max_position_embeddings)
    old_len = scaling["original_max_position_embeddings"]
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations):
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    return inv_freq / factor * (1 - extrapolation) + inv_freq * extrapolation

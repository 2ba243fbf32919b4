"""Load parameters: Hugging Face safetensors folders, the engine's own orbax checkpoints,
or random weights of the right shapes (load_format="dummy")."""

from __future__ import annotations

import dataclasses
import functools
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from jaxmtp.loading.hybrid import check_layer_kind, gated_query_refs, linear_attention_refs
from jaxmtp.loading.tensor_source import StackedRef, TensorRef, TensorSource, slice_ref, stack_refs
from jaxmtp.models.config import ModelConfig
from jaxmtp.models.linear import with_fp8_matmul
from jaxmtp.models.params import (
    BiasedLayerParams,
    ExpertLayerParams,
    HybridLayerParams,
    LayerParams,
    MLAParams,
    MoEParams,
    MTPParams,
    Params,
    layer_params_class,
    param_shapes,
    random_params,
)
from jaxmtp.models.expert_layout import with_shared_apart
from jaxmtp.models.qkv_layout import with_separate_qkv
from jaxmtp.models.registry import FAMILIES

# a tree of parameters (arrays, shapes or tensor refs, Params' layout) -> the same tree of
# shardings: where each loaded array goes
Shardings = Callable[[object], object]


def on_first_device(tree) -> object:
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return jax.tree.map(lambda _: device, tree)


ORBAX_DIR = "params"  # the engine's own checkpoints keep an orbax tree here


def _block_refs(src: TensorSource, prefix: str, cfg: ModelConfig, layer: int,
                norm_names=("input_layernorm", "post_attention_layernorm")) -> LayerParams:
    """Decoder layer `layer` (MTP layers continue the numbering) stored under prefix."""
    attn, mlp = f"{prefix}.self_attn", f"{prefix}.mlp"
    linear = cfg.layer_is_linear(layer)
    gqa, dense = cfg.mla is None and not linear, not cfg.layer_is_moe(layer)

    def optional(name, enabled, **kwargs):
        return src.ref(name, **kwargs) if enabled else None

    def proj(module, enabled=True):
        return src.weight_ref(module, cfg.quantization) if enabled else None

    q_proj = proj(f"{attn}.q_proj", gqa)
    kind, extra = layer_params_class(cfg), {}
    if kind is HybridLayerParams:
        q_proj, attn_gate = gated_query_refs(src, attn, cfg) if gqa else (None, None)
        extra = dict(moe=None if dense else _moe_refs(src, mlp, cfg), attn_gate=attn_gate,
                     linear_attention=linear_attention_refs(src, f"{prefix}.linear_attn", cfg) if linear else None)
    elif kind is ExpertLayerParams:
        extra = dict(mla=None if gqa else _mla_refs(src, attn, cfg), moe=None if dense else _moe_refs(src, mlp, cfg))
    elif kind is BiasedLayerParams:
        extra = dict(
            o_bias=optional(f"{attn}.o_proj.bias", cfg.o_bias),
            gate_up_bias=StackedRef(tuple(src.ref(f"{mlp}.{n}.bias") for n in ("gate_proj", "up_proj")), axis=0)
            if cfg.mlp_bias else None,
            down_bias=optional(f"{mlp}.down_proj.bias", cfg.mlp_bias),
        )
    return kind(
        **extra,
        input_norm=_norm_ref(src, f"{prefix}.{norm_names[0]}.weight", cfg),
        q_proj=q_proj,
        k_proj=proj(f"{attn}.k_proj", gqa),
        v_proj=proj(f"{attn}.v_proj", gqa),
        o_proj=proj(f"{attn}.o_proj", not linear),
        post_norm=_norm_ref(src, f"{prefix}.{norm_names[1]}.weight", cfg),
        gate_up_proj=_gate_up_ref(src, mlp, cfg) if dense else None,
        down_proj=proj(f"{mlp}.down_proj", dense),
        q_bias=optional(f"{attn}.q_proj.bias", cfg.qkv_bias),
        k_bias=optional(f"{attn}.k_proj.bias", cfg.qkv_bias),
        v_bias=optional(f"{attn}.v_proj.bias", cfg.qkv_bias),
        q_norm=_norm_ref(src, f"{attn}.q_norm.weight", cfg) if cfg.qk_norm and not linear else None,
        k_norm=_norm_ref(src, f"{attn}.k_norm.weight", cfg) if cfg.qk_norm and not linear else None,
    )


def _norm_ref(src: TensorSource, name: str, cfg: ModelConfig) -> TensorRef:
    """An RMSNorm's weight; a zero-centred one (ModelConfig.zero_centred_norm) as 1 + w
    in float32, which is exact: transformers computes 1.0 + w.float() itself."""
    return src.ref(name, dtype="float32", add=1.0) if cfg.zero_centred_norm else src.ref(name)


def _gate_up_ref(src: TensorSource, mlp: str, cfg: ModelConfig):
    """gate_proj and up_proj stacked [H, 2, I]."""
    return stack_refs(tuple(src.weight_ref(f"{mlp}.{name}", cfg.quantization) for name in ("gate_proj", "up_proj")), 1)


def _mla_refs(src: TensorSource, attn: str, cfg: ModelConfig) -> MLAParams:
    lora = cfg.mla.q_lora_rank is not None

    def proj(module, enabled=True):
        return src.weight_ref(f"{attn}.{module}", cfg.quantization) if enabled else None

    return MLAParams(
        kv_a_proj=proj("kv_a_proj_with_mqa"),
        kv_a_norm=src.ref(f"{attn}.kv_a_layernorm.weight"),
        kv_b_proj=src.absorbed_ref(f"{attn}.kv_b_proj", cfg.num_heads, cfg.quantization),
        q_proj=proj("q_proj", not lora),
        q_a_proj=proj("q_a_proj", lora),
        q_a_norm=src.ref(f"{attn}.q_a_layernorm.weight") if lora else None,
        q_b_proj=proj("q_b_proj", lora),
    )


def _moe_refs(src: TensorSource, mlp: str, cfg: ModelConfig) -> MoEParams:
    """The routed experts stacked into one array per projection (_expert_refs), at load
    time, and the shared experts: DeepSeek's stored as shared_experts, Qwen's one as
    shared_expert with its gate shared_expert_gate. The router (and Qwen's gate) stays
    unquantized (float32, as the checkpoints keep it)."""
    moe = cfg.moe
    shared = f"{mlp}.shared_expert" if moe.shared_expert_gate else f"{mlp}.shared_experts"
    has_shared = moe.num_shared_experts > 0
    experts_gate_up, experts_down = _expert_refs(src, mlp, cfg)
    return MoEParams(
        router=src.ref(f"{mlp}.gate.weight", transpose=True, dtype="float32"),
        router_bias=src.ref(f"{mlp}.gate.e_score_correction_bias", dtype="float32")
        if moe.routing == "noaux_tc" else None,
        experts_gate_up=experts_gate_up,
        experts_down=experts_down,
        shared_gate_up=_gate_up_ref(src, shared, cfg) if has_shared else None,
        shared_down=src.weight_ref(f"{shared}.down_proj", cfg.quantization) if has_shared else None,
        shared_gate=src.ref(f"{mlp}.shared_expert_gate.weight", fixed=((0, 0),), dtype="float32")
        if moe.shared_expert_gate else None,
    )


def _expert_refs(src: TensorSource, mlp: str, cfg: ModelConfig) -> tuple:
    """The routed experts' gate/up [E, H, 2, I] and down [E, I, H], from one tensor per
    expert and projection (mlp.experts.E.{gate,up,down}_proj), or from one per projection
    for all experts, as Qwen3.5's release stores its main layers: experts.gate_up_proj
    [E, 2I, H] (gate, then up) and experts.down_proj [E, H, I]."""
    experts, q = range(cfg.moe.num_experts), cfg.quantization
    fused = f"{mlp}.experts.gate_up_proj"
    if fused not in src:
        return (stack_refs(tuple(_gate_up_ref(src, f"{mlp}.experts.{e}", cfg) for e in experts), 0),
                stack_refs(tuple(src.weight_ref(f"{mlp}.experts.{e}.down_proj", q) for e in experts), 0))
    if q is not None:
        raise ValueError(f"{fused}: experts fused into one tensor with fp8 block scales are not implemented")
    i = cfg.moe.moe_intermediate_size
    gate_up = [src.ref(fused, transpose=True, fixed=((0, e),)) for e in experts]  # [H, 2I] each
    return (StackedRef(tuple(StackedRef((slice_ref(w, 1, 0, i), slice_ref(w, 1, i, 2 * i)), 1) for w in gate_up), 0),
            StackedRef(tuple(src.ref(f"{mlp}.experts.down_proj", transpose=True, fixed=((0, e),)) for e in experts), 0))


def _mtp_module_refs(src: TensorSource, cfg: ModelConfig, n: int) -> MTPParams:
    """One MTP module in the layout the checkpoint ships (see jaxmtp/worker/mtp.py for layouts)."""
    h = cfg.hidden_size
    if cfg.mtp_layout == "mimo":
        p = f"model.mtp_layers.{n}"
        proj = f"{p}.input_proj.weight"  # [2H, H] over concat(hidden, embedding)
        return MTPParams(
            token_norm=_norm_ref(src, f"{p}.token_layernorm.weight", cfg),
            hidden_norm=_norm_ref(src, f"{p}.hidden_layernorm.weight", cfg),
            proj_token=src.ref(proj, transpose=True, rows=(h, 2 * h)),
            proj_hidden=src.ref(proj, transpose=True, rows=(0, h)),
            block=_block_refs(src, p, cfg, cfg.num_layers + n),
            final_norm=_norm_ref(src, f"{p}.final_layernorm.weight", cfg),
        )
    if cfg.mtp_layout == "qwen3_next":  # one full-attention layer; the main model's embedding and head
        proj = "mtp.fc.weight"  # [H, 2H] over concat(embedding, hidden), as vLLM's qwen3_next_mtp.py
        return MTPParams(
            token_norm=_norm_ref(src, "mtp.pre_fc_norm_embedding.weight", cfg),
            hidden_norm=_norm_ref(src, "mtp.pre_fc_norm_hidden.weight", cfg),
            proj_token=src.ref(proj, transpose=True, rows=(0, h)),
            proj_hidden=src.ref(proj, transpose=True, rows=(h, 2 * h)),
            block=_block_refs(src, f"mtp.layers.{n}", cfg, cfg.num_layers + n),
            final_norm=_norm_ref(src, "mtp.norm.weight", cfg),
        )
    p = f"model.layers.{cfg.num_layers + n}"
    proj = f"{p}.eh_proj.weight"  # [2H, H] over concat(embedding, hidden)
    head = f"{p}.shared_head.head.weight"
    # DeepSeek-V3 and GLM-4.5 store copies of the main model's embedding and head in
    # the layer (embed_tokens, shared_head.head): the module uses the main model's
    own_head = head in src and not FAMILIES[cfg.model_type].mtp_head_is_a_copy
    return MTPParams(
        token_norm=_norm_ref(src, f"{p}.enorm.weight", cfg),
        hidden_norm=_norm_ref(src, f"{p}.hnorm.weight", cfg),
        proj_token=src.ref(proj, transpose=True, rows=(0, h)),
        proj_hidden=src.ref(proj, transpose=True, rows=(h, 2 * h)),
        block=_block_refs(src, p, cfg, cfg.num_layers + n),
        final_norm=_norm_ref(src, f"{p}.shared_head.norm.weight", cfg),
        lm_head=src.ref(head, transpose=True) if own_head else None,
    )


def load_hf_params(model_dir: Path, cfg: ModelConfig, shardings: Shardings, num_mtp_modules: int) -> Params:
    """Each device reads only its own shard of each tensor from disk: no device, and no
    host buffer, ever holds the whole model. Only the first num_mtp_modules MTP modules
    are read."""
    src = TensorSource(model_dir)
    # Qwen3.5's ...ForConditionalGeneration keeps its text model under model.language_model
    model = "model.language_model" if "model.language_model.embed_tokens.weight" in src else "model"
    if cfg.hybrid is not None:
        for i in range(cfg.num_layers):
            check_layer_kind(src, f"{model}.layers.{i}", cfg, i)
    refs = Params(
        embed=src.ref(f"{model}.embed_tokens.weight"),
        layers=[_block_refs(src, f"{model}.layers.{i}", cfg, i) for i in range(cfg.num_layers)],
        final_norm=_norm_ref(src, f"{model}.norm.weight", cfg),
        lm_head=None if cfg.tie_word_embeddings else src.ref("lm_head.weight", transpose=True),
        mtp=[_mtp_module_refs(src, cfg, n) for n in range(num_mtp_modules)],
    )
    # a progress bar on a terminal (tqdm leaves it out when stderr is not one)
    with tqdm(total=len(jax.tree.leaves(refs)), desc=f"loading {model_dir.name}", unit="tensor", disable=None) as bar:
        def place(ref, sharding):
            array = jax.make_array_from_callback(
                ref.shape, sharding, functools.partial(src.read, ref, dtype=jnp.dtype(ref.dtype or cfg.dtype))
            )
            bar.update()
            return array

        return jax.tree.map(place, refs, shardings(refs))


def _orbax():
    import orbax.checkpoint as ocp

    return ocp


def save_checkpoint(out_dir: str | Path, params: Params, cfg: ModelConfig, source_dir: str | Path | None = None) -> Path:
    """Write the engine's own checkpoint: an orbax tree plus config.json (and the
    tokenizer files copied from source_dir), loadable by LLM(out_dir)."""
    out = Path(out_dir).absolute()
    out.mkdir(parents=True, exist_ok=True)
    if source_dir is not None:
        for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "config.json"):
            if (Path(source_dir) / name).is_file() and Path(source_dir).absolute() != out:
                shutil.copy(Path(source_dir) / name, out / name)
    hf = json.loads((out / "config.json").read_text()) if (out / "config.json").is_file() else {}
    hf["num_nextn_predict_layers"] = len(params.mtp)
    if params.mtp:
        hf["jaxmtp_mtp_layout"] = cfg.mtp_layout or "deepseek"
    (out / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    target = out / ORBAX_DIR
    if target.exists():
        shutil.rmtree(target)
    checkpointer = _orbax().StandardCheckpointer()
    # the checkpoint's layout: fp8 weights [in, out] (the reference's), q, k and v apart,
    # the shared experts apart from the routed ones
    checkpointer.save(target, with_separate_qkv(with_shared_apart(with_fp8_matmul(params, "reference")), cfg))
    checkpointer.wait_until_finished()
    return out


def restore_checkpoint(model_dir: Path, cfg: ModelConfig, shardings: Shardings) -> Params:
    """Orbax reads each array straight into its target sharding."""
    shapes = param_shapes(cfg)
    target = jax.tree.map(
        lambda s, sharding: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding),
        shapes, shardings(shapes),
    )
    try:
        return _orbax().StandardCheckpointer().restore(Path(model_dir).absolute() / ORBAX_DIR, target)
    except ValueError as err:
        if "up_proj" in str(err) and "gate_up_proj" in str(err):
            raise ValueError(
                f"{model_dir!s} is an engine checkpoint with gate_proj and up_proj stored apart, from before "
                "the engine stacked them into gate_up_proj (2026-11-30): export it to a Hugging Face folder "
                "(jaxmtp.loading.loader.export_hf_checkpoint) with the engine that wrote it, and load that folder"
            ) from err
        raise


def load_params(
    model_dir: str | Path, cfg: ModelConfig, load_format: str = "auto", seed: int = 0,
    num_mtp_modules: int | None = None, shardings: Shardings | None = None,
) -> Params:
    """Parameters placed as shardings says (a tree of parameters or their shapes to
    its shardings: the runner's sharding rules over its mesh; None: all on the first
    device), with the
    first num_mtp_modules MTP modules (None: all the config declares). The engine asks
    for the modules its drafting runs: none without speculation (checkpoints often
    declare num_nextn_predict_layers but ship without the modules' tensors), and
    min(k, N) for k speculative tokens."""
    model_dir = Path(model_dir)
    shardings = shardings or on_first_device
    num_mtp = cfg.num_mtp_modules if num_mtp_modules is None else num_mtp_modules
    if num_mtp > cfg.num_mtp_modules:
        raise ValueError(f"asked for {num_mtp} MTP modules; {model_dir!s} declares {cfg.num_mtp_modules}")
    if load_format == "dummy":
        return random_params(cfg, jax.random.key(seed), num_mtp, shardings(param_shapes(cfg, num_mtp)))
    if load_format not in ("auto", "safetensors", "orbax"):
        raise ValueError(f"unknown load_format {load_format!r}; use 'auto', 'safetensors', 'orbax' or 'dummy'")
    if load_format == "orbax" or (load_format == "auto" and (model_dir / ORBAX_DIR).is_dir()):
        params = restore_checkpoint(model_dir, cfg, shardings)  # all modules; the unused ones are dropped
        return dataclasses.replace(params, mtp=params.mtp[:num_mtp])
    return load_hf_params(model_dir, cfg, shardings, num_mtp)


def _block_tensors(prefix: str, p: LayerParams) -> dict:
    names = {
        "input_layernorm.weight": (p.input_norm, False),
        "self_attn.q_proj.weight": (p.q_proj, True),
        "self_attn.k_proj.weight": (p.k_proj, True),
        "self_attn.v_proj.weight": (p.v_proj, True),
        "self_attn.o_proj.weight": (p.o_proj, True),
        "post_attention_layernorm.weight": (p.post_norm, False),
        "mlp.gate_proj.weight": (p.gate_up_proj[:, 0], True),
        "mlp.up_proj.weight": (p.gate_up_proj[:, 1], True),
        "mlp.down_proj.weight": (p.down_proj, True),
        "self_attn.q_proj.bias": (p.q_bias, False),
        "self_attn.k_proj.bias": (p.k_bias, False),
        "self_attn.v_proj.bias": (p.v_bias, False),
        "self_attn.q_norm.weight": (p.q_norm, False),
        "self_attn.k_norm.weight": (p.k_norm, False),
        "self_attn.o_proj.bias": (p.o_bias, False),
        "mlp.gate_proj.bias": (None if p.gate_up_bias is None else p.gate_up_bias[0], False),
        "mlp.up_proj.bias": (None if p.gate_up_bias is None else p.gate_up_bias[1], False),
        "mlp.down_proj.bias": (p.down_bias, False),
    }
    return {f"{prefix}.{name}": (w.T if transpose else w) for name, (w, transpose) in names.items() if w is not None}


def export_hf_checkpoint(out_dir: str | Path, params: Params, cfg: ModelConfig, source_dir: str | Path) -> Path:
    """Write params as a Hugging Face folder, MTP modules in the DeepSeek-V3 layout
    (model.layers.{num_hidden_layers + n}: enorm, hnorm, eh_proj over
    concat(embedding, hidden), shared_head.norm), which vLLM and SGLang also read."""
    from safetensors.numpy import save_file

    if cfg.moe is not None or cfg.hybrid is not None:
        raise ValueError(f"export writes Llama-family models; {cfg.model_type} (experts, MLA, hybrid layers) "
                         "is not implemented")
    if cfg.quantization is not None:
        raise ValueError("export writes unquantized weights; writing fp8 weights with their scales is not implemented")
    if cfg.mtp_layout not in (None, "deepseek"):
        raise ValueError(f"export writes the DeepSeek layout; these modules were trained as {cfg.mtp_layout!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    params = with_separate_qkv(params, cfg)
    tensors = {"model.embed_tokens.weight": params.embed, "model.norm.weight": params.final_norm}
    if params.lm_head is not None:
        tensors["lm_head.weight"] = params.lm_head.T
    for i, layer in enumerate(params.layers):
        tensors.update(_block_tensors(f"model.layers.{i}", layer))
    for n, module in enumerate(params.mtp):
        p = f"model.layers.{cfg.num_layers + n}"
        tensors.update(_block_tensors(p, module.block))
        tensors[f"{p}.enorm.weight"] = module.token_norm
        tensors[f"{p}.hnorm.weight"] = module.hidden_norm
        tensors[f"{p}.eh_proj.weight"] = jnp.concatenate([module.proj_token, module.proj_hidden]).T
        tensors[f"{p}.shared_head.norm.weight"] = module.final_norm
        if module.lm_head is not None:
            tensors[f"{p}.shared_head.head.weight"] = module.lm_head.T
    # float32 on disk: numpy has no bfloat16, and the config keeps the dtype to load in
    save_file({name: np.asarray(w, np.float32) for name, w in tensors.items()}, str(out / "model.safetensors"))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (Path(source_dir) / name).is_file():
            shutil.copy(Path(source_dir) / name, out / name)
    hf = json.loads((Path(source_dir) / "config.json").read_text())
    hf.pop("jaxmtp_mtp_layout", None)
    hf["num_nextn_predict_layers"] = len(params.mtp)
    hf["torch_dtype"] = cfg.dtype
    (out / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    return out

"""The shared experts held as the routed experts' first groups (jaxmtp.models.expert_layout)
against the same layer with them apart: the MoE output on every path that takes the
pairs (XLA's sort, the routing kernel in interpret mode, the paired form), fp8 experts
with non-square block scales, where the layout is refused, and the checkpoint's layout
(apart, exactly as loaded). The engine's own fold meets transformers in test_moe_models
and test_fp8 (the DeepSeek and GLM-4.5 models' shared experts are groups there).

Random inputs are fresh per test (the seed is in every failure message)."""

from __future__ import annotations

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmtp.kernels import grouped_matmul as gm
from jaxmtp.kernels import route as route_kernel
from jaxmtp.kernels.grouped_reference import paired_matmul_reference, paired_swiglu_reference
from jaxmtp.loading.loader import on_first_device, restore_checkpoint, save_checkpoint
from jaxmtp.models import moe
from jaxmtp.models.expert_layout import shared_apart, shared_in_experts, with_shared_in_experts
from jaxmtp.models.linear import with_fp8_matmul
from jaxmtp.models.params import FP8, Fp8Weight, random_params
from jaxmtp.models.registry import load_config
from test_moe_kernels import seeded
from test_route_kernel import moe_config

H, EXPERTS, K = 32, 16, 4


def f32(rng, *shape, scale=0.3):
    return jnp.asarray(scale * rng.standard_normal(shape), jnp.float32)


def fp8(rng, shape, block):
    """An Fp8Weight of N(0, 1) fp8 values and scales in [0.05, 0.15) per block."""
    scales = tuple(-(-size // b) for size, b in zip(shape, block))
    return Fp8Weight(jnp.asarray(rng.standard_normal(shape), FP8), jnp.asarray(0.05 + 0.1 * rng.random(scales)),
                     block)


def layer(rng, width: int, shared_width: int, block: tuple[int, int] | None = None) -> moe.MoEParams:
    """EXPERTS routed experts of `width` columns and a shared MLP of shared_width; fp8 in
    [in, out] blocks `block` where given."""
    if block is None:
        gate_up, down = f32(rng, EXPERTS, H, 2, width), f32(rng, EXPERTS, width, H)
        shared_gate_up, shared_down = f32(rng, H, 2, shared_width), f32(rng, shared_width, H)
    else:
        bk, bn = block
        gate_up, down = fp8(rng, (EXPERTS, H, 2, width), (1, bk, 1, bn)), fp8(rng, (EXPERTS, width, H), (1, bk, bn))
        shared_gate_up, shared_down = fp8(rng, (H, 2, shared_width), (bk, 1, bn)), fp8(rng, (shared_width, H), block)
    return moe.MoEParams(router=f32(rng, H, EXPERTS, scale=1.0), router_bias=f32(rng, EXPERTS, scale=0.1),
                         experts_gate_up=gate_up, experts_down=down, shared_gate_up=shared_gate_up,
                         shared_down=shared_down)


def config(shared: int, width: int, **changes):
    return dataclasses.replace(moe_config(EXPERTS, K, "noaux_tc", True), num_shared_experts=shared,
                               moe_intermediate_size=width, **changes)


def assert_same_rows(got, want, rows: int, seed: int):
    """Float32 sums of K + 2 products of float32 dots (32 terms) taken in another order:
    within 64 ulps of the largest output."""
    got, want = np.asarray(got)[:rows], np.asarray(want)[:rows]
    np.testing.assert_allclose(got, want, rtol=0, atol=64 * 2.0**-24 * np.abs(want).max(), err_msg=f"seed={seed}")


@pytest.mark.parametrize("block", [None, (16, 8)], ids=["float32", "fp8-16x8"])
def test_shared_experts_as_groups_give_the_layers_output(monkeypatch, block):
    """Two shared experts: the folded layer's real rows (5 of 8) equal the layer with them
    apart, through XLA's sort, the paired form and the routing kernel (interpret mode);
    fp8 ones with non-square blocks (a swapped block axis would scale the wrong columns).
    Folded in place, the old arrays are freed; undone, the layout is the one loaded, to
    the bit."""
    rng, seed = seeded()
    cfg, apart = config(2, 16), layer(rng, 16, 32, block)
    folded = shared_in_experts(apart, cfg)
    assert folded.shared_in_experts == 2 and folded.shared_gate_up is None and folded.shared_down is None
    x = f32(rng, 8, H, scale=1.0)
    want = moe.moe_ffn(apart, cfg, x, num_rows=5)
    assert_same_rows(moe.moe_ffn(folded, cfg, x, num_rows=5), want, 5, seed)

    routing = moe.route(x, folded.router, folded.router_bias, cfg).with_shared_experts(2).without_rows_from(5)
    by_pair = moe.routed_experts_by_pair(x, routing, folded.experts_gate_up, folded.experts_down,
                                         pair_swiglu=paired_swiglu_reference, pair_matmul=paired_matmul_reference)
    assert_same_rows(by_pair, want, 5, seed)

    monkeypatch.setattr(moe, "routes_in_kernel", lambda *args: True)
    monkeypatch.setattr(moe, "route_and_sort",
                        lambda *args, **kwargs: route_kernel.route_and_sort(*args, **kwargs, interpret=True))
    assert_same_rows(moe.moe_ffn(folded, cfg, x, num_rows=5), want, 5, seed)

    # in place: the same arrays, the old ones freed (no second copy of the experts on the device)
    copy = jax.tree.map(jnp.copy, apart)
    in_place = shared_in_experts(copy, cfg, in_place=True)
    assert all(x.is_deleted() for x in jax.tree.leaves((copy.experts_gate_up, copy.experts_down, copy.shared_gate_up,
                                                       copy.shared_down)))
    for got, expected in zip(jax.tree.leaves(in_place), jax.tree.leaves(folded)):
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(expected, np.float32))

    undone = shared_apart(folded)
    assert jax.tree.structure(undone) == jax.tree.structure(apart)
    for got, expected in zip(jax.tree.leaves(undone), jax.tree.leaves(apart)):
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(expected, np.float32))


def test_fp8_experts_held_k_major_give_the_layers_output():
    """On a kernel path with_fp8_matmul holds fp8 experts K-major ([E, (2,) N, K], the
    grouped kernels' fp8 tile read along K), their shape still the loaded one; the
    layer's output is the loaded layout's through the references (the engine's path off
    GPUs; to the bit), the sorted grouped kernels and the paired ones (interpret mode);
    on the reference path the weights are the loaded ones again, to the bit; experts the
    kernel cannot tile stay as loaded."""
    rng, seed = seeded()
    cfg = config(2, 16)
    loaded = shared_in_experts(layer(rng, 16, 32, (16, 8)), cfg)
    held = with_fp8_matmul(loaded, "pallas_interpret")
    for got, want in ((held.experts_gate_up, loaded.experts_gate_up), (held.experts_down, loaded.experts_down)):
        assert got.k_major and got.in_axis == 1 and got.shape == want.shape
        assert got.weight.shape == (want.shape[0], *want.shape[2:], want.shape[1])
        np.testing.assert_array_equal(np.asarray(got.in_major_weight, np.float32), np.asarray(want.weight, np.float32))
    x = f32(rng, 8, H, scale=1.0)
    np.testing.assert_array_equal(np.asarray(moe.moe_ffn(held, cfg, x, num_rows=5)),
                                  np.asarray(moe.moe_ffn(loaded, cfg, x, num_rows=5)), err_msg=f"seed={seed}: references")
    routing = moe.route(x, loaded.router, loaded.router_bias, cfg).with_shared_experts(2)
    sorted_kernels = dict(expert_swiglu=functools.partial(gm.grouped_swiglu_kernel, interpret=True),
                          expert_matmul=functools.partial(gm.grouped_matmul_kernel, interpret=True))
    paired_kernels = dict(pair_swiglu=functools.partial(gm.paired_swiglu_kernel, interpret=True),
                          pair_matmul=functools.partial(gm.paired_matmul_kernel, interpret=True))
    for name, fn, kernels in [("sorted", moe.routed_experts, sorted_kernels),
                              ("paired", moe.routed_experts_by_pair, paired_kernels)]:
        got = fn(x, routing, held.experts_gate_up, held.experts_down, **kernels)
        want = fn(x, routing, loaded.experts_gate_up, loaded.experts_down, **kernels)
        assert_same_rows(got, want, 8, seed)  # the transposed tile's dot may sum in another order
    back = with_fp8_matmul(held, "reference")
    for got, want in zip(jax.tree.leaves(back), jax.tree.leaves(loaded)):
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    assert not back.experts_gate_up.k_major
    # experts the kernel cannot tile (K = 24, not a multiple of 16) run the reference: as loaded
    untiled = dataclasses.replace(loaded, experts_gate_up=fp8(rng, (EXPERTS, 24, 2, 16), (1, 8, 1, 8)))
    assert not with_fp8_matmul(untiled, "pallas_interpret").experts_gate_up.k_major


@pytest.mark.parametrize("case", ["fp8-not-whole-blocks", "gated", "width-of-its-own"])
def test_shared_experts_stay_apart_where_they_cannot_be_groups(case):
    """fp8 experts of 12 columns in blocks of 8 (the scales would split mid-block); Qwen's
    gated shared expert; one shared expert of a width of its own."""
    rng, _ = seeded()
    if case == "fp8-not-whole-blocks":
        apart, cfg = layer(rng, 12, 24, (16, 8)), config(2, 12)
    elif case == "gated":
        apart = dataclasses.replace(layer(rng, 16, 16), shared_gate=f32(rng, H))
        cfg = config(1, 16, shared_expert_gate=True)
    else:
        apart, cfg = layer(rng, 16, 32), config(1, 16, shared_expert_intermediate_size=32)
    assert shared_in_experts(apart, cfg) is apart


TINY_DEEPSEEK = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 64,
    "intermediate_size": 128, "moe_intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 4, "n_routed_experts": 8, "n_shared_experts": 2, "num_experts_per_tok": 2,
    "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1, "routed_scaling_factor": 2.5, "norm_topk_prob": True,
    "topk_method": "noaux_tc", "scoring_func": "sigmoid", "q_lora_rank": None, "kv_lora_rank": 32,
    "qk_nope_head_dim": 16, "qk_rope_head_dim": 16, "v_head_dim": 16, "vocab_size": 512,
    "max_position_embeddings": 512, "rope_theta": 10000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2, "num_nextn_predict_layers": 1,
}
FP8_BLOCKS = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [32, 16]}


@pytest.mark.parametrize("quantization", [None, FP8_BLOCKS], ids=["bfloat16", "fp8-32x16"])
def test_a_checkpoint_holds_the_shared_experts_apart(tmp_path, quantization):
    """save_checkpoint of params whose 2 shared experts are groups (the MTP layer's too),
    fp8 ones K-major, restores as the loaded layout, every array equal."""
    folder = tmp_path / "model"
    folder.mkdir()
    hf = TINY_DEEPSEEK if quantization is None else {**TINY_DEEPSEEK, "quantization_config": quantization}
    (folder / "config.json").write_text(json.dumps(hf))
    cfg = load_config(folder)
    params = random_params(cfg, jax.random.key(seeded()[1]))
    folded = with_shared_in_experts(params, cfg)
    assert folded.layers[0].moe is None and folded.layers[1].moe.shared_in_experts == 2  # a dense first layer
    assert folded.mtp[0].block.moe.shared_in_experts == 2
    if quantization is not None:  # and the experts K-major, as the kernels read them
        folded = with_fp8_matmul(folded, "pallas_interpret")
        assert folded.layers[1].moe.experts_down.k_major and folded.mtp[0].block.moe.experts_gate_up.k_major
    restored = restore_checkpoint(save_checkpoint(tmp_path / "ckpt", folded, cfg, folder), cfg, on_first_device)
    assert jax.tree.structure(restored) == jax.tree.structure(params)
    for got, expected in zip(jax.tree.leaves(restored), jax.tree.leaves(params)):
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(expected, np.float32))

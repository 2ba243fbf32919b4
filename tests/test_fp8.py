"""fp8 checkpoints with block scales (DeepSeek-V3's format: 128 x 128 blocks; the Llama
here has 128 x 64, so that an engine mixing up the two block sizes fails), on the CPU:
tiny random models quantized here into exactly that format (every linear weight
float8_e4m3fn with its float32 weight_scale_inv, the rest as it was), against
transformers running the same weights dequantized; greedy MTP equal to plain decoding;
the weights stay fp8 on the device, dummy weights and tensor parallelism included."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import ROOT, fresh_rng, greedy, make_hf_model, prompt_logits, run_on_cpu_devices, token_ids
from jaxmtp import LLM, SamplingParams
from jaxmtp.models.registry import load_config
from jaxmtp.models.params import FP8, Fp8Weight
from tolerances import assert_within, logits_bound, rounded_activations_bound

FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
BLOCK = 128
# the Llama's weight_block_size, [out, in]: non-square, so that a block size read along
# the wrong axis (the kernel's K step, a scale's repeat, a shard of whole blocks) shows
LLAMA_BLOCK = (128, 64)
# the tiny DeepSeek's (its matrices are 16-88 wide: 128 x 128 would make each one block)
DEEPSEEK_BLOCK = (32, 16)
E4M3_MAX = 448.0
# a dense Llama whose matrices span several blocks, the last of most partial (K = 320
# for down_proj, N = 320 for gate and up, N = 64 for k and v), with 8 heads of 32
LLAMA_SHAPE = dict(hidden_size=256, intermediate_size=320, num_attention_heads=8, num_key_value_heads=2,
                   head_dim=32)


def is_linear_weight(name: str) -> bool:
    """The tensors the format quantizes: every projection of a decoder layer (attention,
    MLA, dense MLP, experts, shared experts); not the router, the embedding, the norms,
    the LM head or the MTP layer's eh_proj."""
    return (name.endswith("_proj.weight") or name.endswith("kv_a_proj_with_mqa.weight")) and "eh_proj" not in name


def per_block(values: torch.Tensor, block: tuple[int, int], shape) -> torch.Tensor:
    """values [ceil(out / block[0]), ceil(in / block[1])] spread over an [out, in] matrix."""
    return values.repeat_interleave(block[0], 0)[: shape[0]].repeat_interleave(block[1], 1)[:, : shape[1]]


def quantize(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's quantization of an [out, in] weight: per block ([out, in] sizes),
    scale_inv = amax / 448 and q = w / scale_inv in e4m3."""
    out, inp = w.shape
    blocks = (math.ceil(out / block[0]), math.ceil(inp / block[1]))
    padded = torch.zeros(blocks[0] * block[0], blocks[1] * block[1], dtype=torch.float64)
    padded[:out, :inp] = w
    amax = padded.reshape(blocks[0], block[0], blocks[1], block[1]).abs().amax(dim=(1, 3))
    scale = (amax / E4M3_MAX).clamp(min=1e-12).float()
    return (w / per_block(scale, block, w.shape)).to(torch.float8_e4m3fn), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    return q.float() * per_block(scale, block, q.shape)


def quantize_folder(folder, rng, block: tuple[int, int] = (BLOCK, BLOCK)) -> tuple:
    """Quantizes folder's model.safetensors in place into the fp8 format, each block of
    each weight first scaled by 2^U(-2, 2) so that the blocks' scales differ (a scale
    applied to the wrong block shows). Returns the fp8 folder and two twins for
    transformers: the dequantized weights, and the weights before quantization (both
    float32)."""
    twins = [folder.parent / f"{folder.name}-{kind}" for kind in ("dequantized", "unquantized")]
    for twin in twins:
        shutil.copytree(folder, twin)
    stored, dequantized, unquantized = {}, {}, {}
    for name, w in load_file(folder / "model.safetensors").items():
        if not is_linear_weight(name):
            stored[name], dequantized[name], unquantized[name] = w, w.float(), w.float()
            continue
        spread = torch.tensor(2.0 ** rng.uniform(-2, 2, (math.ceil(w.shape[0] / block[0]), math.ceil(w.shape[1] / block[1]))))
        w = w.double() * per_block(spread, block, w.shape)
        q, scale = quantize(w, block)
        stored[name], stored[name + "_scale_inv"], dequantized[name] = q, scale, dequantize(q, scale, block)
        unquantized[name] = w.float()
    for target, tensors in zip((folder, *twins), (stored, dequantized, unquantized)):
        save_file(tensors, str(target / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "quantization_config": {
        **FP8_CONFIG, "weight_block_size": list(block)}}))
    return folder, *twins


def transformers_model(twin, dtype):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(twin, dtype=dtype).eval()
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation("eager")  # the grouped-mm default has no float64
    return model


def transformers_logits(model, ids) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].double().numpy()


def transformers_greedy(model, ids, n) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             pad_token_id=0, eos_token_id=None)
    return out[0, len(ids):].tolist()


# the Llama's decoder layers and its widest sum (down_proj's K); the DeepSeek's (its dense
# MLP's 48 terms; the MTP layer does not reach the logits)
LLAMA_LAYERS, LLAMA_WIDEST_SUM = 2, LLAMA_SHAPE["intermediate_size"]
DEEPSEEK_LAYERS, DEEPSEEK_WIDEST_SUM = 2, 48


def assert_bf16_rounded(ours, theirs, truth, num_layers: int, max_terms: int) -> None:
    """bf16 activations (float32 sums, rounded after each stage) against the float64 truth
    of the same weights: on average within tolerances.rounded_activations_bound, the
    first-order bound every logit obeys where no stage amplifies the rounding handed to
    it. These random models do amplify it at a few rows (the worst logit up to 3.6x the
    bound over 100 seeds, the average at most 0.17x of it), so the average compares. A
    scale on the wrong block moves the logits by their own size. And rounded: at least a
    tenth of transformers' bf16 error on average (0.28x at the least over those seeds;
    float32 lies a thousand times closer)."""
    ours, theirs = np.abs(ours - truth), np.abs(theirs - truth)
    first_order = rounded_activations_bound(float(np.abs(truth).max()), num_layers, max_terms, 2.0**-8)
    assert ours.mean() <= first_order, (ours.mean(), first_order)
    assert ours.mean() > theirs.mean() / 10, (ours.mean(), theirs.mean())


@pytest.fixture(scope="module")
def llama_fp8(tmp_path_factory):
    """A dense Llama in bf16 (as fp8 checkpoints ship their other tensors), quantized in
    128 x 64 blocks."""
    rng = fresh_rng()
    folder = make_hf_model(tmp_path_factory.mktemp("fp8") / "llama", "llama", seed=int(rng.integers(1 << 30)),
                           dtype="bfloat16", **LLAMA_SHAPE)
    return quantize_folder(folder, rng, LLAMA_BLOCK)


@pytest.fixture(scope="module")
def llama_engine(llama_fp8):
    return LLM(llama_fp8[0], dtype="float32", max_num_seqs=2, max_num_batched_tokens=32, page_size=4)


def test_linear_weights_stay_fp8_on_the_device_with_their_block_scales(llama_fp8, llama_engine):
    cfg, layer, params = llama_engine.engine.model_config, llama_engine.engine.params.layers[0], llama_engine.engine.params
    assert (cfg.quantization.block_out, cfg.quantization.block_in) == LLAMA_BLOCK
    # stored [in, out]: scales [ceil(in / 64), ceil(out / 128)]
    for name, shape, blocks in [("q_proj", (256, 256), (4, 2)), ("k_proj", (256, 64), (4, 1)),
                                ("o_proj", (256, 256), (4, 2)), ("down_proj", (320, 256), (5, 2))]:
        w = getattr(layer, name)
        assert isinstance(w, Fp8Weight) and w.weight.dtype == FP8 and w.weight.shape == shape, name
        assert w.scale_inv.dtype == np.float32 and w.scale_inv.shape == blocks, name
        assert w.block == (64, 128), name
    assert layer.gate_up_proj.weight.shape == (256, 2, 320) and layer.gate_up_proj.scale_inv.shape == (4, 2, 3)
    # embeddings, norms and the head keep the model's dtype
    assert params.embed.dtype == params.lm_head.dtype == layer.input_norm.dtype == np.float32
    # the stored bytes are the device's: scales [ceil(out/128), ceil(in/64)], transposed
    stored = load_file(llama_fp8[0] / "model.safetensors")
    np.testing.assert_array_equal(np.asarray(layer.down_proj.scale_inv),
                                  stored["model.layers.0.mlp.down_proj.weight_scale_inv"].numpy().T)
    np.testing.assert_array_equal(np.asarray(layer.q_proj.weight.astype(np.float32)),
                                  stored["model.layers.0.self_attn.q_proj.weight"].float().numpy().T)


def test_logits_and_greedy_match_transformers_on_the_dequantized_weights(llama_fp8, llama_engine, rng):
    folder, dequantized, unquantized = llama_fp8
    ids = [1] + rng.integers(3, 97, size=21).tolist()
    truth = transformers_logits(transformers_model(dequantized, torch.float64), ids)
    hf32 = transformers_model(dequantized, torch.float32)
    ours = prompt_logits(llama_engine.engine, ids)
    assert_within(ours, truth, logits_bound(truth, LLAMA_LAYERS, LLAMA_WIDEST_SUM), "float32")
    out = llama_engine.generate([ids], greedy(16), use_tqdm=False)
    assert token_ids(out) == [transformers_greedy(hf32, ids, 16)]

    # the fp8 rounding of the weights is real: the engine's logits lie further from those
    # of the weights before quantization than a float32 evaluation of them could
    before = transformers_logits(transformers_model(unquantized, torch.float64), ids)
    assert np.abs(ours - before).max() > logits_bound(before, LLAMA_LAYERS, LLAMA_WIDEST_SUM)

    # in the checkpoint's dtype (bf16 activations, as served)
    bf16 = LLM(folder, max_num_seqs=1, max_num_batched_tokens=32, page_size=4)
    assert bf16.engine.model_config.dtype == "bfloat16"
    assert_bf16_rounded(prompt_logits(bf16.engine, ids),
                        transformers_logits(transformers_model(dequantized, torch.bfloat16), ids), truth, LLAMA_LAYERS,
                        LLAMA_WIDEST_SUM)


def test_the_engine_runs_the_pallas_kernel_where_the_attention_does(llama_fp8, llama_engine, rng):
    """attention_backend pallas_interpret: every fp8 matmul goes through the kernel (in
    interpret mode), and gives the reference's logits."""
    from jaxmtp.models.linear import fp8_matmul_for

    quantization = llama_engine.engine.model_config.quantization
    assert fp8_matmul_for("auto", quantization) == "reference"  # a CPU
    assert fp8_matmul_for("pallas", quantization) == "pallas"
    llm = LLM(llama_fp8[0], dtype="float32", max_num_seqs=1, max_num_batched_tokens=32, page_size=4,
              attention_backend="pallas_interpret")
    weights = [w for w in jax.tree.leaves(llm.engine.params, is_leaf=lambda x: isinstance(x, Fp8Weight))
               if isinstance(w, Fp8Weight)]
    assert weights and {w.matmul for w in weights} == {"pallas_interpret"}
    # the kernel reads K-major weights: the checkpoint's [out, in] bytes as they are
    assert all(w.k_major for w in weights)
    layer = llm.engine.params.layers[0]
    assert layer.q_proj.weight.shape == (256, 256) and layer.down_proj.weight.shape == (256, 320)
    assert layer.gate_up_proj.weight.shape == (2, 320, 256) and layer.gate_up_proj.shape == (256, 2, 320)
    stored = load_file(llama_fp8[0] / "model.safetensors")
    np.testing.assert_array_equal(np.asarray(layer.down_proj.weight.astype(np.float32)),
                                  stored["model.layers.0.mlp.down_proj.weight"].float().numpy())
    ids = [1] + rng.integers(3, 97, size=9).tolist()
    # the same float32 products summed in another order (per 128-block, then scaled)
    want = prompt_logits(llama_engine.engine, ids)
    assert_within(prompt_logits(llm.engine, ids), want, logits_bound(want, LLAMA_LAYERS, LLAMA_WIDEST_SUM))


def test_a_checkpoint_saved_from_k_major_weights_holds_the_in_out_layout(llama_fp8, llama_engine, tmp_path):
    """save_checkpoint of an engine whose kernel reads K-major weights writes the [in, out]
    layout the loader restores, and leaves the engine's own weights in place."""
    from jaxmtp.loading.loader import save_checkpoint

    llm = LLM(llama_fp8[0], dtype="float32", max_num_seqs=1, max_num_batched_tokens=32, page_size=4,
              attention_backend="pallas_interpret")
    saved = save_checkpoint(tmp_path / "ckpt", llm.engine.params, llm.engine.model_config, llama_fp8[0])
    restored = LLM(saved, dtype="float32", max_num_seqs=1, max_num_batched_tokens=32, page_size=4)
    for ours, theirs in [(llm.engine.params.layers[1].gate_up_proj, restored.engine.params.layers[1].gate_up_proj),
                         (llm.engine.params.layers[0].o_proj, restored.engine.params.layers[0].o_proj)]:
        assert ours.k_major and not theirs.k_major
        np.testing.assert_array_equal(np.asarray(ours.in_major_weight.astype(np.float32)),
                                      np.asarray(theirs.weight.astype(np.float32)))
        np.testing.assert_array_equal(np.asarray(ours.scale_inv), np.asarray(theirs.scale_inv))
    ids = [1, 5, 9, 13]
    assert_within(prompt_logits(restored.engine, ids), prompt_logits(llama_engine.engine, ids), 0.0)


@pytest.fixture(scope="module")
def deepseek_fp8(tmp_path_factory):
    """A tiny DeepSeek-V3 (MLA, experts, its MTP layer), quantized in 32 x 16 blocks:
    experts, shared experts, dense MLP and every MLA projection, the MTP layer's block
    included."""
    from test_moe_mtp import make_mtp_checkpoint

    rng = fresh_rng()
    folder, _, _ = make_mtp_checkpoint(tmp_path_factory.mktemp("fp8") / "deepseek", "deepseek-qlora-yarn",
                                       seed=int(rng.integers(1 << 30)))
    return quantize_folder(folder, rng, DEEPSEEK_BLOCK)


DEEPSEEK_ENGINE = dict(dtype="float32", page_size=8, max_num_seqs=4, max_num_batched_tokens=16, num_pages=24)


def test_deepseek_v3_fp8_matches_transformers_and_mtp_drafts_exactly(deepseek_fp8, rng):
    folder, twin, _ = deepseek_fp8
    plain = LLM(folder, **DEEPSEEK_ENGINE)
    moe, mla = plain.engine.params.layers[1].moe, plain.engine.params.layers[1].mla
    assert moe.experts_gate_up.weight.dtype == FP8 and moe.experts_gate_up.block == (1, 16, 1, 32)
    assert moe.router.dtype == np.float32 and not isinstance(moe.router, Fp8Weight)
    assert all(isinstance(w, Fp8Weight) for w in (mla.q_a_proj, mla.q_b_proj, mla.kv_a_proj))
    # the absorbed form's weights, dequantized once while read (the step reads them whole)
    m, heads = plain.engine.model_config.mla, plain.engine.model_config.num_heads
    assert mla.kv_b_proj.dtype == np.float32
    assert mla.kv_b_proj.shape == (m.qk_nope_head_dim + m.v_head_dim, heads, m.kv_lora_rank)
    ids = [1] + rng.integers(3, 97, size=29).tolist()
    hf32 = transformers_model(twin, torch.float32)
    truth = transformers_logits(transformers_model(twin, torch.float64), ids)
    assert_within(prompt_logits(plain.engine, ids), truth, logits_bound(truth, DEEPSEEK_LAYERS, DEEPSEEK_WIDEST_SUM),
                  "float32")
    expected = transformers_greedy(hf32, ids, 24)
    assert token_ids(plain.generate([ids], greedy(24), use_tqdm=False)) == [expected]

    # MTP (its layer fp8 too), prefill in chunks of 3: greedy speculation is plain greedy,
    # over three prompts (one random model's drafts can miss all along one prompt)
    spec = LLM(folder, num_speculative_tokens=2, prefill_chunk_size=3, **DEEPSEEK_ENGINE)
    assert spec.engine.params.mtp[0].block.mla.q_b_proj.weight.dtype == FP8
    prompts = [ids] + [[1] + rng.integers(3, 97, size=n).tolist() for n in (17, 11)]
    outs = spec.generate(prompts, greedy(24), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [expected] + [transformers_greedy(hf32, p, 24) for p in prompts[1:]]
    # drafts are accepted, not only rejected. Some quantized random models' MTP layer
    # predicts nothing the main model emits (seed 1955239669): then the same model with
    # its weights dequantized, no fp8 anywhere, must reject every draft too
    if sum(o.spec_stats["accepted_per_position"][0] for o in outs) == 0:
        float_spec = LLM(twin, num_speculative_tokens=2, prefill_chunk_size=3, **DEEPSEEK_ENGINE)
        again = float_spec.generate(prompts, greedy(24), use_tqdm=False)
        assert [(o.outputs[0].token_ids, o.spec_stats["accepted"]) for o in again] == [
            (o.outputs[0].token_ids, 0) for o in outs], "only the fp8 model's drafts are all rejected"


def test_dummy_weights_of_an_fp8_config_are_fp8_and_leave_the_kv_pool_the_bytes_saved(tmp_path):
    """load_format dummy builds fp8 weights for any config with this
    quantization_config (so every shape can be benchmarked): a byte a weight plus
    their scales. On an accelerator the KV pool is sized from the allocator's bytes in
    use after the weights are placed (jaxmtp/worker/memory.py), so it gains what fp8 saves."""
    import dataclasses

    from jaxmtp.worker.memory import activation_bytes, page_bytes, plan_kv_pool
    from jaxmtp.models.params import param_shapes
    from test_memory import FakeGPU

    hf = {"model_type": "llama", "vocab_size": 97, "num_hidden_layers": 2, "torch_dtype": "bfloat16",
          "max_position_embeddings": 64, **LLAMA_SHAPE}
    (tmp_path / "config.json").write_text(json.dumps({**hf, "quantization_config": FP8_CONFIG}))
    llm = LLM(tmp_path, load_format="dummy", max_num_seqs=1, max_num_batched_tokens=8)
    assert len(llm.generate([[1, 2, 3]], greedy(4), use_tqdm=False)[0].outputs[0].token_ids) == 4
    cfg, params = llm.engine.model_config, llm.engine.params
    weights = [w for w in jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, Fp8Weight)) if isinstance(w, Fp8Weight)]
    assert len(weights) == 6 * cfg.num_layers and all(w.weight.nbytes == math.prod(w.shape) for w in weights)
    fp8_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
    bf16_bytes = sum(math.prod(x.shape) * 2 for x in jax.tree.leaves(param_shapes(dataclasses.replace(cfg, quantization=None))))
    saved = sum(math.prod(w.shape) for w in weights) - sum(w.scale_inv.nbytes for w in weights)
    assert fp8_bytes == bf16_bytes - saved

    per_page, active = page_bytes(cfg, 16, 0), activation_bytes(cfg, 8, 1000, 0)
    limit = int((bf16_bytes + active + 200 * per_page) / 0.9) + 1  # bf16 weights leave room for 200 pages

    def pool(weight_bytes):
        gpu = FakeGPU({"bytes_limit": limit, "bytes_in_use": weight_bytes})
        return plan_kv_pool(cfg, page_size=16, num_draft_modules=0, max_pages_per_seq=4, max_num_seqs=1000,
                            max_num_batched_tokens=8, num_speculative_tokens=0, num_pages=None,
                            gpu_memory_utilization=0.9, kv_cache_memory_bytes=None, devices=[gpu]).num_pages

    assert pool(bf16_bytes) == 200
    assert pool(fp8_bytes) == (int(0.9 * limit) - fp8_bytes - active) // per_page > 200 + saved // per_page - 1


@pytest.mark.parametrize("quantization, message", [
    ({**FP8_CONFIG, "fmt": "e5m2"}, "fmt='e5m2'"),
    ({**FP8_CONFIG, "activation_scheme": "static"}, "activation_scheme='static'"),
    ({**FP8_CONFIG, "weight_block_size": None}, "weight_block_size=None"),
    ({**FP8_CONFIG, "modules_to_not_convert": ["lm_head"]}, "modules_to_not_convert"),
    ({**FP8_CONFIG, "kv_cache_scheme": "fp8"}, r"keys \['kv_cache_scheme'\]"),
    ({"quant_method": "gptq", "bits": 4}, "quant_method='gptq'"),
])
def test_other_quantization_configs_are_refused_by_name(tmp_path, quantization, message):
    hf = {"model_type": "llama", "vocab_size": 97, "num_hidden_layers": 1, "quantization_config": quantization,
          **LLAMA_SHAPE}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ValueError, match=message):
        load_config(tmp_path)


def test_a_checkpoint_not_in_the_format_is_refused_by_tensor(tmp_path, llama_fp8):
    """A linear weight left unquantized, and an fp8 tensor where the engine keeps the
    model's dtype (the embedding), each named."""
    folder = tmp_path / "broken"
    shutil.copytree(llama_fp8[0], folder)
    tensors = load_file(folder / "model.safetensors")
    name = "model.layers.1.self_attn.v_proj.weight"
    unquantized = {key: w for key, w in tensors.items() if key != name + "_scale_inv"}
    unquantized[name] = dequantize(tensors[name], tensors[name + "_scale_inv"], LLAMA_BLOCK)
    save_file(unquantized, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match=f"{name} is stored as F32 without a weight_scale_inv"):
        LLM(folder, max_num_seqs=1)
    save_file({**tensors, "model.embed_tokens.weight": tensors["model.embed_tokens.weight"].to(torch.float8_e4m3fn)},
              str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match="model.embed_tokens.weight is stored as float8_e4m3fn"):
        LLM(folder, max_num_seqs=1)


TP_SCRIPT = """
import json, sys
import jax
from jaxmtp import LLM, SamplingParams
result = {}
for tp, backend in ((1, "auto"), (2, "auto"), (2, "pallas_interpret")):
    llm = LLM(sys.argv[1], tensor_parallel_size=tp, dtype="float32", max_num_seqs=2, max_num_batched_tokens=8,
              attention_backend=backend)
    layer = llm.engine.params.layers[0]
    names = ("q_proj", "k_proj", "o_proj", "gate_up_proj", "down_proj")
    result[f"{tp} {backend}"] = {
        "tokens": [o.outputs[0].token_ids for o in llm.generate(
            [[1, 5, 9, 33, 7], [1] + list(range(10, 40))], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
            use_tqdm=False)],
        "specs": {name: [list(getattr(layer, name).weight.sharding.spec), list(getattr(layer, name).scale_inv.sharding.spec)]
                  for name in names},
        "matmul": {name: [getattr(layer, name).matmul, getattr(getattr(layer, name).shards, "split", "-")]
                   for name in names},
    }
print(json.dumps(result))
"""


def test_tensor_parallel_fp8_gives_one_devices_tokens_and_shards_the_scales_with_their_blocks(llama_fp8):
    """TP=2 on two forced CPU devices. A scale axis splits where each device's part of
    the weight is whole blocks (q_proj's 256 columns: 128 each), and stays whole where
    not (gate and up's 320: 160 each). With the kernels (pallas_interpret) each device
    multiplies its part of a weight whose scales split with it (q_proj by its columns,
    o_proj by K, summed over the devices), K-major; the others take the reference."""
    result = run_on_cpu_devices(["-c", TP_SCRIPT, str(llama_fp8[0])], 2)
    assert result["2 auto"]["tokens"] == result["1 auto"]["tokens"] == result["2 pallas_interpret"]["tokens"]
    specs = result["2 auto"]["specs"]
    assert specs["q_proj"] == [[None, "tp"], [None, "tp"]]
    assert specs["o_proj"] == [["tp", None], ["tp", None]]
    assert specs["gate_up_proj"] == [[None, None, "tp"], [None, None, None]]
    assert specs["down_proj"] == [["tp", None], [None, None]]
    assert set(map(tuple, result["2 auto"]["matmul"].values())) == {("reference", "-")}
    kernels = result["2 pallas_interpret"]
    assert kernels["matmul"] == {"q_proj": ["pallas_interpret", "n"], "o_proj": ["pallas_interpret", "k"],
                                 "k_proj": ["reference", "-"], "gate_up_proj": ["reference", "-"],
                                 "down_proj": ["reference", "-"]}
    # K-major: q_proj [out, in] split by its columns (out), o_proj by K (in)
    assert kernels["specs"]["q_proj"] == [["tp", None], [None, "tp"]]
    assert kernels["specs"]["o_proj"] == [[None, "tp"], ["tp", None]]


def test_an_fp8_checkpoint_serves_through_llm_the_cli_and_the_server(tmp_path):
    """The same text from LLM, `jaxmtp generate --model` and the server's completions
    (the official openai client), for an fp8 Llama with the stories260K tokenizer."""
    import openai
    from fastapi.testclient import TestClient

    from jaxmtp.server import ServerConfig, create_app

    rng = fresh_rng()
    folder = make_hf_model(tmp_path / "llama", "llama", seed=int(rng.integers(1 << 30)), dtype="bfloat16",
                           **{**LLAMA_SHAPE, "vocab_size": 512})
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ROOT / "checkpoints" / "stories260K" / name, folder / name)
    folder = quantize_folder(folder, rng)[0]
    options = dict(max_num_seqs=2, max_num_batched_tokens=16, page_size=4)
    llm = LLM(folder, **options)
    want = llm.generate(["Once upon a time"], SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)[0].outputs[0].text
    cli = subprocess.run(
        [sys.executable, "-m", "jaxmtp.cli", "generate", "Once upon a time", "--model", str(folder), "--max-tokens", "8",
         "--temperature", "0", "--max-num-seqs", "2", "--max-num-batched-tokens", "16", "--page-size", "4"],
        cwd=ROOT, env={**os.environ, "JAX_PLATFORMS": "cpu"}, capture_output=True, timeout=300,
    )
    assert cli.returncode == 0, cli.stderr.decode()[-3000:]
    # bytes, not text=True: universal newlines would turn a generated "\r" before the
    # print's "\n" into one "\n" (seed 1533554102)
    assert cli.stdout.decode() == "Once upon a time" + want + "\n"
    with TestClient(create_app(llm.engine, str(folder), ServerConfig(disable_log_stats=True))) as http:
        client = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http, max_retries=0)
        out = client.completions.create(model=folder.name, prompt="Once upon a time", max_tokens=8, temperature=0)
    assert out.choices[0].text == want


def test_fp8_q_k_and_v_merge_with_their_scales_where_the_kernels_run(tmp_path, monkeypatch, rng):
    """Where the step may take the kernels (one GPU; forced here), q, k and v of an fp8
    model whose projections are whole scale blocks (32 x 64 blocks: k and v's 64 columns
    are two) run as one K-major matmul with their scales side by side: the same logits
    as apart, and a saved checkpoint holds them apart again, byte for byte."""
    from jaxmtp.loading.loader import save_checkpoint
    from jaxmtp.worker import param_layouts

    folder = make_hf_model(tmp_path / "llama", "llama", seed=int(rng.integers(1 << 30)), dtype="bfloat16",
                           **LLAMA_SHAPE)
    folder, _, _ = quantize_folder(folder, rng, (32, 64))
    engine = dict(dtype="float32", max_num_seqs=1, max_num_batched_tokens=32, page_size=4,
                  attention_backend="pallas_interpret")
    apart = LLM(folder, **engine)
    monkeypatch.setattr(param_layouts, "dense_kernels_for", lambda backend, mesh: True)
    merged = LLM(folder, **engine)
    layer = merged.engine.params.layers[1]
    assert layer.k_proj is None and isinstance(layer.q_proj, Fp8Weight) and layer.q_proj.k_major
    assert layer.q_proj.shape == (256, 256 + 2 * 64) and layer.q_proj.scale_inv.shape == (4, 12)
    ids = [1] + rng.integers(3, 97, size=11).tolist()
    want = prompt_logits(apart.engine, ids)
    assert_within(prompt_logits(merged.engine, ids), want, logits_bound(want, LLAMA_LAYERS, LLAMA_WIDEST_SUM))
    saved = save_checkpoint(tmp_path / "ckpt", merged.engine.params, merged.engine.model_config, folder)
    monkeypatch.undo()
    restored = LLM(saved, dtype="float32", max_num_seqs=1, max_num_batched_tokens=32, page_size=4).engine.params
    for name in ("q_proj", "k_proj", "v_proj"):
        ours, theirs = getattr(apart.engine.params.layers[1], name), getattr(restored.layers[1], name)
        np.testing.assert_array_equal(np.asarray(ours.in_major_weight.astype(np.float32)),
                                      np.asarray(theirs.weight.astype(np.float32)))
        np.testing.assert_array_equal(np.asarray(ours.scale_inv), np.asarray(theirs.scale_inv))


@pytest.mark.parametrize("fp8", [False, True])
def test_mla_kv_b_proj_reads_as_its_absorbed_halves_in_any_block(tmp_path, rng, fp8):
    """MLA's kv_b_proj, stored [Hq*(Dn + Dv), R] head by head, read as [Dn + Dv, Hq, R]
    (W_UK's rows, then W_UV's) in any block a device's shard asks for; fp8 in 8 x 16
    blocks of stored rows x columns, which straddle the heads' 10 rows, dequantized as
    read. Against the whole tensor dequantized and regrouped in float64."""
    from jaxmtp.loading.tensor_source import TensorSource
    from jaxmtp.models.quantization import Fp8BlockConfig

    heads, per_head, rank, block = 3, 10, 40, (8, 16)
    w = torch.tensor(rng.standard_normal((heads * per_head, rank))).float()
    tensors = {"attn.kv_b_proj.weight": w}
    if fp8:  # each block scaled apart, so that a scale applied to the wrong block shows
        spread = torch.tensor(2.0 ** rng.uniform(-2, 2, [-(-n // b) for n, b in zip(w.shape, block)]))
        q, scale = quantize(w.double() * per_block(spread, block, w.shape), block)
        tensors = {"attn.kv_b_proj.weight": q, "attn.kv_b_proj.weight_scale_inv": scale}
        w = dequantize(q, scale, block)  # in float32, as the read dequantizes
    save_file(tensors, str(tmp_path / "model.safetensors"))
    src = TensorSource(tmp_path)
    ref = src.absorbed_ref("attn.kv_b_proj", heads, Fp8BlockConfig(block_in=block[1], block_out=block[0]))
    whole = w.double().numpy().reshape(heads, per_head, rank).transpose(1, 0, 2)
    assert ref.shape == whole.shape
    for d, h, r in [(slice(None), slice(None), slice(None)), (slice(3, 10), slice(1, 3), slice(5, 37)),
                    (slice(0, 4), slice(2, 3), slice(16, 40))]:
        got = src.read(ref, (d, h, r), np.float64)
        np.testing.assert_array_equal(got, whole[d, h, r], err_msg=f"block {d, h, r}")

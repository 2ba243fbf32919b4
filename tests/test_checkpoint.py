"""Loading paths: sharded safetensors, the engine's own orbax checkpoints, dummy weights."""

from __future__ import annotations

import json

import jax
import pytest
import numpy as np

from conftest import STORIES, make_hf_model, prompt_logits
from jaxmtp import LLM, SamplingParams
from jaxmtp.loading.loader import save_checkpoint

GREEDY = SamplingParams(max_tokens=30, temperature=0.0)


def test_sharded_safetensors_index_loads_like_a_single_file(tmp_path, rng):
    import transformers

    single = make_hf_model(tmp_path / "single", "qwen2", seed=int(rng.integers(1 << 30)))
    model = transformers.AutoModelForCausalLM.from_pretrained(single)
    model.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    ids = [1] + rng.integers(3, 97, size=15).tolist()
    a = prompt_logits(LLM(single, max_num_seqs=1).engine, ids)
    b = prompt_logits(LLM(tmp_path / "sharded", max_num_seqs=1).engine, ids)
    np.testing.assert_array_equal(a, b)


def test_orbax_round_trip_gives_identical_params_and_outputs(tmp_path):
    llm = LLM(STORIES, max_num_seqs=2, max_num_batched_tokens=64)
    out_dir = save_checkpoint(tmp_path / "ckpt", llm.engine.params, llm.engine.model_config, STORIES)
    restored = LLM(out_dir, max_num_seqs=2, max_num_batched_tokens=64)
    for a, b in zip(jax.tree.leaves(llm.engine.params), jax.tree.leaves(restored.engine.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    prompt = "Once upon a time"
    assert (
        restored.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        == llm.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    )


def test_dummy_load_format_needs_only_config(tmp_path):
    (tmp_path / "config.json").write_text((STORIES / "config.json").read_text())
    llm = LLM(tmp_path, load_format="dummy", max_num_seqs=2, max_num_batched_tokens=32)
    shapes = {p.shape for p in jax.tree.leaves(llm.engine.params)}
    assert (512, 64) in shapes and (64, 2, 172) in shapes
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_trained_head_exports_to_the_deepseek_hf_layout(tmp_path):
    from safetensors.numpy import load_file, save_file

    from jaxmtp.loading.loader import export_hf_checkpoint

    mtp_model = STORIES.parent / "stories260K-mtp"
    llm = LLM(mtp_model, num_speculative_tokens=2, max_num_seqs=2, max_num_batched_tokens=64)
    out = export_hf_checkpoint(tmp_path / "hf", llm.engine.params, llm.engine.model_config, mtp_model)
    tensors = load_file(out / "model.safetensors")
    assert {"model.layers.5.eh_proj.weight", "model.layers.5.enorm.weight", "model.layers.5.hnorm.weight",
            "model.layers.5.shared_head.norm.weight"} <= set(tensors)
    exported = LLM(out, num_speculative_tokens=2, max_num_seqs=2, max_num_batched_tokens=64)
    prompt = "Once upon a time, Zoe"
    a = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    b = exported.generate(prompt, GREEDY, use_tqdm=False)[0]
    assert a.outputs[0].token_ids == b.outputs[0].token_ids and a.spec_stats == b.spec_stats

    # a config that declares MTP over files without the module still runs without speculation
    save_file({k: v for k, v in tensors.items() if not k.startswith("model.layers.5.")}, str(out / "model.safetensors"))
    assert LLM(out, max_num_seqs=2).generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids == a.outputs[0].token_ids
    with pytest.raises(ValueError, match="missing tensor 'model.layers.5"):
        LLM(out, num_speculative_tokens=1)


def test_checkpoint_with_gate_and_up_apart_is_named(tmp_path):
    """An engine checkpoint from before gate_up_proj (gate_proj and up_proj stored apart)."""
    import shutil

    import orbax.checkpoint as ocp

    mtp_model = STORIES.parent / "stories260K-mtp"
    tree = ocp.StandardCheckpointer().restore(mtp_model.absolute() / "params")
    for layer in tree["layers"] + [module["block"] for module in tree["mtp"]]:
        gate_up = layer.pop("gate_up_proj")
        layer["gate_proj"], layer["up_proj"] = gate_up[:, 0], gate_up[:, 1]
    old = tmp_path / "old"
    old.mkdir()
    for name in ("config.json", "tokenizer.json"):
        shutil.copy(mtp_model / name, old / name)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save((old / "params").absolute(), tree)
    checkpointer.wait_until_finished()
    with pytest.raises(ValueError, match="gate_proj and up_proj stored apart"):
        LLM(old, max_num_seqs=1)


def _stories_config(tmp_path, **changes):
    hf = {**json.loads((STORIES / "config.json").read_text()), **changes}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    return tmp_path


@pytest.mark.parametrize("changes, message", [
    (dict(hidden_act="gelu_10"), "hidden_act='gelu_10' is not supported"),
    (dict(quantization_config={"quant_method": "awq", "bits": 4}), "quant_method='awq'"),
    (dict(torch_dtype="float64"), "torch_dtype 'float64'"),
])
def test_config_values_the_engine_does_not_implement_are_refused_by_name(tmp_path, changes, message):
    from jaxmtp.models.registry import load_config

    with pytest.raises(ValueError, match=message):
        load_config(_stories_config(tmp_path, **changes))


def test_dtype_auto_is_the_checkpoints_and_an_explicit_dtype_wins(tmp_path):
    from jaxmtp.models.registry import load_config

    for name in ("float32", "bfloat16", "float16"):
        assert load_config(_stories_config(tmp_path, torch_dtype=name)).dtype == name
        assert load_config(_stories_config(tmp_path, torch_dtype=None, dtype=name)).dtype == name  # transformers 5
    assert load_config(_stories_config(tmp_path, torch_dtype=None)).dtype == "float32"  # none written
    assert load_config(_stories_config(tmp_path, torch_dtype="float16"), "bfloat16").dtype == "bfloat16"
    with pytest.raises(ValueError, match="float64"):
        LLM(_stories_config(tmp_path), dtype="float64")


def test_weight_loading_shows_a_progress_bar_of_its_tensors(monkeypatch):
    import io

    import jaxmtp.loading.loader as loader
    from jaxmtp.models.registry import load_config

    bars = []

    class Recorded(loader.tqdm):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **{**kwargs, "disable": False, "file": io.StringIO()})
            bars.append(self)

    monkeypatch.setattr(loader, "tqdm", Recorded)
    params = loader.load_params(STORIES, load_config(STORIES))
    bar, = bars
    assert bar.n == bar.total == len(jax.tree.leaves(params))
    assert "loading stories260K: 100%" in bar.fp.getvalue()

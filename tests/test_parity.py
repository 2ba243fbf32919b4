"""Parity with transformers on CPU: tiny random models of every supported family."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import FAMILIES, make_hf_model, prompt_logits
from jaxmtp import LLM, SamplingParams


def hf_logits(folder, ids, dtype=torch.float32):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy(), model


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_logits_and_greedy_match_transformers(tmp_path, rng, family):
    folder = make_hf_model(tmp_path / family, family, seed=int(rng.integers(1 << 30)))
    ids = [1] + rng.integers(3, 97, size=int(rng.integers(12, 30))).tolist()
    expected, hf = hf_logits(folder, ids)
    llm = LLM(folder, max_num_seqs=2, max_num_batched_tokens=64, page_size=4)
    got = prompt_logits(llm.engine, ids)
    np.testing.assert_allclose(got, expected, rtol=2e-4, atol=2e-4)

    with torch.no_grad():
        hf_out = hf.generate(
            torch.tensor([ids]), max_new_tokens=32, do_sample=False, min_new_tokens=32,
            pad_token_id=0, eos_token_id=None,
        )[0, len(ids):].tolist()
    out = llm.generate([ids], SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert out[0].outputs[0].token_ids == hf_out


def test_bfloat16_logits_within_bf16_tolerance(tmp_path, rng):
    folder = make_hf_model(tmp_path / "llama", "llama", seed=int(rng.integers(1 << 30)))
    ids = [1] + rng.integers(3, 97, size=20).tolist()
    expected, _ = hf_logits(folder, ids)
    hf_bf16, _ = hf_logits(folder, ids, torch.bfloat16)
    llm = LLM(folder, dtype="bfloat16", max_num_seqs=2, max_num_batched_tokens=64)
    assert str(llm.engine.params.embed.dtype) == "bfloat16"
    got = prompt_logits(llm.engine, ids)
    # bf16 rounding alone moves transformers' own logits this far from float32; ours
    # may not be much further from the float32 truth
    ours, theirs = np.abs(got - expected).max(), np.abs(hf_bf16 - expected).max()
    assert ours <= 1.5 * theirs + 1e-3 * np.abs(expected).max(), (ours, theirs)
    # and bf16 checkpoints load as bf16 by default
    bf16_folder = make_hf_model(tmp_path / "llama-bf16", "llama", seed=3, dtype="bfloat16")
    assert LLM(bf16_folder, max_num_seqs=1).engine.model_config.dtype == "bfloat16"

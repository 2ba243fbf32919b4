"""The Pallas attention kernel (interpret mode on the CPU) on the layouts only MTP makes,
inside the engine with its real slots and page tables, against the jnp reference.

A tiny random model (head_dim 16, which the kernel takes; stories260K's 8 it refuses)
with two MTP modules, k = 3: every step runs module 1 over the step's rows, module 2
over them with the rows before each request that batch.with_rows_before adds, and one
chained step of module 2 (one row per request at the position past the boundary, kv_len
one past it). Two engines, one per backend, step in lockstep: each step's tokens,
accepted counts and drafts are equal, and so is every MTP cache array (K/V of both
modules, the hidden pages module 2 reads) to float32 rounding."""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import STORIES
from jaxmtp import LLM, SamplingParams
from tolerances import assert_within, reordered_model_bound


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    config = {
        **json.loads((STORIES / "config.json").read_text()),
        "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "num_hidden_layers": 2, "max_position_embeddings": 128,
        "num_nextn_predict_layers": 2, "jaxmtp_mtp_layout": "deepseek",
    }
    folder = tmp_path_factory.mktemp("hd16-mtp2")
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def mtp_arrays(engine) -> list[np.ndarray]:
    cache, first = engine.cache, engine.model_config.num_layers
    return [np.asarray(a) for a in cache.k[first:] + cache.v[first:] + list(cache.hidden)]


def test_kernel_on_draft_modules_rows_before_and_chain_equals_reference(model_dir, rng):
    engines = [
        LLM(model_dir, load_format="dummy", attention_backend=backend, num_speculative_tokens=3, page_size=4,
            prefill_chunk_size=7, max_num_seqs=2, max_num_batched_tokens=8).engine
        for backend in ("reference", "pallas_interpret")
    ]
    assert engines[1].num_draft_modules == 2 and len(engines[1].cache.hidden) >= 1
    prompts = [[1] + rng.integers(3, 512, size=n).tolist() for n in (10, 2)]
    params = [SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)] * 2
    for engine in engines:
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            engine.add_request(str(i), prompt, p)
    steps = verified = 0
    while engines[0].has_unfinished_requests():
        outs = [engine.step() for engine in engines]
        assert [o.outputs[0].token_ids for o in outs[0]] == [o.outputs[0].token_ids for o in outs[1]], f"step {steps}"
        ref, kernel = (e.last_step_output for e in engines)
        if ref is None:
            continue
        steps += 1
        verified += sum(item.num_drafts > 0 for item in engines[0].last_schedule)
        for field in ("tokens", "num_accepted", "drafts"):
            np.testing.assert_array_equal(getattr(kernel, field), getattr(ref, field), err_msg=f"step {steps} {field}")
        # the same float32 model (2 layers, 2 modules, sums of at most 172 terms) whose
        # attention sums run in another order
        for a, b in zip(mtp_arrays(engines[1]), mtp_arrays(engines[0])):
            assert_within(a, b, reordered_model_bound(float(np.abs(b).max()), 4, 172), f"step {steps}")
    assert not engines[1].has_unfinished_requests()
    assert verified > 0 and steps > 4

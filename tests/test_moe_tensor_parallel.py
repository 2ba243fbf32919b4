"""Tensor parallelism for DeepSeek-V3 (MLA heads split, the latent cache whole on every
device, experts split) and GLM-4.5 (GQA heads split, experts split), each with its MTP
layer, on forced CPU devices: TP=2 and TP=4 give TP=1's greedy tokens, first drafts,
draft cache rows and per-position acceptance, under chunked prefill, prefix caching and
preemption; every array is placed as jaxmtp/worker/sharding.py's rules say. (Sampling reads
the logits the same way for every body: tests/test_tensor_parallel.py samples under TP.)

As tests/test_tensor_parallel.py, the engines run in ONE subprocess (this file run as a
script) started with XLA_FLAGS=--xla_force_host_platform_device_count=4; the tiny
checkpoints are built here first, with transformers.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
NUM_DEVICES = 4
TP_SIZES = (1, 2, 4)
VOCAB = 128  # split over 2 and 4 devices
PAGE = 8
# At most two requests and 8 rows a step, one page-table width, greedy requests only: the
# step compiles for two shapes (1 or 2 requests). A pool of 11 pages of 8 cannot hold two
# requests of 30 + 24 tokens: one is preempted.
ENGINE = dict(page_size=PAGE, max_num_seqs=2, max_num_batched_tokens=8, max_model_len=64, num_pages=11,
              prefill_chunk_size=5, num_speculative_tokens=2, enable_prefix_caching=True)
# 4 q heads and experts 2 a device at TP=4; GLM with 8 q heads over 4 kv heads (GQA groups of 2)
FAMILIES = {"deepseek": ("deepseek-qlora-yarn", {}),
            "glm": ("glm4-moe", dict(num_attention_heads=8, num_key_value_heads=4))}


# ----- the subprocess ---------------------------------------------------------------------


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(11)
    return [[1] + rng.integers(3, VOCAB, size=n - 1).tolist() for n in (30, 21, 26)]


def _draft_cache_rows(engine, pages, length) -> list:
    """The MTP layer's cache rows (MLA: latent and rope key; GQA: K and V of every kv
    head) at positions 0..length-1, gathered from every device."""
    slots = np.array([pages[i // PAGE] * PAGE + i % PAGE for i in range(length)])
    layer = engine.model_config.num_layers
    rows = [np.asarray(x[layer]).reshape(engine.cache.num_slots, -1)[slots] for x in (engine.cache.k, engine.cache.v)]
    return np.concatenate(rows, axis=1).tolist()


def _spec(array) -> list:
    spec = list(array.sharding.spec) + [None] * (array.ndim - len(array.sharding.spec))
    while spec and spec[-1] is None:
        spec.pop()
    return spec


def _run(folder: str, tp: int) -> dict:
    """One engine: a prompt's first drafts and draft cache rows after its prefill; three
    greedy requests (the pool preempts); a request sharing the first prompt's first
    three pages (a prefix-cache hit)."""
    import time

    import jax

    from conftest import greedy, until_prefill_emits
    from jaxmtp import LLM
    from jaxmtp.worker.programs import num_compiles

    start, compiles = time.perf_counter(), num_compiles()
    llm = LLM(folder, tensor_parallel_size=tp, **ENGINE)
    engine = llm.engine
    initial = [a.sharding for a in engine.cache.k]
    prompts = _prompts()
    seq = until_prefill_emits(engine, prompts[0], max_tokens=4)
    report = {"first_drafts": list(seq.drafts), "draft_cache_rows": _draft_cache_rows(engine, seq.pages, len(prompts[0]))}
    engine.abort_request("probe")
    engine.step()
    outs = llm.generate(prompts, greedy(24), use_tqdm=False)
    shared = llm.generate([prompts[0][: 3 * PAGE] + [7, 9]], greedy(16), use_tqdm=False)
    report.update(
        tokens=[o.outputs[0].token_ids for o in outs + shared],
        accepted_per_position=[o.spec_stats["accepted_per_position"] for o in outs + shared],
        preemptions=engine.scheduler.num_preemptions,
        prefix_cache_hits=engine.stats.prefix_cache.hits,
        cache_sharding_kept=all(a.sharding.is_equivalent_to(s, a.ndim) for a, s in zip(engine.cache.k, initial)),
        seconds=time.perf_counter() - start, compiles=num_compiles() - compiles,
    )
    flat = jax.tree_util.tree_flatten_with_path(engine.params)[0]
    arrays = {jax.tree_util.keystr(path): a for path, a in flat}
    arrays.update({f"cache.k[{i}]": a for i, a in enumerate(engine.cache.k)})
    report["layouts"] = {name: {"spec": _spec(a), "shape": list(a.shape), "shard": list(a.addressable_shards[0].data.shape),
                                "devices": len(a.sharding.device_set)} for name, a in arrays.items()}
    return report


def _error(fn) -> str | None:
    try:
        fn()
    except ValueError as err:
        return str(err)
    return None


def worker(folders: dict[str, str]) -> dict:
    import tempfile

    import jax

    from jaxmtp import LLM

    assert len(jax.devices()) == NUM_DEVICES
    report = {"runs": {f"{name} tp={tp}": _run(folder, tp) for name, folder in folders.items() for tp in TP_SIZES}}
    with tempfile.TemporaryDirectory() as tmp:
        config = json.loads((Path(folders["deepseek"]) / "config.json").read_text())
        (Path(tmp) / "config.json").write_text(json.dumps({**config, "n_routed_experts": 6, "n_group": 3}))
        report["errors"] = {
            "heads": _error(lambda: LLM(folders["deepseek"], tensor_parallel_size=3)),
            "experts": _error(lambda: LLM(tmp, load_format="dummy", tensor_parallel_size=4)),
        }
    return report


# ----- the tests ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    from conftest import run_on_cpu_devices
    from test_moe_mtp import make_mtp_checkpoint

    folders = {name: str(make_mtp_checkpoint(tmp_path_factory.mktemp(name) / name, family, vocab_size=VOCAB, **extra)[0])
               for name, (family, extra) in FAMILIES.items()}
    return run_on_cpu_devices([__file__, json.dumps(folders)], NUM_DEVICES, timeout=900, path=(ROOT / "tests",))


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_outputs_drafts_and_acceptance_equal_tp1(report, name, tp):
    from test_moe_mtp import latent_bound
    from tolerances import assert_within

    base, run = report["runs"][f"{name} tp=1"], report["runs"][f"{name} tp={tp}"]
    assert base["preemptions"] > 0 and base["prefix_cache_hits"] > 0  # the runs take those paths
    assert np.sum(base["accepted_per_position"]) > 0  # drafts are accepted, not only rejected
    for key in ("tokens", "first_drafts", "accepted_per_position", "preemptions", "prefix_cache_hits"):
        assert run[key] == base[key], key
    # all-reduce order changes float32 rounding only
    assert_within(run["draft_cache_rows"], base["draft_cache_rows"], latent_bound(base["draft_cache_rows"]),
                  f"{name} tp={tp}")
    assert run["cache_sharding_kept"]


# what the rules say: field -> spec, for the tiny models (every split dim divides by 4)
EXPECTED_SPEC = {
    "embed": ["tp"], "lm_head": [None, "tp"], "final_norm": [], "input_norm": [], "post_norm": [],
    "o_proj": ["tp"], "gate_up_proj": [None, None, "tp"], "down_proj": ["tp"],
    "token_norm": [], "hidden_norm": [], "proj_token": [], "proj_hidden": [],
    # MLA: the latent projections whole, the per-head ones split by heads
    "q_a_proj": [], "q_a_norm": [], "q_b_proj": [None, "tp"], "kv_a_proj": [], "kv_a_norm": [], "kv_b_proj": [None, "tp"],
    # GQA (GLM-4.5)
    "q_proj": [None, "tp"], "k_proj": [None, "tp"], "v_proj": [None, "tp"], "q_bias": ["tp"], "k_bias": ["tp"],
    "v_bias": ["tp"], "q_norm": [], "k_norm": [],
    # experts: whole experts a device; the router whole; shared experts as a dense MLP
    "router": [], "router_bias": [], "experts_gate_up": ["tp"], "experts_down": ["tp"],
    "shared_gate_up": [None, None, "tp"], "shared_down": ["tp"],
}


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_every_weight_and_cache_array_is_placed_by_the_rules(report, name, tp):
    layouts = report["runs"][f"{name} tp={tp}"]["layouts"]
    assert any(".mtp[0].block.moe.experts_gate_up" in n for n in layouts)
    # MLA's latent cache has no head dim: whole on every device; GQA's split by kv head
    cache_spec = [] if name == "deepseek" else [None, None, "tp"]
    for array, layout in layouts.items():
        spec = cache_spec if array.startswith("cache") else EXPECTED_SPEC[array.rsplit(".", 1)[-1]]
        assert layout["spec"] == spec and layout["devices"] == tp, array
        shard = [size // tp if axis == "tp" else size for size, axis in zip(layout["shape"], spec + [None] * 4)]
        assert layout["shard"] == shard, array


def test_sizes_that_do_not_fit_raise_value_errors_naming_the_problem(report):
    errors = report["errors"]
    assert "tensor_parallel_size=3" in errors["heads"] and "num_heads=4" in errors["heads"]
    assert "tensor_parallel_size=4" in errors["experts"] and "n_routed_experts=6" in errors["experts"]


if __name__ == "__main__":
    print(json.dumps(worker(json.loads(sys.argv[1]))))

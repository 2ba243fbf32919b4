"""Tensor parallelism on forced CPU devices: TP=2 and TP=4 give TP=1's outputs, every
array is sharded as jaxmtp/worker/sharding.py's rules say, and bad sizes fail clearly.

The cases run in ONE subprocess (this file run as a script) with
XLA_FLAGS=--xla_force_host_platform_device_count=4 set before JAX starts: compile time
dominates, and one process shares its compiled steps across chunk sizes. The tests
below read what it reports.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import fresh_rng, run_on_cpu_devices, stories_logprob_bound_of
from tolerances import assert_within

ROOT = Path(__file__).resolve().parent.parent
STORIES = ROOT / "checkpoints" / "stories260K"  # safetensors; 8 heads, 4 kv heads, vocab 512
STORIES_MTP = ROOT / "checkpoints" / "stories260K-mtp"  # orbax, with a trained MTP head
NUM_DEVICES = 4
# each model at one chunk size (modules_run and greedy_steps add chunks of 7 and 3): the
# whole step budget without MTP, a small odd chunk with it; and TP sizes 1 and 4 (one kv
# head a device): the MTP model at TP=2 runs in greedy_steps (its layouts recorded there),
# prefix_cache and modules_run
RUNS = (("stories260K", 0, 8, (1, 4)), ("stories260K-mtp", 2, 3, (1, 4)))
MAX_TOKENS = 16
VOCAB = 512
# an all-gather in the compiled CPU HLO (synchronous there): its result's type and shape
ALL_GATHER = re.compile(r"= (\w+)\[([\d,]*)\][^=]*? all-gather\(")


# ----- the subprocess ---------------------------------------------------------------------


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(7)
    return [[1], [1] + rng.integers(3, 512, size=36).tolist()]


def _run(model, tp: int, **engine_kwargs) -> dict:
    """Two greedy requests and a sampled one. One step budget and at most two requests
    a step: the step compiles for two batch shapes only, shared by every chunk size."""
    from jaxmtp import LLM, SamplingParams

    llm = LLM(model, tensor_parallel_size=tp, max_num_seqs=2, max_num_batched_tokens=8, max_model_len=128, **engine_kwargs)
    initial_cache = llm.engine.cache.k[0].sharding
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=0)
    sampled = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, top_k=40, seed=3, ignore_eos=True, logprobs=3)
    outs = llm.generate(_prompts() + [[1, 403]], [greedy] * 2 + [sampled], use_tqdm=False)
    cache = llm.engine.cache
    return {
        "tokens": [o.outputs[0].token_ids for o in outs],
        "logprobs": [[next(iter(e.values())).logprob for e in o.outputs[0].logprobs] for o in outs],
        "top_ids": [[list(e) for e in o.outputs[0].logprobs] for o in outs[2:]],
        "cache_sharding_kept": all(a.sharding.is_equivalent_to(initial_cache, 4) for a in cache.k + cache.v),
        "_llm": llm,
    }


def _prefix_cache_run(tp: int, enable: bool) -> dict:
    """Two requests one after the other sharing a 37-token prefix (two full pages), MTP
    k=2: with the cache on, the second copies its boundary page (copy_pages on the
    kv-head-sharded cache) and computes only its suffix."""
    from jaxmtp import LLM, SamplingParams

    llm = LLM(STORIES_MTP, tensor_parallel_size=tp, max_num_seqs=2, max_num_batched_tokens=8, max_model_len=128,
              num_speculative_tokens=2, enable_prefix_caching=enable)
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    shared = _prompts()[1]
    outs = [llm.generate([shared + tail], greedy, use_tqdm=False)[0] for tail in ([5, 9], [7])]
    return {
        "tokens": [o.outputs[0].token_ids for o in outs],
        "accepted_per_position": [o.spec_stats["accepted_per_position"] for o in outs],
        "hits": llm.engine.stats.prefix_cache.hits,
    }


def _page_accounting(engine) -> dict:
    allocator = engine.allocator
    parked = len(allocator.evictable)
    return {"free_plus_parked": len(allocator.free_pages) + parked, "total": allocator.num_pages,
            "nonzero_ref_counts": sum(1 for c in allocator.ref_counts if c)}


def _modules_run(model, tp: int) -> dict:
    """Two MTP modules drafting three tokens (rows before each request, a chained step),
    prefix caching, and a pool of 16 pages of 4 that preempts: _run's requests; then a
    request aborted while a step that computes it is in flight, and the pages counted."""
    from jaxmtp import LLM, SamplingParams

    llm = LLM(model, tensor_parallel_size=tp, max_num_seqs=2, max_num_batched_tokens=8, max_model_len=128, num_speculative_tokens=3,
              page_size=4, num_pages=16, prefill_chunk_size=7, enable_prefix_caching=True)
    engine = llm.engine
    initial_cache = engine.cache.k[0].sharding
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=0)
    sampled = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, top_k=40, seed=3, ignore_eos=True, logprobs=0)
    prompts = _prompts() + [[1, 403]]
    outs = llm.generate(prompts, [greedy] * 2 + [sampled], use_tqdm=False)
    report = {
        "tokens": [o.outputs[0].token_ids for o in outs],
        "logprobs": [[next(iter(e.values())).logprob for e in o.outputs[0].logprobs] for o in outs],
        "accepted_per_position": [o.spec_stats["accepted_per_position"] for o in outs],
        "preemptions": engine.scheduler.num_preemptions,
        "pages_after_generate": _page_accounting(engine),
        "cache_sharding_kept": all(a.sharding.is_equivalent_to(initial_cache, 4) for a in engine.cache.k + engine.cache.v),
    }
    for i, prompt in enumerate(prompts):
        engine.add_request(f"abort-{i}", prompt, greedy)
    aborted_in_flight = False
    while engine.has_unfinished_requests():
        engine.step()
        victim = engine.requests.get("abort-1")
        if victim and victim.seqs[0].output_token_ids and engine.num_steps_in_flight and victim.seqs[0].in_flight:
            engine.abort_request("abort-1")
            aborted_in_flight = True
    report["aborted_in_flight"] = aborted_in_flight
    report["pages_after_abort"] = _page_accounting(engine)
    return report


def _greedy_steps_run(tp: int) -> dict:
    """MTP k=2, two greedy requests asking for no logprobs, so every step is a greedy
    shape (sharding.argmax_vocab, no logits gather): each step's emitted tokens,
    acceptance and drafts. At TP=2 also the all-gathers of the compiled greedy and
    general steps."""
    from jaxmtp import LLM, SamplingParams
    from jaxmtp.worker.batch import BatchShape

    llm = LLM(STORIES_MTP, tensor_parallel_size=tp, max_num_seqs=2, max_num_batched_tokens=8, max_model_len=128,
              num_speculative_tokens=2, prefill_chunk_size=3)
    engine = llm.engine
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(_prompts()):
        engine.add_request(str(i), prompt, greedy)
    steps, last_id, outputs = [], None, {}
    while engine.has_unfinished_requests():
        outputs.update({o.request_id: o for o in engine.step() if o.finished})
        record, result = engine.last_step, engine.last_step_output
        if record is not None and record.step_id != last_id:
            last_id, n = record.step_id, len(record.scheduled.rows)
            steps.append({"greedy_shape": record.args[-1].greedy, "tokens": result.tokens[:n].tolist(),
                          "num_accepted": result.num_accepted[:n].tolist(), "drafts": result.drafts[:n].tolist()})
    report = {"steps": steps, "tokens": [outputs[str(i)].outputs[0].token_ids for i in range(2)],
              "accepted_per_position": [outputs[str(i)].spec_stats["accepted_per_position"] for i in range(2)]}
    if tp == 2:
        report["layouts"] = _layouts(llm)
        report["all_gathers"] = {
            str(g): [m.groups() for m in ALL_GATHER.finditer(engine.runner.lower_step(BatchShape(8, 2, g)).compile().as_text())]
            for g in (True, False)
        }
    return report


def _argmax_against_jnp(seed: int) -> dict:
    """sharding.argmax_vocab on vocab-sharded random logits against jnp.argmax of the
    whole rows, at TP=2 and 4, in the draft pass's [B, V] and the verify rows' [B, R, V]:
    integer-valued logits (ties everywhere), and planted rows: the maximum on both sides
    of a shard boundary, at the same offset in every shard, twice in one shard after a
    lower one, in two shards past the first, a constant row, -inf rows, NaNs, -0.0 and
    0.0."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    from jaxmtp.worker import sharding

    rng = np.random.default_rng(seed)
    vocab = 512
    report = {}
    for tp in (2, 4):
        mesh, shard = sharding.make_mesh(tp), vocab // tp
        planted = rng.standard_normal((10, vocab)).astype(np.float32)
        planted[0, [shard - 1, shard]] = 9.0  # across the first boundary
        planted[1, np.arange(tp) * shard + 5] = 9.0  # the same offset in every shard
        planted[2, [shard + 3, shard + 7]] = 9.0  # twice in the second shard
        planted[2, 2] = 8.0
        planted[3, [vocab - 1, shard + 1]] = 9.0  # in the last shard and the second, none in the first
        planted[4] = 1.5
        planted[5] = -np.inf
        planted[6] = -np.inf
        planted[6, [vocab - 2, shard + 1]] = -3.0
        planted[7, [shard + 4, vocab - 3]] = np.nan
        planted[8] = -1.0
        planted[8, [shard - 1, shard]] = [0.0, -0.0]
        planted[9, [0, vocab - 1]] = 9.0
        ties = rng.integers(-2, 3, size=(54, vocab)).astype(np.float32)
        logits = np.concatenate([planted, ties])
        for rows in (logits, logits.reshape(8, 8, vocab)):
            x = jax.device_put(rows, NamedSharding(mesh, PartitionSpec(*[None] * (rows.ndim - 1), "tp")))
            got = np.asarray(jax.jit(sharding.argmax_vocab, static_argnums=1)(x, mesh))
            want = np.asarray(jnp.argmax(jnp.asarray(rows), axis=-1))
            report[f"tp={tp} ndim={rows.ndim}"] = {"mismatched_rows": np.flatnonzero(got.ravel() != want.ravel()).tolist(),
                                                   "dtype": str(got.dtype)}
    return report


def _spec(array) -> list:
    """The array's PartitionSpec with trailing unsplit dims dropped (P(None) == P())."""
    spec = list(array.sharding.spec) + [None] * (array.ndim - len(array.sharding.spec))
    while spec and spec[-1] is None:
        spec.pop()
    return spec


def _layouts(llm) -> dict:
    import jax

    params, cache = llm.engine.params, llm.engine.cache
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    arrays = {jax.tree_util.keystr(path): a for path, a in flat}
    arrays.update({f"cache.k[{i}]": a for i, a in enumerate(cache.k)})
    arrays.update({f"cache.v[{i}]": a for i, a in enumerate(cache.v)})
    return {
        name: {"spec": _spec(a), "shape": list(a.shape), "shard": list(a.addressable_shards[0].data.shape),
               "devices": len(a.sharding.device_set)}
        for name, a in arrays.items()
    }


def _error(fn) -> str | None:
    try:
        fn()
    except ValueError as err:
        return str(err)
    return None


def _dummy_model(folder: Path, **overrides) -> Path:
    """A config.json only (load_format="dummy": the weights are made on the devices)."""
    config = {**json.loads((STORIES / "config.json").read_text()), **overrides}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def worker(seed: int) -> dict:
    import tempfile

    import jax

    from conftest import make_modules_model
    from jaxmtp import LLM
    from jaxmtp.loading.loader import save_checkpoint

    assert len(jax.devices()) == NUM_DEVICES
    report = {"runs": {}, "layouts": {}, "errors": {}}
    for name, k, chunk, tp_sizes in RUNS:
        for tp in tp_sizes:
            run = _run(ROOT / "checkpoints" / name, tp, num_speculative_tokens=k, prefill_chunk_size=chunk)
            llm = run.pop("_llm")
            report["runs"][f"{name} k={k} chunk={chunk} tp={tp}"] = run
            if k:
                report["layouts"][tp] = _layouts(llm)

    report["greedy_steps"] = {tp: _greedy_steps_run(tp) for tp in (1, 2)}
    report["layouts"][2] = report["greedy_steps"][2].pop("layouts")
    report["argmax"] = _argmax_against_jnp(seed)

    report["prefix_cache"] = {f"tp={tp} cache={enable}": _prefix_cache_run(tp, enable)
                              for tp, enable in ((1, False), (2, True))}

    with tempfile.TemporaryDirectory() as tmp:
        modules = make_modules_model(Path(tmp) / "stories260K-mtp2", 2)
        report["modules_run"] = _modules_run(modules, 2)

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        # Loading: dummy weights made sharded equal TP=1's; an orbax checkpoint written
        # at TP=4 restores at TP=2 into the rules' shardings.
        dummy = _dummy_model(tmp / "dummy")
        dummy_params = [LLM(dummy, load_format="dummy", tensor_parallel_size=tp).engine.params for tp in (1, 4)]
        report["dummy_equal"] = all(
            np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(*map(jax.tree.leaves, dummy_params))
        )
        four = LLM(STORIES, tensor_parallel_size=4)
        saved = save_checkpoint(tmp / "orbax", four.engine.params, four.engine.model_config, STORIES)
        two = LLM(saved, tensor_parallel_size=2)
        report["orbax_equal"] = all(
            np.array_equal(np.asarray(a), np.asarray(b))
            for a, b in zip(jax.tree.leaves(four.engine.params), jax.tree.leaves(two.engine.params))
        )
        report["orbax_q_proj_spec"] = _spec(two.engine.params.layers[0].q_proj)

        # q/k/v biases (Qwen2) split with their heads, the per-head q/k norm (Qwen3), an
        # MTP module, and the Pallas kernel (interpret mode, head_dim 16) under shard_map
        # at TP=2 against the jnp reference at TP=1.
        folder = _dummy_model(tmp / "qwen3-bias", model_type="qwen3", attention_bias=True, head_dim=16,
                              num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1,
                              num_nextn_predict_layers=1, jaxmtp_mtp_layout="deepseek")
        for tp, backend in ((1, "reference"), (2, "pallas_interpret")):
            run = _run(folder, tp, load_format="dummy", prefill_chunk_size=7, num_speculative_tokens=1,
                       attention_backend=backend)
            run.pop("_llm")
            report["runs"][f"qwen3-bias tp={tp}"] = run

        report["errors"]["kv_heads"] = _error(lambda: LLM(STORIES, tensor_parallel_size=3))
        report["errors"]["devices"] = _error(lambda: LLM(STORIES, tensor_parallel_size=8))
        report["errors"]["ffn"] = _error(lambda: LLM(_dummy_model(tmp / "ffn", intermediate_size=170),
                                                      load_format="dummy", tensor_parallel_size=4))
    return report


# ----- the tests ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def seed() -> int:
    """The seed of the worker's random logits (fresh_rng: JAXMTP_TEST_SEED replays it)."""
    return int(fresh_rng().integers(2**31))


@pytest.fixture(scope="module")
def report(seed) -> dict:
    return run_on_cpu_devices([__file__, str(seed)], NUM_DEVICES, timeout=900)


def run_sequences(run: dict) -> list[list[int]]:
    """The token sequences of _run's requests whose logprobs it reports: each prompt and
    its output but the last token."""
    return [prompt + tokens[:-1] for prompt, tokens in zip(_prompts() + [[1, 403]], run["tokens"])]


def _compare(report, key_of_tp):
    base = report["runs"][key_of_tp(1)]
    for tp in (2, 4):
        key = key_of_tp(tp)
        if key not in report["runs"]:
            continue
        run = report["runs"][key]
        assert run["tokens"] == base["tokens"], key
        # all-reduce order changes float32 rounding only: two evaluations, each within
        # stories_logprob_bound of the exact logprobs
        bound = 2 * stories_logprob_bound_of(run_sequences(base))
        for a, b in zip(run["logprobs"], base["logprobs"]):
            assert_within(a, b, bound, key)
        assert run["cache_sharding_kept"], key


@pytest.mark.parametrize("model,k,chunk,tp_sizes", RUNS)
def test_outputs_equal_tp1_token_for_token(report, model, k, chunk, tp_sizes):
    """Greedy requests and a sampled one (temperature, top-k, its top logprob ids):
    the vocab-sharded head feeds the same sampling."""
    _compare(report, lambda tp: f"{model} k={k} chunk={chunk} tp={tp}")
    for tp in tp_sizes[1:]:
        run = report["runs"][f"{model} k={k} chunk={chunk} tp={tp}"]
        assert run["top_ids"] == report["runs"][f"{model} k={k} chunk={chunk} tp=1"]["top_ids"]


def test_prefix_cache_hit_under_tensor_parallelism_gives_the_uncached_outputs(report):
    cached, plain = report["prefix_cache"]["tp=2 cache=True"], report["prefix_cache"]["tp=1 cache=False"]
    assert cached["hits"] >= 16  # the second request reused at least one full page
    assert cached["tokens"] == plain["tokens"]
    assert cached["accepted_per_position"] == plain["accepted_per_position"]


def test_several_mtp_modules_preemption_and_abort_in_flight(report):
    """Two modules (rows before each request, the chained step), prefix caching and a
    pool that preempts, at TP=2: the plain TP=1 run's tokens (greedy and seeded sampled
    ones alike: a seeded request's tokens do not depend on speculation) and logprobs.
    A request aborted while its step is in flight leaves every page free or parked in
    the prefix cache, and no reference held."""
    run, plain = report["modules_run"], report["runs"][f"stories260K k=0 chunk={RUNS[0][2]} tp=1"]
    assert run["tokens"] == plain["tokens"]
    bound = 2 * stories_logprob_bound_of(run_sequences(plain))
    for a, b in zip(run["logprobs"], plain["logprobs"]):
        assert_within(a, b, bound)
    assert run["cache_sharding_kept"]
    assert run["preemptions"] > 0 and run["aborted_in_flight"]
    accepted = np.sum(run["accepted_per_position"], axis=0)
    assert len(accepted) == 3 and accepted[-1] > 0, accepted  # the chained third draft is accepted at times
    for key in ("pages_after_generate", "pages_after_abort"):
        pages = run[key]
        assert pages["free_plus_parked"] == pages["total"] and pages["nonzero_ref_counts"] == 0, (key, pages)


def test_greedy_steps_take_tp1s_tokens_drafts_and_acceptance(report):
    """Greedy shapes take the argmax of vocab-sharded logits (sharding.argmax_vocab), in
    verification and in the MTP draft pass: step for step the same emitted tokens,
    accepted drafts and new drafts as TP=1 (at TP=2; TP=4's argmax:
    test_sharded_argmax_breaks_ties_as_jnp_argmax, its greedy outputs: the runs')."""
    base, run = report["greedy_steps"]["1"], report["greedy_steps"]["2"]
    assert all(step["greedy_shape"] for step in base["steps"] + run["steps"])
    assert run["steps"] == base["steps"]
    assert run["tokens"] == base["tokens"] and run["accepted_per_position"] == base["accepted_per_position"]
    assert np.sum(base["accepted_per_position"]) > 0  # drafts are accepted, not only rejected


def test_greedy_step_gathers_no_logits(report):
    """The compiled TP=2 greedy step (2 requests, MTP k=2) has no all-gather of a
    vocabulary-sized array: three gathers of [2 devices, rows, 2] floats (the verify
    rows', the two drafts'), 4 * (2*3 + 2*2) * 2 * 2 = 160 bytes in all, where the
    general step still gathers the logits, [2, 3, 512] (12 KiB)."""
    gathers = report["greedy_steps"]["2"]["all_gathers"]
    greedy, general = ([(dtype, [int(d) for d in dims.split(",")]) for dtype, dims in gathers[g]] for g in ("True", "False"))
    assert sorted(shape for _, shape in greedy) == [[2, 2, 2], [2, 2, 2], [2, 2, 3, 2]], greedy
    assert all(dtype == "f32" for dtype, _ in greedy)
    assert sum(4 * np.prod(shape) for _, shape in greedy) == 160
    assert ("f32", [2, 3, VOCAB]) in general and sum(VOCAB in shape for _, shape in general) == 1, general


def test_sharded_argmax_breaks_ties_as_jnp_argmax(report, seed):
    for case, result in report["argmax"].items():
        assert result["mismatched_rows"] == [], f"{case}, seed {seed} (JAXMTP_TEST_SEED={seed} replays it)"
        assert result["dtype"] == "int32", case


def test_qkv_bias_qk_norm_mtp_and_pallas_kernel_under_shard_map(report):
    _compare(report, lambda tp: f"qwen3-bias tp={tp}")


# what the rules say, written out for stories260K-mtp (8/4 heads of 8, ffn 172, vocab 512, tied)
EXPECTED_SPEC = {
    "embed": ["tp"], "final_norm": [], "input_norm": [], "post_norm": [],
    "q_proj": [None, "tp"], "k_proj": [None, "tp"], "v_proj": [None, "tp"], "o_proj": ["tp"],
    "gate_up_proj": [None, None, "tp"], "down_proj": ["tp"],
    "token_norm": [], "hidden_norm": [], "proj_token": [], "proj_hidden": [],
}


@pytest.mark.parametrize("tp", [2, 4])
def test_every_weight_and_cache_array_is_sharded_by_the_rules(report, tp):
    layouts = report["layouts"][str(tp)]
    names = [n for n in layouts if not n.startswith("cache")]
    assert len(names) == 1 + 5 * 8 + 1 + (4 + 8 + 1)  # embed, 5 layers, final norm, the MTP module
    assert any(".mtp[0].block.q_proj" in n for n in names)
    for name, layout in layouts.items():
        field = "cache" if name.startswith("cache") else name.rsplit(".", 1)[-1]
        spec = [None, None, "tp"] if field == "cache" else EXPECTED_SPEC[field]
        assert layout["spec"] == spec, name
        assert layout["devices"] == tp, name
        shard = [size // tp if axis == "tp" else size for size, axis in zip(layout["shape"], spec + [None] * 4)]
        assert layout["shard"] == shard, name
    assert len([n for n in layouts if n.startswith("cache.k")]) == 5 + 1  # main layers, then the MTP layer


def test_loading_places_the_same_weights_at_every_size(report):
    assert report["dummy_equal"]  # random weights made shard by shard equal TP=1's
    assert report["orbax_equal"] and report["orbax_q_proj_spec"] == [None, "tp"]


def test_sizes_that_do_not_fit_raise_value_errors_naming_the_problem(report):
    errors = report["errors"]
    assert "tensor_parallel_size=3" in errors["kv_heads"] and "num_kv_heads=4" in errors["kv_heads"]
    assert "tensor_parallel_size=8" in errors["devices"] and "4 cpu device" in errors["devices"]
    assert "intermediate_size=170" in errors["ffn"]


def test_cli_passes_tensor_parallel_size_to_the_engine(capsys):
    from jaxmtp import cli

    # this process has one CPU device: the engine's own error proves the flag reached it
    code = cli.main(["generate", "hi", "--model", str(STORIES), "--tensor-parallel-size", "2", "--max-tokens", "2"])
    assert code == 2
    assert "tensor_parallel_size=2 is larger than the 1 cpu device(s)" in capsys.readouterr().err


if __name__ == "__main__":
    print(json.dumps(worker(int(sys.argv[1]))))

"""The compiled step: no recompilation after warm-up, the donated cache updated in place,
KV writes and page copies against NumPy, the Pallas backend, parallel warm-up into the
persistent cache, and the greedy program without sampling branches."""

from __future__ import annotations

import subprocess
import sys

import jax
import numpy as np
import pytest

from conftest import MTP_MODEL, ROOT, STORIES, assert_no_leaks, random_prompts, token_ids
from jaxmtp import LLM, SamplingParams
from jaxmtp.worker.batch import OTHER_KINDS, BatchShape, BucketPlan
from jaxmtp.worker.programs import num_compiles

GREEDY = SamplingParams(max_tokens=24, temperature=0.0)


def make_llm(**kwargs) -> LLM:
    defaults = dict(page_size=16, max_num_seqs=8, max_num_batched_tokens=64)
    return LLM(STORIES, **{**defaults, **kwargs})


def test_no_recompilation_after_warmup(rng):
    # two requests a step, 16 rows: few shapes to warm up, and the seven requests below
    # still mix prefill chunks, decodes, greedy and sampled rows in every shape
    llm = make_llm(max_num_seqs=2, max_num_batched_tokens=16, prefill_chunk_size=13)
    llm.engine.warmup()
    before = num_compiles()
    prompts = random_prompts(rng, [3, 30, 17, 8, 25, 1 + 1, 12])
    params = [
        SamplingParams(max_tokens=int(n), temperature=t, top_p=p, top_k=k, seed=s, logprobs=lp)
        for n, t, p, k, s, lp in [
            (5, 0.0, 1.0, -1, None, None), (20, 0.8, 0.9, -1, 1, 2), (9, 1.0, 1.0, 5, None, 0),
            (14, 0.0, 1.0, -1, None, None), (3, 1.2, 0.5, 40, 7, None), (30, 0.0, 1.0, -1, None, 5),
            (11, 0.7, 1.0, -1, None, None),
        ]
    ]
    llm.generate(prompts, params, use_tqdm=False)
    assert num_compiles() == before
    assert_no_leaks(llm)


def test_engine_on_the_pallas_kernel_matches_the_reference(tmp_path, rng):
    """The GPU attention path, run in interpret mode inside the full engine step."""
    from conftest import make_hf_model

    folder = make_hf_model(tmp_path / "hd16", "llama", seed=int(rng.integers(1 << 30)),
                           hidden_size=32, num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=1)
    prompts = [[1] + rng.integers(3, 97, size=n).tolist() for n in (6, 11)]
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    kwargs = dict(page_size=4, max_num_seqs=2, max_num_batched_tokens=16, prefill_chunk_size=5)
    expected = token_ids(LLM(folder, attention_backend="reference", **kwargs).generate(prompts, params, use_tqdm=False))
    got = token_ids(LLM(folder, attention_backend="pallas_interpret", **kwargs).generate(prompts, params, use_tqdm=False))
    assert got == expected


def test_pallas_backend_refuses_head_sizes_it_cannot_tile():
    with pytest.raises(ValueError, match="head_dim a power of two >= 16, got 8"):
        LLM(STORIES, attention_backend="pallas")


def test_compiled_step_updates_the_donated_cache_in_place():
    """No copy of a KV page array in the optimised HLO: the donated cache is aliased
    to the output and written by in-place scatters, the draft chain's one-row
    scatters included (batch shapes with one request). Every scatter declares unique
    indices (padding rows write distinct dropped slots), which XLA's GPU emitter turns
    into plain stores instead of atomic read-modify-writes."""
    llm = LLM(MTP_MODEL, num_speculative_tokens=2, page_size=16, max_num_seqs=4, max_num_batched_tokens=32)
    engine = llm.engine
    for shape in (BatchShape(8, 1), BatchShape(32, 4)):
        assert engine.runner.cache_copies(shape) == []
    lowered = engine.runner.lower_step(BatchShape(8, 1))
    scatters = [line for line in lowered.as_text().splitlines() if '"stablehlo.scatter"' in line]
    assert len(scatters) >= 2 * len(engine.cache.k)
    assert all("unique_indices = true" in line for line in scatters)
    text = lowered.compile().as_text()
    aliased = text.splitlines()[0].count("-alias)")  # the HloModule line lists input/output aliases
    # the logits processors' state is donated too (a greedy step passes it through)
    assert aliased == 2 * len(engine.cache.k) + len(jax.tree.leaves(engine.runner.logits_state))


@pytest.mark.parametrize("rows", [1, 8])
def test_kv_write_fills_the_rows_slots_and_drops_the_padding_rows(rng, rows):
    """write_kv against NumPy: real rows land in their slots, padding rows (distinct
    slots past the end) change nothing; one row takes the two-row scatter path."""
    import jax

    from jaxmtp.models.attention import write_kv
    from jaxmtp.worker.cache import dropped_index

    pages, page_size, heads, dim = 6, 4, 2, 8
    num_slots = pages * page_size
    k_pages, v_pages = (rng.standard_normal((pages, page_size, heads, dim)).astype(np.float32) for _ in range(2))
    k, v = (rng.standard_normal((rows, heads, dim)).astype(np.float32) for _ in range(2))
    real = (rows + 1) // 2
    slots = dropped_index(num_slots, np.arange(rows, dtype=np.int32))
    slots[:real] = rng.choice(num_slots, real, replace=False)
    new_k, new_v = jax.jit(write_kv)(k_pages, v_pages, slots, k, v)
    for new, old, x in ((new_k, k_pages, k), (new_v, v_pages, v)):
        expected = old.reshape(num_slots, heads, dim).copy()
        expected[slots[:real]] = x[:real]
        assert np.array_equal(np.asarray(new).reshape(num_slots, heads, dim), expected)


def test_page_copies_read_every_source_first_and_drop_the_padding(rng):
    from jaxmtp.worker.cache import KVCache, copy_pages, page_copy_arrays

    pages = rng.standard_normal((2, 7, 4, 2, 8)).astype(np.float32)
    cache = KVCache(k=[pages[0]], v=[pages[1]])
    copies = [(1, 3), (3, 5), (6, 0)]  # page 5 gets page 3 as it was before the call
    out = copy_pages(cache, *page_copy_arrays(copies, 7))
    for new, old in ((out.k[0], pages[0]), (out.v[0], pages[1])):
        expected = old.copy()
        for src, dst in copies:
            expected[dst] = old[src]
        assert np.array_equal(np.asarray(new), expected)


def test_parallel_warmup_fills_the_compilation_cache_so_serving_compiles_nothing(tmp_path):
    script = f"""
import jax
jax.config.update("jax_compilation_cache_dir", {str(tmp_path)!r})
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
from jaxmtp import LLM, SamplingParams
from jaxmtp.worker.programs import num_compiles
llm = LLM({str(MTP_MODEL)!r}, num_speculative_tokens=1, max_num_seqs=2, max_num_batched_tokens=8)
shapes = llm.engine.warmup(num_threads=2)
before = num_compiles()
llm.generate([[1, 5, 9], [1, 7]], SamplingParams(max_tokens=6), use_tqdm=False)
print("RESULT", shapes, num_compiles() - before)
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    shapes, compiled_while_serving = map(int, out.stdout.split("RESULT")[1].split())
    # one table width; and the largest constrained, prompt-logprob and both shape
    assert shapes == len(BucketPlan(8, 2, max_pages_per_seq=33).all_shapes()) + len(OTHER_KINDS)
    assert compiled_while_serving == 0
    assert len(list(tmp_path.iterdir())) >= shapes


def test_greedy_batches_run_a_step_without_sampling_branches(rng):
    """A batch whose requests are all greedy (and ask for no top logprobs) runs a step
    compiled without the sampling path; a sampled batch's step takes no conditional
    either (XLA:GPU would run it from the host); next to a sampled request the same
    greedy request runs the general step and gets the same tokens."""
    llm = make_llm(num_speculative_tokens=0)
    engine = llm.engine
    lowered = {greedy: engine.runner.lower_step(BatchShape(8, 2, greedy)) for greedy in (True, False)}
    compiled = {greedy: step.compile().as_text() for greedy, step in lowered.items()}
    assert all(" conditional(" not in text for text in compiled.values())
    # the sampled one draws Gumbel noise (its logarithms) and restricts without a sort, as
    # sampling.RESTRICT_SEARCH_FROM_ROWS has the CPU do (lax.top_k's, for the top
    # logprobs, is a sort on the CPU once compiled: the lowered programs are checked)
    assert " log(" in compiled[False] and " log(" not in compiled[True]
    assert all("stablehlo.sort" not in step.as_text() for step in lowered.values())
    prompt = random_prompts(rng, [9])[0]
    alone = llm.generate([prompt], GREEDY, use_tqdm=False)
    sampled = SamplingParams(max_tokens=30, temperature=0.9, seed=3, ignore_eos=True)  # outlives the greedy one
    mixed = llm.generate([prompt, prompt], [GREEDY, sampled], use_tqdm=False)
    assert token_ids(mixed)[0] == token_ids(alone)[0]
    assert engine.last_step.args[-1].greedy is False  # the steps ran the general program


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_steps_dots_run_at_the_model_dtypes_precision(dtype):
    """float32 means float32 on every backend: each dot of a float32 model's step (main
    model, verify, MTP draft chain) is lowered at HIGHEST precision, which a GPU runs in
    full float32 where its default rounds operands to TF32. A bf16 model's dots keep the
    default (the fast path). Read from the lowered StableHLO, which the CPU shows as a
    GPU would get it."""
    llm = LLM(MTP_MODEL, dtype=dtype, num_speculative_tokens=1, page_size=16, max_num_seqs=2, max_num_batched_tokens=8)
    text = llm.engine.runner.lower_step(BatchShape(8, 2, greedy=False)).as_text()
    dots = [line for line in text.splitlines() if "stablehlo.dot_general" in line]
    assert len(dots) > 10, "the step's matmuls (layers, lm head, draft layer) are dot_generals"
    if dtype == "float32":
        assert all("precision = [HIGHEST, HIGHEST]" in line for line in dots), [d for d in dots if "HIGHEST" not in d][:3]
    else:
        model_dots = [line for line in dots if "xbf16>, tensor<" in line and line.count("xbf16>") >= 2]
        assert model_dots and all("precision = [DEFAULT, DEFAULT]" in line for line in model_dots), model_dots[:3]


def test_the_steps_small_params_come_packed_one_buffer_a_dtype():
    """The host hands the step every array as an argument: the norms (stories260K's
    two a layer and the final one, all float32 here) come packed in one buffer, which
    the step slices back into the same tree, value for value; the compiled step takes
    that many arguments fewer (none of them an [H] norm of its own)."""
    from jaxmtp.worker.packed_params import ParamLayout

    llm = make_llm(dtype="float32")
    runner = llm.engine.runner
    params, (buffers, rest) = runner.params, runner.step_params
    leaves = jax.tree.leaves(params)
    norms = 2 * len(params.layers) + 1
    assert len(buffers) == 1 and buffers[0].shape == (norms * params.final_norm.shape[0],)
    assert len(rest) == len(leaves) - norms
    unpacked = jax.jit(runner.step_config.param_layout.unpack)(runner.step_params)
    assert jax.tree.structure(unpacked) == jax.tree.structure(params)
    for got, want in zip(jax.tree.leaves(unpacked), leaves):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    text = runner.lower_step(BatchShape(8, 1)).as_text()
    unpacked_layout = ParamLayout(jax.tree.structure(params), tuple(range(len(leaves))), ())
    assert unpacked_layout.pack(params) == ((), tuple(leaves))  # a layout that packs nothing hands the tree as is
    main = text[text.index("func.func public @main("):]
    header = main[: main.index(") -> ")]
    hidden = params.final_norm.shape[0]
    assert f"tensor<{buffers[0].shape[0]}xf32>" in header and f"tensor<{hidden}xf32>" not in header

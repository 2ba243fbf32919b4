"""The engine on the shipped stories260K: golden output, chunked prefill, batching,
preemption, page accounting and recompilation."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from conftest import MTP_MODEL, ROOT, STORIES, assert_no_leaks, golden_ids, random_prompts, token_ids
from jaxmtp import LLM, SamplingParams
from jaxmtp.batch import BatchShape, BucketPlan
from jaxmtp.engine import num_compiles

GREEDY = SamplingParams(max_tokens=24, temperature=0.0)


def make_llm(**kwargs) -> LLM:
    defaults = dict(page_size=16, max_num_seqs=8, max_num_batched_tokens=64)
    return LLM(STORIES, **{**defaults, **kwargs})








def test_golden_greedy_output_from_bos():
    llm = make_llm()
    out = llm.generate([[1]], SamplingParams(max_tokens=200, temperature=0.0), use_tqdm=False)
    assert out[0].outputs[0].token_ids == golden_ids()
    assert out[0].outputs[0].finish_reason == "length"
    assert out[0].outputs[0].text.startswith("Once upon a time, there was a little girl named Lily.")
    assert_no_leaks(llm)


@pytest.mark.parametrize("chunk", [1, 3, 15, 16, 17, None])
def test_chunked_prefill_matches_solo_runs(rng, chunk):
    prompts = random_prompts(rng, [5, 23, 40, 16])
    solo_llm = make_llm(max_num_seqs=1)
    solo = [token_ids(solo_llm.generate([p], GREEDY, use_tqdm=False))[0] for p in prompts]
    llm = make_llm(prefill_chunk_size=chunk)
    assert token_ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == solo
    assert_no_leaks(llm)


def test_token_budget_splits_prefill_across_steps(rng):
    """A budget smaller than the prompt still yields the same output."""
    prompts = random_prompts(rng, [45, 9])
    expected = token_ids(make_llm().generate(prompts, GREEDY, use_tqdm=False))
    llm = make_llm(max_num_batched_tokens=8, prefill_chunk_size=5)
    assert token_ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == expected


def test_preemption_recomputes_to_the_same_output(rng):
    prompts = random_prompts(rng, [10, 14, 7, 12, 9, 11])
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    expected = token_ids(make_llm().generate(prompts, params, use_tqdm=False))
    llm = make_llm(page_size=4, num_pages=16)  # room for little more than one request
    got = token_ids(llm.generate(prompts, params, use_tqdm=False))
    assert llm.engine.scheduler.num_preemptions > 0
    assert got == expected
    assert_no_leaks(llm)


def test_no_recompilation_after_warmup(rng):
    llm = make_llm(max_num_seqs=4, max_num_batched_tokens=32, prefill_chunk_size=13)
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


def test_stop_token_ids_stop_strings_and_ignore_eos():
    llm = make_llm()
    full = llm.generate([[1]], SamplingParams(max_tokens=60, temperature=0.0), use_tqdm=False)[0].outputs[0]
    # stop on a token id in the middle of the golden text
    stop_id = full.token_ids[10]
    first = full.token_ids.index(stop_id)
    out = llm.generate([[1]], SamplingParams(max_tokens=60, temperature=0.0, stop_token_ids=[stop_id]), use_tqdm=False)
    assert out[0].outputs[0].token_ids == full.token_ids[: first + 1]
    assert out[0].outputs[0].finish_reason == "stop" and out[0].outputs[0].stop_reason == stop_id
    # stop strings cut the text before the match
    out = llm.generate([[1]], SamplingParams(max_tokens=60, temperature=0.0, stop=["Lily"]), use_tqdm=False)
    assert out[0].outputs[0].text == full.text[: full.text.index("Lily")]
    assert out[0].outputs[0].stop_reason == "Lily"
    # sampled stories end at an eos id (stories260K ends stories with BOS, id 1, as
    # its generation_config.json says); ignore_eos runs through it
    sampled = [SamplingParams(max_tokens=300, temperature=1.0, seed=s) for s in range(6)]
    stories = [o.outputs[0] for o in llm.generate([[1]] * 6, sampled, use_tqdm=False)]
    ended = [(s, story) for s, story in zip(sampled, stories) if story.finish_reason == "stop"]
    assert ended, "no sampled story reached eos"
    params, story = ended[0]
    assert story.token_ids[-1] in (1, 2) and story.stop_reason == story.token_ids[-1]
    params = SamplingParams(max_tokens=len(story.token_ids) + 5, temperature=1.0, seed=params.seed, ignore_eos=True)
    longer = llm.generate([[1]], params, use_tqdm=False)[0].outputs[0]
    assert longer.finish_reason == "length"
    assert longer.token_ids[: len(story.token_ids)] == story.token_ids


def test_streaming_yields_growing_outputs_ending_in_the_full_text():
    llm = make_llm()
    params = SamplingParams(max_tokens=30, temperature=0.0)
    chunks = list(llm.stream("Once upon a time", params))
    assert chunks[-1].finished and not any(c.finished for c in chunks[:-1])
    lengths = [len(c.outputs[0].token_ids) for c in chunks]
    assert lengths == sorted(lengths) and lengths[-1] == 30
    full = llm.generate("Once upon a time", params, use_tqdm=False)[0]
    assert chunks[-1].outputs[0].text == full.outputs[0].text
    assert full.prompt_token_ids[0] == 1


def test_logprobs_are_log_softmax_of_the_chosen_token():
    import numpy as np

    from conftest import prompt_logits

    llm = make_llm()
    out = llm.generate([[1, 403, 407]], SamplingParams(max_tokens=1, temperature=0.0, logprobs=3), use_tqdm=False)
    completion = out[0].outputs[0]
    logits = prompt_logits(llm.engine, [1, 403, 407])[-1].astype(np.float64)
    logp = logits - np.log(np.exp(logits - logits.max()).sum()) - logits.max()
    entry = completion.logprobs[0]
    token = completion.token_ids[0]
    assert list(entry)[0] == token
    np.testing.assert_allclose(entry[token], logp[token], atol=1e-4)
    top3 = np.argsort(-logp)[:3]
    assert set(top3) <= set(entry)


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


def test_stream_closed_early_frees_its_pages():
    llm = make_llm()
    stream = llm.stream("Once upon a time", SamplingParams(max_tokens=50, temperature=0.0))
    next(stream)
    next(stream)
    stream.close()
    assert_no_leaks(llm)


def test_output_text_continues_the_prompt_with_its_leading_space():
    llm = make_llm()
    out = llm.generate("Once upon a", SamplingParams(max_tokens=3, temperature=0.0), use_tqdm=False)[0]
    assert out.outputs[0].text.startswith(" time")
    assert ("Once upon a" + out.outputs[0].text) == llm.tokenizer.decode(out.prompt_token_ids + out.outputs[0].token_ids)


def test_async_scheduling_gives_the_outputs_of_sync_scheduling(rng):
    """Dispatching step N+1 before reading step N (rows continued from the device's
    carry, positions shifted by the accepted drafts) changes no output: MTP drafts,
    chunked prefill, seeded sampling, and spec stats step for step; logprobs to float32
    rounding (a step's batch can differ by a request near max_tokens, which waits for
    its result before it is scheduled again). Under a tiny page pool (preemption at
    different moments) greedy tokens still agree; sampled ones need not, as the verify
    windows after a recompute differ."""
    prompts = random_prompts(rng, [6, 30, 13, 21])
    params = [
        SamplingParams(max_tokens=40, temperature=0.0),
        SamplingParams(max_tokens=33, temperature=0.8, seed=int(rng.integers(1 << 30))),
        SamplingParams(max_tokens=40, temperature=0.0, logprobs=2),
        SamplingParams(max_tokens=21, temperature=1.0, top_p=0.9, seed=int(rng.integers(1 << 30))),
    ]
    for num_pages in (None, 40):
        runs = {}
        for overlap in (False, True):
            llm = LLM(MTP_MODEL, num_speculative_tokens=2, page_size=4, num_pages=num_pages, max_num_seqs=4,
                      max_num_batched_tokens=32, prefill_chunk_size=7, async_scheduling=overlap)
            runs[overlap] = llm.generate(prompts, params, use_tqdm=False)
            assert (llm.engine.scheduler.num_preemptions > 0) == (num_pages is not None)
            assert_no_leaks(llm)
        compared = [0, 1, 2, 3] if num_pages is None else [0, 2]
        assert [token_ids(runs[True])[i] for i in compared] == [token_ids(runs[False])[i] for i in compared]
        if num_pages is None:
            assert [o.spec_stats for o in runs[True]] == [o.spec_stats for o in runs[False]]
            for a, b in zip(runs[True][2].outputs[0].logprobs, runs[False][2].outputs[0].logprobs):
                assert a.keys() == b.keys()
                np.testing.assert_allclose(list(a.values()), list(b.values()), rtol=1e-5, atol=1e-5)


def test_async_step_returns_a_step_late_while_the_next_runs():
    llm = make_llm()
    engine = llm.engine
    engine.add_request("a", [1], SamplingParams(max_tokens=3, temperature=0.0))
    assert engine.step() == [] and engine.num_steps_in_flight == 1  # prefill dispatched, not read
    first = engine.step()  # decode dispatched, then the prefill's token read
    assert engine.num_steps_in_flight == 1 and len(first[0].outputs[0].token_ids) == 1
    while engine.has_unfinished_requests():
        engine.step()
    assert_no_leaks(llm)


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
    assert aliased == 2 * len(engine.cache.k)


@pytest.mark.parametrize("rows", [1, 8])
def test_kv_write_fills_the_rows_slots_and_drops_the_padding_rows(rng, rows):
    """write_kv against NumPy: real rows land in their slots, padding rows (distinct
    slots past the end) change nothing; one row takes the two-row scatter path."""
    import jax

    from jaxmtp.attention import write_kv
    from jaxmtp.cache import dropped_index

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
    from jaxmtp.cache import KVCache, copy_pages, page_copy_arrays

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
from jaxmtp.engine import num_compiles
llm = LLM({str(MTP_MODEL)!r}, num_speculative_tokens=1, max_num_seqs=2, max_num_batched_tokens=16)
shapes = llm.engine.warmup(num_threads=2)
before = num_compiles()
llm.generate([[1, 5, 9], [1, 7]], SamplingParams(max_tokens=6), use_tqdm=False)
print("RESULT", shapes, num_compiles() - before)
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    shapes, compiled_while_serving = map(int, out.stdout.split("RESULT")[1].split())
    assert shapes == len(BucketPlan(16, 2, max_pages_per_seq=33).all_shapes())  # one table width
    assert compiled_while_serving == 0
    assert len(list(tmp_path.iterdir())) >= shapes


def test_greedy_batches_run_a_step_without_sampling_branches(rng):
    """A batch whose requests are all greedy (and ask for no top logprobs) runs a step
    compiled without the sampling and top-logprob conditionals; next to a sampled
    request the same greedy request runs the general step and gets the same tokens."""
    llm = make_llm(num_speculative_tokens=0)
    engine = llm.engine
    conditionals = {
        greedy: engine.runner.lower_step(BatchShape(8, 2, greedy)).compile().as_text().count(" conditional(")
        for greedy in (True, False)
    }
    assert conditionals[True] == 0 and conditionals[False] > 0
    prompt = random_prompts(rng, [9])[0]
    alone = llm.generate([prompt], GREEDY, use_tqdm=False)
    sampled = SamplingParams(max_tokens=30, temperature=0.9, seed=3, ignore_eos=True)  # outlives the greedy one
    mixed = llm.generate([prompt, prompt], [GREEDY, sampled], use_tqdm=False)
    assert token_ids(mixed)[0] == token_ids(alone)[0]
    assert engine.runner.last_args[-1].greedy is False  # the steps ran the general program

"""MTP speculative decoding that stays exact under chunked prefill (DESIGN.md invariants
1-7), on the shipped stories260K with its trained MTP head."""

from __future__ import annotations

import types

import jax.numpy as jnp
import numpy as np
import pytest

from conftest import (MTP_MODEL, STORIES, assert_no_leaks, draft_kv_bound, greedy, make_modules_model, prompt_logits,
                      token_ids, until_prefill_emits)
from jaxmtp import LLM, SamplingParams
from jaxmtp.worker.programs import num_compiles
from jaxmtp.worker.sampling import verify_and_sample
from test_sampling import g_test
from tolerances import assert_within

PAGE = 16
CHUNKS = [1, 7, PAGE - 1, PAGE, PAGE + 1, None]  # None: the whole prompt in one chunk


def make_llm(model=MTP_MODEL, **kwargs) -> LLM:
    # contexts of at most 128 tokens: the CPU attention reads a row's whole page table
    defaults = dict(page_size=PAGE, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=128)
    return LLM(model, **{**defaults, **kwargs})


@pytest.fixture(scope="module")
def plain():
    return make_llm(STORIES)


def sampled_prompts(llm: LLM, rng, lengths) -> list[list[int]]:
    """Prompts the base model would not write greedily (sampled hot), so the main
    model's sample at a chunk boundary often differs from the next prompt token."""
    seeds = rng.integers(0, 2**31, size=len(lengths))
    params = [SamplingParams(max_tokens=n, temperature=1.3, seed=int(s), ignore_eos=True) for n, s in zip(lengths, seeds)]
    outs = llm.generate([[1]] * len(lengths), params, use_tqdm=False)
    return [[1] + o.outputs[0].token_ids[: n - 1] for o, n in zip(outs, lengths)]


# ----- invariant 1: greedy output with MTP == without ------------------------------------


# k = 1 drafts once; k = 2 chains the module (as k = 3 under preemption below; the default
# pool's tests all draft with k = 1 or 2, sharing compiled steps). Each chunk size once,
# the two ks between them (every size: test_chunk_invariance_and_the_sampled_ablation_breaks_it)
@pytest.mark.parametrize("k, chunks", [(1, [1, PAGE, None]), (2, [7, PAGE - 1, PAGE + 1])])
def test_greedy_with_mtp_equals_without(plain, rng, k, chunks):
    prompts = sampled_prompts(plain, rng, [3, 40, 21])
    expected = token_ids(plain.generate(prompts, greedy(24), use_tqdm=False))
    for chunk in chunks:
        llm = make_llm(num_speculative_tokens=k, prefill_chunk_size=chunk)
        outs = llm.generate(prompts, greedy(24), use_tqdm=False)
        assert token_ids(outs) == expected, f"k={k} chunk={chunk}"
        assert all(o.spec_stats["drafted"] > 0 for o in outs)
        assert_no_leaks(llm)


# seed 6: two recomputing requests took turns preempting each other forever while the
# older one waited for the in-flight step that would finish it
@pytest.mark.parametrize("seed", [None, 6])
def test_greedy_with_mtp_equals_without_under_preemption(plain, rng, seed):
    if seed is not None:
        rng = np.random.default_rng(seed)
    prompts = sampled_prompts(plain, rng, [12, 30, 9, 25, 17])
    expected = token_ids(plain.generate(prompts, greedy(48), use_tqdm=False))
    llm = make_llm(num_speculative_tokens=3, prefill_chunk_size=7, page_size=4, num_pages=24)
    assert token_ids(llm.generate(prompts, greedy(48), use_tqdm=False)) == expected
    assert llm.engine.scheduler.num_preemptions > 0
    assert_no_leaks(llm)


# ----- invariants 2 and 3: chunk invariance, and the ablation loses it -------------------


def prefill_state(llm: LLM, prompt: list[int], k: int):
    """Run one request until its prefill emits; return the draft KV at every prompt
    position [2, L, MTP layers x kv heads, head_dim] (module j's heads after module
    j-1's) and the first proposals."""
    engine = llm.engine
    seq = until_prefill_emits(engine, prompt)
    slots = np.array([seq.pages[p // engine.page_size] * engine.page_size + p % engine.page_size for p in range(len(prompt))])
    per_layer = []
    for layer in range(engine.model_config.num_layers, len(engine.cache.k)):
        flat_k = np.asarray(engine.cache.k[layer]).reshape(-1, *engine.cache.k[layer].shape[2:])
        flat_v = np.asarray(engine.cache.v[layer]).reshape(-1, *engine.cache.v[layer].shape[2:])
        per_layer.append(np.stack([flat_k[slots], flat_v[slots]]))
    draft_kv = np.concatenate(per_layer, axis=2)
    first = list(seq.drafts)
    engine.abort_request("probe")
    engine.step()
    return draft_kv, first


def acceptance_per_position(llm: LLM, prompts) -> list[list[int]]:
    return [o.spec_stats["accepted_per_position"] for o in llm.generate(prompts, greedy(48), use_tqdm=False)]


def test_chunk_invariance_and_the_sampled_ablation_breaks_it(plain, rng):
    k = 2
    prompts = sampled_prompts(plain, rng, [50, 33, 47])
    reference = make_llm(num_speculative_tokens=k)  # whole prompt in one chunk
    ref_states = [prefill_state(reference, p, k) for p in prompts]
    ref_accept = acceptance_per_position(reference, prompts)
    for chunk in CHUNKS[:-1]:
        llm = make_llm(num_speculative_tokens=k, prefill_chunk_size=chunk)
        for (ref_kv, ref_first), prompt in zip(ref_states, prompts):
            kv, first = prefill_state(llm, prompt, k)
            # float32 sums over differently shaped batches: equal to rounding
            assert_within(kv, ref_kv, draft_kv_bound(ref_kv, 1), f"chunk={chunk}")
            assert first == ref_first, f"chunk={chunk}"
        assert acceptance_per_position(llm, prompts) == ref_accept, f"chunk={chunk}"

    # The pre-fix behaviour writes the sampled token's draft KV at every non-final chunk
    # boundary where the main model's sample is not the next prompt token.
    ablation = make_llm(num_speculative_tokens=k, prefill_chunk_size=7, mtp_boundary="sampled")
    differs = 0
    for (ref_kv, _), prompt in zip(ref_states, prompts):
        kv, _ = prefill_state(ablation, prompt, k)
        row_differs = np.abs(kv - ref_kv).max(axis=(0, 2, 3)) > draft_kv_bound(ref_kv, 1)
        boundaries = set(range(6, len(prompt) - 1, 7))
        assert set(np.flatnonzero(row_differs)) <= boundaries
        differs += row_differs.sum()
    assert differs > 0, "the ablation never differed: the test cannot tell the fix from the bug"


# ----- N > 1 modules: module j drafts at depth j, exactly ----------------------------------


@pytest.fixture(scope="module")
def modules_model(tmp_path_factory):
    """stories260K-mtp with three MTP modules (conftest.make_modules_model)."""
    return make_modules_model(tmp_path_factory.mktemp("modules") / "stories260K-mtp3", 3)


# One pool for the tests below, so that they share compiled steps: it holds two of the
# chunk-invariance test's requests and makes four of the greedy test's preempt.
MODULES_POOL = 14


def test_chunk_invariance_with_several_modules(plain, modules_model, rng):
    """Three modules, k = 3. Module j's row i is exact when token i+j is a prompt token:
    those rows of every module, the first drafts and the per-position acceptance are the
    same for every chunk size. The sampled-boundary ablation changes module 1's rows
    before chunk boundaries (and, through module 1's output, later modules' rows)."""
    k = m = 3
    prompts = sampled_prompts(plain, rng, [50, 33])
    reference = make_llm(modules_model, num_speculative_tokens=k, num_pages=MODULES_POOL)
    ref_states = [prefill_state(reference, p, k) for p in prompts]
    ref_accept = acceptance_per_position(reference, prompts)
    assert reference.engine.scheduler.num_preemptions == 0
    heads = ref_states[0][0].shape[2] // m

    def exact_rows(kv, j):  # module j's rows i with i + j <= L - 1
        return kv[:, : kv.shape[1] - j, (j - 1) * heads : j * heads]

    # every row a boundary, boundaries inside a page, one past a page (the single-module
    # test takes each chunk size of CHUNKS)
    for chunk in (1, 7, PAGE + 1):
        llm = make_llm(modules_model, num_speculative_tokens=k, prefill_chunk_size=chunk, num_pages=MODULES_POOL)
        for (ref_kv, ref_first), prompt in zip(ref_states, prompts):
            kv, first = prefill_state(llm, prompt, k)
            for j in range(1, m + 1):
                assert_within(exact_rows(kv, j), exact_rows(ref_kv, j), draft_kv_bound(ref_kv, m), f"chunk={chunk} module {j}")
            assert first == ref_first, f"chunk={chunk}"
        assert acceptance_per_position(llm, prompts) == ref_accept, f"chunk={chunk}"

    ablation = make_llm(modules_model, num_speculative_tokens=k, prefill_chunk_size=7, mtp_boundary="sampled",
                        num_pages=MODULES_POOL)
    differs = 0
    for (ref_kv, _), prompt in zip(ref_states, prompts):
        kv, _ = prefill_state(ablation, prompt, k)
        for j in range(1, m + 1):
            row_differs = np.abs(exact_rows(kv, j) - exact_rows(ref_kv, j)).max(axis=(0, 2, 3)) > draft_kv_bound(ref_kv, m)
            if j == 1:
                assert set(np.flatnonzero(row_differs)) <= set(range(6, len(prompt) - 1, 7))
            differs += row_differs.sum()
    assert differs > 0, "the ablation never differed: the test cannot tell the fix from the bug"


# k = 2 runs two of the three modules (sync scheduling), k = 4 all three and module 3
# once more (async: the carried rows' drafts come from the chain)
@pytest.mark.parametrize("k, overlap", [(2, False), (4, True)])
def test_greedy_with_several_modules_equals_without(plain, modules_model, rng, k, overlap):
    """Three modules: mixed prompt lengths, chunked prefill and a pool small enough to
    preempt."""
    prompts = sampled_prompts(plain, rng, [20, 45, 3, 40, 17])
    expected = token_ids(plain.generate(prompts, greedy(40), use_tqdm=False))
    llm = make_llm(modules_model, num_speculative_tokens=k, prefill_chunk_size=7, num_pages=MODULES_POOL,
                   async_scheduling=overlap)
    outs = llm.generate(prompts, greedy(40), use_tqdm=False)
    assert token_ids(outs) == expected
    assert llm.engine.scheduler.num_preemptions > 0
    accepted = np.sum([o.spec_stats["accepted_per_position"] for o in outs], axis=0)
    assert len(accepted) == k and accepted[-1] > 0, accepted  # the deepest draft is accepted at times
    assert_no_leaks(llm)


def test_only_the_modules_drafting_runs_are_loaded(modules_model):
    """k speculative tokens draft with min(k, N) modules; the others stay on disk."""
    from jaxmtp.models.registry import load_config
    from jaxmtp.loading.loader import load_params

    for k, m in ((1, 1), (2, 2), (4, 3)):
        engine = make_llm(modules_model, num_speculative_tokens=k).engine
        assert len(engine.params.mtp) == engine.num_draft_modules == m
        assert len(engine.cache.k) == engine.model_config.num_layers + m
    with pytest.raises(ValueError, match="asked for 4 MTP modules; .* declares 3"):
        load_params(modules_model, load_config(modules_model), num_mtp_modules=4)


# ----- invariant 4: mixed batch ----------------------------------------------------------


def test_mixed_batch_step_gives_each_request_its_solo_result(plain, rng):
    k = 2
    decode_prompt, long_prompt, short_prompt = sampled_prompts(plain, rng, [10, 45, 12])
    solo = {}
    for name, prompt in [("decode", decode_prompt), ("long", long_prompt), ("short", short_prompt)]:
        out = make_llm(num_speculative_tokens=k, prefill_chunk_size=16).generate([prompt], greedy(30), use_tqdm=False)[0]
        solo[name] = (out.outputs[0].token_ids, out.spec_stats)
    llm = make_llm(num_speculative_tokens=k, prefill_chunk_size=16)
    engine = llm.engine
    engine.add_request("decode", decode_prompt, greedy(30))
    while not engine.requests or len(engine.requests["decode"].seqs[0].output_token_ids) < 3:
        engine.step()
    engine.add_request("long", long_prompt, greedy(30))
    engine.add_request("short", short_prompt, greedy(30))
    results = {}
    mixed = False
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                results[out.request_id] = (out.outputs[0].token_ids, out.spec_stats)
        kinds = {(s.seq.request_id, s.num_drafts > 0, s.has_output) for s in engine.last_schedule}
        mixed |= {("decode", True, True), ("long", False, False), ("short", False, True)} <= kinds
    assert mixed, "no step held a decode, a mid-prefill chunk and a final chunk together"
    assert results == solo


# ----- invariant 5: edge cases -----------------------------------------------------------


@pytest.mark.parametrize("k", [1, 2])
def test_prompt_of_length_one_and_one_plus_k(plain, rng, k):
    prompts = [[1]] + sampled_prompts(plain, rng, [1 + k, 2 + k])
    expected = token_ids(plain.generate(prompts, greedy(30), use_tqdm=False))
    llm = make_llm(num_speculative_tokens=k, prefill_chunk_size=k)
    assert token_ids(llm.generate(prompts, greedy(30), use_tqdm=False)) == expected


def test_preempted_request_recomputes_through_its_generated_tokens(plain, rng):
    """After preemption the recompute's chunk boundaries fall inside generated text;
    the boundary token there must be the real generated token."""
    prompts = sampled_prompts(plain, rng, [6, 8, 7])
    expected = token_ids(plain.generate(prompts, greedy(60), use_tqdm=False))
    llm = make_llm(num_speculative_tokens=3, prefill_chunk_size=5, page_size=4, num_pages=24)  # the preemption test's pool
    engine = llm.engine
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, greedy(60))
    boundary_checks = 0
    results = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out.outputs[0].token_ids
        for i, rows in enumerate(engine.last_schedule):
            seq = rows.seq
            end = rows.start + len(rows.token_ids)
            if seq.num_preemptions and not rows.has_output and end > len(seq.prompt_token_ids):
                assert rows.next_chunk_tokens[0] == seq.token_ids[end]
                assert engine.last_step_output.boundary_token[i] == seq.token_ids[end]
                boundary_checks += 1
    assert boundary_checks > 0, "no recompute chunk ended inside generated text"
    assert [results[str(i)] for i in range(len(prompts))] == expected
    assert_no_leaks(llm)


def test_max_tokens_and_stop_tokens_inside_an_accepted_run(plain, rng):
    prompt = sampled_prompts(plain, rng, [20])[0]
    full = plain.generate([prompt], greedy(60), use_tqdm=False)[0].outputs[0].token_ids
    llm = make_llm(num_speculative_tokens=2)
    for n in (1, 2, 5, 13, 31):
        out = llm.generate([prompt], greedy(n), use_tqdm=False)[0].outputs[0]
        assert out.token_ids == full[:n] and out.finish_reason == "length"
    stop = full[17]
    cut = full.index(stop) + 1
    out = llm.generate([prompt], greedy(60, stop_token_ids=[stop]), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == full[:cut] and out.finish_reason == "stop"
    # stop strings ending mid-step, kept or cut, held back by min_tokens or not: as without MTP
    text = plain.generate([prompt], greedy(60), use_tqdm=False)[0].outputs[0].text
    for start, include, min_tokens in ((len(text) // 3, False, 0), (len(text) // 2, True, 0), (5, False, 20)):
        params = greedy(60, stop=[text[start : start + 3]], include_stop_str_in_output=include, min_tokens=min_tokens)
        want, got = (x.generate([prompt], params, use_tqdm=False)[0].outputs[0] for x in (plain, llm))
        assert (got.token_ids, got.text, got.finish_reason, got.stop_reason) == (
            want.token_ids, want.text, want.finish_reason, want.stop_reason)
        assert want.finish_reason == "stop" or min_tokens  # (a held-back match may not come again)
    assert_no_leaks(llm)


def test_head_accepts_often_on_held_out_text(plain, rng):
    """The shipped head is good enough that a boundary error would show: over 8 sampled
    prompts its greedy drafts are accepted more than 40% of the time. Per prompt the
    rate was 0.40-0.90 (mean 0.72) on 240 prompts, except where greedy decoding falls
    into a loop inside a word ("fancy fancy ...", 0.09): 2 of 408 prompts seen. The
    pooled rate drops to 0.4 only when 4 or more of the 8 prompts loop: at a loop rate
    of 2% (above the 0.5% seen) that is 70 * 0.02^4 ~ 1e-5 a run. A head that drafts
    at random is accepted about 1/512 of the time."""
    prompts = sampled_prompts(plain, rng, [30, 40, 50, 60] * 2)
    outs = make_llm(num_speculative_tokens=1).generate(prompts, SamplingParams(max_tokens=64, temperature=0.0), use_tqdm=False)
    drafted = sum(o.spec_stats["drafted"] for o in outs)
    accepted = sum(o.spec_stats["accepted"] for o in outs)
    assert accepted / drafted > 0.4


# ----- invariant 6: temperature > 0 ------------------------------------------------------


def test_speculative_sampling_is_lossless_per_row(rng):
    """Row 0 of a verify step emits p0 exactly; the token after an accepted draft
    follows p1; both over many seeded draws (the joint distribution of every verify row,
    with filters: tests/test_verify_distribution.py)."""
    vocab, draws = 12, 20000
    logits = rng.normal(0, 1.2, size=(2, vocab)).astype(np.float32)
    draft = int(np.argmax(logits[0]))  # a likely draft, so both branches are exercised
    batch = types.SimpleNamespace(
        temperature=jnp.full(draws, 1.0), top_k=jnp.zeros(draws, jnp.int32), top_p=jnp.ones(draws),
        min_p=jnp.zeros(draws), seed=jnp.asarray(rng.integers(0, 2**32, size=draws, dtype=np.uint32)),
        output_index=jnp.zeros(draws, jnp.int32),
    )
    tokens, accepted = verify_and_sample(
        jnp.tile(jnp.asarray(logits), (draws, 1, 1)), jnp.full((draws, 1), draft, jnp.int32),
        jnp.ones(draws, jnp.int32), batch,
    )
    tokens, accepted = np.asarray(tokens), np.asarray(accepted)
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    first = tokens[:, 0]
    assert np.all((first == draft) == (accepted == 1))
    second = tokens[accepted == 1, 1]
    # G-tests (test_sampling.g_test): the two together fail by chance with probability <= 1e-4
    p0, _ = g_test(np.bincount(first, minlength=vocab), p[0])
    p1, _ = g_test(np.bincount(second, minlength=vocab), p[1])
    assert min(p0, p1) >= 1e-4 / 2 / 2, (p0, p1)


def test_spec_sampling_follows_the_models_distribution_end_to_end(rng):
    """The first two tokens sampled after a prompt with speculation (k = 2), one from the
    prefill step and one from the verify step after it, follow the model's joint
    distribution p(t1) p(t2 | t1) at temperature 0.8, computed in float64 from its
    logits: a G-test (test_sampling.g_test) over 600 seeded samples, failing by chance
    with probability <= 1e-4. The steps' wiring shows here (seeds, temperatures, the
    token the prefill step samples); each row's own random key and the verify rows'
    joint distribution, drawn many more times: tests/test_verify_distribution.py."""
    prompt = [1, 403, 407, 261, 378, 432]  # "Once upon a time,"
    n, temperature = 600, 0.8
    seeds = rng.integers(0, 2**31, size=n)
    llm = make_llm(num_speculative_tokens=2)  # the chunk-invariance test's engine: its steps compiled
    outs = llm.generate([prompt] * n, [SamplingParams(max_tokens=2, temperature=temperature, seed=int(s))
                                       for s in seeds], use_tqdm=False)
    assert all(o.spec_stats["drafted"] > 0 for o in outs)

    def probs(ids):
        logits = prompt_logits(llm.engine, ids)[-1].astype(np.float64) / temperature
        p = np.exp(logits - logits.max())
        return p / p.sum()

    # cells: each second token after the first tokens expected at least once in n
    # samples; what the other first tokens hold is one more cell
    first = probs(prompt)
    kept = [int(t) for t in np.flatnonzero(first * n >= 1)]
    cells = {(t1, t2): first[t1] * q for t1 in kept for t2, q in enumerate(probs(prompt + [t1]))}
    expected = np.append(list(cells.values()), 1 - first[kept].sum())
    index = {pair: i for i, pair in enumerate(cells)}
    observed = np.bincount([index.get(tuple(o.outputs[0].token_ids), len(cells)) for o in outs],
                           minlength=len(expected))
    p_value, _ = g_test(observed, expected)
    assert p_value >= 1e-4 / 2, p_value


# ----- invariant 7: no recompilation -----------------------------------------------------


def test_no_recompilation_after_warmup_with_mtp(plain, rng):
    # two requests of k + 1 = 3 rows in 8: the fewest shapes to warm up (8 rows, 1 or 2
    # requests), and the five requests below still mix prefill chunks, verify rows,
    # greedy and sampled rows in each (test_programs warms up these same programs)
    llm = make_llm(num_speculative_tokens=2, max_num_seqs=2, max_num_batched_tokens=8, prefill_chunk_size=5)
    llm.engine.warmup()
    prompts = sampled_prompts(plain, rng, [2, 29, 13, 40, 5])  # (the plain engine may compile its own steps)
    before = num_compiles()
    params = [greedy(20), SamplingParams(max_tokens=15, temperature=0.9, seed=3), greedy(7),
              SamplingParams(max_tokens=25, temperature=0.6, top_p=0.9, logprobs=2), greedy(33)]
    llm.generate(prompts, params, use_tqdm=False)
    # every other kind of step, n > 1 included, runs on the largest shape of its kind
    others = [SamplingParams(max_tokens=8, temperature=0.0, structured_outputs={"regex": "[a-z ]{2,8}"}),
              SamplingParams(max_tokens=5, temperature=0.8, seed=1, prompt_logprobs=2, n=3),
              SamplingParams(max_tokens=6, temperature=0.7, structured_outputs={"choice": ["a cat", "a dog"]},
                             prompt_logprobs=1)]
    llm.generate(prompts[:3], others, use_tqdm=False)
    assert num_compiles() == before
    assert_no_leaks(llm)


# ----- oracle drafts: the benchmarks' acceptance-1 ceiling -------------------------------


def drafts_accepted(outputs) -> tuple[int, int]:
    """(accepted, drafted) over every request's verify steps."""
    return sum(o.spec_stats["accepted"] for o in outputs), sum(o.spec_stats["drafted"] for o in outputs)


@pytest.mark.parametrize("k", [1, 2])
def test_oracle_drafts_on_the_device_are_all_accepted(plain, rng, k):
    """engine.oracle_tokens (a plain greedy run's tokens; a request's row is its seed)
    replaces the MTP drafts inside the step, so it works with async scheduling (carried
    rows read them from the carry) as with sync: the plain tokens, every draft accepted.
    Without it the drafts are the module's again, which this model gets wrong at times."""
    prompts = sampled_prompts(plain, rng, [5, 30, 17])
    n = 24
    # k tokens further than the spec run: the drafts of its last step lie inside the table
    expected = token_ids(plain.generate(prompts, greedy(n + k), use_tqdm=False))
    table = expected[::-1]  # rows in another order than the requests, to check the seed picks the row
    params = [greedy(n, seed=len(prompts) - 1 - i) for i in range(len(prompts))]
    for overlap in (True, False):
        llm = make_llm(num_speculative_tokens=k, prefill_chunk_size=7, async_scheduling=overlap)
        llm.engine.oracle_tokens = table
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert token_ids(outs) == [t[:n] for t in expected], f"async={overlap}"
        accepted, drafted = drafts_accepted(outs)
        assert drafted > 0 and accepted == drafted, f"async={overlap}"
        assert_no_leaks(llm)
    llm.engine.oracle_tokens = None
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert token_ids(outs) == [t[:n] for t in expected]
    accepted, drafted = drafts_accepted(outs)
    assert accepted < drafted

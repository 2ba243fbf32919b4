"""Qwen3-Next and Qwen3.5 running in the engine (issue 36): greedy output against
transformers' at every chunk size, the MTP layer against a float64 NumPy reference of its
math, MTP speculation equal to plain decoding token for token (greedy and seeded) under
chunked prefill, partial acceptance and preemption, and no page or state-slot leaks.

The tiny checkpoints are tests/test_hybrid_models.py's (make_hybrid: transformers' own
models saved, plus an MTP layer); one engine per family and k is shared by the module's
tests (LLM objects compile once; the chunk size is the scheduler's, changed in place)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

import conftest
from conftest import fresh_rng, record_drafts
from jaxmtp import LLM, SamplingParams
from jaxmtp.worker.programs import num_compiles
from test_hybrid_models import FAMILIES, make_hybrid

PAGE = 4
CHUNK_SIZES = (1, 7, PAGE - 1, PAGE, PAGE + 1, None)  # None: the whole prompt
PROMPT_LEN, NEW_TOKENS = 14, 32
ENGINE = dict(page_size=PAGE, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=56)
# the speculating engines: prefill chunks of 5, a pool too small for three requests at once
SPEC_ENGINE = dict(prefill_chunk_size=5, num_pages=16)
NEAR_TIE = 1e-4  # logits of the top two tokens closer than this may order either way in float32


def long_memory(name: str, p: torch.Tensor) -> None:
    """Linear attention that matters to the outputs: transformers' initial A_log decays
    the state within a few tokens (exp(A_log) up to 16) and its 0.02-scale projections
    keep it small, so that a state carried wrongly would hardly change a token. Here the
    state decays by about 1.5-7% a token (exp(A_log) 0.02-0.1 times softplus(a) near 0.7)
    and the projections are 5x larger."""
    if "linear_attn" not in name or "norm" in name:
        return
    if name.endswith("A_log"):
        p.copy_(torch.log(torch.empty_like(p).uniform_(0.02, 0.1)))
    elif name.endswith("dt_bias"):
        p.zero_()
    else:
        p.mul_(5.0)


@pytest.fixture(scope="module")
def checkpoint_seed() -> int:
    return int(fresh_rng().bit_generator.seed_seq.entropy)


@pytest.fixture(autouse=True)
def report_checkpoint_seed(checkpoint_seed):
    """Every test of the module reads the checkpoints made from this seed: a failure names it
    (JAXMTP_TEST_SEED replays it)."""
    conftest._SEEDS.append(checkpoint_seed)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, checkpoint_seed):
    """Per family: the folder, transformers' model and a prompt."""
    rng = np.random.default_rng(checkpoint_seed)
    made = {}
    for family in FAMILIES:
        folder, model = make_hybrid(tmp_path_factory.mktemp(family), family, rng, adjust=long_memory)
        made[family] = (folder, model.eval(), rng.integers(3, 128, PROMPT_LEN).tolist())
    return made


@pytest.fixture(scope="module")
def engines(checkpoints):
    """LLMs by (family, k), made when first asked for, each with one compiled step: its
    largest shape, which every batch then runs on (a warm-up's fallback), and the state
    snapshots' copies compiled as warm-up compiles them. oracle: the engine's oracle table
    (its programs are those compiled for the table's shape)."""
    made = {}

    def get(family: str, k: int = 0, oracle: np.ndarray | None = None, **extra) -> LLM:
        key = (family, k, tuple(sorted(extra.items())))
        if key not in made:
            llm = made[key] = LLM(checkpoints[family][0], num_speculative_tokens=k, **{**ENGINE, **extra})
            llm.engine.oracle_tokens = oracle
            runner = llm.engine.runner
            runner.programs.compile(runner.buckets.largest())
            runner.programs.warmed_up = True
            if runner.snapshots is not None:
                runner.recurrent = runner.snapshots.warm(runner.recurrent)
        return made[key]

    return get


def set_chunk_size(llm: LLM, size: int) -> None:
    scheduler = llm.engine.scheduler
    scheduler.config = dataclasses.replace(scheduler.config, prefill_chunk_size=size)


def assert_no_leaks(llm: LLM) -> None:
    """No page held (conftest.assert_no_leaks), every state slot free and every state
    snapshot free or attached to a cached page."""
    conftest.assert_no_leaks(llm)
    assert sorted(llm.engine.scheduler._free_state_slots) == list(range(llm.engine.config.max_num_seqs))
    snapshots = llm.engine.prefix_cache.snapshots if llm.engine.prefix_cache else None
    if snapshots is not None:
        assert sorted(snapshots.free + list(snapshots.by_entry.values())) == list(range(snapshots.num_snapshots))
        assert all(entry.page in llm.engine.prefix_cache.by_page for entry in snapshots.by_entry)


def transformers_greedy(model, prompt: list[int]) -> tuple[list[int], np.ndarray]:
    """transformers' greedy tokens and the logits each was chosen from [NEW_TOKENS, V]: the
    prompt, then a token at a time on its cache (not generate, whose logits processors
    would keep EOS out where the engine ignores it)."""
    tokens, logits = [], []
    with torch.no_grad():
        out = model(torch.tensor([prompt]), use_cache=True)
        for _ in range(NEW_TOKENS):
            logits.append(out.logits[0, -1].float().numpy())
            tokens.append(int(logits[-1].argmax()))
            out = model(torch.tensor([tokens[-1:]]), past_key_values=out.past_key_values, use_cache=True)
    return tokens, np.stack(logits)


def greedy(n: int = NEW_TOKENS, **extra) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, **extra)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_matches_transformers_at_every_chunk_size(checkpoints, engines, family):
    """32 greedy tokens equal transformers' (float32) for a prompt cut into chunks of
    1, 7, page_size - 1, page_size, page_size + 1 and whole: the linear-attention state
    and conv window carry across chunks exactly. A first difference is allowed only where
    transformers' top two logits are within NEAR_TIE, and the rest is then not compared."""
    _, model, prompt = checkpoints[family]
    want, scores = transformers_greedy(model, prompt)
    llm = engines(family)
    for size in CHUNK_SIZES:
        set_chunk_size(llm, size or ENGINE["max_num_batched_tokens"])
        got = list(llm.generate([prompt], greedy(), use_tqdm=False)[0].outputs[0].token_ids)
        for i, (a, b) in enumerate(zip(got, want)):
            if a != b:
                gap = scores[i, b] - scores[i, a]
                assert gap < NEAR_TIE, (family, size, i, got, want, gap)
                break
        assert len(got) == NEW_TOKENS
    assert_no_leaks(llm)


def numpy_mtp_logits(params, cfg, hidden: np.ndarray, next_ids: np.ndarray) -> np.ndarray:
    """The MTP layer's logits in float64 at every row, by its math: fc over
    [norm(embedding of token i+1), norm(h_i)], a full-attention decoder layer (q/k norms,
    partial rotary, GQA, sigmoid output gate; softmax-routed experts with a gated shared
    expert), its final norm and the LM head."""
    f64 = lambda x: np.asarray(x, np.float64)  # noqa: E731
    m, blk = params.mtp[0], params.mtp[0].block
    eps, t, d, heads, kv = cfg.rms_norm_eps, hidden.shape[0], cfg.head_dim, cfg.num_heads, cfg.num_kv_heads

    def norm(x, w):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * f64(w)

    silu = lambda x: x / (1 + np.exp(-x))  # noqa: E731
    x = norm(f64(params.embed)[next_ids], m.token_norm) @ f64(m.proj_token) + norm(f64(hidden), m.hidden_norm) @ f64(m.proj_hidden)
    h = norm(x, blk.input_norm)
    q = norm((h @ f64(blk.q_proj)).reshape(t, heads, d), blk.q_norm)
    k = norm((h @ f64(blk.k_proj)).reshape(t, kv, d), blk.k_norm)
    v = (h @ f64(blk.v_proj)).reshape(t, kv, d)
    rot = cfg.rotary_dim
    angles = np.arange(t)[:, None] * f64(cfg.rope_inv_freq())[None, :]  # [T, rot/2]
    cos, sin = np.cos(np.concatenate([angles] * 2, -1))[:, None], np.sin(np.concatenate([angles] * 2, -1))[:, None]

    def rope(y):
        r, half = y[..., :rot], rot // 2
        return np.concatenate([r * cos + np.concatenate([-r[..., half:], r[..., :half]], -1) * sin, y[..., rot:]], -1)

    q, k = rope(q), rope(k)
    k, v = np.repeat(k, heads // kv, axis=1), np.repeat(v, heads // kv, axis=1)
    scores = np.einsum("thd,shd->hts", q, k) / np.sqrt(d) + np.triu(np.full((t, t), -np.inf), 1)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    out = np.einsum("hts,shd->thd", probs, v).reshape(t, -1) / (1 + np.exp(-(h @ f64(blk.attn_gate))))
    x = x + out @ f64(blk.o_proj)
    h = norm(x, blk.post_norm)
    moe, mcfg = blk.moe, cfg.moe
    router = h @ f64(moe.router)
    router = np.exp(router - router.max(-1, keepdims=True))
    router /= router.sum(-1, keepdims=True)
    top = np.argsort(-router, axis=-1)[:, :mcfg.num_experts_per_tok]
    weights = np.take_along_axis(router, top, -1)
    weights /= weights.sum(-1, keepdims=True)
    ffn = np.zeros_like(x)
    for row in range(t):
        for e, w in zip(top[row], weights[row]):
            gu = np.einsum("h,hgi->gi", h[row], f64(moe.experts_gate_up[e]))
            ffn[row] += w * (silu(gu[0]) * gu[1]) @ f64(moe.experts_down[e])
    shared = np.einsum("th,hgi->tgi", h, f64(moe.shared_gate_up))
    gate = 1 / (1 + np.exp(-(h @ f64(moe.shared_gate))))
    ffn += gate[:, None] * ((silu(shared[:, 0]) * shared[:, 1]) @ f64(moe.shared_down))
    x = x + ffn
    return norm(x, m.final_norm) @ f64(params.lm_head)


def test_mtp_layer_matches_float64_reference(checkpoints):
    """The engine's MTP layer (mtp.module_forward over the paged cache, its KV in the
    layer after the full-attention ones, and module_logits) on transformers' final-normed
    hidden states of the prompt, against numpy_mtp_logits."""
    import jax.numpy as jnp

    from jaxmtp.engine.scheduler import ScheduledRows
    from jaxmtp.engine.sequence import Sequence
    from jaxmtp.loading.loader import load_params
    from jaxmtp.models import model as model_fns
    from jaxmtp.models.registry import load_config
    from jaxmtp.worker import mtp
    from jaxmtp.worker.batch import BatchShape, build_batch
    from jaxmtp.worker.cache import allocate_cache

    folder, hf, prompt = checkpoints["qwen3_next"]
    cfg = load_config(folder)
    params = load_params(folder, cfg)
    with torch.no_grad():
        hidden = hf.model(torch.tensor([prompt])).last_hidden_state[0].numpy()  # after the final norm
    ids = np.asarray(prompt)
    next_ids = np.concatenate([ids[1:], ids[:1]])  # the last row's is not compared
    pages = list(range(-(-len(ids) // PAGE)))
    seq = Sequence("mtp", list(prompt), SamplingParams(), 0, 0, frozenset(), pages=pages)
    batch = build_batch([ScheduledRows(seq, 0, list(prompt), 0, True)], BatchShape(16, 1), len(pages), PAGE,
                        len(pages) * PAGE, 0)
    batch = dataclasses.replace(batch, input_ids=np.pad(next_ids, (0, 16 - len(ids))))
    cache = allocate_cache(cfg, len(pages), PAGE, 1)
    layer = cfg.num_kv_layers
    x, _, _ = mtp.module_forward(params.mtp[0], params.embed, cfg, jnp.pad(jnp.asarray(hidden), ((0, 16 - len(ids)), (0, 0))),
                                 jnp.asarray(batch.input_ids), jax_batch(batch), cache.k[layer], cache.v[layer],
                                 model_fns.layer_ops(cfg, "reference"))
    got = np.asarray(mtp.module_logits(params, params.mtp[0], cfg, x))[: len(ids) - 1]
    want = numpy_mtp_logits(params, cfg, hidden.astype(np.float64), next_ids)[: len(ids) - 1]
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * np.abs(want).max())
    assert (got.argmax(-1) == want.argmax(-1)).mean() > 0.9


def jax_batch(batch):
    import jax
    import jax.numpy as jnp

    return jax.tree.map(jnp.asarray, batch)


def oracle_with_misses(tokens: list[list[int]], every: int) -> np.ndarray:
    """Plain greedy outputs as an oracle table (step.oracle_drafts), every `every`-th token
    replaced: drafts are accepted up to the next miss, so verification keeps every number
    of rows from 0 to k."""
    table = np.asarray(tokens, np.int32)
    table[:, every - 1::every] = (table[:, every - 1::every] + 1) % 128
    return table


@pytest.mark.parametrize("k,prefix_caching", [(1, False), (2, False), (3, False), (2, True)])
def test_spec_equals_plain_under_chunking_partial_acceptance_and_preemption(checkpoints, engines, k, prefix_caching):
    """Three requests (two greedy, one seeded at temperature 0.9) in a pool too small for
    them all, prefill chunks of 5: MTP with k drafts gives the tokens of plain decoding
    with ample pages, token for token. The greedy requests' drafts come from an oracle
    that misses every third token, so verifications keep 0..k drafts and the recurrent
    state must be the one after exactly the accepted tokens; the preempted requests
    recompute from their prompts in fresh slots (with prefix caching, from the state
    snapshotted after the last page of theirs still cached). No page, slot or snapshot
    leaks afterwards."""
    _, _, prompt = checkpoints["qwen3_next"]
    prompts = [prompt, prompt[:9][::-1], prompt[3:8]]
    params = [greedy(24, seed=0), greedy(24, seed=1),
              SamplingParams(max_tokens=24, temperature=0.9, seed=7, ignore_eos=True)]
    plain = engines("qwen3_next")
    set_chunk_size(plain, 16)
    want = [list(out.outputs[0].token_ids) for out in plain.generate(prompts, params, use_tqdm=False)]
    llm = engines("qwen3_next", k, oracle=oracle_with_misses(want[:2], every=3), **SPEC_ENGINE,
                  **(dict(enable_prefix_caching=True, num_state_snapshots=8) if prefix_caching else {}))
    before = llm.engine.scheduler.num_preemptions
    hits_before = llm.engine.stats.prefix_cache.hits
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [list(out.outputs[0].token_ids) for out in outs] == want
    assert llm.engine.scheduler.num_preemptions > before
    assert (llm.engine.stats.prefix_cache.hits > hits_before) == prefix_caching  # recomputes started past 0
    for out in outs[:2]:  # some verifications kept every draft, some only a part
        stats = out.spec_stats
        assert 0 < stats["accepted"] < stats["drafted"], stats
        assert stats["accepted_per_position"][0] > (stats["accepted_per_position"][-1] if k > 1 else 0), stats
    assert_no_leaks(llm)
    assert_no_leaks(plain)


def test_chunk_boundary_gives_the_unchunked_drafts_and_the_ablation_does_not(checkpoints, engines):
    """Four prompts at once in chunks of 3 and 5 (and cut by the 16-token budget), MTP
    k=1: every request's drafts at every step equal those of the prompt run alone and
    whole; with the pre-fix boundary (mtp_boundary="sampled": the MTP row at a chunk's
    end built from the main model's sample) some request's drafts change."""
    _, _, prompt = checkpoints["qwen3_next"]
    prompts = [prompt, prompt[:11][::-1], prompt[1:], prompt[:9]]
    alone = engines("qwen3_next", 1)
    set_chunk_size(alone, ENGINE["max_num_batched_tokens"])
    want = record_drafts(alone.engine)
    for p in prompts:
        alone.generate([p], greedy(), use_tqdm=False)
    del alone.engine.step
    for boundary in ("next_chunk", "sampled"):
        llm = engines("qwen3_next", 1, **({} if boundary == "next_chunk" else dict(mtp_boundary="sampled")))
        for size in (3, 5):
            set_chunk_size(llm, size)
            got = record_drafts(llm.engine)
            llm.generate(prompts, greedy(), use_tqdm=False)
            del llm.engine.step
            assert (sorted(got) == sorted(want)) == (boundary == "next_chunk"), (boundary, size)
    assert_no_leaks(llm)


@pytest.mark.parametrize("k", [0, 1])
def test_prefix_cache_hits_start_from_the_snapshotted_state(checkpoints, engines, k):
    """Prefix caching with the recurrent state snapshotted at page boundaries: once a
    request has computed the prompt in chunks of 5 (each cut at its page boundary, so a
    snapshot after every page), requests sharing its first 10, 12 and 8 tokens and the
    whole prompt hit the cache through the last page that has a snapshot and, with MTP,
    the version their next token needs (docs/prefix-cache.md), and give the tokens,
    drafts and acceptance of an engine without the cache that takes each prompt in one
    chunk, compiling nothing after the warm-up's copies. (Restoring no snapshot, or
    saving none, fails it.)"""
    _, _, prompt = checkpoints["qwen3_next"]
    cold = engines("qwen3_next", k)
    set_chunk_size(cold, ENGINE["max_num_batched_tokens"])
    llm = engines("qwen3_next", k, enable_prefix_caching=True, num_state_snapshots=16)
    set_chunk_size(llm, 5)
    compiled = num_compiles()
    llm.generate([prompt], greedy(), use_tqdm=False)
    # prompt length shared -> (the new request's tail, its hit without MTP, with MTP): a
    # page whose next token differs is reused whole only without draft KV
    cases = {10: ([5, 6, 7], 8, 8), 12: ([9, 9, 9, 9], 12, 8), 8: ([1], 8, 4), PROMPT_LEN: ([], 12, 12)}
    for shared, (tail, hit, spec_hit) in cases.items():
        request = prompt[:shared] + tail
        cold_drafts, drafts = record_drafts(cold.engine), record_drafts(llm.engine)
        want = cold.generate([request], greedy(), use_tqdm=False)[0]
        got = llm.generate([request], greedy(), use_tqdm=False)[0]
        del cold.engine.step, llm.engine.step  # record_drafts' wrappers
        assert got.num_cached_tokens == (spec_hit if k else hit), (shared, got.num_cached_tokens)
        assert list(got.outputs[0].token_ids) == list(want.outputs[0].token_ids), shared
        assert got.spec_stats == want.spec_stats and drafts == cold_drafts, shared
    assert num_compiles() == compiled  # the snapshots' saves and restores ran on warm-up's copies
    assert_no_leaks(llm)


def test_recurrent_state_takes_its_share_of_the_kv_budget(checkpoints):
    """KV pages for the full-attention layers (and the MTP layer) only; the recurrent
    tables (max_num_seqs slots, k + 1 versions, every linear-attention layer) come out of
    kv_cache_memory_bytes before the pages are counted."""
    import jax

    from jaxmtp.worker.memory import page_bytes

    llm = LLM(checkpoints["qwen3_next"][0], num_speculative_tokens=2, **ENGINE)
    runner = llm.engine.runner
    cfg = runner.model_config
    assert cfg.num_kv_layers == 2 and len(runner.cache.k) == 3  # layers 1 and 3, and the MTP layer
    assert [t.shape[:2] for t in runner.recurrent.ssm] == [(ENGINE["max_num_seqs"], 3)] * 2
    state = sum(x.nbytes for x in jax.tree.leaves(runner.recurrent))
    per_page = page_bytes(cfg, PAGE, 1)
    llm = LLM(checkpoints["qwen3_next"][0], num_speculative_tokens=2, kv_cache_memory_bytes=state + 20 * per_page + 1,
              **ENGINE)
    assert llm.engine.runner.num_pages == 20

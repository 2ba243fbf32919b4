"""A seeded request at temperature > 0 gives the same tokens whatever happens around it:
alone, in a crowd that preempts it, and with or without MTP speculation.

The token at output index n is the target distribution's sample under noise keyed by
(seed, n), whether a plain row or a verify row produces it (jaxmtp/worker/sampling.py), so a
request resumed after preemption (whose first token comes from a plain prefill row
where the uninterrupted run verified a draft) continues as if nothing happened."""

from __future__ import annotations

import contextlib

import pytest

from conftest import MTP_MODEL, STORIES
from jaxmtp import LLM, SamplingParams

PROMPT = [1, 403, 407]
CROWD = [[1, 300 + i] for i in range(4)]  # four others, admitted first: the seeded one is the newest
TOKENS = 60
# short contexts: the CPU attention reads a row's whole page table
ENGINE = dict(page_size=4, max_num_seqs=5, prefill_chunk_size=7, max_num_batched_tokens=16, max_model_len=128)


def seeded(seed: int, temperature: float = 1.0, **filters) -> SamplingParams:
    return SamplingParams(max_tokens=TOKENS, temperature=temperature, seed=seed, ignore_eos=True, **filters)


def crowd_params() -> list[SamplingParams]:
    return [seeded(1000 + i, temperature=0.8) for i in range(len(CROWD))]


def alone_and_in_crowd(llm: LLM, params: SamplingParams) -> tuple[list[int], list[int], int]:
    """The seeded request's tokens alone, then as the newest of five (the one the
    scheduler preempts first), and how often it was preempted there."""
    alone = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].token_ids
    engine = llm.engine
    before = engine.scheduler.num_preemptions
    for i, (prompt, p) in enumerate(zip(CROWD + [PROMPT], crowd_params() + [params])):
        engine.add_request(f"crowd-{params.seed}-{i}", prompt, p)
    target = f"crowd-{params.seed}-{len(CROWD)}"
    engine.step()
    seq = engine.requests[target].seqs[0]
    crowd = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == target and out.finished:
                crowd = out.outputs[0].token_ids
    assert engine.scheduler.num_preemptions > before
    return alone, crowd, seq.num_preemptions


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


POOL = 30


@pytest.fixture(scope="module")
def spec_engine():
    return LLM(MTP_MODEL, num_speculative_tokens=2, num_pages=POOL, **ENGINE)


@pytest.fixture(scope="module")
def plain_engine():
    return LLM(STORIES, num_pages=POOL, **ENGINE)


@contextlib.contextmanager
def pool_of(llm: LLM, pages: int):
    """The engine's allocator with all but `pages` pages held here: a smaller pool that
    runs the same compiled steps (the cache keeps its shape)."""
    held = llm.engine.allocator.allocate(llm.engine.allocator.num_pages - pages)
    try:
        yield
    finally:
        llm.engine.allocator.free(held)


def test_issue_repro_seed_0_pool_30(spec_engine, plain_engine):
    """The reported case: k = 2, 30 pages of 4; uninterrupted and preempted runs parted
    at token 26. Both equal the plain engine's output for the same seed."""
    alone, crowd, preempted = alone_and_in_crowd(spec_engine, seeded(0))
    assert preempted > 0
    assert crowd == alone, f"seed=0: first difference at token {first_difference(alone, crowd)}"
    plain = plain_engine.generate([PROMPT], seeded(0), use_tqdm=False)[0].outputs[0].token_ids
    assert alone == plain, f"seed=0: MTP and plain part at token {first_difference(alone, plain)}"


def test_preempted_seeded_request_gives_its_solo_output(spec_engine, plain_engine, rng):
    """Seeds fresh per run (named in every failure), three pool sizes, filters too."""
    seeds = rng.integers(0, 2**31, size=3).tolist()
    for pages, seed, filters in zip((30, 24, 20), seeds, [{}, {"top_p": 0.9}, {"top_k": 5, "min_p": 0.05}]):
        params = seeded(seed, **filters)
        with pool_of(spec_engine, pages):
            alone, crowd, preempted = alone_and_in_crowd(spec_engine, params)
        where = f"seed={seed} pages={pages} filters={filters} preempted {preempted}x"
        assert spec_engine.engine.allocator.num_free == POOL, where
        assert preempted > 0, where
        assert crowd == alone, f"{where}: first difference at token {first_difference(alone, crowd)}"
        plain = plain_engine.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].token_ids
        assert alone == plain, f"{where}: MTP and plain part at token {first_difference(alone, plain)}"

"""The scheduler, the page allocator and the prefix cache on their own: plain Python,
no model, no device (as vLLM's tests/v1/core build a scheduler from create_scheduler
and create_requests)."""

from __future__ import annotations

import pytest

from jaxmtp.engine.allocator import PageAllocator, pages_for
from jaxmtp.engine.prefix_cache import PrefixCache
from jaxmtp.engine.sampling_params import SamplingParams
from jaxmtp.engine.scheduler import Scheduler, SchedulerConfig
from jaxmtp.engine.sequence import Sequence, Status


def create_scheduler(num_pages=16, page_size=4, max_num_seqs=4, budget=16, chunk=None, k=0, prefix_caching=False):
    m = min(k, 1)
    cache = PrefixCache(page_size, k > 0, "exact", m) if prefix_caching else None
    allocator = PageAllocator(num_pages, page_size, cache)
    config = SchedulerConfig(max_num_seqs, budget, chunk or budget, page_size, 64, k, m)
    return Scheduler(config, allocator, cache)


def create_requests(lengths, max_tokens=8, first_arrival=0):
    return [
        Sequence(f"r{first_arrival + i}", list(range(1, n + 1)), SamplingParams(max_tokens=max_tokens), 0,
                 first_arrival + i, frozenset())
        for i, n in enumerate(lengths)
    ]


def run_step(scheduler, emitted: dict[str, int] | None = None):
    """Schedule, dispatch and read one step synchronously; every request with output
    emits one token (no drafts accepted)."""
    out = scheduler.schedule()
    scheduler.on_dispatch(1, out)
    for item in out.rows:
        if item.has_output:
            scheduler.on_step_output(1, item, 0, 7, [], None)
            item.seq.append_token((emitted or {}).get(item.seq.request_id, 7))
        scheduler.register_cached(item.seq)
    return out


def test_pages_for():
    assert [pages_for(n, 4) for n in (0, 1, 4, 5, 8)] == [0, 1, 1, 2, 2]


def test_prefill_chunks_fill_the_budget_and_carry_the_next_chunk_token():
    scheduler = create_scheduler(budget=6, chunk=4)
    long, short = create_requests([10, 3])
    scheduler.add(long)
    scheduler.add(short)
    out = scheduler.schedule()
    assert [(r.seq.request_id, r.start, len(r.token_ids), r.has_output) for r in out.rows] == [
        ("r0", 0, 4, False), ("r1", 0, 2, False)]
    assert out.rows[0].next_chunk_tokens == (long.token_ids[4],)  # the first token of the next chunk
    assert out.num_tokens == 6 and out.page_copies == []


def test_decodes_go_before_prefill_chunks():
    scheduler = create_scheduler(budget=8, chunk=8)
    first, = create_requests([3])
    scheduler.add(first)
    run_step(scheduler)  # its whole prompt: it decodes from now on
    second, = create_requests([12], first_arrival=1)
    scheduler.add(second)
    out = scheduler.schedule()
    assert [(r.seq.request_id, len(r.token_ids), r.has_output) for r in out.rows] == [("r0", 1, True), ("r1", 7, False)]


def test_running_out_of_pages_preempts_the_newest_and_admits_nothing_that_step():
    scheduler = create_scheduler(num_pages=4, page_size=4, budget=16)
    old, new = create_requests([7, 7])
    for seq in (old, new):
        scheduler.add(seq)
    run_step(scheduler)  # both prefilled: 2 pages each, the pool is full
    waiting, = create_requests([2], first_arrival=2)
    scheduler.add(waiting)
    for _ in range(2):  # old's 9th token needs a third page
        out = run_step(scheduler)
    assert out.num_preempted == 1 and new.status is Status.WAITING and new.num_preemptions == 1
    assert [r.seq.request_id for r in out.rows] == ["r0"]  # nothing admitted in that step
    assert list(scheduler.waiting) == [new, waiting]  # the victim first, to recompute
    assert new.num_computed == 0 and new.pages == []


def test_async_hooks_place_and_fill_the_placeholders():
    scheduler = create_scheduler(budget=8, k=2)
    seq, = create_requests([3])
    seq.drafts = [5, 6]
    scheduler.add(seq)
    first = scheduler.schedule()
    scheduler.on_dispatch(1, first)
    assert seq.num_computed == 3 and seq.in_flight.max_tokens == 1  # a final chunk: one token
    second = scheduler.schedule()  # its output is in flight: placeholder rows from the carry
    rows = second.rows[0]
    assert rows.carry_index == 0 and rows.token_ids == [0, 0, 0] and rows.num_drafts == 2
    scheduler.on_dispatch(2, second)
    assert seq.num_computed == 4 and seq.in_flight.step_id == 2
    scheduler.on_step_output(1, first.rows[0], 0, 9, [10, 11], rows)  # step 1 read: token 9, drafts 10 11
    seq.append_token(9)
    assert seq.in_flight.step_id == 2 and rows.token_ids == [9, 10, 11] and rows.start == 3
    scheduler.on_step_output(2, rows, 2, 12, [13, 14], None)  # both drafts accepted
    assert seq.in_flight is None and seq.num_computed == 6 and seq.drafts == [13, 14]


def test_allocator_parks_cached_pages_and_evicts_the_least_recently_used():
    cache = PrefixCache(4, with_draft_kv=False)
    allocator = PageAllocator(4, 4, cache)
    pages = allocator.allocate(3)
    cache.register(list(range(13)), 12, pages, [], salt=0)  # three full pages cached
    allocator.free(pages)  # last page first: it is evicted first
    assert allocator.num_free == 4 and list(allocator.evictable) == pages[::-1] and len(allocator.free_pages) == 1
    assert allocator.allocate(2)[1] == pages[2] and cache.stats.evictions == 1 and not cache.holds(pages[2])
    allocator.share([pages[0]])
    assert pages[0] not in allocator.evictable and allocator.ref_counts[pages[0]] == 1
    with pytest.raises(RuntimeError, match="freed more often"):
        allocator.free([pages[0], pages[0]])
    allocator.reset()
    assert allocator.num_free == 4 and not cache.by_page and not any(allocator.ref_counts)


def test_a_cached_prefix_is_shared_and_its_last_page_copied_on_write():
    scheduler = create_scheduler(prefix_caching=True, k=1, budget=16)
    first, = create_requests([9], max_tokens=1)
    scheduler.add(first)
    run_step(scheduler, {"r0": 99})
    first_pages = list(first.pages)
    scheduler.finish(first)  # its two full pages stay cached, parked
    assert list(scheduler.allocator.evictable) == first_pages[1::-1]
    second, = create_requests([8], first_arrival=1)  # the same 8 tokens, then nothing yet
    scheduler.add(second)
    out = scheduler.schedule()
    # page 0 is reused whole; page 1's draft row was built from token 9, which does not
    # follow it here yet: a private copy, its last row recomputed
    assert second.pages[0] == first_pages[0] and scheduler.allocator.ref_counts[first_pages[0]] == 1
    assert out.page_copies == [(first_pages[1], second.pages[1])]
    assert (out.rows[0].start, out.rows[0].token_ids, out.rows[0].has_output) == (7, [8], True)
    assert scheduler.prefix_cache.stats.hits == 7

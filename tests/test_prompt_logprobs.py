"""Prompt logprobs (SamplingParams.prompt_logprobs; the server's echo): every prompt
token's log-probability and the top n, against transformers, across chunk boundaries,
with MTP, with a prefix cache that holds the prompt, and after preemption."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import MTP_MODEL, STORIES, fresh_rng, random_prompts, stories_logprob_bound
from jaxmtp import LLM, SamplingParams
from jaxmtp.engine.sampling_params import RequestOutputKind
from tolerances import assert_within

# short contexts: the CPU attention reads a row's whole page table
ENGINE = dict(page_size=4, max_num_seqs=4, prefill_chunk_size=7, max_num_batched_tokens=16, max_logprobs=5,
              max_model_len=128)
TOP = 3


@pytest.fixture(scope="module")
def spec():
    return LLM(MTP_MODEL, num_speculative_tokens=2, num_pages=40, enable_prefix_caching=True, **ENGINE)


@pytest.fixture(scope="module")
def plain():
    return LLM(STORIES, num_pages=40, **ENGINE)


@pytest.fixture(scope="module")
def hf_model():
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(STORIES, dtype="float32").eval()


def reference(hf_model, prompt) -> tuple[np.ndarray, float]:
    """transformers' float32 logprobs at each position, and how far ours may lie from
    them: each within stories_logprob_bound of the exact values."""
    import torch

    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt])).logits[0]
    return torch.log_softmax(logits, -1).numpy(), 2 * stories_logprob_bound(logits.numpy())


def out_first(llm, prompt, params):
    return llm.generate([prompt], params, use_tqdm=False)[0].prompt_logprobs


def check(entries, prompt, reference: tuple[np.ndarray, float]):
    want, bound = reference
    assert len(entries) == len(prompt) and entries[0] is None
    for p in range(1, len(prompt)):
        entry = entries[p]
        token = prompt[p]
        assert next(iter(entry)) == token  # the prompt's own token first
        assert_within(entry[token].logprob, want[p - 1, token], bound, f"position {p}")
        low, high = rank_range(want[p - 1], token, bound)
        assert low <= entry[token].rank <= high, f"position {p}"
        top = np.argsort(-want[p - 1])[:TOP]
        assert set(entry) == {token, *top.tolist()}, f"position {p}"
        for rank, t in enumerate(top.tolist(), 1):
            assert_within(entry[t].logprob, want[p - 1, t], bound, f"position {p}, top {rank}")
            low, high = rank_range(want[p - 1], t, bound)
            assert low <= entry[t].rank <= high, f"position {p}, top {rank}"


def rank_range(row: np.ndarray, t: int, bound: float) -> tuple[int, int]:
    """The ranks token t may have: 1 + the tokens above it, where those within rounding
    of it (twice the bound: both may move) may go either way; t itself never counts."""
    others = np.delete(row, t)
    return 1 + int(np.sum(others > row[t] + 2 * bound)), 1 + int(np.sum(others > row[t] - 2 * bound))


@pytest.mark.parametrize("engine", ["plain", "spec"])
def test_prompt_logprobs_match_transformers_across_chunks(request, hf_model, engine):
    llm = request.getfixturevalue(engine)
    rng = fresh_rng()
    prompts = random_prompts(rng, [23, 2, 9])  # several chunks and pages; one token scored
    params = SamplingParams(max_tokens=4, temperature=0.0, prompt_logprobs=TOP)
    for prompt, out in zip(prompts, llm.generate(prompts, params, use_tqdm=False)):
        check(out.prompt_logprobs, prompt, reference(hf_model, prompt))
    # each entry's text is its token's, decoded after the prompt tokens before it
    tokenizer = llm.get_tokenizer()
    texts = [tokenizer.token_texts(prompts[0][:p], [prompts[0][p]], 4, False)[0] for p in range(1, len(prompts[0]))]
    assert [e[prompts[0][p]].decoded_token for p, e in enumerate(out_first(llm, prompts[0], params), ) if e] == texts
    plain_out = llm.generate(prompts[:1], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)[0]
    assert plain_out.prompt_logprobs is None


def test_a_cached_prompt_is_computed_again_for_its_logprobs(spec, hf_model):
    rng = fresh_rng()
    prompt = random_prompts(rng, [30])[0]
    spec.generate([prompt], SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)  # now cached
    again = spec.generate([prompt], SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)[0]
    assert again.num_cached_tokens > 0
    out = spec.generate([prompt], SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=TOP), use_tqdm=False)[0]
    assert out.num_cached_tokens == 0
    check(out.prompt_logprobs, prompt, reference(hf_model, prompt))


def test_preempted_request_scores_each_prompt_token_once(spec, hf_model):
    rng = fresh_rng()
    prompts = random_prompts(rng, [12, 12, 12, 25])
    engine = spec.engine
    held = engine.allocator.allocate(engine.allocator.num_pages - 22)
    try:
        before = engine.scheduler.num_preemptions
        params = [SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)] * 3 + [
            SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, prompt_logprobs=TOP)
        ]
        outs = spec.generate(prompts, params, use_tqdm=False)
        assert engine.scheduler.num_preemptions > before
    finally:
        engine.allocator.free(held)
    check(outs[-1].prompt_logprobs, prompts[-1], reference(hf_model, prompts[-1]))


def test_a_stream_sends_prompt_logprobs_once(plain):
    rng = fresh_rng()
    prompt = random_prompts(rng, [10])[0]
    engine = plain.engine
    engine.add_request("stream", prompt, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, prompt_logprobs=1,
                                                        output_kind=RequestOutputKind.DELTA))
    sent = []
    while engine.has_unfinished_requests():
        sent += [out.prompt_logprobs for out in engine.step() if out is not None]
    assert len(sent) > 1 and sent[0] is not None and len(sent[0]) == len(prompt)
    assert all(p is None for p in sent[1:])


def test_more_prompt_logprobs_than_max_logprobs_is_refused(plain):
    with pytest.raises(ValueError, match="prompt_logprobs must be <= 5"):
        plain.generate([[1, 5, 6]], SamplingParams(prompt_logprobs=6), use_tqdm=False)

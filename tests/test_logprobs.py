"""Logprobs through the engine against a float64 log-softmax of the model's logits: the
chosen token's, the top n (values and ids) and cumulative_logprob, for plain decode rows
and for MTP verify rows, greedy and sampled (logprobs are of the model's distribution,
before temperature and filters). Each is a Logprob with vLLM's rank (the chosen token's
from the device: 1 + the tokens with a higher logit, also beyond the top n) and the text
the token adds (decoded_token)."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import MTP_MODEL, STORIES, prompt_logits, stories_logprob_bound
from jaxmtp import LLM, Logprob, SamplingParams
from tolerances import assert_within, gamma

TOP = 5


def log_softmax64(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


@pytest.fixture(scope="module", params=[(STORIES, 0), (MTP_MODEL, 2)], ids=["k=0", "k=2"])
def llm(request):
    model, k = request.param
    return LLM(model, num_speculative_tokens=k, max_num_seqs=2, max_num_batched_tokens=16, max_logprobs=TOP,
               max_model_len=128)


def test_logprobs_are_a_float64_log_softmax_of_the_logits(rng, llm):
    k = llm.engine.config.num_speculative_tokens
    prompts = [[1] + rng.integers(3, 512, size=n).tolist() for n in (4, 9, 6)]
    seed = int(rng.integers(2**31))
    params = [SamplingParams(max_tokens=20, temperature=0.0, logprobs=TOP, ignore_eos=True),
              SamplingParams(max_tokens=20, temperature=0.9, top_p=0.8, seed=seed, logprobs=TOP, ignore_eos=True),
              # hot enough that chosen tokens fall outside the top n
              SamplingParams(max_tokens=20, temperature=3.0, seed=seed + 1, logprobs=TOP, ignore_eos=True)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    if k:
        assert sum(o.spec_stats["accepted"] for o in outs) > 0, "no verify row past the first emitted a token"
    chosen_ranks = []
    for prompt, out in zip(prompts, outs):
        completion = out.outputs[0]
        ids = completion.token_ids
        # the logits that predicted output token i sit at position len(prompt) - 1 + i
        logits = prompt_logits(llm.engine, prompt + ids[:-1])[len(prompt) - 1 :]
        expected, bound = log_softmax64(logits), stories_logprob_bound(logits)
        assert len(completion.logprobs) == len(ids)
        for i, (token, entry) in enumerate(zip(ids, completion.logprobs)):
            where = f"k={k} request seed={seed} token {i}"
            values = list(entry.items())
            assert values[0][0] == token and all(isinstance(lp, Logprob) for _, lp in values), where
            descending = np.sort(expected[i])[::-1]
            for t, lp in values:
                assert_within(lp.logprob, expected[i, t], bound, f"{where}, id {t}")
                # rank r: the r-th largest logprob is this token's (up to float32 near-ties)
                assert_within(descending[lp.rank - 1], expected[i, t], 2 * bound, f"{where}, id {t}, rank")
            # the top n follow the chosen token, ranked 1..n (the chosen token keeps its own rank)
            top_ranks = [lp.rank for _, lp in values[1:]]
            assert top_ranks == sorted(top_ranks), where
            assert sorted(top_ranks + ([values[0][1].rank] if len(entry) == TOP else [])) == list(range(1, TOP + 1)), where
            chosen_ranks.append(values[0][1].rank)
            # the top n ids, unless the n-th and the next are so close that float32 may swap them
            order = np.argsort(-expected[i])
            assert len(entry) in (TOP, TOP + 1), where
            if expected[i, order[TOP - 1]] - expected[i, order[TOP]] > 2 * bound:
                assert set(order[:TOP].tolist()) <= set(entry), where
        # a float32 sum of the logprobs, each within bound
        chosen = expected[np.arange(len(ids)), ids]
        assert_within(completion.cumulative_logprob, chosen.sum(), len(ids) * bound + gamma(len(ids)) * np.abs(chosen).sum())
    assert max(chosen_ranks) > TOP, "no chosen token outside the top n: the rank beyond it went untested"
    assert llm.engine.allocator.num_free == llm.engine.allocator.num_pages


def test_decoded_tokens_spell_the_output(llm):
    """Each chosen token's decoded_token is the text it adds, leading space included."""
    out = llm.generate("Once upon a time", SamplingParams(max_tokens=30, temperature=0.0, logprobs=2), use_tqdm=False)
    completion = out[0].outputs[0]
    assert completion.text.startswith(", there was a little girl")
    assert "".join(entry[t].decoded_token for t, entry in zip(completion.token_ids, completion.logprobs)) == completion.text
    # an alternative's text continues the same tokens: a word of its own starts with a space
    first_alternatives = [lp.decoded_token for t, lp in completion.logprobs[1].items() if t != completion.token_ids[1]]
    assert all(isinstance(text, str) and text for text in first_alternatives)

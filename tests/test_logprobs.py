"""Logprobs through the engine against a float64 log-softmax of the model's logits: the
chosen token's, the top n (values and ids) and cumulative_logprob, for plain decode rows
and for MTP verify rows, greedy and sampled (logprobs are of the model's distribution,
before temperature and filters)."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import MTP_MODEL, STORIES, prompt_logits
from jaxmtp import LLM, SamplingParams

TOP = 5


def log_softmax64(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


@pytest.mark.parametrize("model,k", [(STORIES, 0), (MTP_MODEL, 2)])
def test_logprobs_are_a_float64_log_softmax_of_the_logits(rng, model, k):
    llm = LLM(model, num_speculative_tokens=k, max_num_seqs=2, max_num_batched_tokens=16, max_logprobs=TOP)
    prompts = [[1] + rng.integers(3, 512, size=n).tolist() for n in (4, 9)]
    seed = int(rng.integers(2**31))
    params = [SamplingParams(max_tokens=20, temperature=0.0, logprobs=TOP, ignore_eos=True),
              SamplingParams(max_tokens=20, temperature=0.9, top_p=0.8, seed=seed, logprobs=TOP, ignore_eos=True)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    if k:
        assert sum(o.spec_stats["accepted"] for o in outs) > 0, "no verify row past the first emitted a token"
    for prompt, out in zip(prompts, outs):
        completion = out.outputs[0]
        ids = completion.token_ids
        # the logits that predicted output token i sit at position len(prompt) - 1 + i
        expected = log_softmax64(prompt_logits(llm.engine, prompt + ids[:-1])[len(prompt) - 1 :])
        assert len(completion.logprobs) == len(ids)
        for i, (token, entry) in enumerate(zip(ids, completion.logprobs)):
            where = f"k={k} request seed={seed} token {i}"
            values = list(entry.items())
            assert values[0][0] == token, where
            np.testing.assert_allclose(values[0][1], expected[i, token], atol=1e-4, err_msg=where)
            for t, lp in values:
                np.testing.assert_allclose(lp, expected[i, t], atol=1e-4, err_msg=f"{where}, id {t}")
            # the top n ids, unless the n-th and the next are so close that float32 may swap them
            order = np.argsort(-expected[i])
            assert len(entry) in (TOP, TOP + 1), where
            if expected[i, order[TOP - 1]] - expected[i, order[TOP]] > 1e-4:
                assert set(order[:TOP].tolist()) <= set(entry), where
        np.testing.assert_allclose(completion.cumulative_logprob, expected[np.arange(len(ids)), ids].sum(), atol=1e-3)
    assert llm.engine.allocator.num_free == llm.engine.allocator.num_pages

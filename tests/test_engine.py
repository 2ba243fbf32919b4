"""The engine on the shipped stories260K: golden output, chunked prefill, batching,
preemption, stop conditions, streaming, logprobs and async scheduling."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import (MTP_MODEL, STORIES, assert_no_leaks, golden_ids, prompt_logits, random_prompts, stories_logprob_bound,
                      token_ids)
from jaxmtp import LLM, SamplingParams
from tolerances import assert_within

GREEDY = SamplingParams(max_tokens=24, temperature=0.0)


def make_llm(**kwargs) -> LLM:
    # contexts of at most 256 tokens (the golden output's 201): the CPU attention reads a
    # row's whole page table
    defaults = dict(page_size=16, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256)
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
    # min_tokens holds back stop strings as it does stop tokens (vLLM's rule): a match
    # counts once the token that completes it is past the first min_tokens
    first_30 = llm.generate([[1]], SamplingParams(max_tokens=30, temperature=0.0), use_tqdm=False)[0].outputs[0].text
    later = full.text.index("play", len(first_30) - len("play") + 1)
    out = llm.generate([[1]], SamplingParams(max_tokens=60, temperature=0.0, stop=["play"], min_tokens=30),
                       use_tqdm=False)[0].outputs[0]
    assert full.text.index("play") < len(first_30) and out.text == full.text[:later] and len(out.token_ids) > 30
    # sampled stories end at an eos id (stories260K ends stories with BOS, id 1, as
    # its generation_config.json says); ignore_eos runs through it
    sampled = [SamplingParams(max_tokens=250, temperature=1.0, seed=s) for s in range(6)]
    stories = [o.outputs[0] for o in llm.generate([[1]] * 6, sampled, use_tqdm=False)]
    ended = [(s, story) for s, story in zip(sampled, stories) if story.finish_reason == "stop"]
    assert ended, "no sampled story reached eos"
    params, story = ended[0]
    assert story.token_ids[-1] in (1, 2) and story.stop_reason == story.token_ids[-1]
    params = SamplingParams(max_tokens=len(story.token_ids) + 5, temperature=1.0, seed=params.seed, ignore_eos=True)
    longer = llm.generate([[1]], params, use_tqdm=False)[0].outputs[0]
    assert longer.finish_reason == "length"
    assert longer.token_ids[: len(story.token_ids)] == story.token_ids


def test_chat_renders_each_conversation_with_the_chat_template():
    """vLLM's LLM.chat: each conversation rendered with the chat template (the model's,
    here the default one of README.md, or the caller's), then generated as generate()
    generates from those ids; each output's prompt is the rendered text."""
    llm = make_llm()
    story = [{"role": "system", "content": "You tell stories."},
             {"role": "user", "content": [{"type": "text", "text": "A cat"}, {"type": "text", "text": " and a dog"}]}]
    plain = [{"role": "user", "content": "A cat and a dog"}]
    outs = llm.chat([story, plain], GREEDY, use_tqdm=False)
    rendered = ["<s>system: You tell stories.\nuser: A cat and a dog\nassistant:", "<s>user: A cat and a dog\nassistant:"]
    assert [out.prompt for out in outs] == rendered
    # the template writes BOS as text, which encodes to the BOS token
    prompts = [llm.tokenizer.encode(text[len("<s>"):]) for text in rendered]
    assert [out.prompt_token_ids for out in outs] == prompts
    assert token_ids(outs) == token_ids(llm.generate(prompts, GREEDY, use_tqdm=False))
    # one conversation; the caller's template and its variables; the last message continued
    source = "{{ bos_token }}{{ opening }} {{ messages[-1]['content'] }}"
    out = llm.chat(plain, GREEDY, use_tqdm=False, chat_template=source, chat_template_kwargs={"opening": "Q:"})
    assert len(out) == 1 and out[0].prompt == "<s>Q: A cat and a dog"
    out = llm.chat(plain + [{"role": "assistant", "content": "Once upon"}], GREEDY, use_tqdm=False,
                   add_generation_prompt=False, continue_final_message=True)
    assert out[0].prompt.endswith("assistant: Once upon")
    with pytest.raises(ValueError, match="'image_url' part; only text parts"):
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], use_tqdm=False)
    with pytest.raises(ValueError, match="lora_request is not supported"):
        llm.chat(plain, lora_request=object(), use_tqdm=False)
    assert llm.llm_engine is llm.engine


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
    llm = make_llm()
    out = llm.generate([[1, 403, 407]], SamplingParams(max_tokens=1, temperature=0.0, logprobs=3), use_tqdm=False)
    completion = out[0].outputs[0]
    logits = prompt_logits(llm.engine, [1, 403, 407])[-1].astype(np.float64)
    logp = logits - np.log(np.exp(logits - logits.max()).sum()) - logits.max()
    entry = completion.logprobs[0]
    token = completion.token_ids[0]
    assert list(entry)[0] == token
    assert_within(entry[token].logprob, logp[token], stories_logprob_bound(logits))
    top3 = np.argsort(-logp)[:3]
    assert set(top3) <= set(entry)


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
    assert ("Once upon a" + out.outputs[0].text) == llm.tokenizer.decode(out.prompt_token_ids + out.outputs[0].token_ids,
                                                                                 skip_special_tokens=True)


def test_async_scheduling_gives_the_outputs_of_sync_scheduling(rng):
    """Dispatching step N+1 before reading step N (rows continued from the device's
    carry, positions shifted by the accepted drafts) changes no output: MTP drafts,
    chunked prefill, seeded sampling, and spec stats step for step; logprobs to float32
    rounding (a step's batch can differ by a request near max_tokens, which waits for
    its result before it is scheduled again). Under a tiny page pool (preemption at
    different moments) greedy tokens still agree; sampled ones need not, as the verify
    windows after a recompute differ."""
    prompts = random_prompts(rng, [6, 30, 13, 21])
    # eos ignored, so that the pool's demand is known: 12, 16, 14 and 11 pages of 4 tokens
    # at their ends; as the second ends (16 pages) the first and third, at about its pace,
    # hold about 10 and 12: 38 pages together, more than the tiny pool's 30
    params = [
        SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=33, temperature=0.8, seed=int(rng.integers(1 << 30)), ignore_eos=True),
        SamplingParams(max_tokens=40, temperature=0.0, logprobs=2, ignore_eos=True),
        SamplingParams(max_tokens=21, temperature=1.0, top_p=0.9, seed=int(rng.integers(1 << 30)), ignore_eos=True),
    ]
    # one pool size, so both runs share compiled steps; the tiny pool is 30 free pages of it
    for held_pages in (0, 90):
        runs = {}
        for overlap in (False, True):
            llm = LLM(MTP_MODEL, num_speculative_tokens=2, page_size=4, num_pages=120, max_num_seqs=4,
                      max_num_batched_tokens=32, prefill_chunk_size=7, async_scheduling=overlap)
            held = llm.engine.allocator.allocate(held_pages)
            runs[overlap] = llm.generate(prompts, params, use_tqdm=False)
            llm.engine.allocator.free(held)
            assert (llm.engine.scheduler.num_preemptions > 0) == (held_pages > 0)
            assert_no_leaks(llm)
        compared = [0, 2] if held_pages else [0, 1, 2, 3]
        assert [token_ids(runs[True])[i] for i in compared] == [token_ids(runs[False])[i] for i in compared]
        if not held_pages:
            assert [o.spec_stats for o in runs[True]] == [o.spec_stats for o in runs[False]]
            # the same tokens' logprobs from steps of other shapes: float32 sums reordered,
            # each run's within stories_logprob_bound of the exact values
            bound = 2 * stories_logprob_bound(prompt_logits(llm.engine, prompts[2] + token_ids(runs[False])[2][:-1]))
            for a, b in zip(runs[True][2].outputs[0].logprobs, runs[False][2].outputs[0].logprobs):
                assert a.keys() == b.keys()
                assert [lp.rank for lp in a.values()] == [lp.rank for lp in b.values()]
                assert_within([lp.logprob for lp in a.values()], [lp.logprob for lp in b.values()], bound)


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




def test_request_metrics_time_each_stage():
    """RequestOutput.metrics: arrival (the caller's, when given), first scheduled, first
    and last token, finished, in that order, and the stages between them."""
    import time

    llm = make_llm()
    arrival = time.monotonic() - 5.0  # as a server passes the time its HTTP request came in
    llm.engine.add_request("timed", [1, 403, 407], SamplingParams(max_tokens=6, temperature=0.0), arrival_time=arrival)
    outputs = []
    while llm.engine.has_unfinished_requests():
        outputs += llm.engine.step()
    timings = outputs[-1].metrics
    assert outputs[-1].finished and timings.arrival_time == arrival
    stages = [timings.arrival_time, timings.first_scheduled_time, timings.first_token_time, timings.last_token_time,
              timings.finished_time]
    assert stages == sorted(stages) and timings.queue_time >= 5.0
    assert timings.e2e_latency == pytest.approx(
        timings.queue_time + timings.prefill_time + timings.decode_time + timings.finished_time - timings.last_token_time
    )
    assert timings.decode_time > 0  # six tokens take more than the first step
    # each output holds a copy as of its step: an early one saw no end yet
    assert outputs[0].metrics.finished_time is None or len(outputs) == 1

"""One request never fails another, and a failed step never leaves the engine unusable:
numbers the device arrays cannot hold, a batch that cannot be built, a step that
consumed what it donated, and generate() calls that end in an error. The engine drafts
with MTP (greedy output is the base model's golden one either way)."""

from __future__ import annotations

import inspect

import jax
import pytest

from conftest import MTP_MODEL, assert_no_leaks, golden_ids, greedy
from jaxmtp import LLM, SamplingParams
from jaxmtp.engine.structured_outputs import StructuredOutputsParams
from jaxmtp.worker.step import DONATED_STATE, STEP_STATE, step

GOLDEN = golden_ids()[:12]


@pytest.fixture(scope="module")
def llm():
    return LLM(MTP_MODEL, num_speculative_tokens=2, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=128)


@pytest.mark.parametrize("field, value", [
    ("top_k", 2**31), ("max_tokens", 2**31), ("logprobs", 2**31), ("n", 2**31), ("seed", 2**63),
    ("temperature", float("inf")), ("temperature", float("nan")), ("stop_token_ids", [-1]),
])
def test_numbers_the_device_arrays_cannot_hold_are_value_errors_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})
    with pytest.raises(ValueError, match="seed"):  # choice j of n uses seed + j
        SamplingParams(seed=2**63 - 2, n=3)


def test_a_request_that_breaks_the_batch_fails_alone(llm):
    engine = llm.engine
    engine.add_request("good", [1], greedy(12))
    engine.add_request("bad", [1, 5], greedy(12))
    bad = engine._incoming[-1].seqs[0]
    bad.params = SamplingParams(max_tokens=12, temperature=0.0)
    bad.params.top_k = 2**40  # past validation, as a bug elsewhere might leave it
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update({o.request_id: o for o in engine.step() if o.finished})
    assert outputs["bad"].outputs[0].finish_reason == "error" and "int" in outputs["bad"].error.lower()
    assert outputs["good"].outputs[0].token_ids == GOLDEN and outputs["good"].error is None
    assert_no_leaks(llm)


def test_a_step_that_consumed_the_donated_cache_is_recovered_from(llm, monkeypatch):
    """The failed step's requests (all running ones: their KV is gone) end with an
    error; cache, carry, allocator and prefix cache are rebuilt; the engine serves on."""
    engine, runner = llm.engine, llm.engine.runner
    run, failures = runner._run, [RuntimeError("device fell over")]

    def run_and_fail_once(args):
        output = run(args)
        if failures and engine.stats.steps >= 2:
            jax.tree.map(lambda x: x.delete(), (runner.cache, runner.carry))
            raise failures.pop()
        return output

    monkeypatch.setattr(runner, "_run", run_and_fail_once)
    failed_before = engine.stats.failed_steps
    for i in range(3):
        engine.add_request(f"r{i}", [1], greedy(40))
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update({o.request_id: o for o in engine.step() if o.finished})
    assert not failures and engine.usable and engine.stats.failed_steps == failed_before + 1
    assert all(o.outputs[0].finish_reason == "error" and "device fell over" in o.error for o in outputs.values())
    assert_no_leaks(llm)
    out = llm.generate([[1]], SamplingParams(max_tokens=12, temperature=0.0), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == GOLDEN
    assert_no_leaks(llm)


def test_the_state_the_runner_rebuilds_is_what_the_step_carries():
    """The step's arguments after params are STEP_STATE, in order, and what it donates is
    among them: ModelRunner.reset rebuilds exactly STEP_STATE."""
    assert tuple(inspect.signature(step).parameters)[1 : 1 + len(STEP_STATE)] == STEP_STATE
    assert set(DONATED_STATE) <= set(STEP_STATE)


# one request of each kind: plain greedy, sampled with penalties and a bias (logits
# state rows), constrained (grammar masks), prompt logprobs; all under MTP drafts
EVERY_KIND = [
    ([1], greedy(12)),
    ([1, 403], SamplingParams(max_tokens=12, temperature=0.8, seed=5, presence_penalty=0.5, frequency_penalty=0.3,
                              logit_bias={300: 2.0}, ignore_eos=True)),
    ([1], SamplingParams(max_tokens=12, temperature=0.0, structured_outputs=StructuredOutputsParams(regex="[a-z ]{4,12}"))),
    ([1, 403, 407, 5], SamplingParams(max_tokens=6, temperature=0.0, prompt_logprobs=2, ignore_eos=True)),
]


def _served(llm) -> list:
    outs = llm.generate([p for p, _ in EVERY_KIND], [s for _, s in EVERY_KIND], use_tqdm=False)
    return [(o.outputs[0].token_ids, o.prompt_logprobs) for o in outs]


def test_a_step_that_consumed_its_donated_state_loses_no_request_after_it(llm, monkeypatch):
    """The real compiled step runs (donating the cache and the logits state), then
    raises: the step's requests end with an error, every carried state is rebuilt, and
    the same requests then give the outputs they gave before the failure."""
    engine, runner = llm.engine, llm.engine.runner
    before = _served(llm)
    programs_for, failures = runner._programs_for, [RuntimeError("device fell over after donation")]

    class FailingOnce:
        def __init__(self, programs):
            self.programs = programs

        def __getattr__(self, name):
            return getattr(self.programs, name)

        def program(self, shape):
            *first, last = self.programs.program(shape)  # a masked step's second program: its last

            def run(*args):
                output = last(*args)
                if failures:
                    raise failures.pop()
                return output
            return (*first, run)

    monkeypatch.setattr(runner, "_programs_for", lambda oracle: FailingOnce(programs_for(oracle)))
    for i, (prompt, params) in enumerate(EVERY_KIND):
        engine.add_request(f"failing{i}", prompt, params)
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update({o.request_id: o for o in engine.step() if o.finished})
    monkeypatch.undo()
    assert not failures and engine.usable and not runner.cache_is_lost
    assert len(outputs) == len(EVERY_KIND)
    assert all(o.outputs[0].finish_reason == "error" and "after donation" in o.error for o in outputs.values())
    assert_no_leaks(llm)
    assert _served(llm) == before


def test_generate_leaves_the_engine_as_it_was_when_it_fails(llm, monkeypatch):
    engine = llm.engine
    schedule, failures = engine.scheduler.schedule, [RuntimeError("scheduler bug")]

    def schedule_failing_once():
        if failures and engine.stats.steps >= 3:
            raise failures.pop()
        return schedule()

    monkeypatch.setattr(engine.scheduler, "schedule", schedule_failing_once)
    with pytest.raises(RuntimeError, match="scheduler bug"):
        llm.generate([[1], [1, 5], [1, 9]], greedy(30), use_tqdm=False)
    assert not engine.requests and not engine.scheduler.running and not engine.scheduler.waiting
    assert_no_leaks(llm)
    assert llm.generate([[1]], SamplingParams(max_tokens=12, temperature=0.0), use_tqdm=False)[0].outputs[0].token_ids == GOLDEN


def test_generate_raises_when_the_engine_failed_one_of_its_requests(llm, monkeypatch):
    engine = llm.engine
    add_text, failed = engine.output_processor._add_text, []

    def failing_add_text(seq, token):
        if seq.prompt_token_ids == [1, 7] and not failed:
            failed.append(seq.request_id)
            raise RuntimeError("detokeniser exploded")
        return add_text(seq, token)

    monkeypatch.setattr(engine.output_processor, "_add_text", failing_add_text)
    with pytest.raises(RuntimeError, match="detokeniser exploded"):
        llm.generate(["Once upon", [1, 7], [1, 9]], greedy(30), use_tqdm=False)
    assert not engine.requests
    assert_no_leaks(llm)

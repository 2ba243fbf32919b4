"""Compiling the step's shapes in the background while the engine serves: a batch whose
shape is not compiled yet runs on the smallest compiled shape that holds it (the same
tokens), nothing compiles inside a step, a progress bar counts the shapes left, and a
shape that fails to compile leaves the engine serving on a larger one."""

from __future__ import annotations

import logging
import threading
import time

from conftest import MTP_MODEL, greedy, prompt_logits, random_prompts, stories_logprob_bound, token_ids
from jaxmtp import LLM, SamplingParams
from jaxmtp.worker.batch import OTHER_KINDS, BatchShape, BucketPlan
from jaxmtp.worker.programs import num_compiles
from jaxmtp.worker.programs import StepPrograms
from tolerances import assert_within


class FakeLowered:
    def __init__(self, shape, log, fail):
        self.shape, self.log, self.fail = shape, log, fail

    def compile(self):
        if self.shape in self.fail:
            raise RuntimeError(f"cannot compile {self.shape}")
        self.log.append((self.shape, threading.current_thread().name))
        return f"program {self.shape}"


def fake_programs(fail=(), gate: threading.Event | None = None, entered: threading.Event | None = None):
    compiled = []

    def lower(shape):
        if entered is not None:
            entered.set()
        if gate is not None:
            gate.wait()
        return (FakeLowered(shape, compiled, fail),)

    return StepPrograms(lower), compiled


def shape(t, b, greedy=True, p=4):
    return BatchShape(t, b, greedy, p)


def test_a_deferred_shape_runs_on_the_smallest_compiled_shape_that_holds_it():
    programs, _ = fake_programs()
    programs.compile_all([shape(64, 8, greedy=False), shape(16, 2, greedy=False), shape(16, 2), shape(16, 4),
                          shape(16, 2, p=8)])
    with programs._lock:  # as the background compilation defers them
        programs._deferred.update({shape(8, 1), shape(8, 1, greedy=False), shape(32, 4, greedy=False),
                                   shape(8, 1, p=8)})
    assert programs.shape_to_run(shape(16, 4)) == shape(16, 4)  # compiled: itself
    # the greedy program holds a greedy batch before the general one of the same size
    assert programs.shape_to_run(shape(8, 1)) == shape(16, 2)
    assert programs.shape_to_run(shape(8, 1, greedy=False)) == shape(16, 2, greedy=False)  # never a greedy one
    assert programs.shape_to_run(shape(8, 1, p=8)) == shape(16, 2, p=8)  # a table as wide
    assert programs.shape_to_run(shape(32, 4, greedy=False)) == shape(64, 8, greedy=False)
    # not deferred, not compiled: itself, compiled when the step asks for it
    assert programs.shape_to_run(shape(32, 2)) == shape(32, 2)
    assert programs.num_compiled_on_demand == 0
    assert programs.program(shape(32, 2)) == (f"program {shape(32, 2)}",)
    assert programs.num_compiled_on_demand == 1


def test_background_compilation_counts_down_and_a_failed_shape_stays_on_a_larger_one(capfd, caplog):
    gate = threading.Event()
    programs, compiled = fake_programs(fail={shape(16, 2)}, gate=gate)
    gate.set()
    largest = shape(32, 4, greedy=False)
    programs.compile_all([largest])
    gate.clear()
    rest = [shape(8, 1), shape(16, 2), shape(16, 4), largest]
    with caplog.at_level(logging.INFO, "jaxmtp.worker.programs"):
        programs.compile_all(rest, background=True)
        assert programs.compiling and programs.num_left == 3  # the largest was compiled already
        assert programs.shape_to_run(shape(8, 1)) == largest
        gate.set()
        programs.wait()
    assert not programs.compiling
    assert programs.num_left == 1 and programs.shape_to_run(shape(16, 2)) == shape(16, 4)
    assert programs.shape_to_run(shape(8, 1)) == shape(8, 1)
    assert {s for s, _ in compiled} == {largest, shape(8, 1), shape(16, 4)}
    assert all(thread != threading.main_thread().name for s, thread in compiled if s != largest)
    assert "compiling the step for BatchShape(num_tokens=16, num_seqs=2" in caplog.text
    bar = capfd.readouterr().err
    assert "compiling the step" in bar and "3/3" in bar


def test_stop_lets_the_shape_being_compiled_finish_and_compiles_nothing_more():
    gate, entered = threading.Event(), threading.Event()
    programs, compiled = fake_programs(gate=gate, entered=entered)
    programs.compile_all([shape(8, 1), shape(16, 1), shape(32, 1)], background=True)
    entered.wait()  # the first shape is being lowered
    stopper = threading.Thread(target=programs.stop)
    stopper.start()
    while not programs._stopping:
        time.sleep(0.001)
    gate.set()
    stopper.join()
    assert not programs.compiling
    assert [s for s, _ in compiled] == [shape(8, 1)] and programs.num_left == 2


def test_the_engine_serves_before_its_shapes_compile_with_the_same_tokens_and_compiles_nothing_in_a_step(rng):
    """Warm-up in the background, its thread held back: every step runs on the largest
    shape and compiles nothing; once the shapes are compiled the steps run on their
    own (smaller) shapes and the requests get the same tokens (greedy, seeded samples)."""
    llm = LLM(MTP_MODEL, num_speculative_tokens=2, max_num_seqs=2, max_num_batched_tokens=8, max_model_len=128)
    runner = llm.engine.runner
    plan = BucketPlan(8, 2, runner.max_pages_per_seq)  # four shapes: 8 rows, 1 or 2 requests, greedy or not
    largest = plan.largest()
    assert largest == BatchShape(8, 2, False, runner.max_pages_per_seq)
    gate = threading.Event()
    programs = runner.programs
    lower = programs._lower

    def held_back(s):
        if s != largest:
            assert threading.current_thread() is not threading.main_thread(), f"{s} compiled inside a step"
            gate.wait()
        return lower(s)

    programs._lower = held_back
    shapes = llm.engine.warmup(background=True)
    every = {*plan.all_shapes(), *(s for kind in OTHER_KINDS for s in plan.all_shapes(*kind))}
    assert shapes == len(every) and programs.num_left == shapes - 1
    prompts = random_prompts(rng, [3, 13])
    params = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=0.9, seed=5, ignore_eos=True, logprobs=2)]
    ran_on = []
    dispatch = runner.dispatch

    def recording(*args):
        record = dispatch(*args)
        ran_on.append(record.args[-1])
        return record

    runner.dispatch = recording
    try:
        compiles = num_compiles()
        early = llm.generate(prompts, params, use_tqdm=False)
        early_alone = llm.generate(prompts[:1], params[:1], use_tqdm=False)
        assert num_compiles() == compiles and programs.num_compiled_on_demand == 0
        assert set(ran_on) == {largest}
    finally:  # a failure above must not leave the compile thread waiting
        gate.set()
    programs.wait()
    assert programs.num_left == 0
    ran_on.clear()
    compiles = num_compiles()
    late = llm.generate(prompts, params, use_tqdm=False)
    late_alone = llm.generate(prompts[:1], params[:1], use_tqdm=False)
    assert num_compiles() == compiles and programs.num_compiled_on_demand == 0
    assert BatchShape(8, 1, True, runner.max_pages_per_seq) in ran_on  # the greedy request's decode alone
    assert token_ids(early) == token_ids(late) and token_ids(early_alone) == token_ids(late_alone)
    # the same logprobs from steps of other shapes: two evaluations, each within
    # stories_logprob_bound of the exact ones
    bound = 2 * stories_logprob_bound(prompt_logits(llm.engine, prompts[1] + token_ids(early)[1][:-1]))
    for before, after in zip(early[1].outputs[0].logprobs, late[1].outputs[0].logprobs):
        assert before.keys() == after.keys()
        assert_within([lp.logprob for lp in before.values()], [lp.logprob for lp in after.values()], bound)


def test_constrained_and_prompt_logprob_requests_wait_in_the_queue_while_their_kind_compiles():
    """A background warm-up whose thread is held back: a plain request that came last
    runs and finishes at once; a constrained request and a prompt-logprob one wait in
    the queue, no step compiling their shapes, until the largest shape of each kind is
    in; then they run, with the outputs they get once every shape is compiled."""
    llm = LLM(MTP_MODEL, num_speculative_tokens=2, max_num_seqs=2, max_num_batched_tokens=8, max_model_len=128)
    engine, runner = llm.engine, llm.engine.runner
    programs, gate = runner.programs, threading.Event()
    lower = programs._lower

    def held_back(s):
        if s != runner.buckets.largest():
            assert threading.current_thread() is not threading.main_thread(), f"{s} compiled inside a step"
            gate.wait()
        return lower(s)

    programs._lower = held_back
    engine.warmup(background=True)
    requests = {
        "constrained": ([1], SamplingParams(max_tokens=6, temperature=0.0, structured_outputs={"regex": "[a-z ]{3,6}"})),
        "prompt": ([1, 403, 407], SamplingParams(max_tokens=4, temperature=0.0, prompt_logprobs=1)),
        "plain": ([1], greedy(6)),
    }
    finished = {}
    try:
        compiles = num_compiles()
        for request_id, (prompt, params) in requests.items():
            engine.add_request(request_id, prompt, params)
        while "plain" not in finished:
            finished.update({o.request_id: o for o in engine.step() if o.finished})
        assert set(finished) == {"plain"} and engine.num_waiting == 2
        assert num_compiles() == compiles and programs.num_compiled_on_demand == 0
    finally:  # a failure above must not leave the compile thread waiting
        gate.set()
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert programs.num_compiled_on_demand == 0
    programs.wait()
    again = llm.generate([p for p, _ in requests.values()], [s for _, s in requests.values()], use_tqdm=False)
    assert [finished[r].outputs[0].token_ids for r in requests] == token_ids(again)


def test_decode_only_shapes_hold_every_decode_batch_and_no_prefill_chunk():
    """With MLA (BucketPlan.decode_rows) a batch whose requests run at most k + 1 rows
    each gets a decode-only shape, which all_shapes lists (so the server compiles it
    ahead); such a shape holds no batch with a longer run, and a dense model's plan
    makes none."""
    plan = BucketPlan(64, 16, max_pages_per_seq=33, decode_rows=3)
    every = set(plan.all_shapes())
    for seqs in range(1, 17):
        for rows in range(seqs, 3 * seqs + 1):
            shape = plan.shape_for(rows, seqs, longest_run=min(3, rows - seqs + 1))
            assert shape.decode_only and shape in every, (rows, seqs)
    decode, mixed = plan.shape_for(6, 2, longest_run=3), plan.shape_for(6, 2, longest_run=4)
    assert (decode.num_tokens, decode.num_seqs) == (mixed.num_tokens, mixed.num_seqs) and not mixed.decode_only
    assert mixed.holds(decode) and not decode.holds(mixed)
    dense = BucketPlan(64, 16, max_pages_per_seq=33)
    assert not dense.shape_for(2, 2, longest_run=1).decode_only
    assert not any(shape.decode_only for shape in dense.all_shapes())
    assert len(every) < 2 * len(dense.all_shapes())  # decode-only sizes only where a decode batch can take them

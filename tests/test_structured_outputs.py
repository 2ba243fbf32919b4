"""Structured outputs under MTP: every output satisfies its constraint, and greedy and
seeded outputs are token for token the same with k = 2 speculative tokens as without
(each verify row is masked by the grammar's state after the drafts before it), also
through preemption and prefix-cache hits."""

from __future__ import annotations

import dataclasses
import json
import re
import sys

import jsonschema
import llguidance
import pytest

from conftest import MTP_MODEL, STORIES
from jaxmtp import LLM, SamplingParams
from jaxmtp.engine.structured_outputs import StructuredOutputsParams, fill_row_masks

ENGINE = dict(page_size=4, max_num_seqs=4, prefill_chunk_size=7, max_num_batched_tokens=16, num_pages=60,
              enable_prefix_caching=True, max_model_len=144)  # short contexts: the CPU attention reads them whole
COMPACT = {"x-guidance": {"whitespace_flexible": False}}  # llguidance's own option, in the schema
SCHEMAS = {
    "nested": {
        "type": "object", "additionalProperties": False, "required": ["name", "pet"],
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "pet": {"type": "object", "additionalProperties": False, "required": ["kind", "age"],
                    "properties": {"kind": {"enum": ["cat", "dog", "bird"]},
                                   "age": {"type": "integer", "minimum": 1, "maximum": 20}}},
        },
    },
    "array": {
        "type": "object", "additionalProperties": False, "required": ["friends"],
        "properties": {"friends": {"type": "array", "minItems": 2, "maxItems": 3,
                                   "items": {"type": "string", "maxLength": 6}}},
    },
}
PROMPTS = ["Once upon a time", "Lily had a", "The sun"]


def constrained(so: dict, **kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=80, structured_outputs=so, **{"temperature": 0.0, **kwargs})


@pytest.fixture(scope="module")
def plain():
    return LLM(STORIES, **ENGINE)


@pytest.fixture(scope="module")
def spec():
    return LLM(MTP_MODEL, num_speculative_tokens=2, **ENGINE)


def summary(completion) -> tuple[str, list[int], str]:
    return completion.text, completion.token_ids, completion.finish_reason


def texts(llm, params) -> list[tuple[str, list[int], str]]:
    return [summary(o.outputs[0]) for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def started(engine, params, prefix: str):
    """The failure tests' requests added as prefix0.. and stepped past their prefills
    into constrained decoding; returns the first one's sequence."""
    for i, p in enumerate(params):
        engine.add_request(f"{prefix}{i}", PROMPTS[i], p)
    for _ in range(4):
        engine.step()
    return engine.requests[f"{prefix}0"].seqs[0]


@pytest.mark.parametrize("name", SCHEMAS)
def test_json_schema_outputs_are_valid_and_spec_equals_plain(plain, spec, name):
    schema = {**SCHEMAS[name], **COMPACT}  # compact: done within max_tokens
    for params in (constrained({"json": schema}), constrained({"json": schema}, temperature=1.0, seed=5)):
        want = texts(plain, params)
        assert texts(spec, params) == want
        for text, _, finish in want:
            assert finish == "stop", text  # the grammar completed
            jsonschema.validate(json.loads(text), SCHEMAS[name])


def test_regex_choice_and_lark(plain, spec):
    cases = [
        ({"regex": "[a-z]{3,8} [0-9]{2}"}, lambda t: re.fullmatch("[a-z]{3,8} [0-9]{2}", t)),
        ({"choice": ["happy", "sad", "very sleepy"]}, lambda t: t in ("happy", "sad", "very sleepy")),
        ({"grammar": 'start: "The " animal " is " size\nanimal: "cat" | "dog"\nsize: "big" | "small"'},
         lambda t: re.fullmatch("The (cat|dog) is (big|small)", t)),
    ]
    for so, valid in cases:
        for params in (constrained(so), constrained(so, temperature=1.0, seed=9)):
            want = texts(plain, params)
            assert texts(spec, params) == want, so
            assert all(valid(text) for text, _, _ in want), (so, want)


SMALL_SCHEMAS = [
    {"type": "object", "additionalProperties": False, "required": ["name", "age"],
     "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 1, "maximum": 99}}},
    {"type": "object", "additionalProperties": False, "required": ["animal", "happy"],
     "properties": {"animal": {"enum": ["cat", "dog", "bird", "fish"]}, "happy": {"type": "boolean"}}},
    {"type": "object", "additionalProperties": False, "required": ["color"],
     "properties": {"color": {"type": "string", "maxLength": 10}, "count": {"type": "integer", "minimum": 0, "maximum": 10}}},
    {"type": "object", "additionalProperties": False, "required": ["friends"],
     "properties": {"friends": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3}}},
]
STORY_OPENINGS = ["Once upon a time", "Lily saw a cat", "The sun was", "Tom and his dog", "One day, a little bird",
                  "Mom said", "The big tree", "Sam wanted to", "A little girl named", "The dog ran"]


def finished_valid(llm, so: dict, max_tokens: int) -> tuple[int, list[str]]:
    """Twenty requests (ten openings twice, greedy then sampled, a small schema each): how
    many finish with "stop" and output their schema validates, and the texts."""
    cases = [(p, SMALL_SCHEMAS[i % len(SMALL_SCHEMAS)]) for i, p in enumerate(STORY_OPENINGS * 2)]
    params = [SamplingParams(max_tokens=max_tokens, temperature=0.0 if i < len(STORY_OPENINGS) else 0.8, seed=i,
                             structured_outputs={"json": schema, **so}) for i, (_, schema) in enumerate(cases)]
    outs = [o.outputs[0] for o in llm.generate([p for p, _ in cases], params, use_tqdm=False)]
    good = 0
    for out, (_, schema) in zip(outs, cases):
        try:
            jsonschema.validate(json.loads(out.text), schema)
        except (ValueError, jsonschema.ValidationError):
            continue
        good += out.finish_reason == "stop"
    return good, [out.text for out in outs]


@pytest.mark.parametrize("engine", ["plain", "spec"])
def test_json_whitespace_is_bounded_so_that_small_schemas_finish(request, engine):
    """By default a JSON constraint allows runs of at most WHITESPACE_RUN whitespace
    characters: the shipped model then finishes at least 18 of 20 requests with valid
    JSON in 128 tokens (it finished 20). With llguidance's own default, any run (the
    pattern below), it pads with newlines to max_tokens (0 of 20 finished: the ablation
    runs four, shorter); disable_any_whitespace writes compact JSON."""
    from jaxmtp.engine.structured_outputs import WHITESPACE_RUN

    llm = request.getfixturevalue(engine)
    good, outputs = finished_valid(llm, {}, 128)
    assert good >= 18, outputs
    assert not any(re.search(rf"\s{{{WHITESPACE_RUN + 1}}}", text) for text in outputs)
    compact, outputs = finished_valid(llm, {"disable_any_whitespace": True}, 128)
    assert compact >= 18, outputs
    for text in outputs[:compact]:
        assert json.dumps(json.loads(text), separators=(",", ":"), ensure_ascii=False) == text
    unbounded = [SamplingParams(max_tokens=24, temperature=0.0, structured_outputs={
        "json": schema, "whitespace_pattern": r"[\x20\x0A\x0D\x09]+"}) for schema in SMALL_SCHEMAS]
    outs = llm.generate(STORY_OPENINGS[:4], unbounded, use_tqdm=False)
    assert all(o.outputs[0].finish_reason == "length" for o in outs), [o.outputs[0].text for o in outs]


def test_whitespace_options_apply_to_json_constraints_only():
    with pytest.raises(ValueError, match="whitespace_pattern applies to json and json_object"):
        StructuredOutputsParams(regex="a+", whitespace_pattern=" ")
    with pytest.raises(ValueError, match="disable_any_whitespace applies to json and json_object"):
        StructuredOutputsParams(choice=["a"], disable_any_whitespace=True)
    with pytest.raises(ValueError, match="contradict"):
        StructuredOutputsParams(json_object=True, disable_any_whitespace=True, whitespace_pattern=" ")
    # llguidance's own options in the schema are taken as they are, and not beside ours
    text = StructuredOutputsParams(json={**SCHEMAS["array"], **COMPACT}).grammar_text()
    assert '"whitespace_flexible": false' in text and '"whitespace_pattern"' not in text
    with pytest.raises(ValueError, match="x-guidance"):
        StructuredOutputsParams(json={**SCHEMAS["array"], **COMPACT}, disable_any_whitespace=True).grammar_text()


def test_json_object_outputs_parse_as_objects(plain, spec):
    """JSON mode: the output is one JSON object. Left alone, this model writes a string
    that never closes (its stories hold no JSON), so a bias on "}" (byte token 128) has it
    close the object: at once, or after whitespace the grammar allows."""
    for bias in ({128: 100.0}, {128: 20.0}):
        for params in (constrained({"json_object": True}, logit_bias=bias),
                       constrained({"json_object": True}, logit_bias=bias, temperature=1.0, seed=9)):
            want = texts(plain, params)
            assert texts(spec, params) == want
            for text, _, finish in want:
                assert finish == "stop", text
                assert isinstance(json.loads(text), dict), text


def test_drafts_inside_the_grammar_are_accepted(spec):
    """Where a step is built from the read output (here: async scheduling off), the
    tokens the grammar forces (the schema's punctuation and names) are the drafts."""
    import dataclasses

    engine = spec.engine
    config, engine.config = engine.config, dataclasses.replace(engine.config, async_scheduling=False)
    try:
        out = spec.generate(PROMPTS[:1], constrained({"json": {**SCHEMAS["nested"], **COMPACT}}), use_tqdm=False)[0]
    finally:
        engine.config = config
    assert out.spec_stats["mean_acceptance_length"] > 1.5, out.spec_stats


def test_constrained_steps_overlap_the_device(spec, monkeypatch):
    """With async scheduling a constrained request continues the step in flight as any
    other does. Step N+1's first part (the forward) is queued before step N is read; its
    second part, which takes the masks computed from step N's tokens, after that read,
    just before step N+2's forward: the host's turn runs under the forward, and the
    device runs the two parts back to back. Every step holds every request."""
    runner, events = spec.engine.runner, []
    for name in ("dispatch", "read", "complete"):
        method = getattr(runner, name)

        def logged(*args, _name=name, _method=method):
            step_id = args[0] if _name == "dispatch" else args[0].step_id
            if _name != "dispatch":
                events.append((_name, step_id, None))
            result = _method(*args)
            if _name == "dispatch":  # once queued (its before_device hook runs inside)
                events.append((_name, step_id, len(args[1].rows)))
            return result

        monkeypatch.setattr(runner, name, logged)
    schedule = spec.engine.scheduler.schedule
    monkeypatch.setattr(spec.engine.scheduler, "schedule", lambda: events.append(("schedule", None, None)) or schedule())
    outs = spec.generate(PROMPTS, constrained({"json": {**SCHEMAS["nested"], **COMPACT}}), use_tqdm=False)
    assert all(o.outputs[0].finish_reason == "stop" for o in outs)
    order = {(name, step): i for i, (name, step, _) in enumerate(events)}
    steps = sorted(step for name, step, _ in events if name == "dispatch")
    overlapped = [n for n in steps if ("dispatch", n + 1) in order and order[("dispatch", n + 1)] < order[("read", n)]]
    assert len(overlapped) >= len(steps) - 8, events  # all but the prefill and the last steps
    scheduled_at = [i for i, (name, _, _) in enumerate(events) if name == "schedule"]
    for n in overlapped[:-1]:  # (the last step, all its requests done, is completed by a later call)
        assert order[("read", n)] < order[("complete", n + 1)] < order[("dispatch", n + 2)], events
        # step n + 2 was scheduled (and built) before: the masks computed meanwhile
        assert any(order[("read", n)] < i < order[("complete", n + 1)] for i in scheduled_at), events
    rows = [size for name, _, size in events if name == "dispatch"]
    shortest = min(len(o.outputs[0].token_ids) for o in outs)
    assert rows[2 : shortest // 3] == [3] * len(rows[2 : shortest // 3]), rows  # no turns while all three decode


def test_constraints_survive_preemption_and_prefix_cache_hits(spec):
    so = {"json": {**SCHEMAS["array"], **COMPACT}}
    want = texts(spec, constrained(so))
    engine = spec.engine
    held = engine.allocator.allocate(engine.allocator.num_pages - 24)
    try:
        before = engine.scheduler.num_preemptions
        params = [constrained(so)] * 3 + [SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)]
        outs = spec.generate(PROMPTS + ["Tom"], params, use_tqdm=False)
        assert engine.scheduler.num_preemptions > before
    finally:
        engine.allocator.free(held)
    assert [summary(o.outputs[0]) for o in outs[:3]] == want
    assert any(o.num_cached_tokens for o in outs[:3])  # the prompts were cached by the first run


@pytest.mark.parametrize("so, message", [
    ({"json": {"type": "nonsense"}}, "(?s)does not compile: .*nonsense"),
    ({"regex": "("}, "(?s)does not compile: .*unclosed group"),
    ({"grammar": "start: ("}, "does not compile"),
    ({"choice": []}, "choice must be a non-empty list"),
    ({"regex": "a", "choice": ["b"]}, "exactly one of"),
    ({"jsonn": {}}, "structured_outputs: .*jsonn"),
    # what would fail mid-request is refused before admission
    ({"choice": [f"w{i}" for i in range(2000)]}, "at most 1999 choices, got 2000"),
    ({"regex": "[^\\s\\S]"}, "no text satisfies the constraint"),
    ({"json": {"$ref": "#"}}, "no text satisfies the constraint"),
    ({"grammar": 'start: "a" start'}, "forces more text than its parser can hold"),
])
def test_bad_constraints_are_refused_by_name(plain, so, message):
    with pytest.raises(ValueError, match=message):
        plain.generate(PROMPTS[:1], SamplingParams(structured_outputs=so), use_tqdm=False)
    assert texts(plain, SamplingParams(max_tokens=3, temperature=0.0))  # the engine still serves


@pytest.mark.parametrize("extra, message", [
    (dict(structured_outputs={"regex": "[a-z]+"}, allowed_token_ids=[2, 13]), "allows none of them as the first"),
    (dict(allowed_token_ids=[2], min_tokens=4), "every allowed token is a stop token"),
])
def test_masks_that_leave_no_token_are_refused(plain, extra, message):
    """Masks that would leave no token to sample (the sampler would then emit one the
    constraint forbids) are refused, naming the field."""
    with pytest.raises(ValueError, match=message):
        plain.generate(PROMPTS[:1], SamplingParams(max_tokens=8, **extra), use_tqdm=False)
    assert not plain.engine.has_unfinished_requests()


def test_rows_after_a_refused_draft_allow_every_token(spec, rng):
    """A request continuing its step verifies the device's drafts as they are, which may
    leave the grammar: its rows up to the first refused draft get the grammar's masks
    (that row's mask refuses the draft, so the verify rejects it there) and the rows
    after it every token."""
    import numpy as np

    grammars = spec.engine.intake.grammars
    params = StructuredOutputsParams(json={**SCHEMAS["nested"], **COMPACT})
    seed = int(rng.integers(1 << 30))
    pick = np.random.default_rng(seed)

    def masks_after(tokens):
        matcher, mask = grammars.matcher(params), np.full((1, grammars.mask_words), -1, np.int32)
        for token in tokens:
            matcher.accept(token)
        fill_row_masks([(matcher, 0, [])], mask)
        return mask[0]

    def allowed(mask_row, wanted):
        bits = np.unpackbits(mask_row.view(np.uint8), bitorder="little")[: grammars.vocab_size]
        return int(pick.choice(np.flatnonzero(bits == wanted)))

    first = masks_after([])
    valid = allowed(first, 1)
    second = masks_after([valid])
    for drafts, rows in (([allowed(first, 0), valid], [first]), ([valid, allowed(second, 0)], [first, second])):
        got = np.full((3, grammars.mask_words), -1, np.int32)  # as the engine's step bitmask starts
        fill_row_masks([(grammars.matcher(params), 0, drafts)], got)
        want = np.stack(rows + [np.full(grammars.mask_words, -1, np.int32)] * (3 - len(rows)))
        np.testing.assert_array_equal(got, want, err_msg=f"seed={seed} drafts={drafts}")


def test_every_matcher_family_gives_the_same_masks(spec, rng, monkeypatch):
    """Requests copy one of several compiled matchers of their grammar in turn (so that a
    step's masks fill on llguidance's threads side by side, MATCHER_FAMILIES), the first
    request of a grammar the matcher that validated it (compiled once if used once):
    walked through the same random valid tokens, each family's matcher masks as the
    first's."""
    import numpy as np

    grammars = spec.engine.intake.grammars
    word = "".join(chr(97 + c) for c in rng.integers(0, 26, 12))
    once = StructuredOutputsParams(regex=f"{word}[0-9]{{1,3}}")  # a grammar no test used
    compiled, compile_matcher = [], llguidance.LLMatcher
    monkeypatch.setattr(llguidance, "LLMatcher", lambda *args, **kw: compiled.append(args[1]) or compile_matcher(*args, **kw))
    grammars.matcher(once)
    assert len(compiled) == 1, compiled
    monkeypatch.undo()
    monkeypatch.setattr(grammars, "num_families", 3)
    params = StructuredOutputsParams(json=SCHEMAS["nested"])
    matchers = [grammars.matcher(params) for _ in range(3)]  # three in turn: every family
    assert len({id(grammars._family(params.grammar_text(), f)) for f in range(3)}) == 3
    seed = int(rng.integers(1 << 30))
    pick = np.random.default_rng(seed)
    for step in range(40):
        masks = np.zeros((3, grammars.mask_words), np.int32)
        fill_row_masks([(m, i, []) for i, m in enumerate(matchers)], masks)
        np.testing.assert_array_equal(masks, np.broadcast_to(masks[0], masks.shape), err_msg=f"seed={seed} step={step}")
        bits = np.unpackbits(masks[0].view(np.uint8), bitorder="little")[: grammars.vocab_size]
        token = int(pick.choice(np.flatnonzero(bits)))
        if any([m.accept(token) for m in matchers]):
            break


def test_a_greedy_constrained_step_takes_no_branch_on_the_host(spec, monkeypatch):
    """An all-greedy constrained batch runs on a greedy masked shape, whose second
    program masks the logits and takes their argmax with no lax.cond: XLA:GPU reads a
    conditional's predicate on the host, which held each dispatch of a constrained
    step's second program until the device had run the forward before it (on the H200,
    2026-12-04: 3.3-3.6 ms a step, against 0.4 ms without). A sampled batch's second
    program has none either: it samples (Gumbel noise, its logarithms), restricting every
    row."""
    runner, ran = spec.engine.runner, []
    run = runner._run
    monkeypatch.setattr(runner, "_run", lambda args, *rest: ran.append(args[-1]) or run(args, *rest))
    spec.generate(PROMPTS[:2], constrained({"json": {**SCHEMAS["nested"], **COMPACT}}), use_tqdm=False)
    masked = [shape for shape in ran if shape.masked]
    assert masked and all(shape.greedy for shape in masked), ran
    second = {greedy: runner.lower_programs(dataclasses.replace(masked[0], greedy=greedy))[1].as_text()
              for greedy in (True, False)}
    assert not any(re.search(r"stablehlo\.(?:case|if)\b", text) for text in second.values())
    assert "stablehlo.log " in second[False] and "stablehlo.log " not in second[True]


@pytest.fixture(scope="module")
def failure_requests(spec):
    """The failure tests' requests (two constrained, one free; PROMPTS in order) and the
    (text, tokens, finish) each gives alone."""
    so = {"json": {**SCHEMAS["array"], **COMPACT}}
    params = [constrained(so), constrained(so), SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)]
    return params, [summary(spec.generate([prompt], p, use_tqdm=False)[0].outputs[0]) for prompt, p in zip(PROMPTS, params)]


def test_a_request_whose_masks_fail_fails_alone(spec, failure_requests):
    """A grammar whose masks raise while a step's bitmask is filled ends its own request
    with the error; the step runs, and the other requests, constrained or not, give the
    outputs they give alone."""
    params, want = failure_requests
    engine = spec.engine
    broken = started(engine, params, "masks").grammar

    def fail(*args):
        raise RuntimeError("llguidance fell over")

    broken.row_drafts = fail
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update({o.request_id: o for o in engine.step() if o.finished})
    assert outputs["masks0"].outputs[0].finish_reason == "error" and "fell over" in outputs["masks0"].error
    got = [summary(outputs[name].outputs[0]) for name in ("masks1", "masks2")]
    assert got == want[1:]


def test_a_request_aborted_while_its_failing_masks_fill_fails_no_other(spec, failure_requests):
    """The masks fill on a worker thread while the engine admits and aborts: a request
    whose masks fail and that is aborted before the engine takes the fill's result ends
    as aborted, and the others give the outputs they give alone."""
    import time

    params, want = failure_requests
    engine = spec.engine
    seq = started(engine, params, "aborted")
    if engine._masks is not None:  # the fill the last step started runs unbroken
        engine._masks.result()

    def fail_once_aborted(*args):  # the fill runs into the abort, then fails
        deadline = time.monotonic() + 30
        while not seq.finished and time.monotonic() < deadline:
            time.sleep(0.001)
        raise RuntimeError("llguidance fell over")

    seq.grammar.row_drafts = fail_once_aborted
    outputs = {o.request_id: o for o in engine.step() if o.finished}  # ends by starting the next step's fill
    engine.abort_request("aborted0")
    while engine.has_unfinished_requests():
        outputs.update({o.request_id: o for o in engine.step() if o.finished})
    assert outputs["aborted0"].outputs[0].finish_reason == "abort", outputs["aborted0"].error
    got = [summary(outputs[name].outputs[0]) for name in ("aborted1", "aborted2")]
    assert got == want[1:]


def test_a_steps_masks_fill_on_a_worker_while_the_next_step_is_scheduled(spec, monkeypatch):
    """With async scheduling, a constrained step's masks are filled off the engine's
    thread, started as soon as the step before it is read, so that llguidance's fill runs
    beside the host's scheduling and batch building: on the engine's thread each fill is
    started before the next step is scheduled, and that step's sampling is queued after.
    The fill is inside llguidance before the engine's thread goes on to schedule: a
    worker that waits for the GIL would otherwise begin only when the engine's thread
    blocks on its result. (The outputs on this path:
    test_json_schema_outputs_are_valid_and_spec_equals_plain.)"""
    import threading

    import jaxmtp.engine.llm_engine as llm_engine
    import jaxmtp.engine.structured_outputs as structured_outputs

    engine, events, fill_threads = spec.engine, [], []
    if engine._masks is not None:  # a test before this one left its last step's fill running
        engine._masks.result()
    fill, submit = llm_engine.step_bitmask, engine._mask_worker.submit
    schedule, complete = engine.scheduler.schedule, engine.runner.complete

    def recorded(name, method):
        def wrapper(*args, **kwargs):
            events.append(name)
            return method(*args, **kwargs)
        return wrapper

    def recorded_fill(*args):
        fill_threads.append(threading.current_thread().name)
        return fill(*args)

    monkeypatch.setattr(llm_engine, "step_bitmask", recorded_fill)
    llnp = structured_outputs.llnp
    for name in ("fill_next_token_bitmask_par", "fill_next_token_bitmask_par_with_draft_tokens"):
        monkeypatch.setattr(llnp, name, recorded("llguidance fills", getattr(llnp, name)))
    monkeypatch.setattr(engine._mask_worker, "submit", recorded("start fill", submit))
    monkeypatch.setattr(engine.scheduler, "schedule", recorded("schedule", schedule))
    step = engine.step

    def recorded_step():
        outputs = step()
        events.append("step returns")
        return outputs

    monkeypatch.setattr(engine, "step", recorded_step)
    monkeypatch.setattr(engine.runner, "complete", recorded("queue sampling", complete))
    params = constrained({"json": {**SCHEMAS["nested"], **COMPACT}})
    # a thread that waits for the GIL takes it when its holder blocks, or after the switch
    # interval: a long interval leaves the worker only the first, as a busy host does
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1.0)
    try:
        got = texts(spec, params)
    finally:
        sys.setswitchinterval(interval)
    if engine._masks is not None:  # this test's last step's fill, started after its last output
        engine._masks.result()
    fills = [i for i, event in enumerate(events) if event == "start fill"]
    assert len(fills) > 10 and len(fill_threads) == len(fills), (len(fills), len(fill_threads))
    assert all(name.startswith("jaxmtp-masks") for name in fill_threads), fill_threads
    # (a step whose rows with drafts and rows without take two llguidance calls: both
    # are inside llguidance before the step returns)
    host = [events[i + 1 : j] for i, j in zip(fills, fills[1:])]
    assert all(events[i + 1] == "llguidance fills" for i in fills[:-1]), events[:12]
    assert any(steps[:2] == ["llguidance fills"] * 2 for steps in host), "no step had rows with and without drafts"
    assert all([event for event in steps if event != "llguidance fills"] == ["step returns", "schedule", "queue sampling"]
               and "llguidance fills" not in steps[steps.index("step returns"):] for steps in host), host[:5]
    assert all(json.loads(text) for text, _, _ in got)


def test_constrained_sampling_follows_the_masked_distribution_with_mtp(spec, rng):
    """At temperature 0.8 a constrained request's outputs with k = 2 follow the model's
    distribution restricted to the grammar's tokens at every step and renormalised (k = 0
    gives the same tokens seed for seed: test_json_schema_outputs_are_valid_and_spec_equals_plain,
    test_regex_choice_and_lark). The exact distribution over the grammar's token paths
    (every tokenization of every choice) comes from transformers' logits at each node
    and llguidance's masks there. G-test of 1500 samples at p < 1e-4 / 2 (g_test's
    calibration): the test fails by chance with probability at most 1e-4. A sample on a
    path the grammar forbids fails at once."""
    from collections import Counter

    import numpy as np
    import torch
    import transformers

    from test_sampling import g_test

    so, temperature, samples, alpha = {"choice": ["cat", "dog", "bird", "fish"]}, 0.8, 1500, 1e-4 / 2
    grammars = spec.engine.intake.grammars
    prompt = spec.engine.intake.encode_prompt("Once upon a time")[1]
    hf = transformers.AutoModelForCausalLM.from_pretrained(STORIES, dtype=torch.float32).eval()
    exact: dict[tuple, float] = {}

    def walk(path: list[int], p: float) -> None:
        matcher = grammars.matcher(StructuredOutputsParams(**so))
        if any([matcher.accept(t) for t in path]):  # the grammar is complete: the request stops here
            exact[tuple(path)] = p
            return
        mask = np.full((1, grammars.mask_words), -1, np.int32)
        fill_row_masks([(matcher, 0, [])], mask)
        allowed = np.flatnonzero(np.unpackbits(mask[0].view(np.uint8), bitorder="little")[: grammars.vocab_size])
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + path])).logits[0, -1].double().numpy()[allowed] / temperature
        q = np.exp(logits - logits.max())
        for token, qt in zip(allowed, q / q.sum()):
            walk(path + [int(token)], p * qt)

    walk([], 1.0)
    paths = sorted(exact)
    expected = np.array([exact[p] for p in paths])
    seed = int(rng.integers(1 << 30))
    params = [SamplingParams(temperature=temperature, seed=seed + i, max_tokens=12, structured_outputs=so)
              for i in range(samples)]
    outs = spec.generate([prompt] * samples, params, use_tqdm=False)
    counts = Counter(tuple(o.outputs[0].token_ids) for o in outs)
    strays = {path: n for path, n in counts.items() if path not in exact}
    p, bins = g_test(np.array([counts[path] for path in paths]), expected)
    assert {o.outputs[0].finish_reason for o in outs} == {"stop"}
    assert not strays and p >= alpha, (
        f"seeds {seed}..{seed + samples - 1}: p={p:.2e} over {bins} bins, off the grammar's paths: {strays}")

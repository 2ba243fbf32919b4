"""Logits processing (penalties, logit_bias, min_tokens, bad_words, allowed_token_ids):
the device functions against a float64 NumPy reference that processes each verify row
as plain decoding would, the engine's greedy output against transformers' logits run
through that reference, and MTP speculation (k = 2) against plain decoding (k = 0),
greedy and seeded, with preemption in between."""

from __future__ import annotations

import types

import jax.numpy as jnp
import numpy as np
import pytest

from conftest import MTP_MODEL, STORIES, fresh_rng
from jaxmtp import LLM, SamplingParams
from jaxmtp.worker import logits_processors as lp
from jaxmtp.engine.intake import bad_words_ids
from tolerances import U32, assert_within

VOCAB = 512
EOS = 2
ENGINE = dict(page_size=4, max_num_seqs=5, prefill_chunk_size=7, max_num_batched_tokens=16, num_pages=40,
              max_model_len=128)  # short contexts: the CPU attention reads a row's whole page table


def reference_logits(logits, prompt, output, stop_ids, params, bad_words) -> np.ndarray:
    """float64: one row's logits after vLLM's processors, given the output so far."""
    x = np.asarray(logits, np.float64).copy()
    if params.allowed_token_ids is not None:
        keep = np.zeros(len(x), bool)
        keep[params.allowed_token_ids] = True
        x[~keep] = -np.inf
    for word in bad_words:
        if len(word) == 1 or (len(output) >= len(word) - 1 and list(output[len(output) - len(word) + 1 :]) == list(word[:-1])):
            x[word[-1]] = -np.inf
    if len(output) < params.min_tokens:
        x[sorted(stop_ids)] = -np.inf
    for token, value in (params.logit_bias or {}).items():
        x[token] += value
    counts = np.bincount(np.asarray(output, np.int64), minlength=len(x)).astype(np.float64)
    seen = counts > 0
    seen[list(prompt)] = True
    rep = params.repetition_penalty
    x = np.where(seen, np.where(x > 0, x / rep, x * rep), x)
    return x - params.frequency_penalty * counts - params.presence_penalty * (counts > 0)


def random_request(rng, vocab: int) -> tuple[types.SimpleNamespace, SamplingParams]:
    words = [tuple(rng.integers(0, vocab, size=n).tolist()) for n in rng.integers(1, 4, size=3)]
    # a bad word whose prefix is the output's tail, so that it bans at row 0
    output = rng.integers(0, vocab, size=rng.integers(0, 20)).tolist()
    if len(output) >= 2:
        words.append(tuple(output[-2:]) + (int(rng.integers(vocab)),))
    params = SamplingParams(
        repetition_penalty=float(rng.uniform(0.5, 2.0)), frequency_penalty=float(rng.uniform(-2, 2)),
        presence_penalty=float(rng.uniform(-2, 2)), min_tokens=int(rng.integers(0, 25)), max_tokens=100,
        logit_bias={int(t): float(rng.uniform(-100, 100)) for t in rng.integers(0, vocab, size=4)},
        allowed_token_ids=rng.choice(vocab, size=vocab // 2, replace=False).tolist() if rng.random() < 0.5 else None,
    )
    seq = types.SimpleNamespace(
        params=params, prompt_token_ids=rng.integers(0, vocab, size=6).tolist(), output_token_ids=output,
        stop_token_ids=frozenset(rng.integers(0, vocab, size=2).tolist()), bad_words_ids=tuple(words),
    )
    return seq, params


def test_process_logits_matches_plain_decoding_at_every_verify_row():
    """Row j is processed with the output so far plus drafts 0..j-1 (repeated drafts
    and drafts equal to earlier output tokens included), as plain decoding would."""
    rng = fresh_rng()
    vocab, b, r, slots = 40, 4, 4, 6
    seqs = [random_request(rng, vocab) for _ in range(b)]
    state = lp.zero_state(slots, vocab)
    slot_of = rng.permutation(slots)[:b]
    rows = lp.state_rows([s for s, _ in seqs], vocab)
    state = lp.write_rows(state, jnp.asarray(slot_of, jnp.int32), {k: jnp.asarray(v) for k, v in rows.items()})
    logits = rng.normal(size=(b, r, vocab)).astype(np.float32) * 3
    drafts = rng.integers(0, vocab // 4, size=(b, r - 1)).astype(np.int32)  # a small range: repeats
    active = np.array([True, True, True, False])
    batch = types.SimpleNamespace(
        state_slot=jnp.asarray(np.where(active, slot_of, -1), jnp.int32),
        output_index=jnp.asarray([len(s.output_token_ids) for s, _ in seqs], jnp.int32),
        min_tokens=jnp.asarray([p.min_tokens for _, p in seqs], jnp.int32),
        repetition_penalty=jnp.asarray([p.repetition_penalty for _, p in seqs], jnp.float32),
        frequency_penalty=jnp.asarray([p.frequency_penalty for _, p in seqs], jnp.float32),
        presence_penalty=jnp.asarray([p.presence_penalty for _, p in seqs], jnp.float32),
    )
    got = np.asarray(lp.process_logits(jnp.asarray(logits), state, batch, jnp.asarray(drafts)))
    for i, (seq, params) in enumerate(seqs):
        for j in range(r):
            output = seq.output_token_ids + drafts[i, :j].tolist()
            want = logits[i, j] if not active[i] else reference_logits(
                logits[i, j], seq.prompt_token_ids, output, seq.stop_token_ids, params, seq.bad_words_ids,
            )
            where = f"request {i} row {j}"
            finite = np.isfinite(want)
            assert np.array_equal(np.isfinite(got[i, j]), finite), where  # the same tokens masked
            # float32 against float64: at most 8 roundings (the bias, the penalty, the
            # count's product and subtraction, the presence's, and the three penalties
            # held in float32), each within u of a value no larger than this
            rep = params.repetition_penalty
            magnitude = ((np.abs(logits[i, j]) + max(map(abs, params.logit_bias.values()))) * max(rep, 1 / rep)
                         + abs(params.frequency_penalty) * len(output) + abs(params.presence_penalty))
            assert_within(got[i, j][finite], want[finite], (8 * U32 * magnitude)[finite], where)


def test_record_emitted_gives_the_rows_of_the_longer_output():
    rng = fresh_rng()
    vocab, slots = 30, 3
    seqs = [random_request(rng, vocab)[0] for _ in range(2)]
    slot_of = np.array([2, 0], np.int32)
    state = lp.write_rows(lp.zero_state(slots, vocab), jnp.asarray(slot_of), {
        k: jnp.asarray(v) for k, v in lp.state_rows(seqs, vocab).items()
    })
    tokens = rng.integers(0, vocab, size=(2, 3)).astype(np.int32)
    num_accepted = np.array([2, 0], np.int32)
    batch = types.SimpleNamespace(state_slot=jnp.asarray(slot_of), has_output=jnp.asarray([True, True]))
    state = lp.record_emitted(state, batch, jnp.asarray(tokens), jnp.asarray(num_accepted))
    for i, seq in enumerate(seqs):
        seq.output_token_ids = seq.output_token_ids + tokens[i, : num_accepted[i] + 1].tolist()
    want = lp.state_rows(seqs, vocab)
    for name in ("output_counts", "recent_tokens"):
        np.testing.assert_array_equal(np.asarray(getattr(state, name))[slot_of], want[name], err_msg=name)


# ----- the engine ---------------------------------------------------------------------

PROMPTS = [[1, 403, 407, 261], [1, 300, 301]]
CASES = {
    "penalties": dict(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.3),
    "negative-penalties": dict(repetition_penalty=0.8, frequency_penalty=-0.3),
    "bias-and-allowed": dict(logit_bias={395: 4.0, 317: -3.0}, allowed_token_ids=list(range(250, 512))),
    "min-tokens": dict(logit_bias={EOS: 100.0}, min_tokens=5),
}


@pytest.fixture(scope="module")
def plain():
    return LLM(STORIES, **ENGINE)


@pytest.fixture(scope="module")
def spec():
    return LLM(MTP_MODEL, num_speculative_tokens=2, **ENGINE)


@pytest.fixture(scope="module")
def hf_model():
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(STORIES, dtype="float32").eval()


def reference_greedy(hf_model, prompt, params: SamplingParams, stop_ids, bad_words=()) -> list[int]:
    import torch

    output: list[int] = []
    while len(output) < params.max_tokens:
        with torch.no_grad():
            logits = hf_model(torch.tensor([prompt + output])).logits[0, -1].numpy()
        token = int(np.argmax(reference_logits(logits, prompt, output, stop_ids, params, bad_words)))
        output.append(token)
        if token in stop_ids:
            break
    return output


@pytest.mark.parametrize("case", CASES)
def test_greedy_processing_matches_transformers_and_mtp_matches_plain(plain, spec, hf_model, case):
    params = SamplingParams(max_tokens=24, temperature=0.0, **CASES[case])
    stop = frozenset({EOS})
    want = [reference_greedy(hf_model, p, params, stop) for p in PROMPTS]
    got = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, params, use_tqdm=False)]
    assert got == want
    spec_out = spec.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in spec_out] == want
    if case == "penalties":  # the drafts were verified, not only proposed
        assert spec_out[0].spec_stats["accepted"] > 0
    if case == "min-tokens":
        assert all(len(w) == 6 and w[-1] == EOS for w in want)


def test_bad_words_are_never_completed(plain, spec, hf_model):
    tokenizer = plain.get_tokenizer()
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, bad_words=["there was", "girl"])
    words = bad_words_ids(tokenizer, params.bad_words)
    assert any(len(w) > 1 for w in words)
    prompt = tokenizer.encode("Once upon a time")
    want = reference_greedy(hf_model, prompt, params, frozenset(), words)
    unbanned = plain.generate([prompt], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert "there was" in unbanned[0].outputs[0].text  # the ban changes something
    for llm in (plain, spec):
        out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        assert out.token_ids == want
        assert "there was" not in out.text and "girl" not in out.text


def test_seeded_sampling_with_penalties_is_the_same_with_and_without_mtp(plain, spec):
    params = SamplingParams(max_tokens=40, temperature=1.0, seed=11, ignore_eos=True, repetition_penalty=1.2,
                            presence_penalty=0.5, logit_bias={295: 2.0}, bad_words=["the"])
    a = plain.generate(PROMPTS, params, use_tqdm=False)
    b = spec.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]


def test_a_processed_request_changes_nothing_for_its_neighbours(spec):
    plain_params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    alone = spec.generate(PROMPTS[:1], plain_params, use_tqdm=False)[0].outputs[0].token_ids
    mixed = spec.generate(PROMPTS, [plain_params, SamplingParams(max_tokens=20, repetition_penalty=2.0, seed=1)],
                          use_tqdm=False)
    assert mixed[0].outputs[0].token_ids == alone


def test_preempted_processed_request_resumes_with_its_counts(spec):
    """A processed request preempted mid-output is readmitted with its state rebuilt
    from its output so far, and continues as it would have."""
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, frequency_penalty=0.7, repetition_penalty=1.2)
    alone = spec.generate([PROMPTS[0]], params, use_tqdm=False)[0].outputs[0].token_ids
    engine = spec.engine
    held = engine.allocator.allocate(engine.allocator.num_pages - 26)
    try:
        before = engine.scheduler.num_preemptions
        # four requests at once: the batch shapes the other tests compiled (up to 4 requests)
        crowd = [[1, 300 + i] for i in range(3)]
        outs = spec.generate(crowd + [PROMPTS[0]], [SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)] * 3
                             + [params], use_tqdm=False)
        assert engine.scheduler.num_preemptions > before
        assert engine.requests == {}
    finally:
        engine.allocator.free(held)
    assert outs[-1].outputs[0].token_ids == alone


@pytest.mark.parametrize("engine", ["plain", "spec"])
def test_min_tokens_holds_the_stop_tokens_back_for_exactly_min_tokens(request, engine):
    """EOS biased to win everywhere: it is the (min_tokens + 1)-th token, not earlier or later."""
    llm = request.getfixturevalue(engine)
    params = [SamplingParams(max_tokens=12, temperature=0.0, logit_bias={EOS: 100.0}, min_tokens=m) for m in (0, 1, 4)]
    outs = llm.generate([PROMPTS[0]] * 3, params, use_tqdm=False)
    for m, out in zip((0, 1, 4), outs):
        tokens = out.outputs[0].token_ids
        assert out.outputs[0].finish_reason == "stop" and len(tokens) == m + 1 and tokens[-1] == EOS, (m, tokens)
        assert EOS not in tokens[:-1]


@pytest.mark.parametrize("engine", ["plain", "spec"])
def test_logit_bias_moves_only_allowed_tokens(request, engine):
    """allowed_token_ids masks first: a bias cannot bring back a disallowed token, and a
    bias among the allowed ones picks between them."""
    llm = request.getfixturevalue(engine)
    allowed = [5, 17, 403]
    params = [SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, allowed_token_ids=allowed, logit_bias=bias)
              for bias in ({17: 30.0, 300: 100.0}, {17: -100.0, 5: -100.0})]
    favoured, pushed_down = (o.outputs[0].token_ids for o in llm.generate([PROMPTS[1]] * 2, params, use_tqdm=False))
    assert favoured == [17] * 8
    assert pushed_down == [403] * 8


def test_text_options(plain):
    tokenizer = plain.get_tokenizer()
    prompt = tokenizer.encode("Once upon a time")
    ends = SamplingParams(max_tokens=10, temperature=0.0, logit_bias={EOS: 100.0}, min_tokens=3,
                          include_stop_str_in_output=True, skip_special_tokens=False)
    out = plain.generate([prompt], ends, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.text.endswith(tokenizer.decode([EOS], skip_special_tokens=False))
    stop = dict(max_tokens=30, temperature=0.0, stop=["girl"])
    cut = plain.generate([prompt], SamplingParams(**stop), use_tqdm=False)[0].outputs[0].text
    kept = plain.generate([prompt], SamplingParams(include_stop_str_in_output=True, **stop), use_tqdm=False)[0].outputs[0].text
    assert kept == cut + "girl"


@pytest.mark.parametrize("params, message", [
    (dict(logit_bias={VOCAB: 1.0}), "logit_bias has token ids out of vocabulary"),
    (dict(allowed_token_ids=[3, VOCAB + 5]), "allowed_token_ids has token ids out of vocabulary"),
    (dict(bad_words=[f"w{i}" for i in range(40)]), "bad_words: at most 32 token sequences"),
])
def test_requests_the_engine_cannot_process_are_refused(plain, params, message):
    with pytest.raises(ValueError, match=message):
        plain.generate(["Once upon a time"], SamplingParams(**params), use_tqdm=False)


@pytest.mark.parametrize("params, message", [
    (dict(presence_penalty=3.0), "presence_penalty must be in"),
    (dict(repetition_penalty=0.0), "repetition_penalty must be > 0"),
    (dict(logit_bias={5: 101.0}), "logit_bias must map"),
    (dict(min_tokens=20, max_tokens=10), "min_tokens must be"),
    (dict(bad_words=[""]), "bad_words must be"),
    (dict(allowed_token_ids=[]), "allowed_token_ids must be"),
])
def test_sampling_params_validation(params, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**params)

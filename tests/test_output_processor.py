"""OutputProcessor.append's usual case (tokens only a stop string can end: no per-token
checks) against its general per-token path, over random steps of 1..k+1 tokens: the
same tokens, text, logprobs, finish and stop reasons after every step."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import STORIES
from jaxmtp.engine.intake import RequestIntake
from jaxmtp.engine.outputs import EngineStats
from jaxmtp.engine.output_processor import OutputProcessor
from jaxmtp.engine.sampling_params import SamplingParams
from jaxmtp.loading.tokenizer import Tokenizer
from jaxmtp.worker.runner import StepResult

EOS = 2
PROMPT = [1, 403, 407]
NUM_TOP = 2  # top logprobs per row in the made-up step results


@pytest.fixture(scope="module")
def stories():
    return Tokenizer(STORIES)


def step_result(tokens: list[int], rng) -> StepResult:
    """One request's row of a step: its tokens and made-up logprobs."""
    n = len(tokens)
    return StepResult(
        tokens=np.array([tokens]), num_accepted=np.array([n - 1]), drafts=np.zeros((1, 0), np.int64),
        boundary_token=np.zeros(1, np.int64), logprobs=-rng.random((1, n)), ranks=rng.integers(1, 9, (1, n)),
        top_logprobs=-rng.random((1, n, NUM_TOP)), top_token_ids=rng.integers(3, 512, (1, n, NUM_TOP)),
        prompt_logprobs=None, prompt_ranks=None, prompt_top_logprobs=None, prompt_top_token_ids=None,
    )


def run(tokenizer, params: SamplingParams, steps: list[tuple[list[int], StepResult]], general: bool) -> list[tuple]:
    """The sequence's state after each step; general: the usual case turned off."""
    intake = RequestIntake(tokenizer, "tiny", 512, 4096, NUM_TOP, frozenset({EOS}), 0)
    (seq,) = intake.sequences("r", PROMPT, params, 0)
    processor = OutputProcessor(tokenizer, with_spec_stats=False, stats=EngineStats())
    if general:
        processor._only_text_can_end = lambda seq, tokens: False
    processor.start(seq)
    states = []
    for tokens, result in steps:
        finished = processor.append(seq, tokens, result, 0)
        states.append((finished, list(seq.output_token_ids), seq.text, seq.finish_reason, seq.stop_reason,
                       list(seq.output_logprobs), seq.cumulative_logprob, processor.stats.generation_tokens))
        if finished:
            break
    return states


def random_stream(rng, length: int) -> list[int]:
    """Ordinary tokens with runs of byte pieces (ids 3..258), some longer than the
    detokenizer holds back (MAX_HELD_TOKENS), and EOS now and then."""
    stream = []
    while len(stream) < length:
        kind = rng.integers(4)
        if kind == 0:
            stream += rng.integers(3, 259, rng.integers(1, 24)).tolist()  # a byte run, valid UTF-8 or not
        elif kind == 1 and rng.random() < 0.2:
            stream.append(EOS)
        else:
            stream += rng.integers(259, 512, rng.integers(1, 6)).tolist()
    return stream[:length]


@pytest.mark.parametrize("k", [0, 1, 3])
def test_usual_case_equals_the_general_path(stories, rng, k):
    """Stop strings taken from the output's own text (so that they match, mid-step or
    not, included or not, held back by min_tokens or not), stop tokens, max_tokens
    landing inside a step, logprobs: after every step both paths agree."""
    seed = rng.bit_generator.seed_seq.entropy
    for trial in range(40):
        stream = random_stream(rng, 80)
        text = stories.decode(PROMPT + [t for t in stream if t != EOS], True)[len(stories.decode(PROMPT, True)):]
        start = int(rng.integers(0, max(len(text) - 3, 1)))
        stop = [text[start : start + int(rng.integers(1, 4))]] if rng.random() < 0.7 and text else []
        max_tokens = int(rng.integers(1, 90))
        params = SamplingParams(
            max_tokens=max_tokens, temperature=0.0, stop=stop, ignore_eos=bool(rng.random() < 0.5),
            stop_token_ids=[int(rng.choice(stream))] if rng.random() < 0.3 else [],
            include_stop_str_in_output=bool(rng.random() < 0.5),
            min_tokens=int(rng.integers(0, min(20, max_tokens) + 1)) if rng.random() < 0.3 else 0,
            logprobs=NUM_TOP if rng.random() < 0.2 else None,
        )
        steps, at = [], 0
        while at < len(stream):
            n = int(rng.integers(1, k + 2))
            steps.append((stream[at : at + n], step_result(stream[at : at + n], rng)))
            at += n
        usual, general = run(stories, params, steps, False), run(stories, params, steps, True)
        assert usual == general, f"seed={seed} trial={trial} params={params}"

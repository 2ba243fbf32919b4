"""Incremental detokenisation and stop strings against full decodes and brute force.

The exact contract (jaxmtp/engine/detokenizer.py): "".join(pieces) + finish() equals
decode(P + O)[len(decode(P)):] when decode(P + O) starts with decode(P) and no more than
MAX_HELD_TOKENS tokens in a row leave the text unfinished. The random outputs here keep
byte-fallback runs at most 6 long, each closed by an ordinary token; the byte-level
tokenizer's trailing U+FFFD needs 17 high-byte tokens in a row to pass the bound
(probability < 1e-10 per test).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from conftest import STORIES
from jaxmtp.engine import detokenizer
from jaxmtp.engine.detokenizer import IncrementalDetokenizer
from jaxmtp.engine.stop_strings import StopStringMatcher
from jaxmtp.loading.tokenizer import Tokenizer

BPE_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MULTIBYTE = ["中", "日本語", "😀", "👍🏽", "é", "ñ", "ß", "Ω", "€", "🇫🇷", "한국어", "\u00a0"]


def seeded() -> tuple[int, np.random.Generator]:
    seed = int.from_bytes(os.urandom(4), "little")
    return seed, np.random.default_rng(seed)


def build_byte_level_bpe(folder: Path) -> Path:
    """A byte-level BPE tokenizer (GPT-2 style) trained on text with accents, CJK and emoji."""
    corpus = [
        "Once upon a time there was a little girl named Lily. She liked to play outside.",
        "Le café était très bon, ça va? Déjà vu, naïve, über, señor.",
        "中文文本 日本語のテキスト 한국어 텍스트 😀😀 👍🏽 🇫🇷 emoji time!",
        "def main():\n    return {\"key\": [1, 2, 3]}\n\n",
    ] * 20
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=520, special_tokens=BPE_SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(corpus, trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    return folder


@pytest.fixture(scope="module")
def stories() -> Tokenizer:
    return Tokenizer(STORIES)


@pytest.fixture(scope="module")
def bpe(tmp_path_factory) -> Tokenizer:
    return Tokenizer(build_byte_level_bpe(tmp_path_factory.mktemp("bpe")))


def full_text(tok: Tokenizer, prompt: list[int], output: list[int], skip: bool) -> str:
    """The reference: the full decode's text after the prompt's."""
    whole, head = tok.decode(prompt + output, skip), tok.decode(prompt, skip)
    assert whole.startswith(head), "the case breaks the contract's first condition"
    return whole[len(head) :]


def stream(tok: Tokenizer, prompt: list[int], output: list[int], skip: bool) -> list[str]:
    detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
    pieces = [detok.add(i) for i in output]
    pieces.append(detok.finish())
    assert detok.text == "".join(pieces)
    return pieces


def ordinary_ids(tok: Tokenizer) -> np.ndarray:
    vocab = tok.hf.get_vocab_size(with_added_tokens=True)
    return np.array([i for i in range(vocab) if i not in tok.special_token_ids and i not in tok.byte_piece_ids])


def random_output(tok: Tokenizer, rng: np.random.Generator, length: int) -> list[int]:
    """Ordinary tokens, special tokens, multi-byte text, and (byte-fallback tokenizers)
    runs of 1-6 random byte tokens closed by an ordinary token."""
    ordinary, specials = ordinary_ids(tok), sorted(tok.special_token_ids)
    byte_id = {int(tok.hf.id_to_token(i)[3:5], 16): i for i in tok.byte_piece_ids}
    out: list[int] = []
    while len(out) < length:
        kind = rng.integers(5)
        if kind == 0:
            out.append(int(rng.choice(specials)))
        elif kind == 1:
            out += tok.encode(str(rng.choice(MULTIBYTE)), add_special_tokens=False)
        elif kind == 2 and byte_id:
            out += [byte_id[int(b)] for b in rng.integers(256, size=rng.integers(1, 7))]
            out.append(int(rng.choice(ordinary)))
        else:
            out += [int(i) for i in rng.choice(ordinary, size=rng.integers(1, 4))]
    return out


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("name", ["stories", "bpe"])
def test_pieces_join_to_the_full_decode(name, skip, request):
    tok = request.getfixturevalue(name)
    seed, rng = seeded()
    specials = sorted(tok.special_token_ids)
    # tokens that are whole characters (a byte-level tokenizer also has lone bytes)
    whole = [i for i in ordinary_ids(tok) if "\ufffd" not in tok.decode([int(i)])]
    for case in range(40):
        prompt = random_output(tok, rng, int(rng.integers(0, 12)))
        # the prompt ends with a whole token, then maybe special tokens (a chat prompt's)
        prompt.append(int(rng.choice(whole)))
        prompt += [int(rng.choice(specials)) for _ in range(rng.integers(0, 3))]
        output = random_output(tok, rng, int(rng.integers(1, 60)))
        pieces = stream(tok, prompt, output, skip)
        expected = full_text(tok, prompt, output, skip)
        assert "".join(pieces) == expected, f"seed={seed} case={case} prompt={prompt} output={output}"


@pytest.mark.parametrize("name", ["stories", "bpe"])
def test_text_prompts_and_replies(name, request):
    """Prompts and replies as text encodes them: ASCII, accents, CJK, emoji; the first
    output token keeps its leading space."""
    tok = request.getfixturevalue(name)
    seed, rng = seeded()
    for case in range(20):
        words = rng.choice(["Once", "upon", "a", "time", "café", "中文", "😀", "naïve", "\n", "!"], size=12)
        cut = int(rng.integers(1, 11))
        prompt = tok.encode(" ".join(words[:cut]))
        output = tok.encode(" " + " ".join(words[cut:]), add_special_tokens=False)
        for skip in (True, False):
            got = "".join(stream(tok, prompt, output, skip))
            assert got == full_text(tok, prompt, output, skip), f"seed={seed} case={case} words={list(words)}"


def test_sentencepiece_leading_space(stories):
    time = stories.hf.token_to_id("▁time")
    assert stream(stories, stories.encode("Once upon a"), [time], True)[0] == " time"
    # after BOS alone the decoder strips the space, as the full decode of BOS + time does
    assert "".join(stream(stories, [1], [time], True)) == "time" == stories.decode([1, time], skip_special_tokens=True)
    assert "".join(stream(stories, [], [time, time], True)) == "time time" == stories.decode([time, time])


def test_byte_runs_held_until_closed(stories):
    """A byte-fallback run is held until it closes: a later invalid byte turns the whole
    run into U+FFFD (tokenizers' DecodeStream raises here), and a trailing U+FFFD is
    flushed by finish()."""
    e4, b8, ad, ff = (stories.hf.token_to_id(f"<0x{b:02X}>") for b in (0xE4, 0xB8, 0xAD, 0xFF))
    the = stories.hf.token_to_id("▁the")
    prompt = stories.encode("Once upon a")
    detok = IncrementalDetokenizer(stories, prompt)
    assert [detok.add(i) for i in (the, e4, b8, ad, ff)] == [" the", "", "", "", ""]
    assert detok.add(the) == "\ufffd" * 4 + " the"
    assert detok.add(ff) == "" and detok.finish() == "\ufffd"
    assert detok.text == full_text(stories, prompt, [the, e4, b8, ad, ff, the, ff], True)
    detok = IncrementalDetokenizer(stories, prompt)
    assert [detok.add(i) for i in (e4, b8, ad, the)] == ["", "", "", "中 the"]


def test_stop_token_is_not_decoded(stories):
    """The engine does not add a stop token id (EOS); finish() then flushes the held
    byte run the output ends with."""
    prompt = stories.encode("Once upon a")
    output = stories.encode("time 中", add_special_tokens=False)
    assert output[-3:] == [stories.hf.token_to_id(f"<0x{b:02X}>") for b in "中".encode()]
    detok = IncrementalDetokenizer(stories, prompt)
    assert "".join(detok.add(i) for i in output) == " time "
    assert detok.finish() == "中" and detok.text == " time 中" == full_text(stories, prompt, output, True)


def test_cost_per_token_is_bounded(stories):
    """Every decode call sees a bounded window, at most two calls per token, however
    long the output (work counted, not timed)."""
    seed, rng = seeded()
    calls: list[int] = []
    tok = Tokenizer(STORIES)
    decode = tok.decode
    tok.decode = lambda ids, skip_special_tokens=True: calls.append(len(ids)) or decode(ids, skip_special_tokens)
    output = random_output(tok, rng, 3000)
    detok = IncrementalDetokenizer(tok, tok.encode("Once upon a time"))
    per_token = []
    for i in output:
        before = len(calls)
        detok.add(i)
        per_token.append(len(calls) - before)
    bound = detokenizer.MAX_CONTEXT_TOKENS + detokenizer.MAX_HELD_TOKENS + 1
    assert max(calls) <= bound and max(per_token) <= 2, f"seed={seed}"
    assert detok.text + detok.finish() == full_text(stories, tok.encode("Once upon a time"), output, True), f"seed={seed}"


def test_long_unfinished_run_stays_bounded(stories):
    """Beyond MAX_HELD_TOKENS unfinished tokens (outside the exact contract) the text is
    emitted as it decodes then: no error, and the window stays bounded."""
    byte_ids = sorted(stories.byte_piece_ids)
    detok = IncrementalDetokenizer(stories, [1])
    pieces = [detok.add(byte_ids[0xFF]) for _ in range(5 * detokenizer.MAX_HELD_TOKENS)]
    assert sum(1 for p in pieces if p) >= 4 and len(detok._ids) <= detokenizer.MAX_HELD_TOKENS + 8
    assert set(detok.text) == {"\ufffd"}


# ----- stop strings -------------------------------------------------------------------------


def brute_force_match(text: str, stops: list[str]):
    found = [(text.find(s), i, s) for i, s in enumerate(stops) if s in text]
    return min(found)[::2] if found else None


def brute_force_holdback(text: str, stops: list[str]) -> int:
    return max([k for s in stops for k in range(1, len(s)) if k <= len(text) and s.startswith(text[len(text) - k :])], default=0)


def test_stop_strings_match_brute_force():
    seed, rng = seeded()
    for case in range(300):
        stops = ["".join(rng.choice(list("ab\n"), size=rng.integers(1, 5))) for _ in range(rng.integers(1, 4))]
        matcher = StopStringMatcher(stops)
        text = ""
        while len(text) < 40:
            piece = "".join(rng.choice(list("ab\nc"), size=rng.integers(0, 6)))
            match = matcher.feed(piece)
            text += piece
            expected = brute_force_match(text, stops)
            where = f"seed={seed} case={case} stops={stops!r} text={text!r}"
            if match is not None:
                assert (match.start, match.stop) == expected, where
                break
            assert expected is None, where
            assert matcher.holdback() == brute_force_holdback(text, stops), where


def test_stop_strings_refuse_empty():
    with pytest.raises(ValueError, match="non-empty"):
        StopStringMatcher(["ok", ""])
    assert StopStringMatcher([]).feed("anything") is None


def test_byte_piece_in_an_open_run_is_held_without_decoding(stories):
    """A byte piece leaves the window unfinished whatever it decodes to: within
    MAX_HELD_TOKENS it is held back without a decode call; the run's text comes once
    a token closes it (here an ASCII byte run, valid all along)."""
    calls: list[int] = []
    tok = Tokenizer(STORIES)
    decode = tok.decode
    tok.decode = lambda ids, skip_special_tokens=True: calls.append(len(ids)) or decode(ids, skip_special_tokens)
    detok = IncrementalDetokenizer(tok, [1])
    before = len(calls)
    byte_a = sorted(stories.byte_piece_ids)[ord("A")]
    pieces = [detok.add(byte_a) for _ in range(detokenizer.MAX_HELD_TOKENS)]
    assert pieces == [""] * detokenizer.MAX_HELD_TOKENS and len(calls) == before
    the = stories.encode(" the", add_special_tokens=False)[-1]
    run = [byte_a] * detokenizer.MAX_HELD_TOKENS
    assert detok.add(the) == full_text(stories, [1], run + [the], True) and detok.text.startswith("A" * len(run))

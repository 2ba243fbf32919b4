"""Incremental detokenisation: the text each generated token adds, at a cost per token
that does not grow with the output.

The text of output ids O after prompt ids P is the full decode's text after the
prompt's: decode(P + O)[len(decode(P)):]. `IncrementalDetokenizer` produces exactly that
text, piece by piece, by decoding only a short window of recent ids, provided that

- the output does not change the prompt's own text (decode(P + O) starts with
  decode(P)); only a prompt given as ids that ends inside a UTF-8 character or a
  run of byte-fallback tokens can break this, and
- no more than MAX_HELD_TOKENS tokens in a row leave the text unfinished (ending in
  U+FFFD, or inside an open run of byte-fallback tokens): beyond that the held text is
  emitted as it decodes then, so that the window stays bounded.

A piece is emitted only once no later token can change it. Two things can: a trailing
incomplete UTF-8 character (the text ends in U+FFFD until it completes), and a run of
byte-fallback tokens ("<0xE4>"): the ByteFallback decoder renders a run as UTF-8 only if
the whole run is valid, otherwise as one U+FFFD per byte, so a later byte can turn
earlier characters of the run into U+FFFD. Text from an open run is therefore held until
a token that is not a byte piece closes it.

tokenizers' own DecodeStream does not give this: it raises "Invalid prefix encountered"
when a byte-fallback run turns invalid, it holds text ending in U+FFFD without bound
(its window grows with it), and it cannot flush that text when the sequence ends, so the
final text would lack the U+FFFD the full decode has.
"""

from __future__ import annotations

from jaxmtp.loading.tokenizer import Tokenizer

# Longest run of unfinished tokens held back (see the module docstring); a UTF-8
# character spans at most 4 byte tokens, so this holds several characters of a run.
MAX_HELD_TOKENS = 16
# Longest context kept when the window's tail is all byte pieces or skipped tokens;
# each add() decodes at most MAX_CONTEXT_TOKENS + MAX_HELD_TOKENS + 1 ids (decoding
# costs about 1 us per id, so the window is cut back at every emission).
MAX_CONTEXT_TOKENS = 8


class IncrementalDetokenizer:
    """The text of one sequence's output, built token by token.

    add(token_id) returns the text that token adds ("" while it is held back); finish()
    returns the text still held when the sequence ends. "".join of every piece, finish()
    included, equals the full decode of the output after the prompt (see the module
    docstring for the exact condition). `text` is that cumulative text so far.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # tokens a context cannot start with: byte pieces, and special tokens the decoder skips
        skipped = tokenizer.special_token_ids if skip_special_tokens else frozenset()
        self._no_context_ids = tokenizer.byte_piece_ids | skipped
        # byte pieces the decoder sees: each leaves the window unfinished, whatever its text
        self._run_ids = tokenizer.byte_piece_ids - skipped
        # the window: `_ids[:_emitted_ids]` is context whose text was emitted (or is the
        # prompt's), and decodes to `_emitted_chars` characters; the rest is held
        context = list(prompt_ids[self._context_start(prompt_ids) :])
        self._ids = context
        self._emitted_ids = len(context)
        self._emitted_chars = len(self._decode(context))
        self._pieces: list[str] = []

    @property
    def text(self) -> str:
        """The output's text so far (joins the pieces: O(length), so read it once per
        output, not once per token)."""
        if len(self._pieces) > 1:
            self._pieces = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    def add(self, token_id: int) -> str:
        """The text token_id adds after the tokens before it, or "" while held back."""
        return self.add_all((token_id,))[0]

    def add_all(self, token_ids) -> list[str]:
        """add() of each token in turn: the piece each adds. One loop with its lookups
        bound once: the host runs it for every token a step emits."""
        ids, pieces, skip = self._ids, [], self.skip_special_tokens
        run_ids, no_context_ids = self._run_ids, self._no_context_ids
        decode, text_length = self._tokenizer.decode, self._tokenizer.token_text_length
        for token_id in token_ids:
            ids.append(token_id)
            if token_id in run_ids and len(ids) - self._emitted_ids <= MAX_HELD_TOKENS:
                pieces.append("")  # held (_unfinished is true of a window ending in one), no need to decode it
                continue
            window_text = decode(ids, skip_special_tokens=skip)
            if token_id not in no_context_ids and not window_text.endswith("\ufffd"):
                # the usual case, _emit's work inlined: the text is final, and the token alone
                # is the next context
                piece = window_text[self._emitted_chars :]
                if piece:
                    self._pieces.append(piece)
                del ids[:-1]
                self._emitted_ids = 1
                self._emitted_chars = text_length(token_id, skip)
            elif self._unfinished(ids, window_text) and len(ids) - self._emitted_ids <= MAX_HELD_TOKENS:
                piece = ""
            else:
                piece = self._emit(window_text)
            pieces.append(piece)
        return pieces

    def finish(self) -> str:
        """The text still held back, emitted because the sequence ended."""
        if len(self._ids) == self._emitted_ids:
            return ""
        return self._emit(self._decode(self._ids))

    def _emit(self, window_text: str) -> str:
        piece = window_text[self._emitted_chars :]
        if piece:
            self._pieces.append(piece)
        ids = self._ids
        del ids[: self._context_start(ids)]
        self._emitted_ids = len(ids)
        if len(ids) == 1:  # the usual context: one ordinary token
            self._emitted_chars = self._tokenizer.token_text_length(ids[0], self.skip_special_tokens)
        else:
            self._emitted_chars = len(self._decode(ids))
        return piece

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _skipped(self, token_id: int) -> bool:
        return self.skip_special_tokens and token_id in self._tokenizer.special_token_ids

    def _unfinished(self, ids: list[int], window_text: str) -> bool:
        """True if a later token may still change the window's text."""
        if window_text.endswith("\ufffd"):
            return True
        for token_id in reversed(ids):  # the last token the decoder sees
            if not self._skipped(token_id):
                return token_id in self._tokenizer.byte_piece_ids
        return False

    def _context_start(self, ids: list[int]) -> int:
        """Start of the shortest suffix of ids that decodes the text after it as the whole
        of ids would: it begins with a token the decoder sees that is not inside a
        byte-fallback run (so a SentencePiece decoder's stripped leading space and a run's
        validity are the same in both)."""
        start = len(ids) - 1
        while start > 0 and len(ids) - start < MAX_CONTEXT_TOKENS:
            if ids[start] not in self._no_context_ids:
                break
            start -= 1
        return max(start, 0)

"""Placeholder with the interface of the incremental detokenizer (replaced on merge)."""

from __future__ import annotations


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.prompt_ids = list(prompt_ids)
        self.ids: list[int] = []
        self.skip_special_tokens = skip_special_tokens
        self.text = ""

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        text = self.tokenizer.decode_continuation(self.prompt_ids, self.ids, skip_special_tokens=self.skip_special_tokens)
        new, self.text = text[len(self.text):], text
        return new


def find_stop(text: str, new_from: int, stops: list[str]) -> tuple[int, str] | None:
    longest = max((len(s) for s in stops), default=0)
    window = max(0, new_from - longest + 1)
    for stop in stops:
        at = text.find(stop, window)
        if at >= 0:
            return at, stop
    return None

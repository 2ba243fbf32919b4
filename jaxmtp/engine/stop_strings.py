"""Stop strings found in a growing text, looking only at the new text and the few
characters before it that a match ending in the new text can start in."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class StopMatch:
    start: int  # where the stop string begins in the cumulative text
    stop: str


class StopStringMatcher:
    """One per sequence: feed() it each piece of text as it is generated.

    The cost of a feed is O(len(piece) + the stop strings' lengths), whatever the
    length of the text before it, since it keeps only the last (longest stop - 1)
    characters.
    """

    def __init__(self, stops: Sequence[str]):
        if any(not isinstance(stop, str) or not stop for stop in stops):
            raise ValueError("stop strings must be non-empty strings")
        self.stops = tuple(stops)
        self._window = max(map(len, self.stops), default=1) - 1
        # the stops' proper prefixes, matched at the end of the text: the leftmost match is
        # the longest suffix that begins a stop string (one search in C, not a slice per length)
        prefixes = sorted({stop[:k] for stop in self.stops for k in range(1, len(stop))})
        self._open_prefix = re.compile("(?:" + "|".join(map(re.escape, prefixes)) + r")\Z") if prefixes else None
        self._last_chars = frozenset(stop[-1] for stop in self.stops)  # a match ending in a piece ends in one
        self._tail = ""  # the text's last `_window` characters
        self._length = 0  # characters fed so far

    def feed(self, piece: str) -> StopMatch | None:
        """The earliest stop string that ends inside piece (at the lowest start in the
        text; at equal starts, the first in `stops`), or None. Before piece the text held
        no stop string, as earlier feeds found none."""
        match = self.find(piece)
        self.advance(piece)
        return match

    def find(self, piece: str) -> StopMatch | None:
        """What feed(piece) returns, without feeding piece."""
        if self._last_chars.isdisjoint(piece):  # (the usual case: no stop string can end in it)
            return None
        searched = self._tail + piece
        best: tuple[int, str] | None = None
        for stop in self.stops:
            at = searched.find(stop, max(0, len(self._tail) - len(stop) + 1))
            if at >= 0 and (best is None or at < best[0]):
                best = (at, stop)
        return None if best is None else StopMatch(self._length - len(self._tail) + best[0], best[1])

    def advance(self, piece: str) -> None:
        """Take piece into the text without looking for stop strings in it (find found
        none: a piece made of several pieces goes in at once)."""
        self._length += len(piece)
        if self._window:
            self._tail = (self._tail + piece)[-self._window :]

    def holdback(self) -> int:
        """How many trailing characters of the text fed so far a stop string may still
        cut: the longest suffix that begins some stop string. A stream holds these back
        until later text decides."""
        match = self._open_prefix.search(self._tail) if self._open_prefix else None
        return 0 if match is None else len(self._tail) - match.start()

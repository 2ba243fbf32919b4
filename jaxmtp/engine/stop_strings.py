"""Stop strings found in a growing text, looking only at the new text and the few
characters before it that a match ending in the new text can start in."""

from __future__ import annotations

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
        self._proper_prefixes = frozenset(stop[:k] for stop in self.stops for k in range(1, len(stop)))
        self._last_chars = frozenset(stop[-1] for stop in self.stops)  # a match ending in a piece ends in one
        self._tail = ""  # the text's last `_window` characters
        self._length = 0  # characters fed so far

    def feed(self, piece: str) -> StopMatch | None:
        """The earliest stop string that ends inside piece (at the lowest start in the
        text; at equal starts, the first in `stops`), or None. Before piece the text held
        no stop string, as earlier feeds found none."""
        searched = self._tail + piece
        best: tuple[int, str] | None = None
        for stop in self.stops if not self._last_chars.isdisjoint(piece) else ():
            at = searched.find(stop, max(0, len(self._tail) - len(stop) + 1))
            if at >= 0 and (best is None or at < best[0]):
                best = (at, stop)
        offset = self._length - len(self._tail)
        self._length += len(piece)
        self._tail = searched[max(0, len(searched) - self._window) :] if self._window else ""
        return None if best is None else StopMatch(offset + best[0], best[1])

    def holdback(self) -> int:
        """How many trailing characters of the text fed so far a stop string may still
        cut: the longest suffix that begins some stop string. A stream holds these back
        until later text decides."""
        tail = self._tail
        for k in range(min(self._window, len(tail)), 0, -1):
            if tail[len(tail) - k :] in self._proper_prefixes:
                return k
        return 0

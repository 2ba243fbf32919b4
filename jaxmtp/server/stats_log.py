"""The periodic stats line the server logs while it serves, as vLLM's: prompt and
generation throughput over the last interval, running and waiting requests, KV cache
usage, prefix cache hit rate and, with MTP, the mean acceptance length (1 + accepted /
drafts) of the interval's verify steps."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time

log = logging.getLogger("jaxmtp.server")


@dataclasses.dataclass(frozen=True)
class Totals:
    """The engine's counters at one moment."""

    time: float
    prompt_tokens: int
    generation_tokens: int
    drafts: int
    accepted: int

    @classmethod
    def of(cls, engine) -> Totals:
        stats = engine.stats
        return cls(time.monotonic(), stats.prompt_tokens, stats.generation_tokens, stats.spec.num_steps,
                   stats.spec.accepted)


class StatsLogger:
    def __init__(self, engine, interval: float):
        self.engine = engine
        self.interval = interval
        self.last = Totals.of(engine)
        self.was_busy = False

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                self.log()
            except Exception:  # noqa: BLE001 - a line it could not make must not end the next ones
                log.exception("could not log the stats line")

    def log(self) -> None:
        """One line: at INFO while there is work (or was, the interval before), else at
        DEBUG, so that an idle server's log stays quiet."""
        engine, now = self.engine, Totals.of(self.engine)
        seconds = max(now.time - self.last.time, 1e-9)
        prompt_rate = (now.prompt_tokens - self.last.prompt_tokens) / seconds
        generation_rate = (now.generation_tokens - self.last.generation_tokens) / seconds
        running, waiting = engine.num_running, engine.num_waiting
        busy = bool(prompt_rate or generation_rate or running or waiting)
        pages = engine.allocator.num_pages
        line = (
            f"Avg prompt throughput: {prompt_rate:.1f} tokens/s, Avg generation throughput: {generation_rate:.1f} "
            f"tokens/s, Running: {running} reqs, Waiting: {waiting} reqs, "
            f"KV cache usage: {100 * (pages - engine.allocator.num_free) / pages:.1f}%, "
            f"Prefix cache hit rate: {100 * engine.stats.prefix_cache.hit_rate:.1f}%"
        )
        if engine.config.num_speculative_tokens:
            drafts = now.drafts - self.last.drafts
            length = f"{1 + (now.accepted - self.last.accepted) / drafts:.2f}" if drafts else "-"
            line += f", Mean acceptance length: {length}"
        log.log(logging.INFO if busy or self.was_busy else logging.DEBUG, line)
        self.last, self.was_busy = now, busy

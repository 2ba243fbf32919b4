"""The timing loops the benchmarks share."""

from __future__ import annotations

import time

import numpy as np


def median_time(program, *args, warmup: int = 2, runs: int = 7) -> float:
    """Median wall seconds of program(*args) until its outputs are ready, after warm-up
    calls (which also compile)."""
    import jax

    for _ in range(warmup):
        jax.block_until_ready(program(*args))
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        jax.block_until_ready(program(*args))
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def replay_time(step, repeats: int, warmup: int = 3) -> float:
    """Seconds per call of step(), the timed calls queued back to back with one wait at
    the end: the device time of a replayed program, without host waits between calls.
    step runs the program once, keeping the state it carries (a donated cache), and
    returns an output to wait on."""
    import jax

    for _ in range(warmup):
        jax.block_until_ready(step())
    t0 = time.perf_counter()
    for _ in range(repeats):
        out = step()
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / repeats

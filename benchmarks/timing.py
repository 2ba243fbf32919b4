"""The one timing loop the benchmarks share."""

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

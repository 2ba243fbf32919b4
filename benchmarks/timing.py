"""The timing loops the benchmarks share."""

from __future__ import annotations

import collections
import contextlib
import time

import numpy as np


def add_dense_tilings_option(parser) -> None:
    """--dense-tilings measured|none: the ablation of the dense kernel's table."""
    parser.add_argument("--dense-tilings", choices=("measured", "none"), default="measured",
                        help="none: XLA's dot for every dense weight, the ablation of the dense kernel's table")


def apply_dense_tilings(choice: str) -> None:
    """With "none", empty the dense kernel's table so that every dense weight runs XLA's
    dot; the table is read as each step is traced, so call this before any engine."""
    if choice == "none":
        from jaxmtp.kernels import fp8_matmul

        fp8_matmul.DENSE_TILINGS.clear()


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


@contextlib.contextmanager
def runner_phases(engine):
    """Seconds spent while the block runs: "whole", and within it "_run" and "_finish"
    (ModelRunner._run and _finish: the compiled calls' dispatch, a masked step's second
    program in _finish; the device runs behind them) and "read" (ModelRunner.read, the
    read-back, mostly waiting for the device). The rest is the host's own work."""
    runner, spent = engine.runner, collections.Counter()

    def timed(name: str):
        method = getattr(runner, name)

        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                spent[name] += time.perf_counter() - start

        setattr(runner, name, wrapper)  # an instance attribute over the method; deleted below

    for name in ("_run", "_finish", "read"):
        timed(name)
    start = time.perf_counter()
    try:
        yield spent
    finally:
        spent["whole"] = time.perf_counter() - start
        for name in ("_run", "_finish", "read"):
            delattr(runner, name)


def compiled_calls(spent) -> float:
    """The seconds of runner_phases' spent in the compiled calls' dispatch."""
    return spent["_run"] + spent["_finish"]


def host_work(spent) -> float:
    """The seconds of runner_phases' spent in the host's own work: neither the compiled
    calls' dispatch nor the read-back."""
    return spent["whole"] - compiled_calls(spent) - spent["read"]

"""StepPrograms: the compiled step, one executable per batch shape, and the compiling
of shapes in the background while the engine already serves.

A step runs only on a program compiled ahead of time. While a shape waits its turn in
the background, and after a warm-up for a shape it left out, its batches run on the
smallest compiled shape that holds them (more padding, the same tokens), so a request
never waits on a compile and nothing compiles inside a step. In an engine that was not
warmed up (the offline API's) a shape is compiled when first needed."""

from __future__ import annotations

import atexit
import concurrent.futures
import logging
import threading
import time
from typing import Callable

import jax
from tqdm import tqdm

from jaxmtp.worker.batch import BatchShape

log = logging.getLogger("jaxmtp.worker.programs")

_compile_events = {"count": 0}


def _on_compile(event: str, duration: float, **kwargs) -> None:
    if event == "/jax/core/compile/backend_compile_duration":
        _compile_events["count"] += 1


def _on_cache_hit(event: str, **kwargs) -> None:
    if event == "/jax/compilation_cache/cache_hits":
        _compile_events["count"] += 1


jax.monitoring.register_event_duration_secs_listener(_on_compile)
jax.monitoring.register_event_listener(_on_cache_hit)


def num_compiles() -> int:
    """Programs XLA built in this process so far (all functions): compiled, or loaded
    from the persistent compilation cache, which stalls a step as well."""
    return _compile_events["count"]


def use_persistent_cache(path: str) -> None:
    """JAX's persistent compilation cache in `path`, for every program, also those that
    compile in under JAX's default second (most, on a CPU), so that a warm start loads
    them all."""
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)


def run_cost(shape: BatchShape) -> tuple:
    """Orders the shapes that hold a batch: fewest rows, then requests, then table
    width; the greedy program (no sampling) before the general one, a decode-only one
    (no MLA prefill call) before one that takes prefill rows."""
    return shape.num_tokens, shape.num_seqs, shape.pages_per_seq, not shape.greedy, not shape.decode_only


class StepPrograms:
    """lower(shape) -> tuple of jax.stages.Lowered: the programs of a full BatchShape's
    step, in the order they run (ModelRunner.lower_programs); program(shape) gives them
    compiled."""

    def __init__(self, lower: Callable):
        self._lower = lower
        self._compiled: dict[BatchShape, object] = {}
        # shapes whose batches run on a larger compiled shape: waiting for the background
        # compilation, or whose compiling failed there (logged) or was stopped
        self._deferred: set[BatchShape] = set()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.warmed_up = False  # set by warm-up: from then on a batch runs on a compiled holder if there is one
        self.num_compiled_on_demand = 0  # compiled inside a step, because nothing else held its batch

    @property
    def num_left(self) -> int:
        """Shapes the background compilation has not compiled (yet)."""
        return len(self._deferred)

    @property
    def compiling(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def compile(self, shape: BatchShape) -> tuple:
        program = tuple(lowered.compile() for lowered in self._lower(shape))
        with self._lock:
            self._compiled[shape] = program
            self._deferred.discard(shape)
        return program

    def compiled(self, shape: BatchShape) -> bool:
        return shape in self._compiled

    def shape_to_run(self, shape: BatchShape) -> BatchShape:
        """The compiled shape a batch of `shape` runs on: itself, or (while it is
        deferred, and for any shape after a warm-up) the smallest compiled shape that
        holds it; itself when none does."""
        if shape in self._compiled or (shape not in self._deferred and not self.warmed_up):
            return shape
        with self._lock:
            holders = [have for have in self._compiled if have.holds(shape)]
        return min(holders, key=run_cost, default=shape)

    def program(self, shape: BatchShape) -> tuple:
        """The executables of a shape shape_to_run chose; compiled now if they are not yet."""
        program = self._compiled.get(shape)
        if program is None:
            self.num_compiled_on_demand += 1
            program = self.compile(shape)
        return program

    def compile_all(self, shapes: list[BatchShape], num_threads: int = 1, background: bool = False) -> None:
        """Compile the shapes not compiled yet, in this order, num_threads at a time,
        with a progress bar of the shapes left; background: on a thread of its own,
        returning at once (the shapes are deferred until compiled)."""
        todo = [shape for shape in dict.fromkeys(shapes) if shape not in self._compiled]
        if not background:
            self._compile_each(todo, num_threads, background=False)
            return
        if self.compiling:
            raise RuntimeError("a background compilation is already running")
        with self._lock:
            self._deferred.update(todo)
        self._stopping = False
        self._thread = threading.Thread(target=self._compile_each, args=(todo, num_threads, True), name="compile", daemon=True)
        self._thread.start()
        atexit.register(self.stop)  # an interpreter exiting mid-compile must not tear XLA down under it

    def _compile_each(self, shapes: list[BatchShape], num_threads: int, background: bool) -> None:
        start = time.monotonic()
        with tqdm(total=len(shapes), desc="compiling the step", unit="shape", disable=not shapes) as bar:

            def one(shape: BatchShape) -> None:
                if self._stopping:
                    return
                if shape not in self._compiled:
                    try:
                        self.compile(shape)
                    except Exception:  # noqa: BLE001 - its batches keep running on a larger shape
                        if not background:
                            raise
                        log.exception("compiling the step for %s failed; its batches run on a larger shape", shape)
                bar.update(1)

            with concurrent.futures.ThreadPoolExecutor(max(1, num_threads)) as pool:
                list(pool.map(one, shapes))
        if shapes and not self._stopping:
            log.info("compiled the step for %d batch shape(s) in %.1f s", len(shapes), time.monotonic() - start)

    def wait(self) -> None:
        """Until the background compilation has finished."""
        if self._thread is not None:
            self._thread.join()

    def stop(self, wait: bool = True) -> None:
        """Compile nothing more in the background; wait: until the shapes being compiled
        finish (XLA cannot cancel a compile)."""
        self._stopping = True
        if wait:
            self.wait()

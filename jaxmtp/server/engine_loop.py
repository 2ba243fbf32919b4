"""The engine thread: steps the engine for every request the server holds (continuous
batching) and hands each step's outputs to the asyncio loop, so the loop never waits on
a device step."""

from __future__ import annotations

import asyncio
import logging
import threading

from jaxmtp.engine.outputs import RequestOutput
from jaxmtp.engine.sampling_params import SamplingParams
from jaxmtp.server.metrics import Metrics
from jaxmtp.server.protocol import APIError

log = logging.getLogger("jaxmtp.server")


class EngineLoop:
    """Steps the engine on its own thread and hands the outputs to the asyncio loop,
    which puts them on the queue of their engine request. Only the asyncio loop's thread
    touches the queues."""

    def __init__(self, engine, metrics: Metrics):
        self.engine = engine
        self.metrics = metrics
        self._queues: dict[str, asyncio.Queue] = {}
        self._wake = threading.Event()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread.start()

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        self._thread.join()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def add(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams, queue: asyncio.Queue,
        cache_salt: str | None = None, arrival_time: float | None = None,
    ) -> None:
        self.engine.add_request(request_id, prompt_ids, params, cache_salt=cache_salt, arrival_time=arrival_time)
        self._queues[request_id] = queue
        self._wake.set()

    def abort(self, request_id: str) -> None:
        """Stop an unfinished request; its pages are freed at the start of the next step."""
        if self._queues.pop(request_id, None) is not None:
            self.engine.abort_request(request_id)
            self._wake.set()

    def _run(self) -> None:
        while not self._stopping:
            self._wake.wait()
            self._wake.clear()  # anything added before this is seen by the check below
            while self.engine.has_unfinished_requests() and not self._stopping:
                self._step()

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception:
            # The loop must outlive a failed step: fail what is in flight, keep serving.
            log.exception("engine step failed; failing the requests in flight")
            for request_id in list(self.engine.requests):
                self.engine.abort_request(request_id)  # before the next step can fail on them again
            self._loop.call_soon_threadsafe(self._fail_all)
            return
        self.metrics.observe_step()
        for out in outputs:
            if out.finished:
                self.metrics.observe_finished(out)
        if outputs:
            self._loop.call_soon_threadsafe(self._deliver, outputs)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            queue = self._queues.get(out.request_id)
            if queue is None:  # aborted: nobody is listening
                continue
            if out.finished:
                del self._queues[out.request_id]
            queue.put_nowait(out)

    def _fail_all(self) -> None:
        # every request still listening, also one the failed step finished but never reported
        for request_id, queue in self._queues.items():
            self.engine.abort_request(request_id)
            queue.put_nowait(APIError(500, "the engine step failed (see the server log)"))
        self._queues.clear()
        self._wake.set()

"""The generation worker behind the server: one model, one request at a time, a bounded FIFO queue.

Requests are :class:`Job` objects. The worker thread takes them in arrival order and streams each one's text
deltas back to the event loop that submitted it. A job is skipped if it was cancelled (client gone) or timed out
while queued; a running job stops at the next decoding step after cancellation or its deadline. The drafter's
per-generation state (the context database…) is reset by ``Drafter.begin`` at the start of every job, so nothing
leaks between requests.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from hierspec.config import GenerationConfig
from hierspec.decode import GenerationResult, SpeculativeDecoder
from hierspec.errors import HierspecError

log = logging.getLogger(__name__)

_END = object()


class QueueFull(HierspecError):
    """The request queue is full (the server answers 429)."""


@dataclass
class Job:
    """One generation request travelling through the queue.

    ``events`` receives, on the submitting event loop, text deltas (``str``), then the :class:`GenerationResult`
    or an exception, then an end marker.
    """

    prompt_ids: list[int]
    config: GenerationConfig
    deadline: float
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    enqueued: float = field(default_factory=time.monotonic)
    started: float | None = None

    def cancel(self) -> None:
        """Stop the job (before it starts, or at its next decoding step)."""
        self.cancelled.set()

    def _emit(self, item) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, item)

    async def items(self):
        """Deltas, then the result (or an exception); ends after the end marker."""
        while True:
            item = await self.events.get()
            if item is _END:
                return
            yield item


class RequestTimeout(HierspecError):
    """A request ran past its deadline (queued or generating)."""


class Engine:
    """Owns the decoder and the worker thread."""

    def __init__(self, decoder: SpeculativeDecoder, max_queue: int = 64, timeout_s: float = 300.0,
                 on_finish: Callable[[Job, GenerationResult | None], None] | None = None) -> None:
        self.decoder = decoder
        self.timeout_s = timeout_s
        self._queue: queue.Queue[Job | None] = queue.Queue(maxsize=max_queue)
        self._on_finish = on_finish
        self._thread = threading.Thread(target=self._work, name="hierspec-worker", daemon=True)
        self._thread.start()
        self.busy = False

    @property
    def queue_length(self) -> int:
        """Requests waiting (not counting the one generating)."""
        return self._queue.qsize()

    def submit(self, prompt_ids: list[int], config: GenerationConfig) -> Job:
        """Queue a request from the event loop; raises :class:`QueueFull` when no slot is left."""
        job = Job(prompt_ids, config, time.monotonic() + self.timeout_s, asyncio.get_running_loop())
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            raise QueueFull(f"the server is busy: {self._queue.maxsize} requests are already waiting") from None
        return job

    def close(self) -> None:
        """Stop the worker after the current job."""
        self._queue.put(None)
        self._thread.join(timeout=10)

    def _work(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            result = None
            try:
                if job.cancelled.is_set():
                    continue
                if time.monotonic() > job.deadline:
                    job._emit(RequestTimeout("the request timed out while queued"))
                    continue
                self.busy = True
                job.started = time.monotonic()
                result = self._generate(job)
                if result is not None:
                    job._emit(result)
            except Exception as exc:  # reported to the request, never kills the worker
                log.exception("generation failed")
                job._emit(exc)
            finally:
                self.busy = False
                job._emit(_END)
                if self._on_finish is not None:
                    self._on_finish(job, result)

    def _generate(self, job: Job) -> GenerationResult | None:
        stream = self.decoder.stream(job.prompt_ids, job.config)
        iterator = iter(stream)
        for delta in iterator:
            job._emit(delta)
            if job.cancelled.is_set():
                iterator.close()
                return None
            if time.monotonic() > job.deadline:
                iterator.close()
                job._emit(RequestTimeout("the request timed out while generating"))
                return None
        return stream.result

"""The generation worker behind the server: one model, many requests batched together, a bounded FIFO queue.

Requests are :class:`Job` objects. The worker thread takes them in arrival order into a
:class:`~hierspec.batching.BatchScheduler` (continuous batching: up to ``max_batch`` generations verified in one
forward per step, each exactly as it would be alone) and streams each one's text deltas back to the event loop that
submitted it. A job is skipped if it was cancelled (client gone) or timed out while queued; a running job leaves the
batch at the next step after cancellation or its deadline, and the others go on unchanged. Every generation starts
with ``Drafter.begin`` on its own drafter, so nothing of one request's context leaks into another's.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from hierspec.batching import BatchScheduler, Request
from hierspec.config import GenerationConfig
from hierspec.decode import GenerationResult
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
    request: Request | None = None

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
    """Owns the batch scheduler and the worker thread that steps it."""

    def __init__(self, scheduler: BatchScheduler, max_queue: int = 64, timeout_s: float = 300.0,
                 on_finish: Callable[[Job, GenerationResult | None], None] | None = None) -> None:
        self.scheduler = scheduler
        self.timeout_s = timeout_s
        #: a drafter of the method, built before the worker starts, for health checks (it serves requests too)
        self.drafter = scheduler.probe_drafter()
        self._queue: queue.Queue[Job | None] = queue.Queue(maxsize=max_queue)
        self._on_finish = on_finish
        self._jobs: dict[int, Job] = {}  # running requests' jobs by request id
        self._closing = False
        self.busy = False
        self._thread = threading.Thread(target=self._work, name="hierspec-worker", daemon=True)
        self._thread.start()

    @property
    def queue_length(self) -> int:
        """Requests waiting (not counting those generating)."""
        return self._queue.qsize() + self.scheduler.waiting

    @property
    def running(self) -> int:
        """Requests generating in the batch."""
        return self.scheduler.running

    def submit(self, prompt_ids: list[int], config: GenerationConfig) -> Job:
        """Queue a request from the event loop; raises :class:`QueueFull` when no slot is left."""
        job = Job(prompt_ids, config, time.monotonic() + self.timeout_s, asyncio.get_running_loop())
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            raise QueueFull(f"the server is busy: {self._queue.maxsize} requests are already waiting") from None
        return job

    def close(self) -> None:
        """Stop the worker after the current step (requests still running are cancelled)."""
        self._queue.put(None)
        self._thread.join(timeout=10)

    def _work(self) -> None:
        while not (self._closing and self.scheduler.idle):
            self._take_jobs(block=self.scheduler.idle)
            self._drop_stopped_jobs()
            if self._closing:
                for job in list(self._jobs.values()):
                    job.cancel()
                self._drop_stopped_jobs()
                continue
            if self.scheduler.idle:
                continue
            self.busy = True
            try:
                touched = self.scheduler.step()
            except Exception as exc:  # reported to the requests, never kills the worker
                log.exception("a batch step failed")
                touched = []
                for job in list(self._jobs.values()):
                    self._stop(job, exc)
            finally:
                self.busy = not self.scheduler.idle
            for request in touched:
                self._report(request)

    def _take_jobs(self, block: bool) -> None:
        """Move queued jobs into the scheduler (waiting for one when nothing runs)."""
        while True:
            try:
                job = self._queue.get(block=block, timeout=None if block else 0)
            except queue.Empty:
                return
            block = False
            if job is None:
                self._closing = True
                return
            if job.cancelled.is_set():
                self._end(job, None)
                continue
            if time.monotonic() > job.deadline:
                self._end(job, RequestTimeout("the request timed out while queued"))
                continue
            try:
                job.request = self.scheduler.submit(job.prompt_ids, job.config)
            except Exception as exc:
                self._end(job, exc)
                continue
            self._jobs[job.request.id] = job

    def _drop_stopped_jobs(self) -> None:
        """Cancelled or timed-out jobs leave the batch (or the scheduler's queue) before the next step."""
        now = time.monotonic()
        for job in list(self._jobs.values()):
            if job.cancelled.is_set():
                self._stop(job, None)
            elif now > job.deadline:
                phase = "generating" if job.request.admitted_at is not None else "queued"
                self._stop(job, RequestTimeout(f"the request timed out while {phase}"))

    def _stop(self, job: Job, error: BaseException | None) -> None:
        """Take a submitted job's request out of the scheduler (it generates no further) and end the job."""
        self.scheduler.cancel(job.request)
        self._end(job, error)

    def _report(self, request: Request) -> None:
        job = self._jobs.get(request.id)
        if job is None:
            return
        if job.started is None and request.admitted_at is not None:
            job.started = time.monotonic() - (time.perf_counter() - request.admitted_at)
        for delta in request.take_text():
            job._emit(delta)
        if request.result is not None:
            job._emit(request.result)
            self._end(job, None, request.result)
        elif request.error is not None:
            self._end(job, request.error)

    def _end(self, job: Job, error: BaseException | None, result: GenerationResult | None = None) -> None:
        if job.request is not None:
            self._jobs.pop(job.request.id, None)
        if error is not None:
            job._emit(error)
        job._emit(_END)
        if self._on_finish is not None:
            self._on_finish(job, result)

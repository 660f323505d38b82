"""Continuous batching of speculative requests: many generations verified in one forward per step.

On a CPU (or a GPU) a forward's cost is mostly the weights streaming through the cores, once per forward whatever
the row count up to a few dozen rows. :class:`BatchScheduler` runs up to ``max_batch`` generations together: each
step every running generation drafts its own tree (possibly empty), one forward of the target verifies all of them
(:meth:`~hierspec.target.TargetModel.forward_trees`: every product over all rows, attention per generation on its
own KV cache), and each generation accepts from its own rows. Requests join between steps (their prompt is
prefilled alone when they are admitted) and leave as soon as they finish or are cancelled.

Lossless per request: a generation is the very :class:`~hierspec.decode.Generation` that decoding alone runs, with
its own drafter, random generator, stop strings and sampling settings, and the batched forward gives each row the
same logits as verifying its tree alone — so a greedy request's tokens, and a seeded sampled request's, are the ones
it gets alone, whatever else is in the batch (``tests/test_batching.py``).

Tree sizes are chosen together: before drafting, each generation's drafter learns what the others verify in the
same forward (:meth:`~hierspec.drafters.Drafter.share_forward`: their rows and expected tokens, from the last step),
and cost-aware drafters then size their tree for the most tokens per millisecond *of the whole batch* — a full batch
drafts less per request, a lone request as it would alone. ``max_rows`` also caps a step's rows.

Drafters are stateful per generation; finished requests hand theirs (and their KV cache) to the next request, so
a server builds at most ``max_batch`` of each. Stores are shared read-only by the drafters the method builds
(:class:`~hierspec.methods.DrafterContext` opens each once).
"""

from __future__ import annotations

import collections
import itertools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from hierspec.config import GenerationConfig
from hierspec.decode import Generation, GenerationResult, GenerationStats
from hierspec.drafters.base import Drafter
from hierspec.errors import InputError
from hierspec.target import TargetModel
from hierspec.text import TextAssembler, make_detokenizer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BatchConfig:
    """How many generations run together.

    Attributes:
        max_batch: generations verified in one forward; more wait in arrival order.
        max_rows: tree rows (roots included) of one forward, all generations together: each running generation may
            draft up to ``max_rows // running - 1`` tokens per step (and its own ``max_draft_tokens``).
        max_kv_tokens: KV-cache entries the running generations may reserve together (each reserves its prompt,
            its ``max_new_tokens`` and one tree); a request that would pass it waits — unless nothing runs.
    """

    max_batch: int = 8
    max_rows: int = 64
    max_kv_tokens: int = 1 << 16

    def __post_init__(self) -> None:
        for name in ("max_batch", "max_rows", "max_kv_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InputError(f"{name} must be a positive integer, got {value!r}")


@dataclass(eq=False)
class Request:
    """One request's course through the scheduler.

    After each :meth:`BatchScheduler.step`, :meth:`take_text` returns the text released since the last call;
    :attr:`result` is set once the request is finished (``finish_reason`` ``"eos"``, ``"stop"``, ``"length"``) or
    :attr:`error` once it failed. A cancelled request ends with neither.
    """

    id: int
    prompt_ids: list[int]
    config: GenerationConfig
    submitted: float = field(default_factory=time.perf_counter)
    admitted_at: float | None = None
    first_token_at: float | None = None
    result: GenerationResult | None = None
    error: BaseException | None = None
    cancelled: bool = False
    _pending: list[str] = field(default_factory=list)
    _generation: Generation | None = None
    _assembler: TextAssembler | None = None
    _drafter: Drafter | None = None

    @property
    def finished(self) -> bool:
        """Whether the request is over (a result, an error or a cancellation)."""
        return self.result is not None or self.error is not None or self.cancelled

    @property
    def reserved_tokens(self) -> int:
        """KV-cache entries the request may need: prompt, new tokens and one tree."""
        return len(self.prompt_ids) + self.config.max_new_tokens + self.config.max_draft_tokens + 1

    def take_text(self) -> list[str]:
        """Text deltas released since the last call."""
        pending, self._pending = self._pending, []
        return pending


class BatchScheduler:
    """Runs many generations of one target together (continuous batching).

    Not thread-safe: one thread calls :meth:`submit`, :meth:`cancel` and :meth:`step` (the server's worker does).

    Args:
        target: the loaded target.
        new_drafter: builds a drafter for one more concurrent generation (e.g.
            ``lambda: make_drafter("hd", context)``); called at most ``max_batch`` times, drafters are reused.
        config: batch limits.
    """

    def __init__(self, target: TargetModel, new_drafter: Callable[[], Drafter],
                 config: BatchConfig | None = None) -> None:
        self.target = target
        self.config = config or BatchConfig()
        self._new_drafter = new_drafter
        self._ids = itertools.count()
        self._waiting: collections.deque[Request] = collections.deque()
        self._running: list[Request] = []
        self._idle_drafters: list[Drafter] = []
        self._idle_caches: list = []
        self._slots: list | None = None  # the batch's caches (slots of one pool), made at the first admission
        # what each running request verified and spent drafting last step, for sizing the others' trees
        self._rows: dict[int, int] = {}
        self._draft_ms: dict[int, float] = {}
        # generations one forward can hold: the CUDA graphs' single static cache allows one
        self.max_batch = self.config.max_batch if target.runtime.graphed is None else 1
        self.steps = 0
        self.batch_sizes: collections.Counter[int] = collections.Counter()

    # ----------------------------------------------------------------- requests
    def submit(self, prompt_ids: Sequence[int], config: GenerationConfig | None = None) -> Request:
        """Queue a request (checked now: a bad prompt raises :class:`~hierspec.errors.InputError` here)."""
        request = Request(next(self._ids), self.target.check_prompt_ids(prompt_ids), config or GenerationConfig())
        self._waiting.append(request)
        return request

    def cancel(self, request: Request) -> None:
        """Drop a request, queued or running; the others go on unchanged."""
        if request.finished:
            return
        request.cancelled = True
        if request in self._waiting:
            self._waiting.remove(request)
        elif request in self._running:
            self._retire(request)

    @property
    def running(self) -> int:
        """Generations in the batch."""
        return len(self._running)

    @property
    def waiting(self) -> int:
        """Requests queued for a place in the batch."""
        return len(self._waiting)

    @property
    def idle(self) -> bool:
        """Nothing running or waiting."""
        return not self._running and not self._waiting

    def probe_drafter(self) -> Drafter:
        """A drafter of the method (an idle one, built if needed), for health checks and descriptions."""
        if not self._idle_drafters and not self._running:
            self._idle_drafters.append(self._new_drafter())
        return self._idle_drafters[0] if self._idle_drafters else self._running[0]._drafter

    # ----------------------------------------------------------------- the loop
    def step(self) -> list[Request]:
        """Admit waiting requests, verify every running generation's tree in one forward, and accept. Returns the
        requests that released text or finished in this step (admission failures included)."""
        touched = self._admit()
        running = list(self._running)
        if not running:
            return touched
        trees, live = [], []
        shared = self._shared_totals(running)
        for request in running:
            try:
                trees.append(self._propose(request, shared, len(running)))
                live.append(request)
            except Exception as exc:  # a drafter's failure ends its own request only
                self._fail(request, exc)
                touched.append(request)
        if not live:
            return touched
        generations = [r._generation for r in live]
        try:
            outputs = self.target.forward_trees([g.cache for g in generations], trees,
                                                any(g.wants_hidden for g in generations))
        except Exception as exc:  # the forward itself failed: every request in it fails
            for request in live:
                self._fail(request, exc)
            return touched + live
        self.steps += 1
        self.batch_sizes[len(live)] += 1
        for request, output in zip(live, outputs):
            try:
                self._accept(request, output)
            except Exception as exc:
                self._fail(request, exc)
            touched.append(request)
        return touched

    def run(self) -> None:
        """Step until every request is finished."""
        while not self.idle:
            self.step()

    def _admit(self) -> list[Request]:
        admitted = []
        reserved = sum(r.reserved_tokens for r in self._running)
        while self._waiting and len(self._running) < self.max_batch:
            request = self._waiting[0]
            if self._running and reserved + request.reserved_tokens > self.config.max_kv_tokens:
                break
            self._waiting.popleft()
            reserved += request.reserved_tokens
            try:
                self._start(request)
            except Exception as exc:
                self._fail(request, exc)
                admitted.append(request)
                continue
            self._running.append(request)
            if request._generation.done:  # no room to generate: finished at once
                self._finish(request)
                admitted.append(request)
        return admitted

    def _start(self, request: Request) -> None:
        request.admitted_at = time.perf_counter()
        drafter = self._idle_drafters.pop() if self._idle_drafters else self._new_drafter()
        request._drafter = drafter
        cache = self._idle_cache()
        generation = Generation(self.target, drafter, request.prompt_ids, request.config, GenerationStats(), cache)
        request._generation = generation
        target = self.target
        request._assembler = TextAssembler(make_detokenizer(target.tokenizer, target.decode), request.config.stop)
        generation.start()
        self._rows[request.id] = 1

    def _idle_cache(self):
        """A free cache, the lowest slot first (a batch's slots then stay close together), or None for a new one."""
        if self._slots is None and self.target.runtime.graphed is None:
            self._slots = self.target.runtime.slot_caches(self.max_batch)
            self._idle_caches.extend(self._slots)
        if not self._idle_caches:
            return None
        cache = min(self._idle_caches, key=lambda c: getattr(c, "slot", 0))
        self._idle_caches.remove(cache)
        return cache

    def _shared_totals(self, running: list[Request]) -> list[float]:
        """Rows, expected tokens and drafting milliseconds of every running generation's last step, summed: each
        drafter is told the others' share as the total less its own (one pass a step, not one per pair)."""
        return [sum(self._rows.get(r.id, 1) for r in running), sum(_expected_tokens(r) for r in running),
                sum(self._draft_ms.get(r.id, 0.0) for r in running)]

    def _propose(self, request: Request, shared: list[float], running: int):
        generation = request._generation
        rows, tokens, draft_ms = self._rows.get(request.id, 1), _expected_tokens(request), self._draft_ms.get(
            request.id, 0.0)
        generation.drafter.share_forward(shared[0] - rows, shared[1] - tokens, shared[2] - draft_ms)
        share = self.config.max_rows // running - 1
        drafted = generation.stats.draft_time  # the generation times its own drafting
        tree = generation.propose(max(0, share))
        self._draft_ms[request.id] = 1e3 * (generation.stats.draft_time - drafted)
        self._rows[request.id] = tree.size
        # the generations after this one see its new tree and drafting time, as before
        shared[0] += tree.size - rows
        shared[2] += self._draft_ms[request.id] - draft_ms
        return tree

    def _accept(self, request: Request, output) -> None:
        new = request._generation.advance(output)
        if request.first_token_at is None:
            request.first_token_at = time.perf_counter()
        assembler = request._assembler
        delta = assembler.feed(new)
        if delta:
            request._pending.append(delta)
        if assembler.stopped or request._generation.done:
            self._finish(request)

    def _finish(self, request: Request) -> None:
        generation, assembler = request._generation, request._assembler
        tail = assembler.finish()
        if tail:
            request._pending.append(tail)
        self._retire(request)
        ids = assembler.token_ids
        if assembler.stopped:
            reason = "stop"
        elif request.config.stop_at_eos and ids and ids[-1] in self.target.eos_token_ids:
            reason = "eos"
        else:
            reason = "length"
        request.result = GenerationResult(ids, assembler.text, reason, generation.stats)

    def _fail(self, request: Request, exc: BaseException) -> None:
        log.exception("request %d failed", request.id, exc_info=exc)
        request.error = exc
        if request in self._running:
            self._retire(request)

    def _retire(self, request: Request) -> None:
        """Take a request out of the batch: its generation ends, its drafter and cache serve the next request."""
        self._running.remove(request)
        self._rows.pop(request.id, None)
        self._draft_ms.pop(request.id, None)
        generation = request._generation
        if generation is not None:
            try:
                generation.close()
            finally:
                if self.target.runtime.graphed is None:  # the CUDA graphs' static cache is the runtime's to resize
                    self._idle_caches.append(generation.cache)
                self._idle_drafters.append(generation.drafter)


def _expected_tokens(request: Request) -> float:
    """Tokens a running generation is expected to add in a step: its mean so far (one before its first step);
    from its counters, O(1), where :attr:`GenerationStats.mean_accepted` sums every step's."""
    stats = request._generation.stats
    return stats.new_tokens / stats.target_forwards if stats.target_forwards else 1.0


def decode_batch(target: TargetModel, prompts: Sequence[Sequence[int]], new_drafter: Callable[[], Drafter],
                   config: GenerationConfig | None = None, batch: BatchConfig | None = None
                   ) -> list[GenerationResult]:
    """Generate for many prompt id lists at once (continuous batching); results in the prompts' order, each the
    one the prompt gets alone. A request that fails raises its error after the others ended."""
    scheduler = BatchScheduler(target, new_drafter, batch)
    requests = [scheduler.submit(prompt, config) for prompt in prompts]
    scheduler.run()
    for request in requests:
        if request.error is not None:
            raise request.error
    return [request.result for request in requests]

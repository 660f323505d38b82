"""The decoding loop: draft, verify, accept, repeat — shared by every draft source.

Invariant between steps: the KV cache holds every token of the context except the last one, which is the root of
the next draft tree. Plain decoding is this same loop with the empty draft.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from hierspec.accept import Verdict, verify
from hierspec.config import GenerationConfig
from hierspec.drafters.base import Drafter
from hierspec.target import TargetModel, TreeOutput
from hierspec.text import TextAssembler, make_detokenizer
from hierspec.tree import DraftTree


@dataclass
class GenerationStats:
    """Counters and timings of one generation.

    ``target_forwards`` counts verification forwards (the prompt's prefill is timed separately and not counted);
    ``accept_lengths`` holds the tokens each forward added (accepted drafts + the bonus token). A step is *won* by
    the source of its deepest accepted draft token (``won_by_source``; steps accepting no draft are won by none).
    ``drafter`` holds the drafter's own counters (:meth:`~hierspec.drafters.Drafter.report`), e.g. per-level
    figures of hierarchical draft models.
    """

    prompt_tokens: int = 0
    new_tokens: int = 0
    target_forwards: int = 0
    drafted_tokens: int = 0
    accepted_drafts: int = 0
    accept_lengths: list[int] = field(default_factory=list)
    drafted_by_source: dict[str, int] = field(default_factory=dict)
    accepted_by_source: dict[str, int] = field(default_factory=dict)
    won_by_source: dict[str, int] = field(default_factory=dict)
    drafter: dict = field(default_factory=dict)
    prefill_time: float = 0.0
    draft_time: float = 0.0
    verify_time: float = 0.0
    total_time: float = 0.0

    @property
    def mean_accepted(self) -> float:
        """Mean tokens per target forward (MAT)."""
        return sum(self.accept_lengths) / len(self.accept_lengths) if self.accept_lengths else 0.0

    @property
    def tokens_per_s(self) -> float:
        """New tokens per second of total wall time (prefill included)."""
        return self.new_tokens / self.total_time if self.total_time > 0 else 0.0

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens over drafted tokens."""
        return self.accepted_drafts / self.drafted_tokens if self.drafted_tokens else 0.0

    def record_step(self, verdict: Verdict, added: int) -> None:
        """Account for one verification step that added ``added`` tokens to the output."""
        self.target_forwards += 1
        self.accept_lengths.append(added)
        self.drafted_tokens += verdict.tree.num_drafted
        accepted_sources = verdict.accepted_sources[: max(0, added - 1)]
        self.accepted_drafts += len(accepted_sources)
        _add_counts(self.drafted_by_source, Counter(verdict.tree.sources[1:]))
        _add_counts(self.accepted_by_source, Counter(accepted_sources))
        if accepted_sources:
            _add_counts(self.won_by_source, Counter([accepted_sources[-1]]))

    def as_dict(self) -> dict:
        """Plain-dict form with the derived metrics, for JSON."""
        out = asdict(self)
        out.update(mean_accepted=self.mean_accepted, tokens_per_s=self.tokens_per_s,
                   acceptance_rate=self.acceptance_rate)
        return out


def _add_counts(total: dict[str, int], counts: Counter) -> None:
    for key, value in counts.items():
        total[key] = total.get(key, 0) + value


@dataclass
class GenerationResult:
    """Output of one generation.

    Attributes:
        token_ids: generated ids (an end-of-sequence token that ended generation included).
        text: generated text, special tokens removed, cut before the first stop string.
        finish_reason: ``"eos"``, ``"stop"`` (a stop string) or ``"length"`` (max_new_tokens or context full).
        stats: counters and timings.
    """

    token_ids: list[int]
    text: str
    finish_reason: str
    stats: GenerationStats


class GenerationStream:
    """Iterate to receive text as it is accepted; :attr:`result` is set once the iteration ends."""

    def __init__(self, decoder: SpeculativeDecoder, prompt_ids: Sequence[int], config: GenerationConfig) -> None:
        self._decoder = decoder
        self._prompt_ids = list(prompt_ids)
        self._config = config
        self.result: GenerationResult | None = None

    def __iter__(self) -> Iterator[str]:
        target = self._decoder.target
        assembler = TextAssembler(make_detokenizer(target.tokenizer, target.decode), self._config.stop)
        stats = GenerationStats()
        finish = "length"
        steps = self._decoder.steps(self._prompt_ids, self._config, stats)
        for chunk in steps:
            delta = assembler.feed(chunk)
            if delta:
                yield delta
            if assembler.stopped:
                finish = "stop"
                steps.close()
                break
            if self._config.stop_at_eos and chunk[-1] in target.eos_token_ids:
                finish = "eos"
        tail = assembler.finish()
        if tail:
            yield tail
        self.result = GenerationResult(assembler.token_ids, assembler.text, finish, stats)


class SpeculativeDecoder:
    """Lossless speculative decoding of one target model with one drafter."""

    def __init__(self, target: TargetModel, drafter: Drafter) -> None:
        self.target = target
        self.drafter = drafter

    def generate(self, prompt_ids: Sequence[int], config: GenerationConfig | None = None) -> GenerationResult:
        """Generate from prompt token ids and return the whole result."""
        stream = self.stream(prompt_ids, config)
        for _ in stream:
            pass
        assert stream.result is not None
        return stream.result

    def stream(self, prompt_ids: Sequence[int], config: GenerationConfig | None = None) -> GenerationStream:
        """Generate from prompt token ids, yielding text deltas as tokens are accepted."""
        config = config or GenerationConfig()
        return GenerationStream(self, self.target.check_prompt_ids(prompt_ids), config)

    def steps(self, prompt_ids: list[int], config: GenerationConfig, stats: GenerationStats) -> Iterator[list[int]]:
        """The loop itself: yields the tokens each verification step adds, updating ``stats`` as it goes. The
        target is held for the whole generation (:meth:`TargetModel.generating`)."""
        with self.target.generating():
            yield from self._steps(prompt_ids, config, stats)

    def _steps(self, prompt_ids: list[int], config: GenerationConfig, stats: GenerationStats) -> Iterator[list[int]]:
        generation = Generation(self.target, self.drafter, prompt_ids, config, stats)
        try:
            generation.start()
            while not generation.done:
                tree = generation.propose()
                yield generation.advance(self.target.forward_tree(generation.cache, tree, generation.wants_hidden))
        finally:
            generation.close()


class Generation:
    """One generation's state between verification forwards: the loop of :meth:`SpeculativeDecoder.steps`, one step
    at a time, so that a scheduler can verify many generations' trees in one batched forward
    (:mod:`hierspec.batching`) with exactly the arithmetic of decoding each alone.

    Use: :meth:`start` (prefill), then while not :attr:`done`: :meth:`propose` a tree, verify it with the target
    (alone or batched) and hand the forward's output to :meth:`advance`; :meth:`close` at the end (also after a
    cancellation). ``cache`` may be a reused one (it is emptied); by default the target makes a new one.
    """

    def __init__(self, target: TargetModel, drafter: Drafter, prompt_ids: Sequence[int], config: GenerationConfig,
                 stats: GenerationStats | None = None, cache=None) -> None:
        self.target, self.drafter, self.config = target, drafter, config
        self.prompt_ids = list(prompt_ids)
        self.stats = stats if stats is not None else GenerationStats()
        self.limit = min(config.max_new_tokens, target.max_context - len(self.prompt_ids))
        self.context = _TokenBuffer(self.prompt_ids, capacity=len(self.prompt_ids) + self.limit + 1)
        self.generator = _make_generator(config.sampling.seed)
        self.eos = target.eos_token_ids if config.stop_at_eos else frozenset()
        capacity = len(self.prompt_ids) + self.limit + config.max_draft_tokens + 1
        if cache is None:
            cache = target.new_cache(capacity=capacity)
        else:
            cache.reset()
        self.cache = cache
        self.wants_hidden = drafter.wants_hidden
        self.done = self.limit <= 0
        self.tree: DraftTree | None = None
        self._started = 0.0
        self._drafted_at = 0.0
        self._closed = False

    def start(self) -> None:
        """Prefill the prompt (all but its last token, the first tree's root) and ready the drafter."""
        self._started = time.perf_counter()
        self.stats.prompt_tokens = len(self.prompt_ids)
        hidden = self.target.prefill(self.cache, self.prompt_ids[:-1], want_hidden=self.wants_hidden)
        self.drafter.prepare(self.config.sampling, self.generator)
        self.drafter.begin(self.context.view())
        if hidden is not None:
            self.drafter.observe_hidden(_as_numpy(hidden))
        self.target.synchronize()
        self.stats.prefill_time = time.perf_counter() - self._started

    @property
    def room(self) -> int:
        """Draft tokens the next tree may hold: the configured cap, the context left and the tokens left."""
        return max(0, min(self.config.max_draft_tokens, self.target.max_context - len(self.context),
                          self.limit - self.stats.new_tokens))

    def propose(self, budget: int | None = None) -> DraftTree:
        """The drafter's tree for the next step (at most ``budget`` draft tokens where given, within :attr:`room`)."""
        t0 = time.perf_counter()
        room = self.room if budget is None else min(self.room, max(0, budget))
        self.tree = self.drafter.propose(self.context.view(), room)
        self._drafted_at = time.perf_counter()
        self.stats.draft_time += self._drafted_at - t0
        return self.tree

    @property
    def past(self) -> int:
        """Cache entries before the tree (the whole context but its last token, the root)."""
        return len(self.context) - 1

    def advance(self, output: TreeOutput) -> list[int]:
        """Accept from the verification of :attr:`tree` (``output``: its logits, hidden states when wanted): keep
        the accepted path's cache entries, let the drafter learn, and return the tokens the step added."""
        tree, config = self.tree, self.config
        verdict = verify(tree, output.logits, config.sampling, self.generator, self.drafter.verifier_topk)
        self.target.keep_path(self.cache, self.past, (0, *verdict.path))
        self.target.synchronize()
        t2 = time.perf_counter()
        stats = self.stats
        new = _truncate(verdict.accepted_tokens, self.limit - stats.new_tokens, self.eos)
        self.context.extend(new)
        self.drafter.observe(verdict, self.context.view())
        if self.wants_hidden:
            last_kept = verdict.path[-1] if verdict.path else 0
            self.drafter.observe_hidden(_as_numpy(output.hidden[last_kept]))
        stats.record_step(verdict, len(new))
        stats.new_tokens += len(new)
        stats.draft_time += time.perf_counter() - t2
        stats.verify_time += t2 - self._drafted_at
        stats.total_time = time.perf_counter() - self._started
        self.done = stats.new_tokens >= self.limit or new[-1] in self.eos
        return new

    def close(self) -> None:
        """End the generation (finished, stopped or cancelled): the drafter sees the whole context once."""
        if self._closed:
            return
        self._closed = True
        self.done = True
        self.stats.total_time = time.perf_counter() - self._started
        self.drafter.finish(self.context.view())
        self.stats.drafter = self.drafter.report()
        if self.drafter.carried is not None:
            self.drafter.carried.leave(self.drafter.learned())


def _truncate(tokens: list[int], room: int, eos: frozenset[int]) -> list[int]:
    """Cut a step's tokens to the room left and just after the first end-of-sequence token."""
    tokens = tokens[:room]
    for i, token in enumerate(tokens):
        if token in eos:
            return tokens[: i + 1]
    return tokens


def _as_numpy(hidden: torch.Tensor) -> np.ndarray:
    return hidden.detach().to("cpu", torch.float32).numpy()


def _make_generator(seed: int | None) -> torch.Generator:
    generator = torch.Generator()
    generator.manual_seed(seed if seed is not None else int.from_bytes(os.urandom(8), "little") >> 1)
    return generator


class _TokenBuffer:
    """A growable int64 array of the context, handed to drafters as a view without copying."""

    def __init__(self, tokens: Sequence[int], capacity: int) -> None:
        self._data = np.empty(max(capacity, len(tokens)), dtype=np.int64)
        self._data[: len(tokens)] = tokens
        self._length = len(tokens)

    def __len__(self) -> int:
        return self._length

    def extend(self, tokens: Sequence[int]) -> None:
        end = self._length + len(tokens)
        if end > self._data.shape[0]:
            grown = np.empty(max(end, 2 * self._data.shape[0]), dtype=np.int64)
            grown[: self._length] = self._data[: self._length]
            self._data = grown
        self._data[self._length : end] = tokens
        self._length = end

    def view(self) -> np.ndarray:
        view = self._data[: self._length]
        view.flags.writeable = False
        return view

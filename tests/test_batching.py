"""Continuous batching is lossless per request: every request's output equals serving it alone, whatever else is in
the batch, with requests joining and leaving, cancelled, stopped or failing. Sampled requests keep their law: the
χ² tests (``test_sampling_*.py``) sample their generations sixteen at a time through the scheduler."""

import numpy as np
import pytest

from drafters_for_tests import ScriptedDrafter
from hierspec.batching import BatchConfig, BatchScheduler, decode_batch
from hierspec.config import GenerationConfig, SamplingConfig
from hierspec.decode import SpeculativeDecoder
from hierspec.drafters import NoDrafter, PromptLookupConfig, PromptLookupDrafter
from hierspec.drafters.base import Drafter
from hierspec.errors import InputError
from tiny import ARCHITECTURES, make_target

VOCAB = 64


@pytest.fixture(scope="module", params=ARCHITECTURES)
def target(request):
    return make_target(request.param, vocab_size=VOCAB, seed=3)


def _prompts(count, seed, longest=40):
    rng = np.random.default_rng(seed)
    return [rng.integers(1, VOCAB, size=int(rng.integers(1, longest))).tolist() for _ in range(count)]


class ScriptedByPrompt(Drafter):
    """A :class:`ScriptedDrafter` for whichever prompt the generation starts with (drafters are reused across
    requests): right, partly right and wrong branches from that prompt's known answer."""

    name = "scripted"

    def __init__(self, answers: dict, seed: int) -> None:
        self.answers, self.seed, self.inner = answers, seed, None

    def begin(self, prompt):
        self.inner = ScriptedDrafter(len(prompt), self.answers[tuple(int(t) for t in prompt)], VOCAB, self.seed)

    def propose(self, context, budget):
        return self.inner.propose(context, budget)


def _alone(target, prompts, config, drafter=None):
    decoder = SpeculativeDecoder(target, drafter or NoDrafter())
    return [decoder.generate(prompt, config) for prompt in prompts]


def test_every_request_in_a_batch_equals_its_output_alone(target):
    """Twelve prompts of different lengths and answer limits through a batch of at most 5: requests join as others
    leave (eos or their own max_new_tokens), and branching scripted trees are verified side by side."""
    prompts = _prompts(12, seed=1)
    configs = [GenerationConfig(max_new_tokens=int(n), max_draft_tokens=16) for n in (3, 40, 17, 28, 9, 40) * 2]
    reference = [_alone(target, [p], c)[0] for p, c in zip(prompts, configs)]
    answers = {tuple(p): r.token_ids for p, r in zip(prompts, reference)}
    seeds = iter(range(100))
    scheduler = BatchScheduler(target, lambda: ScriptedByPrompt(answers, next(seeds)), BatchConfig(max_batch=5))
    requests = [scheduler.submit(p, c) for p, c in zip(prompts, configs)]
    sizes = []
    while not scheduler.idle:
        scheduler.step()
        sizes.append(scheduler.running)
    assert max(sizes) == 5 and len(set(sizes)) > 2, "the batch never filled and drained: requests did not join/leave"
    for request, alone in zip(requests, reference):
        assert request.result.token_ids == alone.token_ids
        assert request.result.finish_reason == alone.finish_reason
        assert request.result.text == alone.text
    assert sum(max(r.result.stats.accept_lengths) > 1 for r in requests) >= 8, "drafts were hardly ever accepted"
    assert scheduler.batch_sizes[5] > 0
    assert next(seeds) <= 5, "more drafters were built than the batch holds"


def test_prompt_lookup_in_a_batch_equals_alone_and_forwards_are_shared(target):
    prompts = [p * 3 for p in _prompts(6, seed=4, longest=8)]  # repeats give prompt lookup something to find
    config = GenerationConfig(max_new_tokens=32)
    alone = _alone(target, prompts, config, PromptLookupDrafter(PromptLookupConfig(max_ngram=3, min_ngram=1)))
    scheduler = BatchScheduler(target, lambda: PromptLookupDrafter(PromptLookupConfig(max_ngram=3, min_ngram=1)),
                               BatchConfig(max_batch=6))
    requests = [scheduler.submit(p, config) for p in prompts]
    scheduler.run()
    assert [r.result.token_ids for r in requests] == [a.token_ids for a in alone]
    forwards_alone = sum(a.stats.target_forwards for a in alone)
    assert scheduler.steps <= forwards_alone / 3, "six requests did not share their forwards"


def test_cancelling_one_request_leaves_the_others_unchanged(target):
    prompts = _prompts(4, seed=6)
    config = GenerationConfig(max_new_tokens=30, stop_at_eos=False)
    alone = _alone(target, prompts, config)
    scheduler = BatchScheduler(target, NoDrafter, BatchConfig(max_batch=4))
    requests = [scheduler.submit(p, config) for p in prompts]
    for _ in range(5):
        scheduler.step()
    scheduler.cancel(requests[1])
    queued = scheduler.submit(prompts[1], config)
    scheduler.cancel(queued)  # cancelled while waiting: never runs
    scheduler.run()
    assert requests[1].cancelled and requests[1].result is None and queued.result is None
    for index in (0, 2, 3):
        assert requests[index].result.token_ids == alone[index].token_ids
    assert scheduler.running == 0 and scheduler.waiting == 0


def test_stop_strings_text_and_a_failing_drafter_stay_per_request(target):
    prompts = _prompts(3, seed=8)
    plain = GenerationConfig(max_new_tokens=20, stop_at_eos=False)
    alone = _alone(target, prompts, plain)
    stop_word = alone[0].text.split()[3]
    stopped = GenerationConfig(max_new_tokens=20, stop_at_eos=False, stop=(stop_word,))

    class Failing(NoDrafter):
        def propose(self, context, budget):
            if len(context) > 12 and int(context[0]) == prompts[2][0]:
                raise RuntimeError("a broken store")
            return super().propose(context, budget)

    scheduler = BatchScheduler(target, Failing, BatchConfig(max_batch=3))
    requests = [scheduler.submit(prompts[0], stopped), scheduler.submit(prompts[1], plain),
                scheduler.submit(prompts[2], plain)]
    texts = {r.id: "" for r in requests}
    while not scheduler.idle:
        for request in scheduler.step():
            texts[request.id] += "".join(request.take_text())
    assert requests[0].result.finish_reason == "stop"
    assert requests[0].result.text == alone[0].text[: alone[0].text.index(stop_word)] == texts[requests[0].id]
    assert requests[1].result.token_ids == alone[1].token_ids and texts[requests[1].id] == alone[1].text
    assert isinstance(requests[2].error, RuntimeError) and requests[2].result is None


def test_seeded_sampled_requests_give_their_tokens_alone(target):
    prompts = _prompts(5, seed=9)
    configs = [GenerationConfig(max_new_tokens=24, sampling=SamplingConfig(temperature=0.8, top_p=0.9, seed=s))
               for s in range(5)]
    alone = [_alone(target, [p], c)[0] for p, c in zip(prompts, configs)]
    scheduler = BatchScheduler(target, NoDrafter, BatchConfig(max_batch=5))
    requests = [scheduler.submit(p, c) for p, c in zip(prompts, configs)]
    scheduler.run()
    assert [r.result.token_ids for r in requests] == [a.token_ids for a in alone]


def test_admission_is_bounded_by_kv_tokens_and_bad_limits_are_refused(target):
    prompts = _prompts(4, seed=10, longest=10)
    config = GenerationConfig(max_new_tokens=20, max_draft_tokens=4)
    room = max(len(p) for p in prompts) + 20 + 4 + 1
    scheduler = BatchScheduler(target, NoDrafter, BatchConfig(max_batch=4, max_kv_tokens=2 * room))
    for prompt in prompts:
        scheduler.submit(prompt, config)
    peak = 0
    while not scheduler.idle:
        scheduler.step()
        peak = max(peak, scheduler.running)
    assert peak == 2
    for bad in (dict(max_batch=0), dict(max_rows=-1), dict(max_kv_tokens=True)):
        with pytest.raises(InputError):
            BatchConfig(**bad)
    with pytest.raises(InputError):
        scheduler.submit([], config)


def test_decode_batch_returns_results_in_prompt_order(target):
    prompts = _prompts(3, seed=11)
    config = GenerationConfig(max_new_tokens=10)
    results = decode_batch(target, prompts, NoDrafter, config, BatchConfig(max_batch=2))
    assert [r.token_ids for r in results] == [a.token_ids for a in _alone(target, prompts, config)]


class SharingRecorder(Drafter):
    """Drafts ``size`` tokens of its own (``size`` fixed per drafter) and records what it is told about the others."""

    name = "recorder"

    def __init__(self, size: int, log: list) -> None:
        self.size, self.log = size, log

    def share_forward(self, rows, tokens, draft_ms=0.0):
        self.log.append((self.size, rows, tokens))

    def propose(self, context, budget):
        from hierspec.tree import build_tree
        return build_tree(int(context[-1]), [[1] * min(self.size, budget)] if self.size and budget else [])


def test_each_drafter_is_told_the_other_generations_rows_and_tokens(target):
    """Before drafting, a generation learns the others' rows — this step's tree for those that drafted before it,
    the last step's for the rest (one row before any) — and their tokens per step so far (one before any)."""
    log = []
    sizes = iter([0, 2, 5])
    scheduler = BatchScheduler(target, lambda: SharingRecorder(next(sizes), log), BatchConfig(max_batch=3))
    config = GenerationConfig(max_new_tokens=30, stop_at_eos=False)
    requests = [scheduler.submit(p, config) for p in _prompts(3, seed=9)]
    scheduler.step()
    assert [(size, rows) for size, rows, _ in log] == [(0, 1 + 1), (2, 1 + 1), (5, 1 + 3)]
    assert [tokens for _, _, tokens in log] == [2.0, 2.0, 2.0]
    log.clear()
    scheduler.step()
    assert [(size, rows) for size, rows, _ in log] == [(0, 3 + 6), (2, 1 + 6), (5, 1 + 3)]
    stats = [r._generation.stats for r in requests]
    means = [s.mean_accepted for s in stats]
    assert [tokens for _, _, tokens in log] == pytest.approx([sum(means) - m for m in means])

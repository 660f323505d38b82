"""What a method's drafters learn carries from one generation to the next (``drafters/carried.py``): a new drafter
made for the same method and context starts from what the last finished generation learned, a copy of it."""

import numpy as np

from hierspec.calibration import CostCurve, save_curve
from hierspec.config import GenerationConfig
from hierspec.decode import SpeculativeDecoder
from hierspec.drafters import NoDrafter
from hierspec.drafters.carried import CarriedState
from hierspec.methods import DrafterContext, make_drafter
from tiny import make_target

CONFIG = GenerationConfig(max_new_tokens=40, stop_at_eos=False)


def _context(target, tmp_path) -> DrafterContext:
    """A context whose cost curve is in milliseconds (so that hd's source gate runs too)."""
    path = tmp_path / "curve.json"
    save_curve(CostCurve((1, 8, 64), (10.0, 12.0, 40.0), {}), path)
    return DrafterContext(target, cost_curve=str(path), find_default_stores=False)


def _prompts(count: int) -> list[list[int]]:
    rng = np.random.default_rng(11)
    prompts = []
    for _ in range(count):
        motif = rng.integers(1, 64, size=5).tolist()
        prompts.append(motif * 3 + motif[:2])
    return prompts


def test_a_carried_state_hands_out_copies_and_keeps_the_latest_left():
    slot = CarriedState()
    assert slot.latest() is None
    state = {"counts": np.zeros(3)}
    slot.leave(state)
    state["counts"][0] = 5.0  # the finished drafter goes on with its own
    taken = slot.latest()
    taken["counts"][1] = 7.0  # and so does the one that started from it
    assert slot.latest()["counts"].tolist() == [0.0, 0.0, 0.0]
    slot.leave(None)  # a drafter that learns nothing of the kind leaves the latest as it was
    assert slot.latest()["counts"].tolist() == [0.0, 0.0, 0.0]
    slot.leave({"counts": np.ones(3)})
    assert slot.latest()["counts"].tolist() == [1.0, 1.0, 1.0]


def test_a_new_hd_drafter_starts_from_what_the_last_generation_of_its_method_learned(tmp_path):
    target = make_target("llama", vocab_size=64, seed=3)
    context = _context(target, tmp_path)
    first = make_drafter("hd", context)
    assert first.acceptance.trials.sum() == 0
    SpeculativeDecoder(target, first).generate(_prompts(1)[0], CONFIG)
    learned = first.acceptance.trials.copy()
    assert learned.sum() > 0
    second = make_drafter("hd", context)
    assert second.acceptance is not first.acceptance
    assert np.array_equal(second.acceptance.trials, learned)
    assert np.array_equal(second.acceptance.hits, first.acceptance.hits)
    assert second.source_gate is not first.source_gate
    assert second.source_gate.report() == first.source_gate.report()
    assert make_drafter("hd:h_gate=4", context).acceptance.trials.sum() == 0  # another method
    assert make_drafter("hd", _context(target, tmp_path)).acceptance.trials.sum() == 0  # another context


def test_hd_starts_afresh_from_what_was_learned_for_other_databases(tmp_path):
    target = make_target("llama", vocab_size=64, seed=3)
    drafter = make_drafter("hd", _context(target, tmp_path))
    learned = drafter.learned()
    learned["acceptance"].trials += 3.0
    other = make_drafter("hd", _context(target, tmp_path))
    other.resume({**learned, "sources": ["context"]})
    assert other.acceptance.trials.sum() == 0
    other.resume(learned)
    assert other.acceptance.trials.sum() > 0


def test_the_cost_aware_wrapper_carries_its_depth_counts(tmp_path):
    target = make_target("llama", vocab_size=64, seed=3)
    context = _context(target, tmp_path)
    first = make_drafter("pld:min_ngram=1", context)
    SpeculativeDecoder(target, first).generate(_prompts(1)[0], CONFIG)
    assert first._reached.sum() > 0
    second = make_drafter("pld:min_ngram=1", context)
    assert second._reached is not first._reached
    assert np.array_equal(second._reached, first._reached) and np.array_equal(second._accepted, first._accepted)
    assert second._backoff.interval == first._backoff.interval


def test_drafters_that_start_from_earlier_generations_still_decode_exactly_as_plain_decoding(tmp_path):
    target = make_target("llama", vocab_size=64, seed=3)
    context = _context(target, tmp_path)
    plain = SpeculativeDecoder(target, NoDrafter())
    for method in ("hd", "pld:min_ngram=1"):
        for prompt in _prompts(4):
            out = SpeculativeDecoder(target, make_drafter(method, context)).generate(prompt, CONFIG)
            assert out.token_ids == plain.generate(prompt, CONFIG).token_ids


def test_a_seeded_sampled_generation_is_the_same_whatever_an_earlier_generation_taught_the_drafter(tmp_path):
    from hierspec.config import SamplingConfig

    target = make_target("llama", vocab_size=64, seed=3)
    context = _context(target, tmp_path)
    sampled = GenerationConfig(max_new_tokens=40, stop_at_eos=False,
                               sampling=SamplingConfig(temperature=0.9, seed=7))
    prompt = _prompts(1)[0]
    plain = SpeculativeDecoder(target, NoDrafter()).generate(prompt, sampled).token_ids
    first = make_drafter("hd", context)
    assert SpeculativeDecoder(target, first).generate(prompt, sampled).token_ids == plain
    later = make_drafter("hd", context)  # starts from what the first generation learned
    assert later.acceptance.trials.sum() > 0
    assert SpeculativeDecoder(target, later).generate(prompt, sampled).token_ids == plain

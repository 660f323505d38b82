"""Calibration files and cost-aware drafting (trees trimmed by expected tokens per millisecond)."""

import json
import time

import numpy as np
import pytest

from hierspec.accept import Verdict
from hierspec.calibration import CostCurve, default_curve_path, load_curve, measure_cost_curve, save_curve
from hierspec.config import GenerationConfig
from hierspec.decode import SpeculativeDecoder
from hierspec.drafters import NoDrafter
from hierspec.drafters.base import Drafter
from hierspec.drafters.prompt_lookup import PromptLookupDrafter
from hierspec.drafters import cost_aware
from hierspec.drafters.cost_aware import CostAwareDrafter, LoopRowCost, cut_to_depth, depth_rates, probe_level
from hierspec.drafters.scored import ContextCost
from hierspec.errors import InputError
from hierspec.methods import DrafterContext, make_drafter
from hierspec.tree import build_tree, root_only
from tiny import make_target

# a CPU-like curve: any draft costs 1.6 plain steps, more tokens almost nothing
CPU_LIKE = CostCurve((1, 2, 8, 64), (60.0, 96.0, 100.0, 240.0), {"model": "test"})


def test_curve_round_trip_and_errors(tmp_path):
    path = tmp_path / "curve.json"
    save_curve(CPU_LIKE, path)
    assert load_curve(path) == CPU_LIKE
    assert CPU_LIKE.cost(5) == pytest.approx(98.0) and CPU_LIKE.cost(100) == 240.0
    data = json.loads(path.read_text())
    path.write_text(json.dumps({**data, "magic": "other"}))
    with pytest.raises(InputError, match="not a hierspec cost curve"):
        load_curve(path)
    path.write_text(json.dumps({**data, "version": 99}))
    with pytest.raises(InputError, match="version 99"):
        load_curve(path)
    with pytest.raises(InputError, match="hierspec calibrate"):
        load_curve(tmp_path / "missing.json")


# a curve measured over 64 and 1,024 cached tokens: a second row costs 2 ms more over the short context, 8 over the long
GROWING = CostCurve((1, 2, 8), (10.0, 12.0, 20.0), {}, context=64, long_context=1024, long_ms=(14.0, 22.0, 50.0))


def test_a_long_context_curve_round_trips_and_malformed_ones_are_refused(tmp_path):
    path = tmp_path / "curve.json"
    save_curve(GROWING, path)
    assert load_curve(path) == GROWING
    data = json.loads(path.read_text())
    for bad in ({"long_ms": [14.0, 22.0]}, {"long_ms": [14.0, -1.0, 50.0]}, {"long_context": 32},
                {"long_context": "1024"}):
        path.write_text(json.dumps({**data, **bad}))
        with pytest.raises(InputError, match="long-context cost curve"):
            load_curve(path)
    old = {key: value for key, value in data.items() if key not in ("context", "long_context", "long_ms")}
    path.write_text(json.dumps(old))  # a curve saved before long contexts were measured
    assert load_curve(path).context_cost().at(4096)(2) == 12.0  # reads, and does not grow with the context


def test_the_cost_grows_linearly_with_the_context_between_and_beyond_the_measured_ones():
    cost = GROWING.context_cost()
    assert cost(2) == 12.0 and cost.at(64)(2) == 12.0 and cost.at(10)(2) == 12.0  # at or below the short context
    assert ContextCost.of(cost) is cost
    plain = ContextCost.of(CPU_LIKE.cost)  # a curve measured over one context: the same at every context
    assert plain.at(4096)(2) == plain.at(64)(2) == CPU_LIKE.cost(2)
    # contexts are read in steps of 128 above the short one: 544 as 64 + 4 * 128 = 576, (576 - 64) / (1024 - 64) of
    # the way from 12 to 22 ms
    assert cost.at(544)(2) == pytest.approx(12.0 + 512 / 960 * 10.0)
    assert cost.at(960)(2) == pytest.approx(12.0 + 896 / 960 * 10.0)  # 64 + 7 * 128: no rounding
    assert cost.at(2048)(1) == pytest.approx(10.0 + 16 * 128 / 960 * 4.0)  # extended beyond the long context
    # 4 rows: 12 + 8 / 3 over the short context, 22 + 28 / 3 over the long one
    assert cost.at(1024)(4) == pytest.approx(12.0 + 8 / 3 + 1024 / 960 * (22.0 + 28 / 3 - 12.0 - 8 / 3))


def test_a_tree_that_pays_over_a_short_context_is_cut_over_a_long_one():
    # 30 of 50 steps that reached each depth accepted it (rates ~0.6): over 64 cached tokens a row costs ~1.3-2 ms
    # on a 10 ms step and the whole 4-token chain pays; over 4,096 a second row costs ~28 ms more than the ~27 ms
    # step (the long curve extended 4.3x past the short one), so nothing pays: a retrieval drafter's found tree is
    # cut to the root, one that pays per token is not even asked
    for ms, cut, skipped in ((0.0, 1, 0), (0.01, 0, 1)):
        inner = _Chain(ms=ms)
        drafter = CostAwareDrafter(inner, GROWING.context_cost(), explore_every=1000, max_explore_every=1000)
        drafter._reached[1:5] = 50.0
        drafter._accepted[1:5] = 30.0
        assert drafter.propose(np.arange(64), 8).size == 5
        assert drafter.propose(np.arange(4096), 8).size == 1
        assert (drafter.cut_steps, drafter.skipped_steps, len(inner.budgets)) == (cut, skipped, 1 + cut)


def test_measure_cost_curve_on_a_tiny_model(tmp_path):
    target = make_target("llama", vocab_size=64, seed=0, max_positions=256)
    curve = measure_cost_curve(target, sizes=(1, 4, 2), context=16, repeats=2)
    assert curve.sizes == (1, 2, 4) and all(ms > 0 for ms in curve.ms)
    assert curve.long_ms == () and curve.context_cost().at(200)(4) == curve.context_cost()(4)
    both = measure_cost_curve(target, sizes=(1, 2), context=16, repeats=2, long_context=128)
    assert (both.context, both.long_context) == (16, 128) and len(both.long_ms) == 2
    assert all(ms > 0 for ms in both.long_ms)
    held = measure_cost_curve(target, sizes=(1, 2), context=16, repeats=1, long_context=10_000)
    assert held.long_context == 256 - 2 - 1  # as long as the model's context holds beside the largest tree
    assert curve.identity["model"] == target.name
    assert default_curve_path(target, tmp_path).parent == tmp_path
    assert default_curve_path(target, tmp_path) == default_curve_path(target, tmp_path)  # stable name



@pytest.mark.parametrize("long_context", [0, 96])
def test_a_cost_curve_keeps_its_shape_on_a_machine_whose_speed_changes_between_sizes(monkeypatch, long_context):
    """A fake clock: a forward of n rows takes 1 + n / 10 ms times a slowdown that changes from one size to the next
    (the one-token forward paired with a size runs at that size's slowdown). The curve's ratios are the forwards'
    own; the one-token time is the median of the pairs'."""
    import hierspec.calibration as calibration

    target = make_target("llama", vocab_size=64, seed=0, max_positions=256)
    clock, calls = [0.0], [0]
    forward = target.forward_tree
    per_size = 1 + (1 if long_context else 0) + 1  # the pair, then the size over each context

    def slowed_forward(cache, tree, *args, **kwargs):
        out = forward(cache, tree, *args, **kwargs)
        slowdown = 1 + (calls[0] // per_size) % 4  # 1, 2, 3, 4, 1, ... from one size to the next
        clock[0] += (1 + tree.size / 10) * slowdown / 1000
        calls[0] += 1
        return out

    monkeypatch.setattr(target, "forward_tree", slowed_forward)
    monkeypatch.setattr(calibration.time, "perf_counter", lambda: clock[0])
    curve = measure_cost_curve(target, sizes=(1, 2, 4, 8), context=16, repeats=3, long_context=long_context)
    slowdowns = [1 + i % 4 for i in range(4, 16)]  # the three measured rounds' sizes (the first round warms up)
    one = 1.1 * float(np.median(slowdowns))
    assert curve.ms == pytest.approx(tuple(one * (1 + n / 10) / 1.1 for n in (1, 2, 4, 8)), rel=1e-9)
    if long_context:
        assert curve.long_ms == pytest.approx(curve.ms, rel=1e-9)  # the fake costs do not grow with the context

def test_cut_to_depth_keeps_a_breadth_first_prefix():
    tree = build_tree(9, [[1, 2, 3], [1, 4], [5]], sources=["a", "b", "c"])
    cut = cut_to_depth(tree, 1)
    assert cut.tokens.tolist() == [9, 1, 5] and cut.sources == ("root", "a", "c")
    assert cut_to_depth(tree, 0).size == 1 and cut_to_depth(tree, 5).size == tree.size


class _Chain(Drafter):
    """Drafts the chain 1 2 3 4 (cut to the budget); each drafted token costs ``ms``; counts its proposals."""

    name = "chain"

    def __init__(self, ms: float = 0.0) -> None:
        self.ms = ms
        self.budgets: list[int] = []
        self.observed = 0

    def draft_cost(self, tokens):
        return tokens * self.ms

    def propose(self, context, budget):
        self.budgets.append(budget)
        return build_tree(int(context[-1]), [[1, 2, 3, 4][:budget]])

    def observe(self, verdict, context):
        self.observed += 1


def _verdict(tree, accepted):
    return Verdict(tree, path=tuple(range(1, accepted + 1)), bonus=0, target_argmax=np.zeros(tree.size, dtype=int))


def _run(drafter, steps, accepted=lambda tree: 0, budget=8):
    """``steps`` proposals, each answered with ``accepted(tree)`` accepted tokens; the trees' sizes."""
    context = np.array([7])
    sizes = []
    for _ in range(steps):
        tree = drafter.propose(context, budget)
        drafter.observe(_verdict(tree, min(accepted(tree), tree.size - 1)), context)
        sizes.append(tree.size)
    return sizes


def test_depth_follows_observed_acceptance():
    inner = _Chain()
    drafter = CostAwareDrafter(inner, CPU_LIKE.cost, explore_every=1000, max_explore_every=1000)
    sizes = _run(drafter, 30)  # drafts are never accepted: drafting costs 1.6x for nothing
    assert sizes[-20:] == [1] * 20 and drafter.cut_steps + drafter.skipped_steps >= 20
    good = CostAwareDrafter(_Chain(), CPU_LIKE.cost, explore_every=1000, max_explore_every=1000)
    _run(good, 30, accepted=lambda tree: tree.size - 1)  # every draft token accepted: the whole chain pays
    assert good.propose(np.array([7]), 8).size == 5


def test_deeper_depths_start_from_the_continuation_the_shallower_ones_show():
    drafter = CostAwareDrafter(_Chain(), CPU_LIKE.cost)
    assert np.allclose(drafter.rates(3), [0.5, 0.25, 0.125])  # fresh: one half, then the same chance per token
    drafter._reached[1] = drafter._accepted[1] = 8.0  # 8 of 8 one-token drafts accepted
    # r1 = (8 + 2 * 0.5) / (8 + 2) = 0.9; r2 = 0.9^2 / 1 = 0.81; r3 = 0.81^2 / 0.9 = 0.729 (no data below depth 1)
    assert np.allclose(drafter.rates(3), [0.9, 0.81, 0.729])
    drafter._reached[2] = 8.0  # 8 two-token drafts, none accepted its second token: the data outweighs the prior
    assert np.allclose(drafter.rates(3), [0.9, 2 * 0.81 / 10, (2 * 0.81 / 10) ** 2 / 0.9])
    failing = CostAwareDrafter(_Chain(), CPU_LIKE.cost)
    failing._reached[1] = 8.0  # 0 of 8 accepted
    assert np.allclose(failing.rates(3), [0.1, 0.01, 0.001])


def test_a_new_generation_keeps_a_quarter_of_what_earlier_ones_taught():
    drafter = CostAwareDrafter(_Chain(), CPU_LIKE.cost)
    drafter._reached[1:3] = 8.0  # 8 drafts two deep: all first tokens accepted, no second one
    drafter._accepted[1] = 8.0
    drafter.begin(np.array([1, 2, 3]))
    assert drafter._reached[1] == drafter._reached[2] == drafter._accepted[1] == 2.0
    # r1 = (2 + 1) / (2 + 2) = 0.75; r2 = (0 + 2 * 0.75^2) / (2 + 2) = 0.28125, where the 8 stale trials held it at 0.162
    assert np.allclose(drafter.rates(2), [0.75, 0.28125])


def test_a_drafter_that_cannot_pay_never_runs(caplog):
    # 54 ms per drafted token against a 60 ms step: even with every token accepted, at best 1.015x (d = 8:
    # 9 * 60 / (8 * 54 + c(9) = 102.5)), under the 1.05x floor
    inner = _Chain(ms=54.0)
    drafter = CostAwareDrafter(inner, CPU_LIKE.cost, explore_every=2)
    with caplog.at_level("WARNING"):
        sizes = _run(drafter, 200, accepted=lambda tree: tree.size - 1)
    assert inner.budgets == [] and set(sizes) == {1} and drafter.skipped_steps == 200
    assert inner.observed == 200  # it still sees every verdict (context databases, successor tables learn)
    assert "drafting cannot pay" in caplog.text


def test_the_floor_grants_a_good_draft_models_acceptance_not_every_token():
    """SmolLM2's int4 curve as `hierspec calibrate` measured it (6.0 / 6.4 / 6.9 / 9.1 / 14.1 ms at 1 / 2 / 4 / 8 /
    16 rows) and its 90 %-layer self-draft at 0.86 of a step a token (5.16 ms): with every token accepted a 2-token
    draft would reach 3 x 6 / (10.32 + c(3) = 6.65) = 1.061x, over the 1.05x floor, but at 4 in 5 accepted the best
    is 1.8 x 6 / (5.16 + 6.4) = 0.934x, so it never drafts. Qwen2.5-Coder-0.5B for the 1.5B (12.4 ms a token
    against 43.1 / 42.7 / 47.5 / 63.3 / 118.5 ms) reaches 2.44 x 43.1 / (24.8 + c(3) = 45.1) = 1.504x at depth 2."""
    smol = CostCurve((1, 2, 4, 8, 16), (6.0, 6.4, 6.9, 9.1, 14.1), {}).cost
    inner = _Chain(ms=5.16)
    drafter = CostAwareDrafter(inner, smol, explore_every=2)
    sizes = _run(drafter, 50, accepted=lambda tree: tree.size - 1)
    assert inner.budgets == [] and set(sizes) == {1}
    assert drafter._ceiling == pytest.approx(1.8 * 6.0 / (5.16 + 6.4))
    qwen = CostAwareDrafter(_Chain(ms=12.4), CostCurve((1, 2, 4, 8, 16), (43.1, 42.7, 47.5, 63.3, 118.5), {}).cost)
    assert qwen.can_pay(8) and qwen._ceiling == pytest.approx((1 + 0.8 + 0.64) * 43.1 / (2 * 12.4 + 45.1))


class _FreeFallback(_Chain):
    """A costly chain that can also offer the free draft ``9 9`` (as HSDDW offers its retrieval level alone)."""

    def free_proposal(self, context, budget):
        return build_tree(int(context[-1]), [[9, 9][:budget]])


def test_a_step_the_plan_prices_out_sends_the_drafters_free_proposal_and_teaches_the_plan_nothing():
    inner = _FreeFallback(ms=54.0)  # cannot pay, as in the test above
    drafter = CostAwareDrafter(inner, CPU_LIKE.cost, explore_every=2)
    sizes = _run(drafter, 20, accepted=lambda tree: tree.size - 1)
    assert inner.budgets == [] and sizes == [3] * 20 and drafter.skipped_steps == 20
    assert inner.observed == 20 and drafter._reached.sum() == drafter._accepted.sum() == 0
    assert drafter.propose(np.array([7]), 1).tokens.tolist() == [7, 9]  # within the budget


def test_a_free_proposal_is_cut_by_the_acceptance_seen_on_free_proposals():
    """The free ``9 9`` of a drafter that cannot pay, on CPU_LIKE (60 / 96 / 96.67 ms at 1 / 2 / 3 rows): fresh, the
    whole of it (1 + 0.5 + 0.25 tokens in 96.67 ms beats 1 in 60); once nothing is accepted the rates fall (one
    rejected tree: r1 = 1 / 3, r2 = 2 r1^2 / 3 = 2 / 27; 1.41 / 96.67 < 1 / 60) and the root goes alone — the planned drafts'
    counts untouched. Accepted in full, it stays whole."""
    inner = _FreeFallback(ms=54.0)
    drafter = CostAwareDrafter(inner, CPU_LIKE.cost, explore_every=2)
    assert _run(drafter, 1, accepted=lambda tree: 0) == [3]
    assert np.allclose(depth_rates(drafter._free_accepted, drafter._free_reached, 2), [1 / 3, 2 / 27])
    assert _run(drafter, 9, accepted=lambda tree: 0) == [1] * 9 and drafter.cut_steps == 9 and inner.budgets == []
    assert drafter._reached.sum() == drafter._accepted.sum() == 0
    whole = CostAwareDrafter(_FreeFallback(ms=54.0), CPU_LIKE.cost)
    assert _run(whole, 10, accepted=lambda tree: tree.size - 1) == [3] * 10


class _EveryOther(_Chain):
    """A retrieval drafter that finds the one token ``9`` in every other step and nothing in the others."""

    def propose(self, context, budget):
        self.budgets.append(budget)
        return build_tree(int(context[-1]), [[9]] if len(self.budgets) % 2 else [])


def test_a_retrieval_drafter_searches_every_step_and_only_its_found_tree_is_priced():
    """On CPU_LIKE a second row costs 0.6 of a step: a found token accepted 4 times in 5 pays (1.8 tokens in 96 ms
    against 1 in 60), but a plan made before searching, half of whose steps find nothing, would expect 1.4 tokens for
    a 1.5-row (rounded: 2-row) step and skip every search. Searched every step, each found token is verified; the
    search of prompt lookup (reading only the context) is never gated, other retrieval drafters' are."""
    inner = _EveryOther()
    drafter = CostAwareDrafter(inner, CPU_LIKE.cost, explore_every=1000, max_explore_every=1000)
    drafter._reached[1], drafter._accepted[1] = 50.0, 40.0
    sizes = _run(drafter, 20, accepted=lambda tree: tree.size - 1)
    assert sizes == [2, 1] * 10 and len(inner.budgets) == 20 and drafter.skipped_steps == 0
    assert CostAwareDrafter(PromptLookupDrafter(), CPU_LIKE.cost).search_gate is None
    assert CostAwareDrafter(_Chain(), CPU_LIKE.cost).search_gate is not None


class _WaitingWindow(_Chain):
    """A drafter that drafts token by token (it keeps the cost-aware window) but, like HSDDW before its middle model
    starts, answers every step with its free first level's chain ``9 9 9 9``."""

    def use_window(self, window):
        return True

    @property
    def proposed_free(self):
        return True

    def propose(self, context, budget):
        self.budgets.append(budget)
        return build_tree(int(context[-1]), [[9, 9, 9, 9][:budget]])


def test_a_free_chain_in_place_of_a_windowed_draft_is_cut_as_a_free_proposal():
    """The plan drafts (1 ms a token on CPU_LIKE) but the drafter sends its free chain instead: fresh, all four
    tokens pay at the prior (1.94 tokens in 98 ms beat 1 in 60); once one is rejected at once the free rates fall
    and the root goes alone, as for a free proposal — not the whole chain every step, and neither the planned
    drafts' counts nor the window learn from a draft that was not theirs."""
    inner = _WaitingWindow(ms=1.0)
    drafter = CostAwareDrafter(inner, CPU_LIKE.cost, explore_every=1000, max_explore_every=1000)
    assert drafter.window is not None and drafter.plan(8) > 0
    assert _run(drafter, 6, accepted=lambda tree: 0) == [5, 1, 1, 1, 1, 1]
    assert inner.budgets == [8] * 6 and inner.observed == 6
    assert drafter._free_reached[1] > 0 and drafter._reached.sum() == drafter._accepted.sum() == 0
    assert drafter.report()["cost_cut_steps"] == 5


def test_a_costly_drafter_drafts_the_planned_window_once_acceptance_shows_it_pays():
    # 40 ms per token, curve flat at 60 ms up to 8 rows: at the prior (half accepted) one token gives 1.5 / 100
    # tokens per ms < 1 / 60 (no draft); with every token accepted 2 / 100 > 1 / 60, and 3 / 140 more at depth 2
    flat = CostCurve((1, 8, 64), (60.0, 60.0, 240.0), {}).cost
    inner = _Chain(ms=40.0)
    drafter = CostAwareDrafter(inner, flat, explore_every=4)
    assert drafter.plan(8) == 0
    sizes = _run(drafter, 40, accepted=lambda tree: tree.size - 1)
    assert sizes[:3] == [1, 1, 1] and sizes[3] == 2  # skipped, then the 4th step explores one token
    assert inner.budgets[0] == 1  # a drafter that pays per token is asked for the planned window only
    assert drafter.plan(8) >= 2 and max(inner.budgets) <= 8 and sizes[-1] >= 3


class _SlowSearch(_Chain):
    """A retrieval drafter (no draft cost) whose every search takes ``seconds``."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    def propose(self, context, budget):
        time.sleep(self.seconds)
        return super().propose(context, budget)


def test_a_retrieval_search_that_saves_less_than_it_takes_is_run_every_few_steps_only():
    # verifying 1-8 rows costs the same 2 ms, so the plan always drafts; a search takes >= 1 ms
    flat = CostCurve((1, 8, 64), (2.0, 2.0, 8.0), {}).cost
    rare = _SlowSearch(0.001)
    drafter = CostAwareDrafter(rare, flat, explore_every=1000, max_explore_every=1000)
    sizes = _run(drafter, 200, accepted=lambda tree: 0)  # never accepted: saves 0 ms a search
    searches = len(rare.budgets)
    # 16 searches to learn, then looks 2, 4, 8, 16, 32, 32 ... steps apart: 16 + 9 in 200 steps
    assert 16 < searches <= 30 and drafter.gated_steps == 200 - searches and rare.observed == 200
    assert sizes.count(1) >= 200 - searches  # a gated step verifies the root alone
    report = drafter.report()
    assert report["gated_steps"] == drafter.gated_steps and report["search_gate"]["interval"] == 32
    paying = _SlowSearch(0.001)
    drafter = CostAwareDrafter(paying, CPU_LIKE.cost)  # 60 ms steps, every token accepted: 4 x 60 ms saved
    _run(drafter, 60, accepted=lambda tree: tree.size - 1)
    assert len(paying.budgets) == 60 and drafter.gated_steps == 0
    costly = CostAwareDrafter(_Chain(ms=1.0), flat)  # a drafter that pays per token is never gated
    assert costly.search_gate is None


def test_a_retrieval_search_is_priced_net_of_the_rows_that_verify_its_tree():
    # each search takes >= 7.5 ms and one token of its tree is accepted every step, saving a 10 ms step; a second
    # row costs 4.5 ms more on the steep curve (the tree is cut to one token there), nothing on the flat one (margins
    # of ~2 ms either side for a busy machine's sleeps)
    steep = CostCurve((1, 2, 8, 64), (10.0, 14.5, 25.0, 50.0), {}).cost
    flat = CostCurve((1, 8, 64), (10.0, 10.0, 40.0), {}).cost
    runs = {}
    for name, curve in (("steep", steep), ("flat", flat)):
        inner = _SlowSearch(0.0075)
        drafter = CostAwareDrafter(inner, curve, explore_every=1000, max_explore_every=1000)
        drafter._loop = LoopRowCost(warmup=10**9)  # the curve's rows only (the loop's own: the next tests)
        sizes = _run(drafter, 200, accepted=lambda tree: 1)
        runs[name] = (len(inner.budgets), drafter.gated_steps, sizes)
    searches, gated, sizes = runs["steep"]
    # 10 ms saved - 4.5 ms of rows = 5.5 ms a search against its >= 7.5 ms: learned in 16, then ever more rarely
    assert 16 < searches <= 30 and gated == 200 - searches
    assert min(sizes[:16]) >= 2 and sizes[-40:].count(1) >= 35  # trees while it learns, then the root alone
    searches, gated, sizes = runs["flat"]
    assert searches == 200 and gated == 0  # 10 ms saved, no row to pay: every step searches


def test_the_loops_row_cost_is_read_off_its_steps(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(cost_aware.time, "perf_counter", lambda: clock[0])
    loop = LoopRowCost(decay=0.5, warmup=2)
    for rows, ms in ((1, 10.0), (3, 14.0), (1, 10.0)):
        loop.proposed(rows)
        clock[0] += ms / 1e3
        loop.verified()
        assert loop.per_row() is None  # two steps of each kind first
    loop.verified()  # no proposal pending: nothing counted
    loop.proposed(3)
    clock[0] += 5.0  # a generation ended unanswered, the next one's prompt read
    loop.forget_pending()
    loop.verified()
    for rows, ms in ((3, 18.0), (1, 12.0), (2, 14.0)):
        loop.proposed(rows)
        clock[0] += ms / 1e3
        loop.verified()
    # roots 10, 10, then 12 -> 11; rows: (14 - 10) / 2 = 2, then (18 - 10) / 2 = 4 -> 3, then (14 - 11) / 1 = 3 -> 3
    assert loop.per_row() == pytest.approx(3.0)


class _ClockedSearch(_Chain):
    """A retrieval drafter whose search takes 3 ms of a fake clock and finds the chain every other step."""

    def __init__(self, clock: list[float]) -> None:
        super().__init__()
        self.clock = clock

    def propose(self, context, budget):
        self.clock[0] += 3e-3
        tree = super().propose(context, budget)
        return tree if len(self.budgets) % 2 else root_only(int(context[-1]))


def test_the_search_gate_charges_a_row_what_the_loop_pays_for_it(monkeypatch):
    # a flat curve says rows are free; the loop pays 10 ms a step and `row_ms` more for each drafted row; every
    # found tree has one token accepted (10 ms saved), so a search pays while one row costs less than 10 - 2 x 3 ms
    clock = [0.0]
    monkeypatch.setattr(cost_aware.time, "perf_counter", lambda: clock[0])
    flat = CostCurve((1, 8, 64), (10.0, 10.0, 40.0), {}).cost
    searches = {}
    for row_ms in (0.0, 12.0):
        inner = _ClockedSearch(clock)
        drafter = CostAwareDrafter(inner, flat, explore_every=1000, max_explore_every=1000)
        context = np.array([7])
        for _ in range(200):
            tree = drafter.propose(context, 1)  # one token at most: one drafted row
            clock[0] += (10.0 + row_ms * (tree.size - 1)) / 1e3
            drafter.observe(_verdict(tree, tree.size - 1), context)
        searches[row_ms] = len(inner.budgets)
    assert searches[0.0] == 200  # free rows: every step searches
    assert searches[12.0] <= 40  # 12 ms a row against 10 saved: the gate closes once the loop's cost is known


class _ColdFirstSearch(_Chain):
    """A retrieval drafter whose first search of a generation takes 0.2 s (a store's pages first touched), the
    others nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.first = True

    def begin(self, prompt):
        self.first = True

    def propose(self, context, budget):
        if self.first:
            time.sleep(0.2)
            self.first = False
        return super().propose(context, budget)


def test_a_generations_slow_first_search_does_not_price_the_search_out():
    # 2 ms steps, one accepted token a search (2 ms saved) against ~0 ms searches: it pays; counting the first
    # search's 200 ms would have gated it for the rest of the run
    flat = CostCurve((1, 8, 64), (2.0, 2.0, 8.0), {}).cost
    inner = _ColdFirstSearch()
    drafter = CostAwareDrafter(inner, flat, explore_every=1000, max_explore_every=1000)
    for _ in range(2):
        drafter.begin(np.array([7]))
        _run(drafter, 40, accepted=lambda tree: 1)
    assert drafter.gated_steps == 0 and len(inner.budgets) == 80
    assert drafter.report()["search_gate"]["searches"] == 78  # each generation's first search is not counted


def test_the_plan_and_the_cut_read_as_the_formulas_say_on_random_histories():
    # the plan reads its rates, shapes and costs in arrays (every step, for every cost-aware method): its choices
    # are those of the formulas written out one depth at a time, on random acceptance counts, tree shapes, other
    # generations' rows in the forward, contexts (the curve grows with them) and draft costs
    rng = np.random.default_rng(7)
    for trial in range(60):
        drafter = CostAwareDrafter(_Chain(ms=float(rng.choice([0.0, 0.7, 4.0]))), GROWING.context_cost())
        deepest = int(rng.integers(1, 65))
        for counts in (drafter._reached, drafter._asked):
            counts[1:] = rng.uniform(0, 50, counts.shape[0] - 1)
        drafter._accepted[1:] = drafter._reached[1:] * rng.uniform(0, 1, drafter._reached.shape[0] - 1)
        drafter._deep[1:] = drafter._asked[1:] * rng.uniform(0, 1, drafter._asked.shape[0] - 1)
        drafter._nodes[1:] = drafter._deep[1:] * rng.uniform(1, 3, drafter._deep.shape[0] - 1)
        drafter._shared = (int(rng.integers(0, 40)), float(rng.uniform(0, 20)))
        drafter._cost_now = drafter._curve.at(int(rng.integers(1, 3000)))
        assert drafter.plan(deepest) == _plan_by_the_formulas(drafter, deepest)
        tree = build_tree(1, [list(range(2, 2 + int(rng.integers(1, 12)))) for _ in range(int(rng.integers(1, 4)))])
        assert drafter.best_depth(tree) == _cut_by_the_formulas(drafter, tree)


def _rates_by_the_formulas(drafter, deepest):
    rates, before, above = [], 1.0, 1.0
    for d in range(1, deepest + 1):
        prior = 0.5 if d == 1 else above * above / before
        rate = min((drafter._accepted[d] + 2.0 * prior) / (drafter._reached[d] + 2.0), above)
        rates.append(rate)
        before, above = above, rate
    return np.array(rates)


def _best(gains, ms, shared_tokens):
    expected = shared_tokens + 1.0 + np.concatenate([[0.0], np.cumsum(gains)])
    return int(np.argmax(expected / np.array(ms)))


def _plan_by_the_formulas(drafter, deepest):
    if not drafter.can_pay(deepest):
        return 0
    asked = drafter._asked[1 : deepest + 1] + 1.0
    reach, width = (drafter._deep[1 : deepest + 1] + 1.0) / asked, (drafter._nodes[1 : deepest + 1] + 1.0) / asked
    nodes = 1.0 + np.concatenate([[0.0], np.cumsum(width)])
    rows, tokens = drafter._shared
    ms = [drafter.draft_cost(d) + drafter.cost(rows + max(1, round(nodes[d]))) for d in range(deepest + 1)]
    return _best(reach * _rates_by_the_formulas(drafter, deepest), ms, tokens)


def _cut_by_the_formulas(drafter, tree):
    deepest = int(tree.depths.max())
    nodes_up_to = np.cumsum(np.bincount(tree.depths, minlength=deepest + 1))[: deepest + 1]
    rows, tokens = drafter._shared
    return _best(_rates_by_the_formulas(drafter, deepest), [drafter.cost(rows + int(n)) for n in nodes_up_to], tokens)


def test_a_draft_model_learns_no_rejection_from_a_step_it_did_not_draft(tmp_path):
    target = make_target("llama", vocab_size=64, seed=3)
    drafter = make_drafter("sd:draft=self:1,k=3", DrafterContext(target, cost_curve=str(_saved(tmp_path))))
    sd, context = drafter.inner, np.array([5, 6, 7])
    tree = sd.propose(context, 3)
    sd.observe(_verdict(tree, 0), context)
    assert len(sd.threshold.rejected) == 1
    skipped = drafter.propose(context, 0)  # no budget: nothing drafted, the wrapper still passes the verdict on
    drafter.observe(_verdict(skipped, 0), context)
    assert skipped.size == 1 and len(sd.threshold.rejected) == 1


def _saved(tmp_path):
    path = tmp_path / "curve.json"
    save_curve(CPU_LIKE, path)
    return path


def test_exploration_backs_off_while_it_finds_nothing():
    flat = CostCurve((1, 8, 64), (60.0, 60.0, 240.0), {}).cost
    inner = _Chain(ms=40.0)
    drafter = CostAwareDrafter(inner, flat, explore_every=8, max_explore_every=128)
    sizes = _run(drafter, 1000)
    explored = [step + 1 for step, size in enumerate(sizes) if size > 1]
    # the interval doubles after each fruitless exploration: 8, 16, 32, 64, then 128 at most
    assert explored == [8, 16, 32, 64, 128, 256, 384, 512, 640, 768, 896]
    assert inner.budgets == [1] * len(explored)


class _Wide(_Chain):
    """A retrieval drafter (no draft cost) offering four first tokens, each continued: REST's trie of continuations."""

    def propose(self, context, budget):
        self.budgets.append(budget)
        return build_tree(int(context[-1]), [[1, 2], [3, 4], [5, 6], [8, 9]], budget=budget)


def test_an_exploration_verifies_the_drafters_first_choice_at_the_explored_depth_only():
    """A wide tree cut to the root once nothing is accepted (a second row costs 1.6 steps on CPU_LIKE): every
    exploration goes one level deeper with one row, not the level's four (REST's ~3.7 on SmolLM2 cost an exploration
    ~1.1 steps on a Zen 1). On a curve where rows are cheap, it verifies as many of the level's nodes as a quarter of
    a step pays for."""
    drafter = CostAwareDrafter(_Wide(), CPU_LIKE.cost, explore_every=4, max_explore_every=16)
    context = np.array([7])
    explored = []
    for _ in range(40):
        tree = drafter.propose(context, 8)
        drafter.observe(_verdict(tree, 0), context)
        if drafter._exploring:
            explored.append(tree)
    assert len(explored) == 4  # steps 4, 8, 16 and 32
    assert all(tree.tokens.tolist() == [7, 1] and tree.parents.tolist() == [-1, 0] for tree in explored)
    # where rows cost little (a quarter of a step, 15 ms, buys three rows of 4 ms here), it verifies that many
    cheap_rows = CostCurve((1, 4, 8, 64), (60.0, 72.0, 100.0, 240.0), {}).cost  # 4 ms a row up to 4
    wide = CostAwareDrafter(_Wide(), cheap_rows, explore_every=4, max_explore_every=16)
    wide._reached[1] = 50.0  # none accepted
    for _ in range(3):
        assert wide.propose(context, 8).size == 1
    assert wide.propose(context, 8).tokens.tolist() == [7, 1, 3, 5]
    probe = probe_level(build_tree(7, [[1, 2], [3, 4], [5, 6]]), 2)  # levels above kept whole, one node at depth 2
    assert probe.tokens.tolist() == [7, 1, 3, 5, 2] and probe.parents.tolist() == [-1, 0, 0, 0, 1]
    assert probe_level(root_only(7), 1).size == 1


def test_the_remembered_plan_is_the_plan_computed_afresh_at_every_step():
    """The plan is remembered while nothing it reads changes (priced-out steps change no count): over steps with
    random verdicts, budgets, contexts and new generations, it always equals the plan computed anew."""
    rng = np.random.default_rng(0)
    cheap = CostCurve((1, 2, 8, 64), (10.0, 11.0, 14.0, 60.0), {}, context=64, long_context=1024,
                      long_ms=(12.0, 14.0, 22.0, 90.0))
    # a drafter that pays per token (a little): only those are planned before drafting
    drafter = CostAwareDrafter(_Wide(ms=0.01), cheap.context_cost(), explore_every=3, max_explore_every=12)
    plans = set()
    for step in range(300):
        context = np.arange(1 + 300 * (step // 50))  # the curve's context step changes every 50 steps
        budget = 8 if step % 10 else int(rng.integers(1, 12))
        if step % 37 == 36:
            drafter.begin(context)  # a new generation: the counts are scaled down
        drafter._cost_now = drafter._curve.at(context.shape[0])  # what the step's proposal reads the plan with
        assert drafter.plan(budget) == drafter._plan(budget)
        plans.add(drafter.plan(budget))
        tree = drafter.propose(context, budget)
        accepted = int(rng.integers(0, tree.size)) if rng.random() < 0.2 else 0  # mostly priced out
        drafter.observe(_verdict(tree, accepted), context)
    assert len(plans) > 1  # the plan did change along the way
    # nine rejected drafts price a cheap curve's drafts out; the steps after change nothing, a new generation does
    fresh = CostAwareDrafter(_Wide(ms=0.01), CostCurve((1, 2, 8, 64), (10.0, 11.0, 14.0, 60.0), {}).cost,
                             explore_every=1000, max_explore_every=1000)
    assert _run(fresh, 12) == [4] + [2] * 8 + [1] * 3 and fresh.plan(8) == 0
    fresh.begin(np.array([7]))  # what earlier generations taught is kept at a quarter of its weight
    assert fresh.plan(8) == fresh._plan(8) == 1


def test_cost_aware_drafting_is_the_default_and_keeps_greedy_output_identical(tmp_path):
    target = make_target("llama", vocab_size=64, seed=3)
    context = DrafterContext(target, cost_curve=str(_saved(tmp_path)))
    drafter = make_drafter("pld:min_ngram=1", context)
    assert isinstance(drafter, CostAwareDrafter)
    assert isinstance(make_drafter("pld:min_ngram=1,budget=auto", context), CostAwareDrafter)
    assert not isinstance(make_drafter("pld:min_ngram=1,budget=off", context), CostAwareDrafter)
    assert not isinstance(make_drafter("hd", context), CostAwareDrafter)  # its scored tree sizes itself
    assert isinstance(make_drafter("hd:budget=auto", context), CostAwareDrafter)
    rng = np.random.default_rng(5)
    config = GenerationConfig(max_new_tokens=40)
    for _ in range(4):
        motif = rng.integers(1, 64, size=6).tolist()
        prompt = motif * 3 + motif[:2]
        reference = SpeculativeDecoder(target, NoDrafter()).generate(prompt, config)
        assert SpeculativeDecoder(target, drafter).generate(prompt, config).token_ids == reference.token_ids
    with pytest.raises(InputError, match="use auto .* or off"):
        make_drafter("pld:budget=7", context)
    with pytest.raises(InputError, match="hierspec calibrate"):
        make_drafter("pld:budget=auto", DrafterContext(target, cost_curve=str(tmp_path / "none.json")))


def test_a_draft_models_cost_is_its_curves_shape_in_its_targets_milliseconds(tmp_path, monkeypatch):
    """The draft's own curve is measured when first needed (its shape); its step costs the paired ratio of the two
    models' one-token forwards times the target's step (measured once per process)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    target = make_target("llama", vocab_size=64, seed=3, max_positions=256)
    drafter = make_drafter("sd:draft=self:1", DrafterContext(target))
    assert isinstance(drafter, CostAwareDrafter)
    from hierspec import calibration

    pairs = []
    monkeypatch.setattr(calibration, "paired_cost_ratio", lambda model, reference: pairs.append(model) or 0.25)
    draft = drafter.inner.lm.model
    assert not calibration.default_curve_path(draft).is_file()  # measured when first needed
    three = drafter.draft_cost(3)
    assert calibration.default_curve_path(draft).is_file()
    target_step = calibration.verification_cost(target, measure=False)(1)
    assert three == pytest.approx(3 * 0.25 * target_step) and target_step > 0
    assert drafter.draft_cost(5) == pytest.approx(5 * 0.25 * target_step) and pairs == [draft]


def test_a_draft_models_cost_ratio_is_measured_once_per_machine_setting(tmp_path, monkeypatch, caplog):
    """The paired ratio is saved beside the curves and read back by later processes; another thread count (another
    setting) measures its own, and a damaged or foreign file is measured again and replaced. A cache that cannot be
    written still gives the ratio."""
    import torch

    import hierspec.calibration as calibration

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    target = make_target("llama", vocab_size=64, seed=0, max_positions=256)
    draft = make_target("llama", vocab_size=64, seed=1, max_positions=256)
    measured = []
    monkeypatch.setattr(calibration, "paired_cost_ratio",
                        lambda model, reference: measured.append(model) or 0.125 * len(measured))
    path = calibration.default_ratio_path(draft, target)
    assert not path.exists()
    assert calibration.saved_paired_cost_ratio(draft, target) == 0.125 and path.is_file()
    assert calibration.saved_paired_cost_ratio(draft, target) == 0.125 and len(measured) == 1  # read back
    saved = json.loads(path.read_text())
    assert saved["magic"] == "hierspec-cost-ratio" and saved["version"] == 1 and saved["ratio"] == 0.125

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1 if threads > 1 else 2)
        other = calibration.default_ratio_path(draft, target)
        assert other != path and calibration.saved_paired_cost_ratio(draft, target) == 0.25 and len(measured) == 2
    finally:
        torch.set_num_threads(threads)
    assert calibration.saved_paired_cost_ratio(draft, target) == 0.125  # each setting keeps its own

    for damage in (b"{not json", json.dumps({**saved, "ratio": -1.0}).encode(),
                   json.dumps({**saved, "reference": {**saved["reference"], "model": "another"}}).encode()):
        path.write_bytes(damage)
        before = len(measured)
        assert calibration.saved_paired_cost_ratio(draft, target) == 0.125 * (before + 1)
        assert json.loads(path.read_text())["ratio"] == 0.125 * (before + 1)  # replaced by the new measurement

    monkeypatch.setattr(calibration, "write_json_atomic", lambda *args, **kwargs: (_ for _ in ()).throw(
        OSError(28, "No space left on device")))
    path.unlink()
    with caplog.at_level("WARNING", logger="hierspec.calibration"):
        assert calibration.saved_paired_cost_ratio(draft, target) == 0.125 * len(measured)
    assert "used for this run only" in caplog.text and not path.exists()


def test_a_paired_cost_ratio_holds_on_a_machine_whose_speed_changes_between_pairs(monkeypatch):
    """A fake clock: the draft's one-token forward takes 3 units, the target's 10, both times a slowdown that
    changes from one pair to the next (1, 5, 2, 7, ...): each pair's ratio, hence their median, is 0.3, where the
    two models' times taken apart would give any ratio from 3/70 to 21/10."""
    import hierspec.calibration as calibration

    target = make_target("llama", vocab_size=64, seed=0, max_positions=256)
    draft = make_target("llama", vocab_size=64, seed=1, max_positions=256)
    clock, calls, order = [0.0], [0], []
    slowdowns = [1, 5, 2, 7, 3, 6]

    def slowed(model, units):
        forward = model.forward_tree

        def timed_forward(cache, tree, *args, **kwargs):
            out = forward(cache, tree, *args, **kwargs)
            clock[0] += units * slowdowns[(calls[0] // 2) % len(slowdowns)]
            calls[0] += 1
            order.append(units)
            return out
        return timed_forward

    monkeypatch.setattr(draft, "forward_tree", slowed(draft, 3))
    monkeypatch.setattr(target, "forward_tree", slowed(target, 10))
    monkeypatch.setattr(calibration.time, "perf_counter", lambda: clock[0])
    assert calibration.paired_cost_ratio(draft, target, pairs=6, context=16) == pytest.approx(0.3, rel=1e-12)
    assert order[:4] == [10, 3, 3, 10]  # which goes first alternates
    with pytest.raises(InputError, match="at least one pair"):
        calibration.paired_cost_ratio(draft, target, pairs=0)


def test_a_missing_curve_is_measured_once_and_saved(tmp_path, monkeypatch):
    from hierspec import calibration

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # no curve saved by other tests of this session
    target = make_target("llama", vocab_size=64, seed=3, max_positions=256)
    path = calibration.default_curve_path(target)
    assert not path.exists()
    cost = calibration.verification_cost(target)
    assert path.is_file()
    curve = load_curve(path)
    assert curve.sizes == calibration.AUTO_SIZES and all(ms > 0 for ms in curve.ms)
    assert curve.identity["hardware"] and curve.identity["runtime"] == target.runtime.kind
    assert cost(64) >= cost(1) > 0

    def refuse(*_args, **_kwargs):
        raise AssertionError("the saved curve should have been read")

    monkeypatch.setattr(calibration, "measure_cost_curve", refuse)
    calibration.verification_cost(target)
    assert calibration.verification_cost(make_target("llama", vocab_size=64, seed=3, max_positions=256),
                                         measure=False)(4) > 0


def test_cpu_flags_are_read_from_cpuinfo():
    from hierspec.machine import cpu_info, parse_cpuinfo

    text = "processor : 0\nmodel name : AMD EPYC 9R14\nflags : fpu sse avx2 fma avx512f avx512_bf16\n\n" \
           "processor : 1\nmodel name : other\nflags : fpu\n"
    assert parse_cpuinfo(text) == ("AMD EPYC 9R14", ("avx2", "fma", "avx512f", "avx512_bf16"))
    assert parse_cpuinfo("") == ("", ())
    info = cpu_info()
    assert info.model and info.capability and info.describe().startswith(info.model)

"""The search gate: a batched hd step searches its databases only where the search's time pays (hand-made cost
curves and figures, the expected decisions written out); alone it always searches."""

import numpy as np
import torch

from hierspec.accept import accept_greedy
from hierspec.drafters.hierarchy import HierarchyConfig, HierarchyDrafter
from hierspec.drafters.retrieval_gate import FIRST_SEARCHES, RetrievalGate
from hierspec.drafters.scored import ContextCost


def docstring_cost(rows: int) -> float:
    """The module docstring's forward: 9 ms for one row, 11 for 2..8, 20 for 9..57, 22 beyond."""
    return 9.0 if rows == 1 else 11.0 if rows <= 8 else 20.0 if rows <= 57 else 22.0


def warmed_gate(search_ms=1.5, rows=8, tokens=2.2, every=8, most=64) -> RetrievalGate:
    gate = RetrievalGate(every=every, most=most)
    for _ in range(FIRST_SEARCHES):
        gate.record(search_ms, rows, tokens)
    return gate


def test_the_docstring_example():
    gate = warmed_gate()
    assert gate.search_ms == 1.5 and gate.rows == 8 and abs(gate.tokens - 2.2) < 1e-12
    assert gate.pays(docstring_cost)  # alone: 2.2 / 12.5 = 0.176 tokens/ms against 1 / 9 = 0.111
    # beside seven others (56 rows, 15 tokens, 10.5 ms of drafting): 17.2 / 34 = 0.506 against 16 / 30.5 = 0.525
    assert not gate.pays(docstring_cost, rows=56, tokens=15.0, draft_ms=10.5)
    # a cheaper search tips it: 17.2 / 32.9 = 0.523 against 0.525 still skips; free, 17.2 / 32.5 = 0.529 searches
    assert not warmed_gate(search_ms=0.4).pays(docstring_cost, rows=56, tokens=15.0, draft_ms=10.5)
    assert warmed_gate(search_ms=0.0).pays(docstring_cost, rows=56, tokens=15.0, draft_ms=10.5)


def test_no_skip_before_the_first_searches_are_counted():
    gate = RetrievalGate()
    for _ in range(FIRST_SEARCHES):
        assert gate.pays(docstring_cost, rows=56, tokens=15.0, draft_ms=10.5)
        gate.record(50.0, 8, 1)  # searches that cannot pay
    assert not gate.pays(docstring_cost, rows=56, tokens=15.0, draft_ms=10.5)


def test_the_search_cost_is_a_median_and_the_means_start_plain():
    gate = RetrievalGate()
    for ms, tokens in ((1.0, 1), (200.0, 3), (2.0, 2)):  # one stray slow search
        gate.record(ms, 4, tokens)
    assert gate.search_ms == 2.0 and gate.tokens == 2.0 and gate.rows == 4.0


def test_looks_after_skipped_steps_back_off_while_the_skip_holds():
    gate = warmed_gate(tokens=1.0, every=2, most=8)  # searches that never pay in a full batch
    batch = dict(rows=56, tokens=15.0, draft_ms=10.5)
    decisions = []
    for _ in range(16):
        searched = gate.pays(docstring_cost, **batch)
        decisions.append(searched)
        if searched:
            gate.record(1.5, 8, 1)
    # a look after 1 skipped step (the wait of 2 counts the look), then 3 (a wait of 4), then 7 (8: the most)
    assert [i for i, d in enumerate(decisions) if d] == [1, 5, 13]
    assert gate.wait == 8


def test_a_look_that_pays_resets_the_wait():
    gate = warmed_gate(tokens=1.0, every=2, most=8)
    batch = dict(rows=56, tokens=15.0, draft_ms=10.5)
    assert not gate.pays(docstring_cost, **batch)
    assert gate.pays(docstring_cost, **batch)  # the look
    for _ in range(30):  # the text turned easy: the look's search gave 6 tokens, and the steps after it too
        gate.record(1.5, 8, 6)
    assert gate.pays(docstring_cost, **batch) and gate.wait == 2


class CountingDrafter(HierarchyDrafter):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.searches = 0

    def candidates(self, context):
        self.searches += 1
        return super().candidates(context)


def test_hd_skips_its_search_in_a_full_batch_only():
    milliseconds = ContextCost(docstring_cost, milliseconds=True)
    drafter = CountingDrafter(HierarchyConfig(l=1, m=2, order="c"), cost=milliseconds)
    assert drafter.search_gate is not None
    drafter.search_gate = warmed_gate(search_ms=1.5, tokens=1.0)
    context = np.array([4, 5, 6, 4, 5, 6, 4])
    drafter.begin(context[:-1])
    drafter.share_forward(56, 15.0, 10.5)
    tree = drafter.propose(context, budget=8)
    assert tree.size == 1 and drafter.searches == 0  # the root alone, nothing searched
    drafter.observe(accept_greedy(tree, torch.zeros((1, 8))), np.append(context, 0))
    drafter.share_forward(0, 0.0, 0.0)  # alone: it searches whatever the gate's figures
    drafter.propose(np.append(context, 0), budget=8)
    assert drafter.searches == 1


def test_the_gate_is_off_without_a_curve_in_milliseconds_or_when_asked():
    assert HierarchyDrafter(HierarchyConfig(l=1, m=2, order="c")).search_gate is None  # relative cost only
    milliseconds = ContextCost(docstring_cost, milliseconds=True)
    assert HierarchyDrafter(HierarchyConfig(l=1, m=2, order="c", search_gate=False), cost=milliseconds).search_gate \
        is None
    assert HierarchyDrafter(HierarchyConfig(l=1, m=2, order="c", tree="fixed"), cost=milliseconds).search_gate is None

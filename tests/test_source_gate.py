"""The source gate: `hd` searches a database only while the time its accepted tokens save exceeds its search time
(hand-made figures, the expected decisions written out); greedy output unchanged whatever it skips."""

import time

import numpy as np
import torch

from hierspec.accept import accept_greedy
from hierspec.config import GenerationConfig
from hierspec.decode import SpeculativeDecoder
from hierspec.drafters import NoDrafter
from hierspec.drafters.hierarchy import HierarchyConfig, HierarchyDrafter
from hierspec.drafters.scored import ContextCost
from hierspec.drafters.source_gate import SourceGate
from tiny import make_target


def warmed(gate: SourceGate, name: str, ms: float, accepted: int, token_ms: float = 5.0) -> None:
    for _ in range(gate.warmup):
        gate.searched(name, ms, accepted, token_ms)


def due_pattern(gate: SourceGate, name: str, steps: int, ms: float, accepted: int) -> str:
    """'S' for a step that searched ``name`` (accounted with ``ms`` and ``accepted``), '.' for one it skipped."""
    out = []
    for _ in range(steps):
        if gate.due(name):
            gate.searched(name, ms, accepted, 5.0)
            out.append("S")
        else:
            out.append(".")
    return "".join(out)


def test_every_database_is_searched_during_the_warm_up():
    gate = SourceGate(["statistics"], warmup=4)
    assert due_pattern(gate, "statistics", 3, ms=2.0, accepted=0) == "SSS"


def test_a_database_that_saves_less_than_it_costs_is_searched_ever_more_rarely_up_to_every_32_steps():
    gate = SourceGate(["statistics"], warmup=4)
    warmed(gate, "statistics", ms=2.0, accepted=0)  # the 4th search already doubled the interval to 2
    assert due_pattern(gate, "statistics", 2 + 4 + 8, ms=2.0, accepted=0) == ".S" + "...S" + ".......S"
    assert due_pattern(gate, "statistics", 16 + 32 + 32, ms=2.0, accepted=0) == "." * 15 + "S" + ("." * 31 + "S") * 2
    assert gate.report()["statistics"]["interval"] == 32


def test_a_database_whose_search_costs_at_most_a_hundredth_of_a_step_is_never_gated():
    """0.05 ms against a 5 ms step (1 %) is searched every step though its tokens are never accepted; 0.06 ms (1.2 %)
    is gated as any other."""
    cheap = SourceGate(["successors"], warmup=4)
    assert due_pattern(cheap, "successors", 60, ms=0.05, accepted=0) == "S" * 60
    assert cheap.report()["successors"]["interval"] == 1
    dearer = SourceGate(["successors"], warmup=4)
    assert due_pattern(dearer, "successors", 7, ms=0.06, accepted=0) == "SSSS" + ".S."


def test_a_database_whose_tokens_save_more_than_its_search_is_searched_every_step():
    gate = SourceGate(["head"], warmup=4)
    # one accepted token every other search at 5 ms a token: 2.4-5 ms saved per search against 1.5 ms
    for i in range(40):
        assert gate.due("head")
        gate.searched("head", 1.5, (i + 1) % 2, 5.0)
    assert gate.report()["head"]["interval"] == 1


def test_the_rows_that_verify_a_databases_tokens_count_against_what_they_save():
    """One token accepted a search at 5 ms a token against a 1 ms search: searched every step while its rows add
    3.5 ms to the step (1.5 ms net), gated once they add 4.5 ms (0.5 ms net)."""
    paying = SourceGate(["rest"], warmup=4)
    for _ in range(20):
        assert paying.due("rest")
        paying.searched("rest", 1.0, 1, 5.0, rows_ms=3.5)
    assert paying.report()["rest"] == {"searches": 20, "ms": 1.0, "saved_ms": 1.5, "interval": 1}
    losing = SourceGate(["rest"], warmup=4)
    pattern = ""
    for _ in range(10):
        searched = losing.due("rest")
        pattern += "S" if searched else "."
        if searched:
            losing.searched("rest", 1.0, 1, 5.0, rows_ms=4.5)
    assert pattern == "SSSS" + ".S" + "...S"
    assert losing.report()["rest"]["saved_ms"] == 0.5


def test_a_gated_database_that_pays_again_is_searched_every_step_again():
    gate = SourceGate(["statistics"], warmup=4, decay=0.1)
    warmed(gate, "statistics", ms=1.0, accepted=0)
    assert due_pattern(gate, "statistics", 2, ms=1.0, accepted=3) == ".S"  # saved 0 + 0.1 (15 - 0) = 1.5 >= 1.0
    # with nothing accepted the saving decays 1.5 -> 1.35 -> 1.215 -> 1.094 -> 0.984: four searches, then a skip
    assert due_pattern(gate, "statistics", 5, ms=1.0, accepted=0) == "SSSS."


class SlowWrong:
    """A statistics database that spends ~2 ms a search and drafts a token the target never takes."""

    def __init__(self, token: int) -> None:
        self.token = token
        self.searches = 0

    def retrieve(self, context, limit):
        self.searches += 1
        end = time.perf_counter() + 0.002
        while time.perf_counter() < end:
            pass
        return [[self.token, self.token]]


def test_hd_searches_a_slow_database_that_never_wins_ever_more_rarely_and_keeps_plain_decodings_tokens():
    target = make_target("llama", vocab_size=64, seed=4)
    prompt = [3, 4, 5, 6, 3, 4, 5]
    config = GenerationConfig(max_new_tokens=60)
    reference = SpeculativeDecoder(target, NoDrafter()).generate(prompt, config).token_ids
    slow = SlowWrong(next(t for t in range(64) if t not in prompt + reference))
    cost = ContextCost(lambda rows: 1.0 + 0.01 * rows, milliseconds=True)  # a 1 ms target step
    drafter = HierarchyDrafter(HierarchyConfig(l=1, m=2, order="cs"), statistics=slow, cost=cost)
    result = SpeculativeDecoder(target, drafter).generate(prompt, config)
    assert result.token_ids == reference
    record = drafter.report()["source_gate"]["statistics"]
    assert record["saved_ms"] == 0.0 and record["ms"] >= 2.0 and record["interval"] > 1
    assert result.stats.accepted_by_source.get("statistics", 0) == 0
    # the warm-up's 16 searches, then one in 2, 4, 8, ... steps
    assert 16 <= slow.searches < result.stats.target_forwards - 8


def test_the_source_gate_is_off_without_a_curve_in_milliseconds_or_when_asked():
    assert HierarchyDrafter(HierarchyConfig(l=1, m=2, order="c")).source_gate is None  # relative cost only
    milliseconds = ContextCost(lambda rows: 9.0, milliseconds=True)
    assert HierarchyDrafter(HierarchyConfig(l=1, m=2, order="c"), cost=milliseconds).source_gate is not None
    assert HierarchyDrafter(HierarchyConfig(l=1, m=2, order="c", source_gate=False),
                            cost=milliseconds).source_gate is None
    assert HierarchyDrafter(HierarchyConfig(l=1, m=2, order="c", tree="fixed"), cost=milliseconds).source_gate is None


def test_a_step_accounts_each_searched_database_with_its_accepted_tokens_but_a_generations_first():
    """A generation's first search of a database is not accounted (a process's first touches a store's pages:
    ~200 ms for SmolLM2's statistics store against ~0.3 ms later); the second step's is, with its accepted token."""
    milliseconds = ContextCost(lambda rows: 4.0, milliseconds=True)
    drafter = HierarchyDrafter(HierarchyConfig(l=1, m=2, order="c"), cost=milliseconds)
    context = np.array([4, 5, 6, 4, 5, 6, 4])
    drafter.begin(context[:-1])
    for searches, saved in ((0, 0.0), (1, 4.0)):
        tree = drafter.propose(context, budget=8)
        assert tree.size > 1 and tree.sources[1] == "context"
        logits = torch.zeros((tree.size, 8))
        logits[0, int(tree.tokens[1])] = 1.0  # the target takes the first drafted token
        context = np.append(context, int(tree.tokens[1]))
        drafter.observe(accept_greedy(tree, logits), context)
        record = drafter.report()["source_gate"]["context"]
        assert record["searches"] == searches and record["saved_ms"] == saved

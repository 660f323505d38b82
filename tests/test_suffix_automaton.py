"""The suffix automaton and the recent-outputs text: matches equal brute-force longest matches on random streams."""

import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hierspec.datastore.recent_outputs import SEPARATOR, OutputsCursor, RecentOutputs
from hierspec.datastore.suffix_automaton import SuffixAutomaton
from hierspec.drafters.suffix_sources import AutomatonDatabase, OutputsDatabase, capped, match_bin
from hierspec.errors import InputError

streams = st.lists(st.integers(min_value=0, max_value=3), min_size=1, max_size=80)


def longest_repeat(text: list[int]) -> int:
    """Brute force: the longest suffix of ``text`` that also ends at an earlier position."""
    n = len(text)
    best = 0
    for length in range(1, n):
        suffix = text[n - length :]
        if any(text[end - length + 1 : end + 1] == suffix for end in range(length - 1, n - 1)):
            best = length
    return best


def longest_match_in(corpus: list[int], stream: list[int]) -> int:
    """Brute force: the longest suffix of ``stream`` that occurs in ``corpus``."""
    best = 0
    for length in range(1, len(stream) + 1):
        suffix = stream[len(stream) - length :]
        if any(corpus[i : i + length] == suffix for i in range(len(corpus) - length + 1)):
            best = length
    return best


@settings(max_examples=200, deadline=None)
@given(streams)
def test_the_repeat_after_every_token_equals_the_brute_force_longest_repeat(text):
    automaton = SuffixAutomaton()
    for i, token in enumerate(text):
        automaton.extend(token)
        prefix = text[: i + 1]
        length = automaton.repeat_length
        assert length == longest_repeat(prefix)
        if length:
            end = automaton.repeat_end
            assert end < i  # an earlier occurrence, with at least the current token after it
            assert prefix[end - length + 1 : end + 1] == prefix[i - length + 1 :]


@settings(max_examples=200, deadline=None)
@given(streams)
def test_every_continuation_follows_a_true_earlier_occurrence_of_its_match(text):
    automaton = SuffixAutomaton()
    automaton.extend_many(text)
    found = automaton.continuations(limit=10, length=4)
    lengths = [matched for _, matched in found]
    assert lengths == sorted(lengths, reverse=True)
    if automaton.repeat_length:
        assert found and found[0][1] == automaton.repeat_length
    n = len(text)
    for tokens, matched in found:
        suffix = text[n - matched :]
        # some earlier occurrence of the matched suffix is followed by exactly these tokens
        assert any(text[end - matched + 1 : end + 1] == suffix and tuple(text[end + 1 : end + 1 + len(tokens)]) == tokens
                   for end in range(matched - 1, n - 1))


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=1, max_size=60), streams)
def test_advance_matches_another_stream_like_brute_force(corpus, stream):
    automaton = SuffixAutomaton()
    automaton.extend_many(corpus)
    state, length = 0, 0
    for i, token in enumerate(stream):
        state, length = automaton.advance(state, length, token)
        assert length == longest_match_in(corpus, stream[: i + 1])


def test_a_hand_made_example_drafts_what_followed_the_longest_match():
    automaton = SuffixAutomaton()
    automaton.extend_many([5, 6, 7, 9, 5, 6])
    assert automaton.repeat_length == 2 and automaton.repeat_end == 1
    # [5, 6] -> 7 9 5 6; then its suffix [6] (same occurrence, same continuation: skipped as a prefix)
    assert automaton.continuations(limit=4, length=3) == [((7, 9, 5), 2)]
    automaton.extend_many([8, 1, 5, 6])
    # [5, 6] now occurred at 1 and 5; the newest occurrence is drafted first, then the shorter [6]'s
    found = automaton.continuations(limit=4, length=2)
    assert found[0] == ((8, 1), 2)
    assert automaton.continuations(limit=4, length=2, min_match=3) == []


def test_bins_and_depth_caps_on_hand_made_values():
    assert [match_bin(n) for n in (1, 2, 3, 4, 7, 8, 40)] == [3, 2, 2, 1, 1, 0, 0]
    assert capped((1, 2, 3, 4, 5), matched=1, match_depth=2.0) == (1, 2)
    assert capped((1, 2, 3, 4, 5), matched=2, match_depth=1.5) == (1, 2, 3)
    assert capped((1, 2, 3), matched=1, match_depth=0.0) == (1, 2, 3)
    assert capped((1, 2, 3), matched=1, match_depth=0.1) == (1,)


def test_the_automaton_database_follows_a_growing_context_and_restarts_on_a_new_one():
    db = AutomatonDatabase(value_len=3)
    context = np.array([5, 6, 7, 9, 5])
    assert db.retrieve_scored(context, 4) == [((6, 7, 9), 3)]  # one-token match: bin 3
    context = np.append(context, [6, 7])
    assert db.retrieve_scored(context, 1) == [((9, 5, 6), 2)]  # [5, 6, 7]: a 3-token match, bin 2
    assert len(db.automaton) == 7
    db.retrieve_scored(np.array([1, 2, 1]), 4)  # not an extension: starts over
    assert db.automaton.tokens == [1, 2, 1]


def test_recent_outputs_never_match_across_two_outputs():
    outputs = RecentOutputs(max_tokens=100)
    outputs.add([1, 2, 3])
    outputs.add([4, 5, 6])
    cursor = OutputsCursor()
    # [3, 4] spans the join: only [4] matches, then 5 6 follow
    assert outputs.continuations(cursor, [9, 3, 4], limit=4, length=4) == [((5, 6), 1)]
    assert outputs.continuations(cursor, [9, 3, 4, 5], limit=4, length=4) == [((6,), 2)]
    # after the last token of an output the separator follows: nothing to draft
    assert outputs.continuations(cursor, [9, 3, 4, 5, 6], limit=4, length=4) == []


def test_recent_outputs_keep_the_newest_half_when_full_and_cursors_rematch():
    outputs = RecentOutputs(max_tokens=20)
    cursor = OutputsCursor()
    outputs.add([1, 2, 3, 4, 5])
    assert outputs.continuations(cursor, [7, 1, 2], limit=2, length=2) == [((3, 4), 2)]
    outputs.add([10, 11, 12, 13, 14])
    outputs.add([20, 21, 22, 23, 24])
    outputs.add([30, 31, 32, 33, 34])  # 24 tokens with separators: rebuilt from the newest half
    assert outputs.outputs == 1 and len(outputs) == 6
    assert outputs.continuations(cursor, [7, 1, 2, 30], limit=2, length=2) == [((31, 32), 1)]
    assert outputs.continuations(OutputsCursor(), [1, 2], limit=2, length=2) == []  # the oldest were dropped
    assert SEPARATOR < 0
    long = RecentOutputs(max_tokens=20)
    long.add(range(100, 115))
    long.add(range(200, 215))  # each output alone is over half the bound: the newest is kept whole
    assert long.outputs == 1 and len(long) == 16
    assert long.continuations(OutputsCursor(), [200, 201], limit=1, length=2) == [((202, 203), 2)]
    with pytest.raises(InputError):
        RecentOutputs(max_tokens=1)


def test_the_outputs_database_reads_earlier_outputs_while_another_thread_adds_some():
    outputs = RecentOutputs(max_tokens=400)
    outputs.add(list(range(100, 130)))
    db = OutputsDatabase(outputs, value_len=3)
    errors = []

    def writer():
        try:
            for i in range(60):
                outputs.add([200 + i, 201 + i, 202 + i])
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    thread = threading.Thread(target=writer)
    thread.start()
    context = [7, 100, 101]
    for token in range(102, 128):
        found = db.retrieve_scored(np.array(context), 2)
        assert found and found[0][0] == (token, token + 1, token + 2)[: len(found[0][0])]
        context.append(token)
    thread.join()
    assert not errors

"""Suffix-array retrieval agrees with a brute-force scan (the bisected match length too); the trie keeps the most
frequent connected prefixes."""

from collections import Counter
from pathlib import Path

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from hierspec.datastore.suffix import SuffixStore, suffix_array
from hierspec.drafters.rest import RestConfig, RestDrafter, top_trie_nodes

SEP = 65535


def _store(shard_docs):
    shards = []
    for docs in shard_docs:
        tokens = np.array([t for doc in docs for t in list(doc) + [SEP]], dtype=np.uint16)
        shards.append((tokens, suffix_array(tokens)))
    return SuffixStore(Path("."), {"separator": SEP, "num_tokens": sum(len(t) for t, _ in shards)}, shards,
                       vocab_size=SEP, separator=SEP)


def _brute_force(shard_docs, context, n_max, n_min, m):
    for n in range(min(n_max, len(context)), n_min - 1, -1):
        pattern = list(context[-n:])
        found = []
        for docs in shard_docs:
            tokens = [t for doc in docs for t in list(doc) + [SEP]]
            for p in range(len(tokens) - n + 1):
                if tokens[p:p + n] == pattern:
                    cont = []
                    for t in tokens[p + n:p + n + m]:
                        if t == SEP:
                            break
                        cont.append(t)
                    found.append(tuple(cont + [-1] * (m - len(cont))))
        if found:
            return n, found
    return None, []


def test_suffix_array_sorts_suffixes():
    tokens = np.array([2, 1, 2, 1, 0, SEP], dtype=np.uint16)
    sa = suffix_array(tokens)
    suffixes = [tuple(tokens[i:].tolist()) for i in sa]
    assert suffixes == sorted(suffixes)
    assert sa.dtype == np.int32


doc = st.lists(st.integers(0, 3), min_size=1, max_size=12)


@settings(max_examples=250, deadline=None)
@given(
    shard_docs=st.lists(st.lists(doc, min_size=1, max_size=4), min_size=1, max_size=3),
    context=st.lists(st.integers(0, 3), min_size=1, max_size=8),
    n_max=st.integers(1, 6),
    n_min=st.integers(1, 3),
    m=st.integers(1, 5),
)
def test_longest_match_and_continuations_agree_with_brute_force(shard_docs, context, n_max, n_min, m):
    n_min = min(n_min, n_max)
    store = _store(shard_docs)
    match = store.longest_match(np.array(context), n_max, n_min)
    assert store.longest_match(np.array(context), n_max, n_min) == match  # again, from the remembered first rows
    length, expected = _brute_force(shard_docs, context, n_max, n_min, m)
    if length is None:
        assert match is None
        return
    assert match.length == length and match.count == len(expected)
    rows = store.continuations(match, k=10_000, m=m)
    assert Counter(map(tuple, rows.tolist())) == Counter(expected)


def test_continuations_stop_at_document_boundaries_and_corpus_end():
    store = _store([[[1, 2, 3], [1, 2], [5, 1, 2, 4, 4]]])
    match = store.longest_match(np.array([9, 1, 2]), n_max=3, n_min=1)
    assert match.length == 2 and match.count == 3
    rows = sorted(map(tuple, store.continuations(match, k=10, m=3).tolist()))
    assert rows == [(-1, -1, -1), (3, -1, -1), (4, 4, -1)]


def test_k_caps_rows_with_an_even_sample():
    store = _store([[[7, 10 + t] for t in range(10)]])
    match = store.longest_match(np.array([7]), n_max=1, n_min=1)
    assert match.count == 10
    rows = store.continuations(match, k=5, m=1)
    assert rows[:, 0].tolist() == [10, 12, 14, 16, 18]  # evenly spaced over the sorted range


def test_top_trie_nodes_docstring_example():
    rows = np.array([[1, 2], [1, 2], [1, 3], [4, -1]])
    assert [s.tolist() for s in top_trie_nodes(rows, 3)] == [[1], [1, 2], [4]]


def test_top_trie_nodes_hand_example():
    rows = np.array([
        [5, 6, 7],
        [5, 6, 8],
        [5, 6, 7],
        [5, 9, -1],
        [3, 4, 4],
        [3, 4, 4],
    ])
    # counts: [5]=4, [5,6]=3, [3]=2, [3,4]=2, [3,4,4]=2, [5,6,7]=2, [5,6,8]=1, [5,9]=1
    assert [s.tolist() for s in top_trie_nodes(rows, 6)] == [[5], [5, 6], [3], [3, 4], [3, 4, 4], [5, 6, 7]]
    assert [s.tolist() for s in top_trie_nodes(rows, 2)] == [[5], [5, 6]]
    assert top_trie_nodes(np.empty((0, 3), dtype=np.int64), 4) == []
    # min_count 3 keeps [5] (4 rows) and [5, 6] (3 rows) only
    assert [s.tolist() for s in top_trie_nodes(rows, 6, min_count=3)] == [[5], [5, 6]]
    assert top_trie_nodes(rows, 6, min_count=5) == []


@settings(max_examples=200, deadline=None)
@given(rows=st.lists(st.lists(st.integers(-1, 3), min_size=3, max_size=3), min_size=1, max_size=30),
       c=st.integers(1, 20))
def test_top_trie_nodes_are_connected_and_most_frequent(rows, c):
    rows = [r[:r.index(-1)] + [-1] * (3 - r.index(-1)) if -1 in r else r for r in rows]  # -1 only as padding
    counts = Counter()
    for r in rows:
        for d in range(3):
            if r[d] < 0:
                break
            counts[tuple(r[:d + 1])] += 1
    selected = [tuple(s.tolist()) for s in top_trie_nodes(np.array(rows, dtype=np.int64), c)]
    assert len(selected) == min(c, len(counts)) and len(set(selected)) == len(selected)
    chosen = set()
    for node in selected:
        assert len(node) == 1 or node[:-1] in chosen  # each node extends an earlier one: connected
        chosen.add(node)
    if not selected:
        assert not counts
        return
    threshold = min(counts[n] for n in selected)
    assert all(counts[n] <= threshold for n in counts if n not in chosen)  # nothing left out beats a kept node


def test_rest_drafter_builds_tree_from_store():
    store = _store([[[1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 6]]])
    drafter = RestDrafter(store, RestConfig(n_max=4, n_min=1, m=3, c=4))
    tree = drafter.propose(np.array([0, 1, 2]), budget=16)
    assert tree.tokens.tolist() == [2, 3, 6, 4, 5]
    assert tree.parents.tolist() == [-1, 0, 0, 1, 1]
    assert drafter.propose(np.array([8, 9]), budget=16).num_drafted == 0
    assert drafter.propose(np.array([1, 2]), budget=2).num_drafted == 2
    # [3] starts 2 of 3 continuations, [3, 4] and [3, 5] one each: min_share 0.5 keeps [3] only
    confident = RestDrafter(store, RestConfig(n_max=4, n_min=1, m=3, c=4, min_share=0.5))
    assert confident.propose(np.array([0, 1, 2]), budget=16).tokens.tolist() == [2, 3]


@settings(max_examples=200, deadline=None)
@given(rows=st.lists(st.lists(st.integers(-1, 70000), min_size=5, max_size=5), min_size=1, max_size=20))
def test_packed_order_is_lexicographic(rows):
    from hierspec.drafters.rest import lexicographic_order

    array = np.array(rows, dtype=np.int64)
    ordered = [tuple(r) for r in array[lexicographic_order(array)].tolist()]
    assert ordered == sorted(map(tuple, rows))

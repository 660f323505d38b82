import numpy as np
import pytest

from hierspec.tree import ancestor_matrix, below_chain, build_tree, root_only, tree_attention_mask, tree_position_ids


def test_merge_shares_prefixes_and_flattens_breadth_first():
    tree = build_tree(7, [[1, 2], [1, 3], [4]], sources=["a", "b", "c"])
    assert tree.tokens.tolist() == [7, 1, 4, 2, 3]
    assert tree.parents.tolist() == [-1, 0, 0, 1, 1]
    assert tree.depths.tolist() == [0, 1, 1, 2, 2]
    assert tree.sources == ("root", "a", "c", "a", "b")
    assert tree.num_drafted == 4
    assert not tree.is_chain


def test_duplicate_sequences_merge_into_one_path():
    tree = build_tree(0, [[5, 6, 7], [5, 6, 7], [5, 6]])
    assert tree.tokens.tolist() == [0, 5, 6, 7]
    assert tree.parents.tolist() == [-1, 0, 1, 2]
    assert tree.is_chain


def test_budget_keeps_earlier_sequences_whole():
    tree = build_tree(0, [[1, 2, 3], [4, 5, 6]], budget=4)
    assert tree.tokens.tolist() == [0, 1, 4, 2, 3]
    assert tree.num_drafted == 4
    assert build_tree(0, [[1, 2]], budget=0).tokens.tolist() == [0]


def test_probs_follow_the_first_sequence_reaching_a_node():
    tree = build_tree(0, [[1, 2], [1, 3]], probs=[[0.5, 0.25], [0.9, 0.75]])
    assert tree.probs.tolist() == [1.0, 0.5, 0.25, 0.75]


def test_children_and_paths():
    tree = build_tree(9, [[1, 2, 3], [1, 4], [5]])
    # tokens: [9, 1, 5, 2, 4, 3]
    assert tree.tokens.tolist() == [9, 1, 5, 2, 4, 3]
    assert tree.children(0) == {1: 1, 5: 2}
    assert tree.children(1) == {2: 3, 4: 4}
    assert tree.path_to(5) == [1, 3, 5]
    assert tree.sequence(5) == [1, 2, 3]
    assert tree.path_to(0) == []


def test_mask_sees_context_ancestors_and_self_only():
    tree = build_tree(7, [[1, 2], [1, 3], [4]])
    mask = tree_attention_mask(tree, context_length=2)
    expected = np.array([
        # ctx ctx  r  1  4  2  3
        [1, 1, 1, 0, 0, 0, 0],  # root
        [1, 1, 1, 1, 0, 0, 0],  # 1
        [1, 1, 1, 0, 1, 0, 0],  # 4
        [1, 1, 1, 1, 0, 1, 0],  # 2 (under 1)
        [1, 1, 1, 1, 0, 0, 1],  # 3 (under 1)
    ], dtype=bool)
    np.testing.assert_array_equal(mask, expected)


def test_chain_mask_is_causal():
    tree = build_tree(0, [[1, 2, 3]])
    np.testing.assert_array_equal(ancestor_matrix(tree), np.tril(np.ones((4, 4), dtype=bool)))


def test_positions_are_context_length_plus_depth():
    tree = build_tree(7, [[1, 2], [1, 3], [4]])
    assert tree_position_ids(tree, 10).tolist() == [10, 11, 11, 12, 12]


def test_root_only_is_plain_decoding():
    tree = root_only(3)
    assert tree.tokens.tolist() == [3] and tree.num_drafted == 0
    assert tree_attention_mask(tree, 2).tolist() == [[True, True, True]]


def test_mismatched_sources_are_rejected():
    with pytest.raises(ValueError):
        build_tree(0, [[1]], sources=["a", "b"])


def test_a_tree_hung_below_a_chain_keeps_its_shape_breadth_first():
    tree = build_tree(7, [[1, 2], [1, 3], [4]])
    whole = below_chain([5, 6], tree)
    assert whole.tokens.tolist() == [5, 6, *tree.tokens.tolist()]
    assert whole.parents.tolist() == [-1, 0, 1, *[p + 2 for p in tree.parents[1:].tolist()]]
    assert whole.depths.tolist() == [0, 1, 2, *[d + 2 for d in tree.depths[1:].tolist()]]
    assert whole.size == tree.size + 2 and whole.sources[0] == "root"
    assert below_chain([], tree) is tree

"""Exact tree attention (``--attention exact``): every row of any tree bit-identical to the same token verified at
the end of a chain, i.e. in plain decoding, at any depth; close to PyTorch's attention."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from hierspec.decode import GenerationConfig, SpeculativeDecoder
from hierspec.drafters import PromptLookupDrafter
from hierspec.drafters.base import NoDrafter
from hierspec.errors import InputError
from hierspec.runtime import RuntimeConfig
from hierspec.runtime.exact_attention import ExactPlan, exact_attention, exact_attention_blocks
from hierspec.runtime.inputs import TreeInputs
from hierspec.target import TargetModel
from hierspec.tree import build_tree
from tiny import assert_tree_rows_equal_chains, make_model, make_tokenizer

HEADS, KV_HEADS, DIM = 9, 3, 64


def _ancestry(parents: list[int], node: int) -> list[int]:
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def random_sequence_mask(gen: torch.Generator, capacity: int) -> tuple[int, int, torch.Tensor]:
    """A sequence of 1–599 cached tokens under 1–5 new rows, each attending the cache, itself and a random subset of
    the rows before it: ``(past, rows, mask [rows, capacity])``."""
    past, rows = int(torch.randint(1, 600, (1,), generator=gen)), int(torch.randint(1, 6, (1,), generator=gen))
    mask = torch.zeros(rows, capacity, dtype=torch.bool)
    mask[:, :past] = True
    mask[:, past : past + rows] = torch.tril(torch.rand(rows, rows, generator=gen) < 0.6) | torch.eye(
        rows, dtype=torch.bool)
    return past, rows, mask


def _attend(query, keys, values, mask):
    return exact_attention(query, keys, values, ExactPlan(mask), DIM ** -0.5)


def _check_random_tree(gen: torch.Generator, dtype: torch.dtype, parents: list[int] | None = None) -> int:
    """Verify a random breadth-first tree (or the one ``parents`` gives) over a random cache; assert each node's row
    equals the row alone at the end of its path laid out as a chain; returns the tree's depth."""
    past = int(torch.randint(0, 1500, (1,), generator=gen))
    if parents is None:
        nodes = int(torch.randint(2, 24, (1,), generator=gen))
        parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, nodes)]
    nodes = len(parents)
    rows = nodes + int(torch.randint(0, 8, (1,), generator=gen))
    width = -(-(past + rows) // 512) * 512
    cache_k, cache_v = (torch.randn(1, KV_HEADS, width, DIM, generator=gen).to(dtype) for _ in range(2))
    node_k, node_v = (torch.randn(1, KV_HEADS, nodes, DIM, generator=gen).to(dtype) for _ in range(2))
    node_q = torch.randn(1, HEADS, nodes, DIM, generator=gen).to(dtype)
    keys, values = cache_k.clone(), cache_v.clone()
    keys[:, :, past : past + nodes], values[:, :, past : past + nodes] = node_k, node_v
    mask = torch.zeros(rows, width, dtype=torch.bool)
    mask[:, :past] = True
    for node in range(nodes):
        mask[node, [past + a for a in _ancestry(parents, node)]] = True
    mask[nodes:, past] = True  # padding rows, as the runtime's
    query = torch.zeros(1, HEADS, rows, DIM, dtype=dtype)
    query[:, :, :nodes] = node_q
    tree = _attend(query, keys, values, mask)
    reference = F.scaled_dot_product_attention(
        query.reshape(1, KV_HEADS, -1, DIM), keys, values, attn_mask=mask.repeat(HEADS // KV_HEADS, 1)[None, None],
        scale=DIM ** -0.5).view(KV_HEADS, HEADS // KV_HEADS, rows, DIM).permute(2, 0, 1, 3).reshape(rows, -1)
    tolerance = {torch.float64: 1e-10, torch.float32: 1e-5}.get(dtype, 2e-2)
    torch.testing.assert_close(tree[:nodes], reference[:nodes], rtol=tolerance, atol=tolerance)
    for node in range(nodes):
        path = _ancestry(parents, node)
        keys, values = cache_k.clone(), cache_v.clone()
        keys[:, :, past : past + len(path)] = node_k[:, :, path]
        values[:, :, past : past + len(path)] = node_v[:, :, path]
        alone = torch.zeros(1, width, dtype=torch.bool)
        alone[:, : past + len(path)] = True
        row = _attend(node_q[:, :, node : node + 1], keys, values, alone)[0]
        assert torch.equal(row, tree[node]), f"past {past}, node {node} of {nodes} in {rows} rows"
    return max(len(_ancestry(parents, node)) for node in range(nodes)) - 1


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_every_row_of_a_random_tree_equals_the_same_row_alone_bit_for_bit(dtype):
    gen = torch.Generator().manual_seed({torch.float64: 0, torch.float32: 1}.get(dtype, 2))
    depths = [_check_random_tree(gen, dtype) for _ in range(40)]
    assert max(depths) >= 5  # trees with deep branches were among them


def test_rows_of_branches_deeper_than_sixteen_tokens_are_exact_too():
    """The earlier split was exact to depth 15 only; walking each row's own keys has no depth limit."""
    depth = 20
    # root, then two branches of `depth` nodes, breadth-first: root, a1, b1, a2, b2, ...
    parents = [-1] + [0, 0] + [node - 2 for node in range(3, 1 + 2 * depth)]
    for dtype in (torch.float32, torch.bfloat16):
        assert _check_random_tree(torch.Generator().manual_seed(3), dtype, parents) == depth


def test_a_row_that_attends_nothing_is_refused():
    mask = torch.ones(3, 8, dtype=torch.bool)
    mask[1] = False
    with pytest.raises(ValueError, match="at least one key"):
        ExactPlan(mask)


def _target(dtype=torch.float32, **runtime) -> TargetModel:
    model = make_model("llama", vocab_size=64, seed=7, dtype=dtype, hidden=64, layers=2)
    return TargetModel(model, make_tokenizer(64), name="tiny-llama", runtime=RuntimeConfig(**runtime))


def test_packed_runtime_tree_rows_equal_their_paths_verified_as_chains():
    assert_tree_rows_equal_chains(_target(kind="packed", attention="exact"))


def test_exact_attention_keeps_greedy_output_and_is_close_to_sdpa():
    exact, sdpa = _target(kind="packed", attention="exact"), _target(kind="packed", attention="sdpa")
    assert exact.runtime.exact and not sdpa.runtime.exact
    prompt = [4, 8, 15, 16, 23, 42, 4, 8, 15]
    cache_a, cache_b = exact.new_cache(), sdpa.new_cache()
    exact.prefill(cache_a, prompt[:-1])
    sdpa.prefill(cache_b, prompt[:-1])
    tree = build_tree(prompt[-1], [[4, 8], [9, 9, 9], [4, 2]])
    # float32 sums in two orders (the kernel's own, four keys at a time, against SDPA's blocks): logits of ~10
    # agree to a few 1e-5
    torch.testing.assert_close(exact.forward_tree(cache_a, tree).logits, sdpa.forward_tree(cache_b, tree).logits,
                               rtol=1e-5, atol=5e-5)
    config = GenerationConfig(max_new_tokens=30, stop_at_eos=False)
    reference = SpeculativeDecoder(exact, NoDrafter()).generate(prompt, config)
    assert SpeculativeDecoder(exact, PromptLookupDrafter()).generate(prompt, config).token_ids == reference.token_ids


def test_batched_trees_under_exact_attention_equal_each_tree_alone():
    target = _target(kind="packed", attention="exact")
    prompts = ([4, 8, 15, 16, 23, 42, 4, 8, 15], [7, 7, 1, 2, 3, 9, 9, 30, 31, 32, 33])
    trees = (build_tree(15, [[4, 8], [9, 9, 9], [4, 2]]), build_tree(33, [[1], [2, 3, 4, 5]]))
    alone = []
    for prompt, tree in zip(prompts, trees):
        cache = target.new_cache()
        target.prefill(cache, prompt[:-1])
        alone.append(target.forward_tree(cache, tree).logits)
    caches = target.runtime.slot_caches(2)
    for cache, prompt in zip(caches, prompts):
        target.prefill(cache, prompt[:-1])
    together = target.runtime.forward_trees(caches, trees)
    for (logits, _), own in zip(together, alone):
        assert torch.equal(logits, own)


def test_exact_attention_needs_the_owned_decoder():
    with pytest.raises(InputError, match="own decoder"):
        _target(attention="exact", decoder="transformers")
    with pytest.raises(InputError, match="unknown attention"):
        RuntimeConfig(attention="fast")


def test_exact_attention_is_the_default_wherever_it_can_run():
    """``auto``: sdpa flipped near-ties against plain decoding on a Zen 4 (BENCHMARKS.md), so exact is the default
    on hierspec's own CPU decoder, and PyTorch's attention where that decoder does not run."""
    own = _target(kind="packed")
    assert own.runtime.exact and own.runtime.describe()["attention"] == "exact"
    stock = _target(decoder="transformers")
    assert not stock.runtime.exact and stock.runtime.describe()["attention"] == "sdpa"


def test_keys_are_read_in_place_from_a_cache_buffer_with_the_same_result_as_a_copy():
    gen = torch.Generator().manual_seed(5)
    buffer = torch.randn(2, 1, KV_HEADS, 700, DIM, generator=gen)  # two slots of a pool, 700 slots of capacity
    view = buffer[1, :, :, :300]  # what a cache layer hands attention: [1, kv_heads, visible, d], not contiguous
    query = torch.randn(1, HEADS, 5, DIM, generator=gen)
    mask = torch.ones(5, 300, dtype=torch.bool).tril(295)
    plan = ExactPlan(mask)
    in_place = exact_attention(query, view, view, plan, 0.125)
    assert torch.equal(in_place, exact_attention(query, view.contiguous(), view.contiguous(), plan, 0.125))
    scores = (query.view(KV_HEADS, 3, 5, DIM) @ view[0, :, None].transpose(-1, -2)) * 0.125
    reference = torch.softmax(scores.masked_fill(~mask, -torch.inf), -1) @ view[0, :, None]
    torch.testing.assert_close(in_place, reference.permute(2, 0, 1, 3).reshape(5, -1), rtol=1e-5, atol=1e-5)


def test_one_call_over_a_pool_of_sequences_equals_each_sequence_alone():
    """Sequences in slots of one ``[slots, kv_heads, capacity, d]`` buffer (a slot pool's layer) attended by one
    :func:`exact_attention_blocks` call: every row bit-equal to its own sequence's :func:`exact_attention`."""
    gen = torch.Generator().manual_seed(11)
    slots, capacity = 4, 700
    pool_k, pool_v = (torch.randn(slots, KV_HEADS, capacity, DIM, generator=gen) for _ in range(2))
    plans, queries, alone, used = [], [], [], [0, 1, 3]  # slot 2 holds another sequence's keys, never read
    for slot in used:
        past, rows, mask = random_sequence_mask(gen, capacity)
        query = torch.randn(1, HEADS, rows, DIM, generator=gen)
        plans.append(ExactPlan(mask))
        queries.append(query)
        alone.append(exact_attention(query, pool_k[slot : slot + 1], pool_v[slot : slot + 1], plans[-1], 0.125))
    blocks = np.concatenate([np.full(q.shape[2], slot * KV_HEADS, dtype=np.int64) for slot, q in zip(used, queries)])
    together = exact_attention_blocks(torch.cat(queries, dim=2), pool_k.flatten(0, 1), pool_v.flatten(0, 1),
                                      ExactPlan.concatenate(plans, blocks), KV_HEADS, 0.125)
    assert torch.equal(together, torch.cat(alone))


@pytest.mark.parametrize("groups", [1, 3])
def test_a_plan_made_from_the_tree_equals_the_plan_read_from_its_mask(groups):
    """``fill_exact``'s plan (made from the parents) holds the very arrays ``ExactPlan`` reads from ``fill``'s mask,
    for random trees, cache lengths, padding rows and grouped (folded) masks."""
    rng = np.random.default_rng(7)
    inputs = TreeInputs(torch.device("cpu"), groups=groups, align=8)
    for _ in range(200):
        parts = [list(map(int, rng.integers(0, 50, size=rng.integers(1, 6)))) for _ in range(rng.integers(0, 5))]
        tree = build_tree(int(rng.integers(0, 50)), parts, ["x"] * len(parts))
        past, rows = int(rng.integers(0, 300)), tree.size + int(rng.integers(0, 4))
        ids, positions, mask = inputs.fill(tree, past, rows)
        ids, positions = ids.clone(), positions.clone()
        from_mask = ExactPlan(mask[0, 0, :rows])
        exact_ids, exact_positions, from_tree = inputs.fill_exact(tree, past, rows)
        assert torch.equal(exact_ids, ids) and torch.equal(exact_positions, positions)
        for name in ("indptr", "indices", "blocks"):
            got, want = getattr(from_tree, name), getattr(from_mask, name)
            assert got.dtype == want.dtype and np.array_equal(got, want), (name, tree.parents, past, rows)

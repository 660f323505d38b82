"""A batch's sequences in slots of one shared KV buffer: one attention call per layer gives every row exactly what
its own sequence's attention gives alone (the batch invariance continuous batching rests on), and the slots behave
as ordinary caches (prefill, growth, the accepted path kept)."""

import numpy as np
import pytest
import torch

from hierspec.runtime.attention import tree_attention
from hierspec.runtime.kv_cache import TreeCache
from hierspec.runtime.slots import SlotPool, finish_slot_batch, plan_slot_batch, slot_attention
from hierspec.tree import build_tree
from tiny import make_target

DIM = 16


def _tree_mask(past: int, rows: int, width: int, groups: int, rng) -> torch.Tensor:
    """A folded boolean tree mask ``[1, 1, groups * rows, width]``: the context, the diagonal and random earlier
    rows (any pattern with the diagonal is a valid one for the kernel)."""
    block = np.tril(rng.random((rows, rows)) < 0.5) | np.eye(rows, dtype=bool)
    mask = np.zeros((rows, width), dtype=bool)
    mask[:, :past] = True
    mask[:, past : past + rows] = block
    return torch.from_numpy(np.tile(mask, (groups, 1)))[None, None]


@pytest.mark.parametrize("kv_heads,groups", [(3, 3), (2, 1), (1, 4)])
def test_one_attention_call_equals_each_sequence_alone(kv_heads, groups):
    """float32 (the CPU runtimes' dtype): sequences in slots 0, 1 and 3 of 5 (a hole and an unused slot), contexts
    on both sides of a 512-key block, 1 to 7 rows each; every row's output and every written key bit-equal to the
    sequence's own cache and :func:`tree_attention` over its own aligned width."""
    rng = np.random.default_rng(kv_heads * 10 + groups)
    torch.manual_seed(groups)
    heads = kv_heads * groups
    pool = SlotPool(num_layers=1, slots=5, capacity=512)
    alone = [TreeCache(1, 512) for _ in range(5)]
    pasts = {0: 100, 1: 530, 3: 20}
    for slot, past in pasts.items():
        context_k, context_v = torch.randn(2, 1, kv_heads, past, DIM).unbind(0)
        pool.caches[slot].layers[0].update(context_k, context_v)
        alone[slot].layers[0].update(context_k, context_v)
    for rows_by_slot in ({0: 1, 1: 5, 3: 3}, {0: 7, 1: 1, 3: 4}, {0: 2, 3: 6}):
        slots = sorted(rows_by_slot)
        bounds, masks, start = [], [], 0
        for slot in slots:
            rows, past = rows_by_slot[slot], pool.caches[slot].get_seq_length()
            width = -(-(past + rows) // 512) * 512
            masks.append(_tree_mask(past, rows, width, groups, rng))
            bounds.append((start, start + rows))
            start += rows
        query = torch.randn(1, heads, start, DIM)
        key, value = torch.randn(2, 1, kv_heads, start, DIM).unbind(0)
        plan = plan_slot_batch([pool.caches[s] for s in slots], bounds, masks, groups, torch.float32)
        together = slot_attention(plan, 0, query, key, value, scaling=0.25)
        finish_slot_batch(plan)
        for slot, (a, b), mask in zip(slots, bounds, masks):
            layer = alone[slot].layers[0]
            layer.align = 512
            keys, values = layer.update(key[:, :, a:b], value[:, :, a:b])
            additive = torch.zeros(mask.shape).masked_fill_(~mask, -torch.inf)
            own, _ = tree_attention(None, query[:, :, a:b], keys, values, additive, scaling=0.25)
            assert torch.equal(together[a:b], own.reshape(b - a, heads * DIM)), f"slot {slot} rows {a}:{b}"
            assert pool.caches[slot].get_seq_length() == layer.length
            assert torch.equal(pool.caches[slot].layers[0].keys, layer.keys)
            assert torch.equal(pool.caches[slot].layers[0].values, layer.values)


def test_a_slot_grows_every_slot_and_keeps_what_they_hold():
    pool = SlotPool(num_layers=2, slots=3, capacity=4)
    held = torch.arange(3.0).view(1, 1, 3, 1)
    for layer in pool.caches[0].layers:
        layer.update(held, -held)
    longer = torch.arange(10.0).view(1, 1, 10, 1)
    pool.caches[2].layers[1].update(longer, longer)  # past the capacity: every slot, every layer doubles twice
    assert pool.capacity == 16 and all(k.shape == (3, 1, 16, 1) for k in pool.keys)
    for layer in pool.caches[0].layers:
        assert layer.keys.flatten().tolist() == [0.0, 1.0, 2.0] and layer.values.flatten().tolist() == [0, -1, -2]
        assert layer._keys.data_ptr() == pool.keys[layer.index].data_ptr()  # views of the new buffer
    assert pool.caches[2].layers[1].keys.flatten().tolist() == list(range(10))
    with pytest.raises(AttributeError):
        pool.caches[0].layers[0].keys = held


def test_forward_trees_on_slots_equals_each_tree_alone_across_steps():
    """A tiny float32 model on the packed runtime (keys in whole 512-key blocks, as every CPU runtime that batches
    attends them), three sequences (contexts 5, 600 and 300: key widths 512 and 1024 in one call) verifying
    branching trees for three steps with their accepted paths kept, then one sequence retired and the other two
    (slots 0 and 2) verified together: every logit equals the sequence's own forwards on its own cache."""
    target = make_target("qwen2", vocab_size=64, seed=5, max_positions=2048, dtype=torch.float32)
    runtime = target.runtime
    assert runtime.batches and runtime.kind == "packed"
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 64, size=n).tolist() for n in (5, 600, 300)]
    slots = runtime.slot_caches(3)
    alone = [target.new_cache() for _ in prompts]
    for prompt, slot, own in zip(prompts, slots, alone):
        target.prefill(slot, prompt[:-1])
        target.prefill(own, prompt[:-1])
    roots = [p[-1] for p in prompts]
    for step in range(4):
        active = [0, 1, 2] if step < 3 else [0, 2]
        trees = [build_tree(roots[i], [rng.integers(1, 64, size=3).tolist(), rng.integers(1, 64, size=2).tolist()])
                 for i in active]
        pasts = [slots[i].get_seq_length() for i in active]
        together = target.forward_trees([slots[i] for i in active], trees)
        for i, tree, past, out in zip(active, trees, pasts, together):
            own = target.forward_tree(alone[i], tree)
            assert torch.equal(out.logits, own.logits), f"step {step} sequence {i}"
            kept = (0, *tree.path_to(tree.size - 1)[1:]) if tree.size > 1 else (0,)
            target.keep_path(slots[i], past, kept)
            target.keep_path(alone[i], past, kept)
            roots[i] = int(out.logits[kept[-1]].argmax())

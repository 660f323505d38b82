"""The int4 decoder's compiled exact attention (``int4_attention.cpp``): every tree row bit-identical to the same row
alone at the end of its path, on one thread or two, in one sequence's cache or a pool's; close to the numba kernel;
bad plans refused; the int4 decoder's layers run through it."""

import threading

import numpy as np
import pytest
import torch

from hierspec.runtime import int4_kernel
from hierspec.runtime.decoder import LlamaFamilyDecoder
from hierspec.runtime.exact_attention import ExactPlan, exact_attention
from hierspec.tree import build_tree
from test_exact_attention import _ancestry, random_sequence_mask
from test_quantized import _int4_target, _tiny, _tiny_k_quant
from tiny import assert_tree_rows_equal_chains

HEADS, KV_HEADS, DIM = 9, 3, 64
SCALE = DIM ** -0.5


@pytest.fixture(scope="module")
def module():
    compiled, reason = int4_kernel.compiled_kernel()
    if compiled is None:
        pytest.skip(reason)
    return compiled


@pytest.fixture(params=[1, 2])
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def _tensors(plan: ExactPlan) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.from_numpy(plan.indptr), torch.from_numpy(plan.indices), torch.from_numpy(plan.blocks)


def _attend(module, query, key, value, keys, values, write_blocks, write_slots, mask, blocks=None, scale=SCALE):
    plan = ExactPlan(mask)
    if blocks is not None:
        plan.blocks = np.ascontiguousarray(blocks, dtype=np.int64)
    return module.exact_attention(query, key, value, keys, values, write_blocks, write_slots, *_tensors(plan), scale)


# SmolLM2's heads; Qwen2.5-1.5B's; a head size with a tail past whole vectors (16 or 8 lanes); one query per key;
# seven queries per key (query heads are taken in blocks of up to four)
SHAPES = [(HEADS, KV_HEADS, DIM), (12, 2, 128), (4, 2, 72), (3, 3, 40), (14, 2, 64)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_every_row_of_a_random_tree_equals_the_row_alone_and_the_rows_keys_are_written(module, threads, shape):
    heads, kv_heads, dim = shape
    scale = dim ** -0.5
    gen = torch.Generator().manual_seed(threads)
    for _ in range(6 if shape[2] == DIM else 3):
        past = int(torch.randint(0, 1500, (1,), generator=gen))
        nodes = int(torch.randint(2, 24, (1,), generator=gen))
        parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, nodes)]
        capacity = past + nodes + 40
        cache_k, cache_v = (torch.randn(kv_heads, capacity, dim, generator=gen) for _ in range(2))
        node_k, node_v = (torch.randn(1, kv_heads, nodes, dim, generator=gen) for _ in range(2))
        # queries as the layer hands them: a view of [1, rows, heads, dim] with heads and rows transposed
        node_q = torch.randn(1, nodes, heads, dim, generator=gen).transpose(1, 2)
        mask = torch.zeros(nodes, capacity, dtype=torch.bool)
        mask[:, :past] = True
        for node in range(nodes):
            mask[node, [past + a for a in _ancestry(parents, node)]] = True
        keys, values = cache_k.clone(), cache_v.clone()
        tree = _attend(module, node_q, node_k, node_v, keys, values, torch.zeros(nodes, dtype=torch.long),
                       torch.arange(past, past + nodes), mask, scale=scale)
        assert torch.equal(keys[:, past : past + nodes], node_k[0]) and torch.equal(values[:, :past], cache_v[:, :past])
        reference = exact_attention(node_q.double(), keys[None].double(), values[None].double(), ExactPlan(mask), scale)
        torch.testing.assert_close(tree.double(), reference, rtol=1e-5, atol=1e-6)
        for node in range(nodes):
            path = _ancestry(parents, node)
            keys, values = cache_k.clone(), cache_v.clone()  # the path's earlier tokens already cached, as a chain
            keys[:, past : past + len(path) - 1] = node_k[0, :, path[:-1]]
            values[:, past : past + len(path) - 1] = node_v[0, :, path[:-1]]
            alone = torch.zeros(1, capacity, dtype=torch.bool)
            alone[:, : past + len(path)] = True
            row = _attend(module, node_q[:, :, node : node + 1], node_k[:, :, node : node + 1],
                          node_v[:, :, node : node + 1], keys, values, torch.zeros(1, dtype=torch.long),
                          torch.tensor([past + len(path) - 1]), alone, scale=scale)
            assert torch.equal(row[0], tree[node]), f"past {past}, node {node} of {nodes}"


@pytest.mark.parametrize("shape", [(HEADS, KV_HEADS, DIM), (12, 2, 128), (4, 2, 72)],
                         ids=lambda s: "x".join(map(str, s)))
def test_a_context_in_consecutive_slots_gives_the_bits_of_the_same_entries_scattered(module, threads, shape):
    """A context in one run of slots is read at a stride, one spread over slots with gaps through a list of
    addresses: the same entries in the same order give the same bits either way (a chain of five rows)."""
    heads, kv_heads, dim = shape
    gen = torch.Generator().manual_seed(dim + threads)
    past, rows = 400, 5
    capacity = 2 * past + rows + 8
    context_k, context_v = (torch.randn(kv_heads, past, dim, generator=gen).half() for _ in range(2))
    query = torch.randn(1, heads, rows, dim, generator=gen)
    key, value = (torch.randn(1, kv_heads, rows, dim, generator=gen) for _ in range(2))
    scattered = torch.sort(torch.randperm(2 * past, generator=gen)[:past]).values  # ascending, with gaps
    assert int(scattered[-1] - scattered[0]) > past - 1
    outputs = []
    # the rows' own slots right after the context's last, as decoding writes them
    for slots, written in ((torch.arange(past), torch.arange(past, past + rows)),
                           (scattered, torch.arange(2 * past, 2 * past + rows))):
        keys, values = (torch.zeros(kv_heads, capacity, dim, dtype=torch.half) for _ in range(2))
        keys[:, slots], values[:, slots] = context_k, context_v
        mask = torch.zeros(rows, capacity, dtype=torch.bool)
        mask[:, slots] = True
        for row in range(rows):  # a chain: each row attends the rows before it and itself
            mask[row, written[: row + 1]] = True
        outputs.append(_attend(module, query, key, value, keys, values, torch.zeros(rows, dtype=torch.long), written,
                               mask, scale=dim ** -0.5))
    assert torch.equal(outputs[0], outputs[1])


@pytest.mark.parametrize("half", [False, True], ids=["float32", "float16"])
def test_rows_that_share_few_or_no_leading_slots_and_many_rows_each_equal_the_row_alone(module, threads, half):
    """Rows are attended in blocks that read their common leading slots once: rows whose slot lists part early (or
    at once), a row whose slots are a prefix of the others', and more rows than one block holds (40) still give
    each row its bits alone."""
    gen = torch.Generator().manual_seed(5 + threads)
    capacity, rows = 900, 40
    cache_k, cache_v = (torch.randn(KV_HEADS, capacity, DIM, generator=gen) for _ in range(2))
    if half:
        cache_k, cache_v = cache_k.half(), cache_v.half()
    query = torch.randn(1, rows, HEADS, DIM, generator=gen).transpose(1, 2)
    key, value = (torch.randn(1, KV_HEADS, rows, DIM, generator=gen) for _ in range(2))
    written = torch.arange(capacity - rows, capacity)
    mask = torch.zeros(rows, capacity, dtype=torch.bool)
    for row in range(rows):
        if row % 3 == 0:  # a random subset: parts from its neighbours at once or early
            mask[row, : capacity - rows] = torch.rand(capacity - rows, generator=gen) < 0.5
        else:  # a common context, its length varying (row 1's a prefix of row 2's)
            mask[row, : 300 + 7 * (row % 5)] = True
        mask[row, written[row]] = True
    keys, values = cache_k.clone(), cache_v.clone()
    together = _attend(module, query, key, value, keys, values, torch.zeros(rows, dtype=torch.long), written, mask)
    for row in range(rows):
        alone = _attend(module, query[:, :, row : row + 1], key[:, :, row : row + 1], value[:, :, row : row + 1],
                        keys.clone(), values.clone(), torch.zeros(1, dtype=torch.long), written[row : row + 1],
                        mask[row : row + 1])
        assert torch.equal(alone[0], together[row]), f"row {row}"


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_a_float16_cache_is_attended_as_its_entries_widened_and_its_rows_written_rounded(module, shape):
    """A float16 buffer gives the float32 call's bits on the same entries widened (widening is exact), and the rows'
    keys and values go in rounded to nearest, as PyTorch rounds them."""
    heads, kv_heads, dim = shape
    gen = torch.Generator().manual_seed(dim)
    past, rows, mask = random_sequence_mask(gen, 700)  # up to 599 cached and 5 new
    query = torch.randn(1, heads, rows, dim, generator=gen)
    key, value = (torch.randn(1, kv_heads, rows, dim, generator=gen) for _ in range(2))
    half_k, half_v = (torch.randn(kv_heads, 700, dim, generator=gen).half() for _ in range(2))
    wide_k, wide_v = half_k.float(), half_v.float()
    blocks, positions = torch.zeros(rows, dtype=torch.long), torch.arange(past, past + rows)
    got = _attend(module, query, key, value, half_k, half_v, blocks, positions, mask, scale=dim ** -0.5)
    assert torch.equal(half_k[:, past : past + rows], key[0].half())
    assert torch.equal(half_v[:, past : past + rows], value[0].half())
    expected = _attend(module, query, key.half().float(), value.half().float(), wide_k, wide_v, blocks, positions,
                       mask, scale=dim ** -0.5)
    assert torch.equal(got, expected)
    with pytest.raises(RuntimeError, match="both alike"):
        _attend(module, query, key, value, half_k, wide_v, blocks, positions, mask)
    key[0, 0, 0, 0] = 7e4  # beyond float16: refused, not stored as infinity
    with pytest.raises(RuntimeError, match="beyond float16's range"):
        _attend(module, query, key, value, half_k, half_v, blocks, positions, mask, scale=dim ** -0.5)


def test_one_call_over_a_pool_of_sequences_equals_each_sequence_alone(module, threads):
    gen = torch.Generator().manual_seed(11)
    slots, capacity = 4, 700
    pool_k, pool_v = (torch.randn(slots * KV_HEADS, capacity, DIM, generator=gen) for _ in range(2))
    inputs, alone, used = [], [], [0, 1, 3]  # slot 2 holds another sequence's keys, neither read nor written
    for slot in used:
        past, rows, mask = random_sequence_mask(gen, capacity)
        query, key, value = (torch.randn(1, n, rows, DIM, generator=gen) for n in (HEADS, KV_HEADS, KV_HEADS))
        block = torch.full((rows,), slot * KV_HEADS)
        keys, values = (b[slot * KV_HEADS : (slot + 1) * KV_HEADS].clone() for b in (pool_k, pool_v))
        alone.append(_attend(module, query, key, value, keys, values, torch.zeros(rows, dtype=torch.long),
                             torch.arange(past, past + rows), mask))
        inputs.append((query, key, value, block, torch.arange(past, past + rows), mask))
    query, key, value = (torch.cat([i[n] for i in inputs], dim=2) for n in range(3))
    blocks, positions = torch.cat([i[3] for i in inputs]), torch.cat([i[4] for i in inputs])
    untouched = pool_k[2 * KV_HEADS : 3 * KV_HEADS].clone()
    plan = ExactPlan.concatenate([ExactPlan(i[5]) for i in inputs], blocks.numpy())
    together = module.exact_attention(query, key, value, pool_k, pool_v, blocks, positions, *_tensors(plan), SCALE)
    assert torch.equal(together, torch.cat(alone))
    assert torch.equal(pool_k[2 * KV_HEADS : 3 * KV_HEADS], untouched)


def test_plans_that_read_or_write_outside_the_buffers_are_refused(module):
    keys, values = torch.zeros(KV_HEADS, 16, DIM), torch.zeros(KV_HEADS, 16, DIM)
    query, key = torch.zeros(1, HEADS, 1, DIM), torch.zeros(1, KV_HEADS, 1, DIM)
    zero = torch.zeros(1, dtype=torch.long)
    indptr = torch.tensor([0, 2])
    with pytest.raises(RuntimeError, match="attended slot outside"):
        module.exact_attention(query, key, key, keys, values, zero, zero, indptr, torch.tensor([0, 16]), zero, SCALE)
    with pytest.raises(RuntimeError, match="written slot outside"):
        module.exact_attention(query, key, key, keys, values, zero, torch.tensor([16]), indptr, torch.tensor([0, 1]),
                               zero, SCALE)
    with pytest.raises(RuntimeError, match="block outside"):
        module.exact_attention(query, key, key, keys, values, zero, zero, indptr, torch.tensor([0, 1]),
                               torch.tensor([1]), SCALE)
    with pytest.raises(RuntimeError, match="at least one key"):
        module.exact_attention(query, key, key, keys, values, zero, zero, torch.tensor([0, 0]),
                               torch.zeros(0, dtype=torch.long), zero, SCALE)
    with pytest.raises(RuntimeError, match="float32"):
        module.exact_attention(query.double(), key, key, keys, values, zero, zero, indptr, torch.tensor([0, 1]),
                               zero, SCALE)


def test_the_int4_decoder_runs_its_layers_as_one_compiled_call_close_to_the_python_layers(module, tmp_path,
                                                                                        monkeypatch):
    # float32 products: the AMX ones round their inputs to bfloat16, where a last-bit difference in attention may
    # move a tiny random model's logits by ~1e-3 of their scale
    target = _int4_target(*_tiny(tmp_path), "compiled", attention="exact")
    decoder = target.runtime.decoder
    if decoder._fused is None:
        pytest.skip("the compiled layer halves are not used here")
    assert decoder._fused.attends
    calls = []
    original = LlamaFamilyDecoder.tree_step

    def counted(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        if out is not None:  # the whole forward as ExactLayerStack.step: one compiled call
            calls.append(args)
        return out

    monkeypatch.setattr(LlamaFamilyDecoder, "tree_step", counted)
    prompt, chain = [3, 14, 15, 9, 26, 5, 35], [8, 9, 7, 9, 3]

    tree = build_tree(chain[0], [chain[1:], [4, 4], [9, 1, 2]])

    def forward() -> torch.Tensor:
        cache = target.runtime.new_cache()
        target.runtime.prefill(cache, prompt)
        logits, _ = target.runtime.forward_tree(cache, tree)
        assert cache.get_seq_length() == len(prompt) + target.runtime.rows_for(tree.size)
        return logits

    compiled = forward()
    assert len(calls) == 1 and len(decoder._fused.layer_stack()) == len(decoder.layers)
    decoder._fused.attends = False
    python = forward()
    assert len(calls) == 1
    torch.testing.assert_close(compiled, python, rtol=1e-4, atol=1e-4)  # measured 2e-5
    assert torch.equal(compiled.argmax(-1), python.argmax(-1))


def test_the_layer_stack_equals_one_compiled_call_per_layer(module, tmp_path):
    """``ExactLayerStack.forward`` is ``exact_layer`` through every layer in order, bit for bit, buffers included."""
    target = _int4_target(*_tiny(tmp_path), "compiled", attention="exact")
    decoder = target.runtime.decoder
    if decoder._fused is None or not decoder._fused.attends:
        pytest.skip("the compiled layers do not attend here")
    gen = torch.Generator().manual_seed(5)
    rows, past = 3, 20
    hidden = torch.randn(rows, decoder.embedding.shape[1], generator=gen)
    cos, sin = decoder._rotation(torch.arange(past, past + rows))
    mask = torch.zeros(rows, 64, dtype=torch.bool)
    mask[:, : past + 1] = True
    mask[1:, past + 1] = mask[2, past + 2] = True
    plan = ExactPlan(mask)
    indptr, indices, blocks = _tensors(plan)
    buffers = [[torch.randn(decoder.kv_heads, 64, decoder.head_dim, generator=gen) for _ in range(2)]
               for _ in decoder.layers]
    copies = [[b.clone() for b in pair] for pair in buffers]
    write_blocks, write_slots = torch.zeros(rows, dtype=torch.long), torch.arange(past, past + rows)
    stacked = decoder._fused.layer_stack().forward(hidden, cos, sin, [k for k, _ in buffers], [v for _, v in buffers],
                                                   write_blocks, write_slots, indptr, indices, blocks)
    one_by_one = hidden
    for layer, (keys, values) in zip(decoder.layers, copies):
        one_by_one = module.exact_layer(one_by_one, layer.norm1, decoder.eps, layer.qkv.native, layer.qkv.bias, cos,
                                        sin, decoder.heads, decoder.kv_heads, decoder.head_dim, keys, values,
                                        write_blocks, write_slots, indptr, indices, blocks, decoder.scaling,
                                        layer.norm2, layer.out.native, layer.gate_up.native, layer.down.native,
                                        layer.gate_up.widths[0])
    assert torch.equal(stacked, one_by_one)
    assert all(torch.equal(a, b) for pair, copy in zip(buffers, copies) for a, b in zip(pair, copy))
    stack = decoder._fused.layer_stack()
    with pytest.raises(RuntimeError, match="one key and value buffer per layer"):
        stack.forward(hidden, cos, sin, [], [], write_blocks, write_slots, indptr, indices, blocks)
    # the plan is checked once per forward, against buffers that must all have the first one's shape
    keys, values = [k for k, _ in buffers], [v for _, v in buffers]
    with pytest.raises(RuntimeError, match="attended slot outside"):
        stack.forward(hidden, cos, sin, keys, values, write_blocks, write_slots, indptr, indices + 64, blocks)
    shorter = keys[:-1] + [keys[-1][:, :32].contiguous()]
    with pytest.raises(RuntimeError, match="alike in shape"):
        stack.forward(hidden, cos, sin, shorter, values, write_blocks, write_slots, indptr, indices, blocks)


def _forward_entries(runtime, tree, rows: int, prompt: list[int], stepped: bool):
    """A tree's forward over a fresh cache holding ``prompt`` — as one ``tree_step`` call or through the decoder's
    Python path — its (logits, hidden), its cache length and every layer's entries."""
    cache = runtime.new_cache()
    runtime.prefill(cache, prompt)
    past = cache.get_seq_length()
    decoder = runtime.decoder
    if stepped:
        out = decoder.tree_step(cache, tree, rows, want_hidden=True)
        assert out is not None
    else:
        ids, positions, _, plan = runtime._tree_inputs(runtime.inputs, tree, past, rows)
        out = decoder.forward(ids, positions, None, cache, slice(0, tree.size), True, True, plan=plan)
    entries = [t[0, :, : past + rows].clone() for layer in cache.layers for t in (layer._keys, layer._values)]
    return out, cache.get_seq_length(), entries


@pytest.mark.parametrize("model", ["llama", "k-quant"])
def test_a_tree_step_in_one_call_equals_the_decoders_forward_bit_for_bit(module, tmp_path, model):
    """``tree_step`` (the rows' tokens, positions, plan, embedding and rotation rows, every layer, the final norm and
    the head as one ``ExactLayerStack.step``) gives the decoder's own logits, hidden states and cache entries, bit for
    bit: a root alone, a chain, a branching tree, each in its own row count and in a padded bucket."""
    files = _tiny(tmp_path) if model == "llama" else _tiny_k_quant(tmp_path)
    runtime = _int4_target(*files, "vnni8", attention="exact").runtime
    if runtime.decoder._step_head is None:
        pytest.skip("the compiled layers do not attend here")
    prompt = [3, 14, 15, 9, 26, 5, 35, 8, 9]
    for tree in (build_tree(7, []), build_tree(7, [[9, 3, 2, 3]]), build_tree(7, [[9, 7], [4, 4], [9, 1, 2]])):
        for rows in (tree.size, tree.size + 3):
            (got, got_length, got_entries), (want, want_length, want_entries) = (
                _forward_entries(runtime, tree, rows, prompt, stepped) for stepped in (True, False))
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (tree.tokens, rows)
            assert got_length == want_length == len(prompt) + rows
            assert all(torch.equal(a, b) for a, b in zip(got_entries, want_entries))
    assert got[0].shape == (tree.size, runtime.decoder.lm_head.widths[0])


def test_a_tree_step_declines_where_it_does_not_apply_and_refuses_bad_trees(module, tmp_path):
    """Without the compiled layers' attention (or with another head) ``tree_step`` answers ``None`` and leaves the
    cache as it was (the forward then takes the decoder's Python path); a tree whose parents do not precede their
    children, a token outside the vocabulary or a position past the rotation table is refused with a clear error."""
    runtime = _int4_target(*_tiny(tmp_path), "vnni8", attention="exact").runtime
    decoder = runtime.decoder
    if decoder._step_head is None:
        pytest.skip("the compiled layers do not attend here")
    cache = runtime.new_cache()
    runtime.prefill(cache, [3, 14, 15])
    stack = decoder._fused.layer_stack()
    keys, values = zip(*(layer.buffers() for layer in cache.layers))
    head, bias = decoder._step_head

    def step(tokens, parents, depths, past=2, rows=None, tables=(decoder._cos, decoder._sin)):
        arrays = (torch.tensor(a, dtype=torch.long) for a in (tokens, parents, depths))
        return stack.step(decoder.embedding, *arrays, past, rows or len(tokens), *tables, keys, values,
                          decoder.final_norm, head, bias)

    with pytest.raises(RuntimeError, match="parents must precede children"):
        step([7, 8], [-1, 1], [0, 1])
    with pytest.raises(RuntimeError, match="root's parent"):
        step([7, 8], [0, 0], [0, 1])
    with pytest.raises(RuntimeError, match="outside the embedding table"):
        step([7, decoder.embedding.shape[0]], [-1, 0], [0, 1])
    with pytest.raises(RuntimeError, match="beyond the rotation tables"):
        step([7], [-1], [0], past=decoder._cos.shape[0])
    with pytest.raises(RuntimeError, match="rows >= n"):
        step([7, 8], [-1, 0], [0, 1], rows=1)
    length = cache.get_seq_length()
    decoder._fused.attends = False
    assert decoder.tree_step(cache, build_tree(7, [[8]]), 2, want_hidden=False) is None
    assert cache.get_seq_length() == length


def test_the_compiled_layers_give_every_tree_row_its_chains_logits(module, tmp_path):
    assert_tree_rows_equal_chains(_int4_target(*_tiny(tmp_path), attention="exact"))


def _stack_inputs(decoder, rows: int, past: int, seed: int):
    """Random hidden rows, their rotation, a chain's plan after ``past`` cached entries and random float32 buffers."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(rows, decoder.embedding.shape[1], generator=gen)
    cos, sin = decoder._rotation(torch.arange(past, past + rows))
    width = past + rows + 8
    mask = torch.zeros(rows, width, dtype=torch.bool)
    for r in range(rows):
        mask[r, : past + r + 1] = True
    indptr, indices, blocks = _tensors(ExactPlan(mask))
    buffers = [[torch.randn(decoder.kv_heads, width, decoder.head_dim, generator=gen) for _ in range(2)]
               for _ in decoder.layers]
    writes = torch.zeros(rows, dtype=torch.long), torch.arange(past, past + rows)
    return hidden, cos, sin, buffers, writes, (indptr, indices, blocks)


@pytest.mark.parametrize("model", ["llama", "k-quant"])
def test_a_forward_with_a_helper_thread_equals_one_without_bit_for_bit(module, tmp_path, model):
    """Few rows over integer products run as a team (the helper takes at::parallel_for's second chunk of every
    product and attention call and fetches the next layer's weights between them): the same hidden states and cache
    entries as without, bit for bit, on two threads, and on one or three (no team there)."""
    files = _tiny(tmp_path) if model == "llama" else _tiny_k_quant(tmp_path)
    target = _int4_target(*files, "vnni8", attention="exact")
    decoder = target.runtime.decoder
    if decoder._fused is None or not decoder._fused.attends:
        pytest.skip("the compiled layers do not attend here")
    team, alone = decoder._fused.new_stack(team=True), decoder._fused.new_stack(team=False)
    assert team.runs_as_team(1) and team.runs_as_team(64) and not team.runs_as_team(65)
    assert not alone.runs_as_team(1)
    # another kernel's products would run on one thread inside a team: never one there
    other = _int4_target(*files, "compiled", attention="exact").runtime.decoder
    assert not other._fused.new_stack(team=True).runs_as_team(1)
    before = torch.get_num_threads()
    try:
        for threads in (2, 1, 3):  # a team on two threads only
            torch.set_num_threads(threads)
            for rows in (1, 3, 8, 20):
                hidden, cos, sin, buffers, writes, plan = _stack_inputs(decoder, rows, 30, seed=rows)
                copies = [[b.clone() for b in pair] for pair in buffers]
                got = team.forward(hidden, cos, sin, [k for k, _ in buffers], [v for _, v in buffers], *writes, *plan)
                want = alone.forward(hidden, cos, sin, [k for k, _ in copies], [v for _, v in copies], *writes, *plan)
                assert torch.equal(got, want), (threads, rows)
                assert all(torch.equal(a, b) for pair, copy in zip(buffers, copies) for a, b in zip(pair, copy))
    finally:
        torch.set_num_threads(before)


def test_the_stacks_reused_tensors_never_reach_its_caller_and_two_threads_may_share_a_stack(module, tmp_path):
    """A stack forward reuses its layers' tensors from one forward to the next (``int4_scratch.h``): what it returns
    is its own (the next forward leaves it as it was), and a second thread's forward while the first runs allocates
    its own — the same results as one after the other."""
    target = _int4_target(*_tiny(tmp_path), "vnni8", attention="exact")
    decoder = target.runtime.decoder
    if decoder._fused is None or not decoder._fused.attends:
        pytest.skip("the compiled layers do not attend here")
    stack = decoder._fused.layer_stack()
    inputs = [_stack_inputs(decoder, rows, 30, seed=seed) for seed, rows in enumerate((1, 1, 3, 3))]

    def forward(hidden, cos, sin, buffers, writes, plan):
        copies = [[b.clone() for b in pair] for pair in buffers]
        return stack.forward(hidden, cos, sin, [k for k, _ in copies], [v for _, v in copies], *writes, *plan)

    alone, kept = [], []
    for args in inputs:
        alone.append(forward(*args))
        kept.append(alone[-1].clone())
    assert all(torch.equal(a, b) for a, b in zip(alone, kept))  # later forwards wrote none of the earlier results
    assert not torch.equal(kept[0], kept[1])  # other inputs (seeds), other results: a real check above
    results = [None] * len(inputs)

    def run(index: int) -> None:
        for _ in range(20):
            results[index] = forward(*inputs[index])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(inputs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert all(torch.equal(got, want) for got, want in zip(results, kept))


def test_an_error_inside_a_team_forward_reaches_the_caller_and_the_next_forward_runs(module, tmp_path):
    """Float64 buffers pass the stack's shape checks and fail at the first layer's attention, on the team's own
    thread while the helper waits: the error is raised, and the helper has stopped (the next forward completes)."""
    target = _int4_target(*_tiny(tmp_path), "vnni8", attention="exact")
    decoder = target.runtime.decoder
    if decoder._fused is None or not decoder._fused.attends:
        pytest.skip("the compiled layers do not attend here")
    team = decoder._fused.layer_stack()
    assert team.runs_as_team(2)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        hidden, cos, sin, buffers, writes, plan = _stack_inputs(decoder, 2, 10, seed=1)
        doubles = [[b.double() for b in pair] for pair in buffers]
        with pytest.raises(RuntimeError, match="float32 or float16"):
            team.forward(hidden, cos, sin, [k for k, _ in doubles], [v for _, v in doubles], *writes, *plan)
        out = team.forward(hidden, cos, sin, [k for k, _ in buffers], [v for _, v in buffers], *writes, *plan)
        assert out.shape == hidden.shape and torch.isfinite(out).all()
    finally:
        torch.set_num_threads(before)

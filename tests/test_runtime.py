"""The verification runtime: prepacked linears, shared-input fusion, tree attention, the growable KV cache, input
buffers and bucket padding."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hierspec.config import GenerationConfig
from hierspec.decode import SpeculativeDecoder
from hierspec.drafters import NoDrafter, PromptLookupDrafter
from hierspec.errors import InputError
from hierspec.runtime import RuntimeConfig, onednn
from hierspec.runtime.fusion import find_shared_inputs
from hierspec.runtime.inputs import TreeInputs, bucket_for
from hierspec.runtime.kv_cache import TreeCache
from hierspec.target import TargetModel
from hierspec.tree import build_tree
from drafters_for_tests import ScriptedDrafter
from tiny import assert_chain_equals_steps, make_model, make_target, make_tokenizer

needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="PyTorch without oneDNN")


# ---------------------------------------------------------------- the private oneDNN ops (fail loudly if they change)
@needs_onednn
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_private_onednn_linear_ops_still_match_f_linear(dtype):
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("no native bfloat16 on this CPU")
    assert onednn.probe(dtype) is None, onednn.probe(dtype)
    generator = torch.Generator().manual_seed(1)
    weight = torch.randn(96, 80, generator=generator).to(dtype)
    bias = torch.randn(96, generator=generator).to(dtype)
    rows = torch.randn(7, 80, generator=generator).to(dtype)
    got = onednn.packed_linear(rows, onednn.pack_weight(weight), bias)
    tolerance = 1e-5 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(got.float(), F.linear(rows.float(), weight.float(), bias.float()), rtol=tolerance,
                               atol=tolerance)


@needs_onednn
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_products_do_not_depend_on_the_row_count(dtype):
    """What tree verification relies on: a row's product is the same whatever rows travel with it (from 4 rows up,
    the runtime's smallest bucket)."""
    if onednn.probe(dtype) is not None:
        pytest.skip(onednn.probe(dtype))
    generator = torch.Generator().manual_seed(2)
    for out_features, in_features in ((192, 64), (64, 192), (1000, 64)):
        packed = onednn.pack_weight(torch.randn(out_features, in_features, generator=generator).to(dtype))
        rows = torch.randn(64, in_features, generator=generator).to(dtype)
        full = onednn.packed_linear(rows, packed, None)
        for count in (4, 6, 8, 12, 16, 24, 32, 48):
            assert torch.equal(onednn.packed_linear(rows[:count], packed, None), full[:count])


def test_probe_refuses_dtypes_it_does_not_pack():
    assert "float64" in onednn.probe(torch.float64)


# ---------------------------------------------------------------- choosing the runtime
def test_float64_models_fall_back_to_eager_linears():
    target = make_target("llama")
    assert target.runtime.kind == "eager" and target.runtime.packing is None
    assert all(type(m) is not onednn.PackedLinear for m in target.model.modules())


def test_asking_for_the_packed_runtime_where_it_is_unavailable_is_a_clear_error():
    with pytest.raises(InputError, match="packed runtime is unavailable"):
        TargetModel(make_model("llama"), make_tokenizer(64), runtime=RuntimeConfig(kind="packed"))
    with pytest.raises(InputError, match="unknown runtime"):
        RuntimeConfig(kind="fast")
    with pytest.raises(InputError, match="increasing"):
        RuntimeConfig(buckets=(8, 4))


@needs_onednn
def test_packed_runtime_swaps_linears_reversibly_and_keeps_the_state_dict():
    model = make_model("llama", dtype=torch.float32)
    names_before = sorted(model.state_dict())
    target = TargetModel(model, make_tokenizer(64), runtime=RuntimeConfig(decoder="transformers"))
    assert target.runtime.kind == "packed"
    linears = [m for m in model.modules() if isinstance(m, (nn.Linear, onednn.PackedLinear))]
    assert linears and all(type(m) is onednn.PackedLinear for m in linears)
    assert sorted(model.state_dict()) == names_before
    with target.stock():
        assert all(type(m) is nn.Linear for m in model.modules() if isinstance(m, (nn.Linear,
                                                                                   onednn.PackedLinear)))
        assert model.config._attn_implementation == "sdpa"
    assert model.config._attn_implementation == "hierspec_tree"
    assert all(type(m) is not nn.Linear for m in model.modules())


@needs_onednn
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_shared_input_linears_are_found_and_fused_exactly(arch):
    model = make_model(arch, dtype=torch.float32, layers=2)
    onednn.LinearPacking(model)
    groups = find_shared_inputs(model, torch.arange(4).unsqueeze(0))
    names = {id(m): n for n, m in model.named_modules()}
    found = sorted(sorted(names[id(m)].rsplit(".", 1)[1] for m in g) for g in groups)
    assert found == [["gate_proj", "up_proj"]] * 2 + [["k_proj", "q_proj", "v_proj"]] * 2
    ids = torch.tensor([[3, 1, 4, 1, 5, 9]])
    with torch.inference_mode():
        before = model(input_ids=ids).logits
        # packs nothing new, fuses the groups
        target = TargetModel(model, make_tokenizer(64), runtime=RuntimeConfig(decoder="transformers"))
        assert len(target.runtime.fused_groups) == 4
        after = model(input_ids=ids).logits
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)


@needs_onednn
def test_a_fused_member_called_on_another_input_still_computes_its_own_product():
    model = make_model("llama", dtype=torch.float32, layers=1)
    target = TargetModel(model, make_tokenizer(64), runtime=RuntimeConfig(decoder="transformers"))
    q_proj = model.model.layers[0].self_attn.q_proj
    assert q_proj.group is not None
    x, y = torch.randn(1, 3, 32), torch.randn(1, 3, 32)
    with torch.inference_mode():
        model.model.layers[0].self_attn.k_proj(x)  # the group now holds products of x
        got = q_proj(y)
    torch.testing.assert_close(got, F.linear(y, q_proj.weight), rtol=1e-5, atol=1e-5)
    assert target.runtime.describe()["fused_groups"] == 2


# ---------------------------------------------------------------- inputs, buckets and the cache
def test_bucket_for_pads_to_the_smallest_bucket_that_fits():
    assert [bucket_for(n, (4, 8, 16)) for n in (1, 4, 5, 16, 17)] == [4, 4, 8, 16, 17]
    assert bucket_for(3, ()) == 3


def test_tree_inputs_pad_with_rows_no_real_node_sees():
    tree = build_tree(7, [[1, 2], [3]])  # tokens [7, 1, 3, 2], depths [0, 1, 1, 2]
    inputs = TreeInputs(torch.device("cpu"), groups=2, align=4)
    ids, positions, mask = inputs.fill(tree, past=3, rows=5)
    assert ids.tolist() == [[7, 1, 3, 2, 7]]
    assert positions.tolist() == [[3, 4, 4, 5, 3]]
    assert mask.shape == (1, 1, 10, 8)  # 2 groups x 5 rows; 3 + 5 = 8 columns, already a multiple of 4
    expected = np.array([
        [1, 1, 1, 1, 0, 0, 0, 0],
        [1, 1, 1, 1, 1, 0, 0, 0],
        [1, 1, 1, 1, 0, 1, 0, 0],
        [1, 1, 1, 1, 1, 0, 1, 0],
        [1, 1, 1, 0, 0, 0, 0, 1],
    ], dtype=bool)
    assert np.array_equal(mask[0, 0, :5].numpy(), expected)
    assert np.array_equal(mask[0, 0, 5:].numpy(), expected)  # the second query head of each group: same rows
    _, _, wider = inputs.fill(tree, past=4, rows=4)
    assert wider.shape[-1] == 8 and not wider[0, 0, :, 8:].any()


def test_tree_inputs_written_through_numpy_equal_the_torch_writes_used_off_the_cpu():
    """CPU buffers are filled through NumPy views; the torch writes other devices take give the same inputs, on
    random trees, paddings and pasts (each buffer reused across fills, as the runtime does)."""
    rng = np.random.default_rng(3)
    host, device_path = TreeInputs(torch.device("cpu"), groups=3, align=8), TreeInputs(torch.device("cpu"), groups=3,
                                                                                       align=8)
    for _ in range(40):
        branches = [rng.integers(0, 50, size=rng.integers(1, 5)).tolist() for _ in range(rng.integers(0, 4))]
        tree = build_tree(int(rng.integers(0, 50)), branches)
        past, rows = int(rng.integers(0, 300)), tree.size + int(rng.integers(0, 4))
        device_path._host = None  # what a CUDA TreeInputs holds
        expected = [t.clone() for t in device_path.fill(tree, past, rows)]
        got = host.fill(tree, past, rows)
        assert all(torch.equal(a, b) for a, b in zip(got, expected))


def test_a_layers_buffers_follow_its_growth():
    cache = TreeCache(num_layers=1, capacity=4)
    like = torch.zeros(1, 2, 0, 8)
    start, buffers = cache.reserve(3, like)
    assert start == 0 and buffers[0][0].shape == (2, 4, 8)
    assert cache.reserve(1, like)[1][0][0] is buffers[0][0]  # the same views while the buffer stays
    start, grown = cache.reserve(5, like)  # 9 entries: the buffer doubles twice
    assert start == 4 and grown[0][0].shape == (2, 16, 8)
    assert grown[0][0].data_ptr() == cache.layers[0]._keys.data_ptr()


def test_tree_cache_grows_by_doubling_and_keeps_contents():
    cache = TreeCache(num_layers=2, capacity=4)
    first = torch.arange(3 * 8, dtype=torch.float32).reshape(1, 1, 3, 8)
    keys, _ = cache.update(first, first + 100, 0)
    assert keys.shape[2] == 3 and cache.layers[0].capacity == 4
    second = torch.full((1, 1, 6, 8), -1.0)
    keys, values = cache.update(second, second, 0)
    assert cache.layers[0].capacity == 16 and keys.shape[2] == 9
    assert torch.equal(keys[:, :, :3], first) and torch.equal(values[:, :, :3], first + 100)


def test_tree_cache_keep_moves_the_accepted_path_into_place():
    cache = TreeCache(num_layers=1, capacity=8)
    entries = torch.arange(7, dtype=torch.float32).reshape(1, 1, 7, 1)
    cache.update(entries, entries * 10, 0)
    cache.keep(2, [0, 2, 4])  # past = 2; keep tree nodes 0, 2, 4 (entries 2, 4, 6)
    layer = cache.layers[0]
    assert layer.get_seq_length() == 5
    assert layer.keys[0, 0, :, 0].tolist() == [0, 1, 2, 4, 6]
    assert layer.values[0, 0, :, 0].tolist() == [0, 10, 20, 40, 60]
    cache.keep(3, [0, 1])  # a prefix of the breadth-first order only shortens the cache
    assert layer.keys[0, 0, :, 0].tolist() == [0, 1, 2, 4, 6]


def test_aligned_views_are_rounded_up_and_finite():
    cache = TreeCache(num_layers=1, capacity=4)
    with cache.aligned(8):
        keys, _ = cache.update(torch.ones(1, 2, 5, 4), torch.ones(1, 2, 5, 4), 0)
    assert keys.shape[2] == 8 and torch.isfinite(keys).all() and keys[:, :, 5:].eq(0).all()
    assert cache.get_seq_length() == 5
    keys, _ = cache.update(torch.ones(1, 2, 1, 4), torch.ones(1, 2, 1, 4), 0)
    assert keys.shape[2] == 6  # outside the block: exact views, as transformers' own masks expect


# ---------------------------------------------------------------- outputs
@pytest.mark.parametrize("buckets", [None, (), (8, 32)])
def test_bucket_padding_changes_no_logits(buckets):
    model = make_model("llama", seed=3)
    padded = TargetModel(model, make_tokenizer(64), runtime=RuntimeConfig(buckets=buckets))
    exact = TargetModel(make_model("llama", seed=3), make_tokenizer(64), runtime=RuntimeConfig(buckets=()))
    prompt = [5, 9, 2, 7, 11, 4]
    tree = build_tree(prompt[-1], [[1, 2, 3], [1, 6], [8]])
    logits = []
    for target in (padded, exact):
        cache = target.new_cache()
        target.prefill(cache, prompt[:-1])
        logits.append(target.forward_tree(cache, tree).logits)
        assert cache.get_seq_length() == len(prompt) - 1 + target.runtime.rows_for(tree.size)
    torch.testing.assert_close(logits[0], logits[1], rtol=0, atol=1e-12)


@needs_onednn
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_runtime_chain_verification_equals_plain_steps_bit_for_bit(dtype):
    """A drafted chain's logits are exactly those of plain decoding steps over the same tokens."""
    if onednn.probe(dtype) is not None:
        pytest.skip(onednn.probe(dtype))
    target = make_target("qwen2", vocab_size=64, seed=4, dtype=dtype, hidden=64)
    assert target.runtime.kind == "packed"
    prompt = [3, 14, 15, 9, 26, 5, 35]
    chain = [8, 9, 7, 9, 3, 2, 38, 4, 6, 26]
    assert_chain_equals_steps(target, prompt, chain)


@needs_onednn
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_packed_runtime_greedy_output_equals_plain_decoding(arch):
    target = make_target(arch, vocab_size=64, seed=5, dtype=torch.float32, hidden=64)
    assert target.runtime.kind == "packed"
    config = GenerationConfig(max_new_tokens=40, stop_at_eos=False)
    prompt = [4, 8, 15, 16, 23, 42, 4, 8, 15]
    reference = SpeculativeDecoder(target, NoDrafter()).generate(prompt, config)
    with torch.inference_mode():  # transformers' own greedy decoding on the stock model
        with target.stock():
            hf = target.model.generate(torch.tensor([prompt]), max_new_tokens=40, do_sample=False,
                                       eos_token_id=None, pad_token_id=0)
    assert hf[0, len(prompt):].tolist() == reference.token_ids
    for drafter in (PromptLookupDrafter(), ScriptedDrafter(len(prompt), reference.token_ids, vocab=64, seed=1)):
        result = SpeculativeDecoder(target, drafter).generate(prompt, config)
        assert result.token_ids == reference.token_ids
        assert result.stats.accepted_drafts > 0 or drafter.name == "pld"


def test_bfloat16_on_a_cpu_without_native_support_is_called_out_once(monkeypatch, caplog):
    import hierspec.runtime as runtime_module

    monkeypatch.setattr(onednn, "native_bfloat16", lambda: False)
    runtime_module._warn_emulated_bfloat16.cache_clear()
    with caplog.at_level("WARNING", logger="hierspec.runtime"):
        TargetModel(make_model("llama", dtype=torch.bfloat16), make_tokenizer(64))
        TargetModel(make_model("llama", dtype=torch.bfloat16), make_tokenizer(64))
        TargetModel(make_model("llama", dtype=torch.float32), make_tokenizer(64))
    warnings = [r.message for r in caplog.records if "no native bfloat16" in r.message]
    assert len(warnings) == 1 and "--dtype float32" in warnings[0]
    runtime_module._warn_emulated_bfloat16.cache_clear()


@pytest.mark.parametrize("kv_heads,groups,dim,context", [(3, 3, 64, 300), (2, 2, 16, 60)])
def test_a_query_rows_attention_does_not_depend_on_the_rows_beside_it(kv_heads, groups, dim, context):
    """CPU attention computes blocks of fewer than 4 query rows differently; ``tree_attention`` pads them away."""
    from hierspec.runtime.attention import tree_attention

    torch.manual_seed(0)
    width, rows = context + 84, 70
    keys, values = torch.randn(1, kv_heads, width, dim), torch.randn(1, kv_heads, width, dim)
    queries = torch.randn(1, kv_heads * groups, rows, dim)
    visible = torch.arange(width)[None, :] <= context + torch.arange(rows)[:, None]
    mask = visible[None, None].repeat(1, 1, groups, 1)
    full, _ = tree_attention(None, queries, keys, values, mask, scaling=dim ** -0.5)
    for count in range(1, rows + 1):
        part, _ = tree_attention(None, queries[:, :, :count], keys, values,
                                 visible[:count][None, None].repeat(1, 1, groups, 1), scaling=dim ** -0.5)
        assert torch.equal(part, full[:, :count]), count


@pytest.mark.parametrize("kv_heads,groups,dim", [(3, 3, 64), (2, 7, 64), (1, 1, 32)])
def test_a_chain_rows_attention_does_not_depend_on_the_masked_keys_after_it(kv_heads, groups, dim):
    """A token verified at depth ``j`` of a chain of ``n`` rows on top of ``past`` entries sees the same keys as
    the same token decoded alone on top of ``past + j``; only the masked slots after it differ (other tree nodes,
    stale entries). With key views in whole :data:`KEY_BLOCK` blocks, its attention is bit-identical (PyTorch's CPU
    flash kernel splits a partial last block's products by that block's width: this fails if the block changes)."""
    from hierspec.runtime.attention import KEY_BLOCK, tree_attention

    torch.manual_seed(0)
    size = 3 * KEY_BLOCK
    keys, values = torch.randn(1, kv_heads, size, dim), torch.randn(1, kv_heads, size, dim)

    def attend(query: torch.Tensor, past: int, rows: int, depth: int) -> torch.Tensor:
        width = -(-(past + rows) // KEY_BLOCK) * KEY_BLOCK
        visible = torch.arange(width)[None, :] <= past + torch.arange(rows)[:, None]
        queries = torch.randn(1, kv_heads * groups, rows, dim)
        queries[:, :, depth] = query
        out, _ = tree_attention(None, queries, keys[:, :, :width], values[:, :, :width],
                                visible[None, None].repeat(1, 1, groups, 1), scaling=dim ** -0.5)
        return out[:, depth]

    for position in (40, 300, 505, 511, 512, 700, 1020, 1100):
        query = torch.randn(1, kv_heads * groups, dim)
        alone = attend(query, position, 1, 0)
        for rows, depth in ((4, 0), (8, 3), (16, 15), (29, 7), (64, 30)):
            if depth <= position:
                assert torch.equal(attend(query, position - depth, rows, depth), alone), (position, rows, depth)


@pytest.mark.parametrize("native", [True, False])
def test_auto_dtype_is_bfloat16_only_where_the_cpu_computes_it_natively(monkeypatch, native):
    from hierspec import loading

    monkeypatch.setattr(loading, "native_bfloat16", lambda: native)
    cpu = torch.device("cpu")
    assert loading.resolve_dtype("auto", cpu) == (torch.bfloat16 if native else torch.float32)
    assert loading.resolve_dtype("auto", cpu, quantized_file=True) == torch.float32  # the int4 path's prompt weights
    assert loading.resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    assert loading.resolve_dtype("float32", cpu) == torch.float32

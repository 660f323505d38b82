"""The compiled layers over a model's own float weights (a bfloat16 model on a CPU with native bfloat16): the compiled
product of oneDNN-prepacked weights (``dense_onednn.cpp``, a private PyTorch op reached through the dispatcher) equals
the Python call bit for bit and fails loudly when the op changes; the decoder that uses it runs every layer as one
compiled call, gives the same bits as its own Python layers, stays within bfloat16's rounding of the float32 model,
and keeps every tree row and every batched sequence bit-identical to plain decoding."""

import copy

import pytest
import torch

from hierspec.config import GenerationConfig
from hierspec.decode import SpeculativeDecoder
from hierspec.drafters.base import NoDrafter
from hierspec.drafters.prompt_lookup import PromptLookupDrafter
from hierspec.errors import InputError
from hierspec.runtime import RuntimeConfig, dense_kernel, int4_kernel, onednn
from hierspec.target import TargetModel
from hierspec.tree import build_tree
from drafters_for_tests import ScriptedDrafter
from tiny import assert_chain_equals_steps, assert_tree_rows_equal_chains, make_model, make_tokenizer

MODULE, REASON = int4_kernel.compiled_kernel()
needs_module = pytest.mark.skipif(MODULE is None or not hasattr(MODULE, "dense_mm"), reason=str(REASON))
needs_bfloat16 = pytest.mark.skipif(onednn.probe(torch.bfloat16) is not None,
                                    reason=str(onednn.probe(torch.bfloat16)))
GENERATOR = torch.Generator().manual_seed(71)


DOTS = MODULE is not None and hasattr(MODULE, "dense_bf16_ready") and MODULE.dense_bf16_ready()
needs_dots = pytest.mark.skipif(not DOTS, reason="no AVX512-BF16 dense products in this build")
#: both kernels of a bfloat16 model's tree rows, the dot products only where this CPU has them
KERNELS = ["onednn", pytest.param("dots", marks=needs_dots)]


def _target(arch: str, seed: int = 3, kernel: str = "onednn", **kwargs) -> TargetModel:
    model = make_model(arch, vocab_size=96, seed=seed, dtype=torch.bfloat16, hidden=64, **kwargs)
    return TargetModel(model, make_tokenizer(96), name=f"tiny-{arch}-bf16", runtime=RuntimeConfig(dense_kernel=kernel))


# ---------------------------------------------------------------- the private op behind the compiled product
@needs_module
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_compiled_product_is_the_python_calls_bit_for_bit(dtype):
    if onednn.probe(dtype) is not None:
        pytest.skip(onednn.probe(dtype))
    weight = torch.randn(80, 48, generator=GENERATOR).to(dtype)
    stack = onednn.DenseStack(onednn.pack_weight(weight))
    rows = torch.randn(7, 48, generator=GENERATOR)
    got = MODULE.dense_mm(rows, stack.weight, 0)
    assert got.dtype == torch.float32 and got.shape == (7, 80)
    assert torch.equal(got, stack(rows))
    assert torch.equal(got, onednn.packed_linear(rows.to(dtype), stack.weight, None).float())
    tolerance = 1e-5 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(got, rows.to(dtype).float() @ weight.float().T, rtol=tolerance, atol=tolerance)


@needs_module
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_beyond_the_invariant_count_are_multiplied_in_calls_that_keep_each_rows_result(dtype):
    if onednn.probe(dtype) is not None:
        pytest.skip(onednn.probe(dtype))
    limit = onednn.invariant_rows(dtype, 960, 576)  # SmolLM2's q/k/v shape: 32 on an Intel Xeon with AMX
    assert 4 <= limit <= onednn.MAX_ROWS_PER_CALL
    weight = onednn.pack_weight(torch.randn(960, 576, generator=GENERATOR).to(dtype))
    stack = onednn.DenseStack(weight, rows_per_call=min(limit, 32))
    rows = torch.randn(100, 576, generator=GENERATOR)
    alone = torch.cat([stack(rows[start : start + 4]) for start in range(0, 100, 4)])
    for count in (4, 13, 32, 33, 48, 64, 100):
        got = stack(rows[:count])
        assert torch.equal(got, alone[:count]), count
        assert torch.equal(MODULE.dense_mm(rows[:count], weight, stack.rows_per_call), got), count
    assert stack.native[1].item() == stack.rows_per_call and len(onednn.DenseStack(weight).native) == 1


@needs_module
def test_the_compiled_product_refuses_a_weight_oneDNN_did_not_pack():
    with pytest.raises(RuntimeError, match="prepacked by oneDNN"):
        MODULE.dense_mm(torch.randn(2, 8), torch.randn(4, 8), 0)


# ---------------------------------------------------------------- the decoder over bfloat16 weights
@needs_module
@needs_bfloat16
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_bfloat16_model_runs_every_layer_as_one_compiled_call(arch):
    target = _target(arch)
    described = target.runtime.describe()
    assert (described["kind"], described["weights"], described["layers"], described["kv_cache"]) == (
        "packed", "bfloat16", "compiled-exact", "float16")
    decoder = target.runtime.decoder
    assert decoder.embedding.dtype == torch.float32 and decoder.final_norm.dtype == torch.float32
    stack = decoder.layers[0].qkv.stacks[0]
    assert isinstance(stack, onednn.DenseStack) and stack.weight.dtype == torch.bfloat16
    assert stack.rows_per_call == onednn.invariant_rows(torch.bfloat16, stack.weight.shape[0], 64)
    prompts = target.runtime.prefill_decoder  # prompts in whole calls: the same weights
    assert prompts.layers[0].qkv.stacks[0].rows_per_call == 0 and prompts.layers[0].qkv.stacks[0].weight is stack.weight


@needs_module
@needs_bfloat16
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("kernel", KERNELS)
def test_the_compiled_layer_halves_equal_the_python_layers_over_the_same_weights(arch, kernel):
    decoder = _target(arch, kernel=kernel).runtime.decoder
    python = copy.copy(decoder)
    python._fused = None  # the same weights, norm and activation; the halves operation by operation in Python
    rows = 5
    hidden = torch.randn(rows, 64, generator=GENERATOR)
    cos, sin = decoder._rotation(torch.arange(20, 20 + rows))
    for layer in decoder.layers:
        compiled = decoder._fused.attention_inputs(layer, hidden, cos, sin)
        expected = python._attention_inputs(layer, python._norm(hidden, layer.norm1, python.eps), cos, sin, rows)
        for got, want in zip(compiled, expected):
            assert torch.equal(got, want.contiguous())
        attended = torch.randn(rows, 64, generator=GENERATOR)
        assert torch.equal(decoder._mlp(layer, hidden.clone(), attended), python._mlp(layer, hidden.clone(), attended))


@needs_module
@needs_bfloat16
@pytest.mark.parametrize("seed", [8, 9, 10, 11])
def test_the_compiled_layers_are_as_close_to_the_float32_model_as_transformers_bfloat16_forward(seed):
    model = make_model("llama", vocab_size=96, seed=seed, dtype=torch.bfloat16, hidden=64, init_std=0.1)
    target = TargetModel(model, make_tokenizer(96))
    reference = make_model("llama", vocab_size=96, seed=seed, dtype=torch.float32, hidden=64, init_std=0.1)
    reference.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    prompt = [int(t) for t in torch.randint(1, 96, (24,), generator=torch.Generator().manual_seed(seed))]
    cache = target.new_cache()
    target.prefill(cache, prompt[:-1])
    got = target.forward_tree(cache, build_tree(prompt[-1], [])).logits[0]
    with torch.inference_mode():
        expected = reference(torch.tensor([prompt])).logits[0, -1]
        with target.stock():
            transformers_bf16 = model(torch.tensor([prompt])).logits[0, -1].float()
    assert int(got.argmax()) == int(expected.argmax())
    assert (got - expected).abs().max() <= 2 * (transformers_bf16 - expected).abs().max()


@needs_module
@needs_bfloat16
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tree_rows_and_chains_equal_plain_decoding_bit_for_bit(arch, kernel):
    target = _target(arch, seed=4, kernel=kernel)
    assert target.runtime.dense_kernel == kernel
    assert_chain_equals_steps(target, [3, 14, 15, 9, 26, 5, 35], [8, 9, 7, 9, 3, 2, 38, 4, 6, 26])
    # 41 nodes: a 48-row forward, past the 32 rows up to which oneDNN's bfloat16 products on AMX keep each row's bits
    assert_chain_equals_steps(target, [3, 14, 15, 9, 26, 5, 35], [(7 * i + 3) % 95 + 1 for i in range(40)])
    assert_tree_rows_equal_chains(target, trees=4)


@needs_module
@needs_bfloat16
@pytest.mark.parametrize("kernel", KERNELS)
def test_greedy_speculation_equals_plain_decoding_alone_and_batched(kernel):
    target = _target("qwen2", seed=5, kernel=kernel)
    config = GenerationConfig(max_new_tokens=40, stop_at_eos=False)
    prompts = [[4, 8, 15, 16, 23, 42, 4, 8, 15], [7, 7, 1, 90, 33, 2, 7, 7]]
    references = [SpeculativeDecoder(target, NoDrafter()).generate(p, config).token_ids for p in prompts]
    for prompt, reference in zip(prompts, references):
        for drafter in (PromptLookupDrafter(), ScriptedDrafter(len(prompt), reference, vocab=96, seed=1)):
            assert SpeculativeDecoder(target, drafter).generate(prompt, config).token_ids == reference
    from hierspec.batching import BatchConfig, BatchScheduler

    scheduler = BatchScheduler(target, PromptLookupDrafter, BatchConfig(max_batch=2))
    requests = [scheduler.submit(p, config) for p in prompts]
    scheduler.run()
    assert [r.result.token_ids for r in requests] == references


@needs_module
@needs_bfloat16
@pytest.mark.parametrize("kernel", KERNELS)
def test_a_head_over_some_tokens_gives_the_whole_heads_logits_of_them(kernel):
    target = _target("llama", seed=6, kernel=kernel)
    tokens = [3, 50, 7, 95, 0, 64, 12]
    cache = target.new_cache()
    target.prefill(cache, [9, 8, 7, 6, 5])
    whole = target.forward_tree(cache, build_tree(4, [[11, 12]])).logits
    cache = target.new_cache()
    target.prefill(cache, [9, 8, 7, 6, 5])
    some = target.forward_tree(cache, build_tree(4, [[11, 12]]), head=target.head_over(tokens)).logits
    assert torch.equal(some, whole[:, tokens])


# ---------------------------------------------------------------- the AVX512-BF16 dot products (dense_bf16.cpp)
def test_the_dot_products_layout_puts_a_blocks_outputs_at_an_input_pair_side_by_side():
    weight = torch.arange(32 * 4, dtype=torch.float32).reshape(32, 4).to(torch.bfloat16)  # exact in bfloat16
    packed = dense_kernel.pack_dots(weight)
    assert packed.shape == (2, 2, 16, 2) and packed.dtype == torch.bfloat16 and packed.is_contiguous()
    for block, pair, output, half in [(0, 0, 0, 0), (0, 1, 5, 1), (1, 0, 15, 1), (1, 1, 3, 0)]:
        assert packed[block, pair, output, half] == weight[16 * block + output, 2 * pair + half]
    assert dense_kernel.dots_fit(32, 64) and not dense_kernel.dots_fit(40, 64) and not dense_kernel.dots_fit(32, 48)


@needs_dots
def test_each_rows_dot_products_are_the_same_whatever_rows_travel_with_it():
    """Every row of 1..40 rows, and the rows taken apart or on one thread, bit for bit; within float32 rounding of the
    float64 product of the bfloat16-rounded rows."""
    weight = torch.randn(208, 96, generator=GENERATOR).to(torch.bfloat16)  # 13 blocks: 3 passes of 4 and one of 1
    packed = dense_kernel.pack_dots(weight)
    rows = torch.randn(40, 96, generator=GENERATOR)
    whole = MODULE.dense_bf16_mm(rows, packed)
    assert whole.dtype == torch.float32 and whole.shape == (40, 208)
    reference = rows.to(torch.bfloat16).double() @ weight.double().T
    torch.testing.assert_close(whole.double(), reference, rtol=1e-5, atol=1e-4)
    for count in range(1, 41):
        assert torch.equal(MODULE.dense_bf16_mm(rows[:count], packed), whole[:count]), count
    for start in (3, 17, 39):
        assert torch.equal(MODULE.dense_bf16_mm(rows[start : start + 1], packed), whole[start : start + 1])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(MODULE.dense_bf16_mm(rows, packed), whole)
    finally:
        torch.set_num_threads(threads)
    stack = dense_kernel.dense_stack([weight[:100], weight[100:]], weight, "dots")
    assert isinstance(stack, dense_kernel.DotsStack) and torch.equal(stack(rows), whole)
    with pytest.raises(RuntimeError, match="packed"):
        MODULE.dense_bf16_mm(rows, weight)  # an unpacked weight


@needs_dots
def test_a_dots_kernels_prompts_are_read_by_the_members_own_weights_in_whole_products():
    weights = [torch.randn(48, 64, generator=GENERATOR).to(torch.bfloat16) for _ in range(2)]
    stack = dense_kernel.dense_stack(weights, torch.cat(weights), "dots")
    prompt = stack.whole()
    assert isinstance(prompt, dense_kernel.MembersStack)
    assert [m.data_ptr() for m in prompt.members] == [w.data_ptr() for w in weights]  # no copy
    rows = torch.randn(70, 64, generator=GENERATOR)
    expected = torch.cat([torch.nn.functional.linear(rows.to(torch.bfloat16), w) for w in weights], -1).float()
    assert torch.equal(prompt(rows), expected) and torch.equal(MODULE.dense_members_mm(rows, prompt.native), expected)
    target = _target("llama", kernel="dots")
    qkv = target.runtime.decoder.layers[0].qkv.stacks[0]
    assert isinstance(qkv, dense_kernel.DotsStack) and target.runtime.describe()["dense_kernel"] == "dots"
    assert isinstance(target.runtime.prefill_decoder.layers[0].qkv.stacks[0], dense_kernel.MembersStack)


def test_the_dense_kernel_is_chosen_by_timing_once_per_dtype_and_kept(monkeypatch):
    timed = []
    monkeypatch.setattr(dense_kernel, "dots_reason", lambda dtype: None)
    monkeypatch.setattr(dense_kernel, "time_dense_products", lambda dtype: timed.append(dtype) or (
        {"onednn": [3e-3, 5e-3], "dots": [2e-3, 5.5e-3]} if dtype == torch.bfloat16 else
        {"onednn": [3e-3, 5e-3], "dots": [2.5e-3, 6e-3]}))
    dense_kernel.timed_dense_choice.cache_clear()
    paths = [dense_kernel.dense_choice_path(7, dtype) for dtype in ("bfloat16", "float32")]
    try:
        assert dense_kernel.resolve_dense_kernel("auto", torch.bfloat16, 7) == "dots" and paths[0].is_file()
        assert dense_kernel.resolve_dense_kernel("auto", torch.float32, 7) == "onednn" and paths[1].is_file()
        dense_kernel.timed_dense_choice.cache_clear()
        assert dense_kernel.resolve_dense_kernel("auto", torch.bfloat16, 7) == "dots"
        assert dense_kernel.resolve_dense_kernel("auto", torch.float32, 7) == "onednn"
        assert timed == [torch.bfloat16, torch.float32]  # kept, not timed again
        assert dense_kernel.resolve_dense_kernel("onednn", torch.bfloat16, 7) == "onednn"
        assert dense_kernel.resolve_dense_kernel("dots", torch.float32, 7) == "dots"
        from hierspec.runtime import prompt_kernel

        assert set(paths) <= set(prompt_kernel.kept_choices(7))  # forgotten by `hierspec calibrate --retime-kernels`
    finally:
        for path in paths:
            path.unlink(missing_ok=True)
        dense_kernel.timed_dense_choice.cache_clear()
    assert dense_kernel.choose_dense_kernel({"onednn": [1.0, 2.0], "dots": [1.0, 2.0]}) == "onednn"  # a tie
    monkeypatch.setattr(dense_kernel, "dots_reason", lambda dtype: "this CPU has no AVX512-BF16")
    assert dense_kernel.resolve_dense_kernel("auto", torch.bfloat16, 7) == "onednn"
    with pytest.raises(InputError, match="no AVX512-BF16"):
        dense_kernel.resolve_dense_kernel("dots", torch.bfloat16, 7)
    with pytest.raises(InputError, match="unknown dense kernel"):
        RuntimeConfig(dense_kernel="fast")


@needs_module
def test_each_rows_float32_products_are_the_same_whatever_rows_travel_with_it():
    """The float32 layout and kernel: every row of 1..30 rows bit for bit, on one thread too; within float32
    rounding of the float64 product."""
    weight = torch.randn(80, 40, generator=GENERATOR)  # 5 blocks: a pass of 4 (2 with AVX2) and the rest
    packed = dense_kernel.pack_dots(weight)
    assert packed.shape == (5, 40, 16) and packed[2, 7, 3] == weight[35, 7]
    rows = torch.randn(30, 40, generator=GENERATOR)
    whole = MODULE.dense_f32_mm(rows, packed)
    torch.testing.assert_close(whole.double(), rows.double() @ weight.double().T, rtol=1e-5, atol=1e-5)
    for count in range(1, 31):
        assert torch.equal(MODULE.dense_f32_mm(rows[:count], packed), whole[:count]), count
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(MODULE.dense_f32_mm(rows[5:9], packed), whole[5:9])
    finally:
        torch.set_num_threads(threads)
    stack = dense_kernel.dense_stack([weight], weight, "dots")
    assert isinstance(stack, dense_kernel.DotsStack) and torch.equal(stack(rows), whole)
    assert torch.equal(stack.whole()(rows), torch.nn.functional.linear(rows, weight))


@needs_module
@pytest.mark.parametrize("kernel", ["onednn", "dots"])
def test_a_float32_models_tree_rows_equal_plain_decoding_on_either_kernel(kernel):
    if onednn.probe(torch.float32) is not None:
        pytest.skip(onednn.probe(torch.float32))
    model = make_model("qwen2", vocab_size=96, seed=12, dtype=torch.float32, hidden=64)
    target = TargetModel(model, make_tokenizer(96), name="tiny-qwen2-f32", runtime=RuntimeConfig(dense_kernel=kernel))
    assert target.runtime.dense_kernel == kernel
    stack = target.runtime.decoder.layers[0].gate_up.stacks[0]
    assert isinstance(stack, dense_kernel.DotsStack if kernel == "dots" else onednn.DenseStack)
    assert_chain_equals_steps(target, [3, 14, 15, 9, 26, 5, 35], [(5 * i + 2) % 95 + 1 for i in range(40)])
    assert_tree_rows_equal_chains(target, trees=3)

"""GGUF weights kept quantized (:mod:`hierspec.runtime.quantized`): exact repacking of each block type, a tiny model
written as a GGUF file by the ``gguf`` package run on the int4 path, losslessness on that path, clean fallbacks."""

from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize, quantize

from hierspec.batching import BatchConfig, decode_batch
from hierspec.calibration import machine_identity
from hierspec.config import GenerationConfig, ModelConfig
from hierspec.decode import SpeculativeDecoder
from hierspec.drafters import NoDrafter
from hierspec.errors import InputError
from hierspec.methods import DrafterContext, draft_model_config, make_drafter
from hierspec.runtime import RuntimeConfig, onednn, prompt_kernel
from hierspec.runtime import quantized as q
from hierspec.runtime.int4_kernel import pack_vnni
from hierspec.target import TargetModel, runtime_config
from hierspec.tree import build_tree
from tiny import (accepted_drafts_of_methods_equal_to_plain, assert_chain_equals_steps, assert_tree_rows_equal_chains,
                  make_model, make_tokenizer)

VOCAB = 64
LAYER_TENSORS = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                 "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                 "ffn_down": "mlp.down_proj"}


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q5_0", "Q8_0"])
def test_decoded_blocks_equal_gguf_dequantization_bit_for_bit(kind):
    rng = np.random.default_rng(0)
    data = (rng.standard_normal((48, 96)) * rng.uniform(0.01, 3, size=(48, 1))).astype(np.float32)
    data[0, :32] = 0.0  # an all-zero block
    qtype = GGMLQuantizationType[kind]
    raw = quantize(data, qtype)
    passes = q.decode_blocks(kind, raw, 48, 96)
    assert len(passes) == (2 if kind in ("Q8_0", "Q5_0") else 1)
    for weight in passes:
        assert weight.codes.dtype == torch.uint8 and int(weight.codes.max()) <= 15
    decoded = sum(p.dequantize() for p in passes)
    assert torch.equal(decoded, torch.from_numpy(dequantize(raw, qtype)))


def random_k_blocks(kind, rows, cols, rng):
    """Raw ``Q4_K``/``Q6_K`` blocks of a ``[rows, cols]`` tensor: random codes and sub-block scales, super-block
    scales of a realistic size (the ``gguf`` package reads these types but does not write them)."""
    supers = cols // 256
    if kind == "Q4_K":
        blocks = rng.integers(0, 256, size=(rows, supers, 144), dtype=np.uint8)
        for start in (0, 2):  # d and dmin
            blocks[..., start : start + 2] = rng.uniform(2e-3, 6e-3, (rows, supers, 1)).astype(np.float16).view(np.uint8)
    else:
        blocks = rng.integers(0, 256, size=(rows, supers, 210), dtype=np.uint8)
        blocks[..., 208:210] = rng.uniform(2e-4, 8e-4, (rows, supers, 1)).astype(np.float16).view(np.uint8)
    return blocks.reshape(rows, -1)


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K"])
def test_k_quant_blocks_decode_to_gguf_dequantization_bit_for_bit(kind):
    rng = np.random.default_rng(1)
    raw = random_k_blocks(kind, 48, 512, rng)
    passes = q.decode_blocks(kind, raw, 48, 512)
    assert len(passes) == (4 if kind == "Q6_K" else 1)
    for weight in passes:
        assert weight.codes.dtype == torch.uint8 and int(weight.codes.max()) <= 15
    assert torch.equal(sum(p.dequantize() for p in passes), torch.from_numpy(dequantize(raw, GGMLQuantizationType[kind])))


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K"])
def test_k_quant_scale_factors_are_the_files_units_and_steps_and_multiply_back_to_the_scales_exactly(kind):
    """``Q4_K``: scale = d sc per 32 inputs and the folded offset zero - 8 scale = -dmin m (within the fold's
    rounding); ``Q6_K``: the 8-bit form's scale per 16 = d sc. Rows reordered keep their factors."""
    rng = np.random.default_rng(3)
    raw = random_k_blocks(kind, 32, 512, rng)
    passes = q.decode_blocks(kind, raw, 32, 512)
    factors = passes[0].factors
    assert all(p.factors is factors for p in passes)
    assert factors.units.dtype == torch.float32 and factors.units.shape == (32, 2)
    blocks = raw.reshape(32, 2, -1)
    d = torch.from_numpy(blocks[..., -2:].copy().view(np.float16)[..., 0].astype(np.float32)) if kind == "Q6_K" \
        else torch.from_numpy(blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32))
    assert torch.equal(factors.units, d)
    if kind == "Q4_K":
        assert factors.steps.dtype == factors.offset_steps.dtype == torch.uint8 and int(factors.steps.max()) <= 63
        scales = factors.units.repeat_interleave(8, 1) * factors.steps
        assert torch.equal(scales, passes[0].scales)
        offsets = factors.offset_units.repeat_interleave(8, 1) * factors.offset_steps
        assert torch.allclose(offsets, passes[0].zeros - 8 * passes[0].scales, rtol=0, atol=1e-6)
        assert (factors.offset_units < 0).all()
    else:
        assert factors.steps.dtype == torch.int8 and factors.offset_units is None and factors.offset_steps is None
        _, scales = q.as_int8(passes)
        assert torch.equal(factors.units.repeat_interleave(16, 1) * factors.steps, scales)
    order = torch.randperm(32, generator=torch.Generator().manual_seed(0))
    moved = passes[0].take_rows(order).factors
    assert torch.equal(moved.units, factors.units[order]) and torch.equal(moved.steps, factors.steps[order])


@pytest.mark.parametrize("kind", ["Q8_0", "Q5_0", "Q6_K"])
def test_eight_bit_weights_rebuild_exactly_from_their_passes(kind):
    """The compiled kernel's 8-bit form (signed codes, a scale per 16 inputs) is the file's weight bit for bit."""
    rng = np.random.default_rng(4)
    if kind == "Q6_K":
        raw = random_k_blocks(kind, 48, 512, rng)
    else:
        raw = quantize((rng.standard_normal((48, 512)) * 0.3).astype(np.float32), GGMLQuantizationType[kind])
    codes, scales = q.as_int8(q.decode_blocks(kind, raw, 48, 512))
    assert codes.dtype == torch.int8 and codes.shape == (48, 512) and scales.shape == (48, 32)
    assert int(codes.min()) >= (-32 if kind == "Q6_K" else -128) and int(codes.max()) <= (31 if kind == "Q6_K" else 127)
    weight = codes.float() * scales.repeat_interleave(16, dim=1)
    assert torch.equal(weight, torch.from_numpy(dequantize(raw, GGMLQuantizationType[kind])))
    assert q.as_int8(q.decode_blocks("Q4_1", quantize(np.ones((16, 32), np.float32), GGMLQuantizationType.Q4_1),
                                      16, 32)) is None


@pytest.mark.parametrize("kind", ["Q8_0", "Q5_0", "Q6_K"])
def test_a_weight_of_more_than_4_bits_requantizes_to_one_4_bit_pass_within_half_a_step(kind):
    rng = np.random.default_rng(5)
    values = (rng.standard_normal((48, 512)) * 0.05).astype(np.float32)
    values[3, :32] = 0.25  # a constant group
    values[4, 32:64] += 3.0  # a group far from zero
    raw = random_k_blocks(kind, 48, 512, rng) if kind == "Q6_K" else quantize(values, GGMLQuantizationType[kind])
    passes = q.decode_blocks(kind, raw, 48, 512)
    exact = sum(p.dequantize() for p in passes)
    (one,) = q.requantize_4bit(passes)
    assert one.codes.dtype == torch.uint8 and one.codes.shape == (48, 512) and int(one.codes.max()) <= 15
    minimum = one.zeros - 8 * one.scales  # the value at code 0
    for part in (one.scales, minimum):  # float16 values, as Q4_1 stores them (the kernels' half-width scales)
        assert part.shape == (48, 16) and torch.equal(part.to(torch.float16).to(torch.float32), part)
    packed = pack_vnni([one.codes], [one.scales], [one.zeros])
    assert packed.scales.dtype == packed.bias.dtype == torch.float16  # 20 bytes a group and output, not 24
    error = (one.dequantize() - exact).abs().reshape(48, 16, 32)
    assert (error <= one.scales[..., None] / 2 * (1 + 1e-5) + 1e-7).all()
    assert (one.scales >= 0).all() and one.scales.mean() < exact.abs().mean()  # a step is a fraction of the weights
    four_bit = q.decode_blocks("Q4_1", quantize(values, GGMLQuantizationType.Q4_1), 48, 512)
    kept = q.requantize_4bit(four_bit)
    assert len(kept) == 1 and kept[0] is four_bit[0]  # already 4 bits: as stored


def test_requantized_groups_keep_float16_minimums_that_survive_the_folded_offset():
    """A group whose minimum lies much nearer zero than its step (the sum ``b + 8 d`` would drop the minimum's low
    bits) still gets a float16 minimum ``b`` and step ``d`` with ``(b + 8 d) - 8 d == b`` exactly in float32."""
    low = torch.tensor([1e-4, -1e-4, 1000.0, -0.3, 0.25])
    high = torch.tensor([8.0, 8.0, 1000.001, 0.4, 0.25])
    plain = q._float16_at_most(low)
    plain_step = q._float16_at_least((high - plain) / 15)
    assert ((plain + 8 * plain_step) - 8 * plain_step != plain)[:2].all()  # the first two groups need the move
    bias, step = q._float16_grid(low, high)
    assert torch.equal((bias + 8 * step) - 8 * step, bias)
    for part in (bias, step):
        assert torch.equal(part.half().float(), part)
    assert (bias <= low).all() and (bias + 15 * step >= high).all() and (step >= 0).all()
    assert bias[0] == 0 and step[0] == q._float16_at_least(torch.tensor(8.0 / 15))  # moved down to zero
    assert bias[1] == -q._float16_at_least(torch.tensor(8.0001 / 15))  # moved down one step (the step chosen first)
    assert bias[2] == 1000 and bias[3] == plain[3] and step[3] == plain_step[3]  # as plain rounding gives
    assert step[4] == 0 and bias[4] == 0.25  # a constant group


def test_a_q6_k_pass_decodes_the_other_half_of_each_group_to_exact_zeros_in_the_kernel():
    """The kernel sees bfloat16 scales: a pass's foreign half must still cancel to 0, not to a rounding residue."""
    raw = random_k_blocks("Q6_K", 16, 256, np.random.default_rng(2))
    passes = q.decode_blocks("Q6_K", raw, 16, 256)
    for index, weight in enumerate(passes):
        packed, table = q._pack([weight])
        columns = torch.ops.aten._weight_int4pack_mm_for_cpu(torch.eye(256, dtype=q.KERNEL_DTYPE), packed, q.GROUP,
                                                             table).t().float()
        foreign = torch.arange(256).remainder(32).div(16, rounding_mode="floor") != index // 2
        assert torch.count_nonzero(columns[:, foreign]) == 0, index
        assert torch.count_nonzero(columns[:, ~foreign]) > 0, index


def test_unsupported_block_types_are_refused_by_name():
    with pytest.raises(ValueError, match="Q5_K"):
        q.decode_blocks("Q5_K", np.zeros(176, np.uint8), 1, 256)


def _llama_cpp_permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's row order for Llama q/k weights (what its converter writes)."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(
        weight.shape)


def write_tiny_gguf(path, model, layer_kind="Q4_1", head_kind="Q8_0", plain=(), kinds=None):
    """Quantize ``model``'s linears into a GGUF file the way llama.cpp lays them out, and set the model's weights to
    the file's dequantized values (so the float32 model *is* the file). ``plain`` names tensors written as F32;
    ``kinds`` maps tensor-name fragments (``"attn_v"``) to other block types; K-quant tensors get random blocks."""
    writer = GGUFWriter(str(path), model.config.model_type)
    rng = np.random.default_rng(3)
    config = model.config
    tensors = {"token_embd.weight": (model.model.embed_tokens, head_kind), "output.weight": (model.lm_head, head_kind)}
    for i in range(config.num_hidden_layers):
        layer = model.model.layers[i]
        for short, long in LAYER_TENSORS.items():
            tensors[f"blk.{i}.{short}.weight"] = (layer.get_submodule(long), layer_kind)
    for name, (module, kind) in tensors.items():
        weight = module.weight.detach().numpy().astype(np.float32)
        heads = config.num_attention_heads if ".attn_q." in name else config.num_key_value_heads
        permuted = config.model_type == "llama" and (".attn_q." in name or ".attn_k." in name)
        stored = _llama_cpp_permute(weight, heads) if permuted else weight
        if name in plain:
            writer.add_tensor(name, stored)
            continue
        kind = next((k for fragment, k in (kinds or {}).items() if fragment in name), kind)
        qtype = GGMLQuantizationType[kind]
        raw = random_k_blocks(kind, *stored.shape, rng) if kind.endswith("_K") else quantize(stored, qtype)
        writer.add_tensor(name, raw, raw_dtype=qtype)
        exact = dequantize(raw, qtype)
        if stored is not weight:  # undo the permutation for the model's own copy
            order = np.arange(weight.shape[0]).reshape(heads, weight.shape[0] // heads // 2, 2).swapaxes(1, 2)
            exact = exact[order.reshape(-1)]
        module.weight.data.copy_(torch.from_numpy(exact))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _tiny(tmp_path, arch="llama", **kinds):
    model = make_model(arch, vocab_size=VOCAB, seed=7, dtype=torch.float32, layers=2, hidden=64)
    return model, write_tiny_gguf(tmp_path / "tiny.gguf", model, **kinds)


def _tiny_k_quant(tmp_path):
    """A Qwen2-shaped model (q/k/v biases) written like a ``Q4_K_M`` file: ``Q4_K`` layers, ``Q6_K`` values, down
    projection and head — so the q/k/v product mixes one- and four-pass members."""
    model = make_model("qwen2", vocab_size=VOCAB, seed=7, dtype=torch.float32, layers=2, hidden=256)
    return model, write_tiny_gguf(tmp_path / "tiny-k.gguf", model, layer_kind="Q4_K", head_kind="Q6_K",
                                  kinds={"attn_v": "Q6_K", "ffn_down": "Q6_K"})


def test_a_k_quant_files_weights_decode_to_exactly_the_dequantized_model(tmp_path):
    model, path = _tiny_k_quant(tmp_path)
    weights, reason = q.read_gguf_weights(path, model.config)
    assert reason is None
    modules = dict(model.named_modules())
    assert len(weights["model.layers.0.self_attn.v_proj"]) == 4 and len(weights["model.layers.0.self_attn.q_proj"]) == 1
    for name, passes in weights.items():
        assert torch.equal(sum(p.dequantize() for p in passes), modules[name].weight.detach()), name


def test_a_k_quant_file_runs_its_model_on_the_int4_path_and_every_method_equals_plain_decoding(tmp_path, prefill,
                                                                                             kernel):
    model, path = _tiny_k_quant(tmp_path)
    target = _int4_target(model, path, kernel)
    expected, got = _tree_logits(_float32_copy(model, "qwen2", hidden=256), target)
    error = (expected - got).abs().mean() / expected.abs().mean()
    assert error < 0.1, error
    assert_tree_rows_equal_chains(target)
    accepted_drafts_of_methods_equal_to_plain(target, ([4, 8, 15, 16, 23, 42, 4, 8, 15],), ("pld:budget=off", "hd"),
                                               GenerationConfig(max_new_tokens=30, stop_at_eos=False))


@pytest.mark.parametrize("layer_kind", ["Q4_0", "Q4_1", "Q5_0"])
def test_a_gguf_files_weights_decode_to_exactly_the_dequantized_model(tmp_path, layer_kind):
    model, path = _tiny(tmp_path, layer_kind=layer_kind)
    weights, reason = q.read_gguf_weights(path, model.config)
    assert reason is None
    modules = dict(model.named_modules())
    assert set(weights) == {f"model.layers.{i}.{n}" for i in range(2) for n in LAYER_TENSORS.values()} | {"lm_head"}
    for name, passes in weights.items():  # q/k rows back in transformers' order, Q8_0 head in two passes
        assert torch.equal(sum(p.dequantize() for p in passes), modules[name].weight.detach()), name


@pytest.fixture
def float32_prefill(monkeypatch):
    """Prompts read through the float32 expansion, as on CPUs without native bfloat16 where ``auto`` times the
    expanded products faster."""
    monkeypatch.setattr(onednn, "native_bfloat16", lambda: False)
    monkeypatch.setattr(prompt_kernel, "timed_prompt_choice", lambda threads: "expanded")
    monkeypatch.setattr(prompt_kernel, "timed_short_prompt_rows", lambda key, threads, time_prompt: 0)


@pytest.fixture(params=["float32", "bfloat16", "integer"])
def prefill(request, monkeypatch):
    """Each way the int4 runtime reads prompts: float32 products, bfloat16 ones (CPUs with native bfloat16) of the
    expanded weights, or the integer products' weights with rows as one 8-bit code (where trees are verified by
    the integer kernels and ``auto`` times them faster)."""
    if request.param == "integer" and request.node.callspec.params.get("kernel") not in ("vnni", "vnni8"):
        pytest.skip("prompts are read by the integer products only where trees are")
    monkeypatch.setattr(onednn, "native_bfloat16", lambda: request.param == "bfloat16")
    monkeypatch.setattr(prompt_kernel, "timed_prompt_choice",
                        lambda threads: "vnni8" if request.param == "integer" else "expanded")
    monkeypatch.setattr(prompt_kernel, "timed_short_prompt_rows", lambda key, threads, time_prompt: 0)
    return request.param


@pytest.fixture(params=["compiled", "torch", "amx", "bf16", "vnni", "vnni8", "mixed"])
def kernel(request, monkeypatch):
    """Each int4 product kernel that runs here (hierspec's compiled one, PyTorch's, the AMX one, the AVX512-BF16
    one, the AVX512-VNNI one), and two mixed as ``auto`` chose on an Intel Xeon before the AMX products: 4-bit and Q8_0 weights by
    PyTorch's kernel, Q6_K ones by the compiled 8-bit product."""
    if request.param == "mixed":
        for name in ("torch", "compiled"):
            if q.resolve_kernel(name)[0] is None:
                pytest.skip(q.resolve_kernel(name)[1])
        monkeypatch.setattr(q, "_timed_choice", lambda threads, candidates: q.Int4Kernels("torch", "compiled"))
        return "auto"
    kernels, reason = q.resolve_kernel(request.param)
    if kernels is None:
        pytest.skip(reason)
    return request.param


def _int4_target(model, path, int4_kernel="auto", **config):
    kernels, reason = q.resolve_kernel(int4_kernel)
    if kernels is None:
        pytest.skip(reason)
    target = TargetModel(model, make_tokenizer(VOCAB), "tiny-int4",
                         RuntimeConfig(gguf=str(path), int4_kernel=int4_kernel, **config))
    assert target.runtime.kind == "int4" and target.runtime.describe()["weights"] == "gguf-int4"
    assert target.runtime.describe()["int4_kernel"] == kernels.four_bit
    assert target.runtime.describe()["int8_kernel"] == kernels.eight_bit
    return target


def _float32_copy(model, arch="llama", hidden=64) -> TargetModel:
    """The file's model expanded to float32, run by the eager runtime (its own unpacked forward)."""
    reference = TargetModel(make_model(arch, vocab_size=VOCAB, seed=7, dtype=torch.float32, layers=2, hidden=hidden),
                            make_tokenizer(VOCAB), "f32", RuntimeConfig(kind="eager"))
    reference.model.load_state_dict(model.state_dict())
    return reference


def _tree_logits(*targets) -> list[torch.Tensor]:
    """Each target's logits for one small tree over one prompt."""
    prompt, tree = [3, 14, 15, 9, 26, 5], build_tree(35, [[8, 9, 7], [8, 2], [11]])
    logits = []
    for t in targets:
        cache = t.new_cache()
        t.prefill(cache, prompt)
        logits.append(t.forward_tree(cache, tree).logits)
    return logits


@pytest.mark.parametrize(("int4_kernel", "tolerance"),
                         [("torch", 0.1), ("compiled", 1e-5), ("amx", 0.05), ("bf16", 0.05), ("vnni", 0.05),
                          ("vnni8", 0.05)])
def test_the_int4_forward_computes_the_files_model(tmp_path, float32_prefill, int4_kernel, tolerance):
    model, path = _tiny(tmp_path)
    expected, got = _tree_logits(_float32_copy(model), _int4_target(model, path, int4_kernel, kv_cache="model"))
    # PyTorch's kernel rounds activations and scales to bfloat16: close; the AMX and AVX512-BF16 ones round
    # activations and decoded weights only, the AVX512-VNNI one activations to 8 bits per 32: closer;
    # the compiled one keeps float32: equal up to the order of its sums
    error = (expected - got).abs().mean() / expected.abs().mean()
    assert error < tolerance, error
    assert torch.equal(expected.argmax(-1), got.argmax(-1))


def test_a_float16_cache_holds_the_float32_entries_rounded_and_changes_logits_little(tmp_path, float32_prefill):
    """The int4 path's default cache stores keys and values in float16 (compiled layers only): the first layer's
    entries are the float32 ones rounded to nearest, bit for bit (later layers' inputs saw rounded entries), and the
    logits stay within float16's rounding of float32 ones."""
    model, path = _tiny(tmp_path)
    half = _int4_target(model, path, "compiled")
    if half.runtime.layer_calls != "compiled-exact":
        pytest.skip("the compiled layers do not attend here")
    assert half.runtime.kv_dtype == torch.float16 and half.runtime.describe()["kv_cache"] == "float16"
    layers = _prompt_cache_layers(half, _float32_copy(model))
    first, theirs = layers[0]
    assert first.keys.dtype == torch.float16
    assert torch.equal(first.keys, theirs.keys.to(torch.float16))
    assert torch.equal(first.values, theirs.values.to(torch.float16))
    for ours, theirs in layers[1:]:
        for mine, exact in ((ours.keys, theirs.keys), (ours.values, theirs.values)):
            assert 0 < (mine.float() - exact).norm() < 1e-2 * exact.norm()
    wide = _int4_target(model, path, "compiled", kv_cache="model")
    assert wide.runtime.kv_dtype is None
    expected, got = _tree_logits(wide, half)
    error = (expected - got).abs().mean() / expected.abs().mean()
    assert 0 < error < 2e-3, error
    assert torch.equal(expected.argmax(-1), got.argmax(-1))


def test_a_float16_cache_is_refused_where_the_compiled_layers_do_not_attend(tmp_path):
    from hierspec.config import ModelConfig

    for make in (RuntimeConfig, ModelConfig):
        with pytest.raises(InputError, match="unknown KV cache dtype"):
            make(kv_cache="bfloat16")
    model, path = _tiny(tmp_path)
    with pytest.raises(InputError, match="float16 KV cache"):
        _int4_target(model, path, "compiled", kv_cache="float16", attention="sdpa")
    assert _int4_target(model, path, "compiled", attention="sdpa").runtime.kv_dtype is None


def test_the_int4_runtime_reads_prompts_through_the_files_float32_weights(tmp_path, float32_prefill):
    """The prompt's keys and values are the float32 expansion's (no second copy of the weights), bit for bit."""
    model, path = _tiny(tmp_path)
    reference = _float32_copy(model)
    target = _int4_target(model, path, kv_cache="model", prompt_kernel="expanded")
    assert target.runtime.prefill_decoder.lm_head.weights[0].data_ptr() == model.lm_head.weight.data_ptr()
    for ours, theirs in _prompt_cache_layers(target, reference):
        assert torch.equal(ours.keys, theirs.keys) and torch.equal(ours.values, theirs.values)


def _prompt_cache_layers(target, reference):
    """Pairs of cache layers (``target``'s, ``reference``'s) after each prefilled the same prompt."""
    prompt = [3, 14, 15, 9, 26, 5, 35, 2, 2, 7]
    caches = []
    for t in (target, reference):
        cache = t.new_cache()
        t.prefill(cache, prompt)
        caches.append(cache)
    return list(zip(caches[0].layers, caches[1].layers))


def test_on_a_native_bfloat16_cpu_prompts_are_read_with_bfloat16_products_of_the_files_weights(tmp_path, monkeypatch):
    """The prefill decoder's layer products run on a bfloat16 copy of the float32 expansion (2.4x faster on prompt
    rows where the CPU computes bfloat16); its head keeps the loaded weight (prefill logits are never read). The
    prompt's keys and values stay close to the float32 expansion's."""
    model, path = _tiny(tmp_path)
    monkeypatch.setattr(onednn, "native_bfloat16", lambda: True)
    target = _int4_target(model, path, kv_cache="model", prompt_kernel="expanded")
    prefill = target.runtime.prefill_decoder
    qkv = prefill.layers[0].qkv
    attention = model.model.layers[0].self_attn
    stacked = torch.cat([attention.q_proj.weight, attention.k_proj.weight, attention.v_proj.weight]).detach()
    assert qkv.product_dtype == torch.bfloat16 and qkv.weight.dtype == torch.bfloat16
    # prepacked for oneDNN where it packs bfloat16 (a native bfloat16 CPU), else the plain copy
    assert qkv.prepacked == (onednn.probe(torch.bfloat16) is None)
    if not qkv.prepacked:
        assert torch.equal(qkv.weight, stacked.to(torch.bfloat16))
    rows = torch.randn(7, stacked.shape[1], generator=torch.Generator().manual_seed(3))
    expected = F.linear(rows.to(torch.bfloat16), stacked.to(torch.bfloat16)).float()
    expected = expected if qkv.bias is None else expected + qkv.bias
    assert torch.allclose(qkv(rows, split=False)[0], expected, rtol=1e-2, atol=1e-2)
    assert prefill.lm_head.weights[0].data_ptr() == model.lm_head.weight.data_ptr()
    for ours, theirs in _prompt_cache_layers(target, _float32_copy(model)):
        assert ours.keys.dtype == torch.float32 and not torch.equal(ours.keys, theirs.keys)
        for mine, exact in ((ours.keys, theirs.keys), (ours.values, theirs.values)):
            assert (mine - exact).norm() < 0.05 * exact.norm()  # measured 0.3 % after one layer, 1.7 % after two


@pytest.mark.parametrize(("trees", "prompts"), [("vnni", "vnni8"), ("vnni8", "vnni")])
def test_prompts_read_by_integer_rows_share_the_trees_weights_and_equal_that_kernels_own_prompts(tmp_path, trees,
                                                                                                prompts):
    """``--prompt-kernel vnni8`` where trees are verified by ``vnni`` (and the reverse) reads prompts through a view
    of the trees' own packed weights (no copy, no expanded bfloat16 copy) with the other row rounding: its keys and
    values are, bit for bit, those of a runtime that runs that kernel for both."""
    model, path = _tiny(tmp_path)
    target = _int4_target(model, path, trees, prompt_kernel=prompts, kv_cache="model")
    own = _int4_target(model, path, prompts, prompt_kernel=prompts, kv_cache="model")
    assert target.runtime.describe()["prompt_kernel"] == prompts and own.runtime.prefill_decoder is None
    for view, layer in zip(target.runtime.prefill_decoder.layers, target.runtime.decoder.layers):
        for name in ("qkv", "out", "gate_up", "down"):
            for mine, theirs in zip(getattr(view, name).native, getattr(layer, name).native):
                assert [t.data_ptr() for t in mine[:4]] == [t.data_ptr() for t in theirs[:4]]
                assert len(mine) == (5 if prompts == "vnni8" else 4)
    for ours, theirs in _prompt_cache_layers(target, own):
        assert torch.equal(ours.keys, theirs.keys) and torch.equal(ours.values, theirs.values)
    same_rows = _int4_target(model, path, trees, prompt_kernel=trees, kv_cache="model")
    assert same_rows.runtime.prefill_decoder is None
    assert not all(torch.equal(ours.keys, theirs.keys) for ours, theirs in _prompt_cache_layers(target, same_rows))


def test_store_hidden_states_on_the_int4_path_are_each_rows_prompt_read_alone(tmp_path):
    """Stores (dense, head) are built from the hidden states the int4 runtime gives a prompt: each row of a
    right-padded batch read alone (zeros after its mask), its last state the prefill's own, every state close to
    the float32 expansion's transformers forward."""
    model, path = _tiny(tmp_path)
    target = _int4_target(model, path, kv_cache="model")
    ids = torch.tensor([[3, 14, 15, 9, 26, 5], [7, 8, 9, 0, 0, 0]])
    states = target.hidden_states(ids, torch.tensor([[1] * 6, [1, 1, 1, 0, 0, 0]]))
    assert states.shape == (2, 6, model.config.hidden_size) and not states[1, 3:].any()
    for row, count in ((0, 6), (1, 3)):
        last = target.prefill(target.new_cache(), ids[row, :count].tolist(), want_hidden=True)
        assert torch.equal(states[row, count - 1], last)
    expected = _float32_copy(model).hidden_states(ids[:1])[0]
    assert (states[0] - expected).norm() < 0.05 * expected.norm()
    assert torch.equal(target.hidden_states(ids[:1])[0], states[0])  # no mask: the whole row


def test_an_integer_prompt_kernel_is_refused_where_trees_are_verified_by_another_kernel(tmp_path):
    model, path = _tiny(tmp_path)
    with pytest.raises(InputError, match="use --int4-kernel vnni or vnni8"):
        _int4_target(model, path, "compiled", prompt_kernel="vnni8")
    assert _int4_target(model, path, "compiled").runtime.describe()["prompt_kernel"] == "expanded"


def test_int4_verification_of_a_chain_equals_plain_steps_bit_for_bit(tmp_path, kernel):
    target = _int4_target(*_tiny(tmp_path), kernel)
    prompt = [3, 14, 15, 9, 26, 5, 35]
    chain = [8, 9, 7, 9, 3, 2, 38, 4, 6, 26, 1, 17, 40]
    assert_chain_equals_steps(target, prompt, chain)


def test_int4_exact_attention_gives_every_tree_row_its_chains_logits(tmp_path, kernel):
    assert_tree_rows_equal_chains(_int4_target(*_tiny(tmp_path), kernel, attention="exact"))


def test_every_method_on_the_int4_path_equals_its_plain_decoding(tmp_path, prefill, kernel):
    methods = ("pld:budget=off", "hd", "sd:draft=self:1,k=4,budget=off", "hsddw:first=pld,middle=self:1,budget=off")
    accepted = accepted_drafts_of_methods_equal_to_plain(
        _int4_target(*_tiny(tmp_path), kernel), ([4, 8, 15, 16, 23, 42, 4, 8, 15], [5, 6, 7, 5, 6, 7, 5, 6]), methods,
        GenerationConfig(max_new_tokens=40, stop_at_eos=False))
    assert accepted > 0


@pytest.mark.parametrize("requantize", ["4bit", "none"])
def test_a_draft_models_8_bit_weights_are_requantized_to_4_bits_at_load_and_no_output_changes(tmp_path, monkeypatch,
                                                                                             requantize):
    target = _int4_target(*_tiny(tmp_path))
    draft_model = make_model("llama", vocab_size=VOCAB, seed=11, dtype=torch.float32, layers=1, hidden=64)
    draft_file = write_tiny_gguf(tmp_path / "draft.gguf", draft_model, layer_kind="Q8_0")
    loaded = []

    def load_draft(spec, config):  # load_model's runtime for the file, as the context configures it
        loaded.append(TargetModel(draft_model, make_tokenizer(VOCAB), spec,
                                  RuntimeConfig(gguf=str(draft_file), requantize=config.requantize)))
        return loaded[-1]

    monkeypatch.setattr("hierspec.target.load_model", load_draft)
    context = DrafterContext(target, find_default_stores=False, draft_requantize=requantize)
    draft = context.load_draft_lm("tiny-draft", "sd").model
    assert draft is loaded[0] and draft.runtime.kind == "int4" and not target.runtime.requantized
    assert draft.runtime.requantized == (requantize == "4bit")
    # another model than the file's: its cost curve is its own
    assert draft.name == ("tiny-draft, requantized to 4 bits" if requantize == "4bit" else "tiny-draft")
    identity = machine_identity(draft)  # a new rounding of the weights is measured again
    assert identity.get("requantized") == (q.REQUANTIZED_CACHE_VERSION if requantize == "4bit" else None)
    assert "requantized" not in machine_identity(target)
    prompt, config = [4, 8, 15, 16, 23, 42, 4, 8, 15], GenerationConfig(max_new_tokens=30, stop_at_eos=False)
    reference = SpeculativeDecoder(target, NoDrafter()).generate(prompt, config).token_ids
    result = SpeculativeDecoder(target, make_drafter("sd:draft=tiny-draft,k=4,budget=off", context)).generate(
        prompt, config)
    assert result.token_ids == reference and result.stats.drafted_tokens > 0


@pytest.mark.parametrize("draft_dtype, runtime", [("auto", "int4"), ("target", "eager"), ("float32", "eager")])
def test_a_gguf_draft_beside_a_target_of_another_dtype_runs_as_draft_dtype_says_and_no_output_changes(
        tmp_path, monkeypatch, draft_dtype, runtime):
    target = TargetModel(make_model("llama", vocab_size=VOCAB, seed=5, dtype=torch.float64, layers=1, hidden=64),
                         make_tokenizer(VOCAB), "tiny-float64", RuntimeConfig(kind="eager"))
    draft_model = make_model("llama", vocab_size=VOCAB, seed=11, dtype=torch.float32, layers=1, hidden=64)
    draft_file = write_tiny_gguf(tmp_path / "draft.gguf", draft_model)
    seen = []

    def load_draft(spec=None, config=None):  # load_model with the file's runtime as the configuration asks
        seen.append(config)
        return TargetModel(draft_model, make_tokenizer(VOCAB), config.spec, runtime_config(config, draft_model))

    monkeypatch.setattr("hierspec.target.load_model", load_draft)
    target_config = ModelConfig(dtype="float64", runtime="eager")
    context = DrafterContext(target, find_default_stores=False, model_config=target_config, draft_dtype=draft_dtype)
    draft = context.load_draft_lm(str(draft_file), "sd").model
    assert seen[0].spec == str(draft_file)
    assert seen[0].dtype == {"auto": "auto", "target": "float64", "float32": "float32"}[draft_dtype]
    assert draft.runtime.kind == runtime and draft.runtime.config.gguf_cache is None
    prompt, config = [4, 8, 15, 16, 23, 42, 4, 8, 15], GenerationConfig(max_new_tokens=30, stop_at_eos=False)
    reference = SpeculativeDecoder(target, NoDrafter()).generate(prompt, config).token_ids
    result = SpeculativeDecoder(target, make_drafter(f"sd:draft={draft_file},k=4,budget=off", context)).generate(
        prompt, config)
    assert result.token_ids == reference and result.stats.drafted_tokens > 0


def test_draft_model_config_rounds_a_checkpoint_draft_to_4_bits_only_under_auto_and_rejects_unknown_dtypes(
        tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    target_config = ModelConfig(dtype="bfloat16", runtime="packed", threads=2)
    directory = str(tmp_path / "a-checkpoint")
    assert draft_model_config(target_config, directory, "4bit", "auto") == replace(
        target_config, spec=directory, requantize="4bit", dtype="float32", runtime="auto")
    assert draft_model_config(target_config, directory, "none", "auto") == replace(
        target_config, spec=directory, requantize="none")
    assert draft_model_config(target_config, directory, "4bit", "target") == replace(
        target_config, spec=directory, requantize="none")
    gguf = draft_model_config(target_config, str(tmp_path / "draft.gguf"), "none", "auto")
    assert (gguf.dtype, gguf.runtime, gguf.threads, gguf.requantize) == ("auto", "auto", 2, "none")
    expanded = draft_model_config(target_config, str(tmp_path / "draft.gguf"), "4bit", "float16")
    assert (expanded.dtype, expanded.requantize) == ("float16", "none")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    on_cuda = replace(target_config, device="cuda")
    assert draft_model_config(on_cuda, directory, "4bit", "auto").dtype == "bfloat16"
    with pytest.raises(InputError, match="draft dtype"):
        draft_model_config(target_config, directory, "4bit", "int3")
    with pytest.raises(InputError, match="--draft-dtype"):
        DrafterContext(None, draft_dtype="int3")


def test_a_float_weight_rounded_to_4_bits_lands_within_half_a_step_of_every_element():
    weight = torch.randn(32, 96, generator=torch.Generator().manual_seed(3)) * 0.05
    weight[0, :32] = 0.0  # a constant group
    (rounded,) = q.quantize_4bit(weight)
    steps = rounded.scales.repeat_interleave(q.GROUP, dim=1)
    error = (rounded.dequantize() - weight).abs()
    assert bool((error <= steps / 2 + 1e-7).all()) and rounded.codes.max() <= 15
    assert torch.equal(rounded.dequantize()[0, :32], weight[0, :32])


def test_rounding_a_weight_a_few_rows_at_a_time_gives_the_whole_weight_rounding_and_leaves_the_weight_alone(
        monkeypatch):
    weight = torch.randn(48, 64, generator=torch.Generator().manual_seed(4)) * 0.05
    weight[5, 32:] = -0.25  # a constant group
    kept = weight.clone()
    groups = weight.reshape(48, 2, q.GROUP)
    bias, step = q._float16_grid(groups.amin(dim=-1), groups.amax(dim=-1))
    whole = torch.round((groups - bias[..., None]) / torch.where(step > 0, step, 1.0)[..., None])
    whole = whole.clamp(0, 15).to(torch.uint8).reshape(48, 64)
    monkeypatch.setattr(q, "QUANTIZE_CHUNK", 3 * 64 + 1)  # chunks of 3 rows, 16 of them
    (chunked,) = q.quantize_4bit(weight)
    monkeypatch.setattr(q, "QUANTIZE_CHUNK", 7 * 64)  # chunks of 7 rows, the last of 6
    (uneven,) = q.quantize_4bit(weight)
    for rounded in (chunked, uneven):
        assert torch.equal(rounded.codes, whole) and torch.equal(rounded.scales, step)
        assert torch.equal(rounded.zeros, bias + 8 * step)
    assert torch.equal(weight, kept)  # rounded in copies, never in the caller's tensor

def test_a_float32_checkpoint_draft_runs_its_weights_rounded_to_4_bits_and_no_output_changes(tmp_path):
    kernels, reason = q.resolve_kernel("auto")
    if kernels is None:
        pytest.skip(reason)
    target = TargetModel(make_model("llama", vocab_size=VOCAB, seed=5, dtype=torch.float64, layers=1, hidden=64),
                         make_tokenizer(VOCAB), "tiny-float64", RuntimeConfig(kind="eager"))
    float_draft = make_model("llama", vocab_size=VOCAB, seed=11, dtype=torch.float32, layers=1, hidden=64)
    draft = TargetModel(float_draft, make_tokenizer(VOCAB), "tiny-draft", RuntimeConfig(requantize="4bit"))
    assert draft.runtime.kind == "int4" and draft.runtime.describe()["weights"] == "rounded-int4"
    assert draft.name == "tiny-draft, requantized to 4 bits"
    plain = TargetModel(float_draft, make_tokenizer(VOCAB), "tiny-draft", RuntimeConfig())
    assert plain.runtime.kind != "int4"  # without the rounding asked for, a checkpoint stays float
    rounded_copy = make_model("llama", vocab_size=VOCAB, seed=11, dtype=torch.float32, layers=1, hidden=64)
    modules = dict(rounded_copy.named_modules())
    weights, reason = q.float_weights_4bit(float_draft)
    assert reason is None and len(weights) == 7 + 1
    with torch.no_grad():
        for name, (rounded,) in weights.items():  # the float model with each linear's rounded weight
            modules[name].weight.copy_(rounded.dequantize())
        ids = torch.tensor([[4, 8, 15, 16, 23, 42]])
        reference, unrounded = rounded_copy(ids).logits[0, -1], float_draft(ids).logits[0, -1]
    cache = draft.new_cache(capacity=16)
    draft.prefill(cache, ids[0].tolist()[:-1])
    logits = draft.forward_tree(cache, build_tree(42, [], []), False).logits[0].to(torch.float32)
    # the rounded weights' model up to the kernels' row rounding (rows as 8-bit codes, a float16 cache), not the
    # float model
    assert torch.linalg.vector_norm(logits - reference) < 0.3 * torch.linalg.vector_norm(logits - unrounded)
    prompt, config = [4, 8, 15, 16, 23, 42, 4, 8, 15], GenerationConfig(max_new_tokens=30, stop_at_eos=False)
    expected = SpeculativeDecoder(target, NoDrafter()).generate(prompt, config).token_ids
    context = DrafterContext(target, find_default_stores=False)
    context._opened[("draft-model", "tiny-draft", "4bit", "auto")] = draft
    result = SpeculativeDecoder(target, make_drafter("sd:draft=tiny-draft,k=4,budget=off", context)).generate(
        prompt, config)
    assert result.token_ids == expected and result.stats.drafted_tokens > 0


def test_a_q5_0_file_runs_on_the_int4_path_as_8_bit_codes_and_every_method_equals_plain_decoding(tmp_path, kernel):
    """Most of Qwen2.5-Coder-0.5B's Q4_K_M file is Q5_0 (rows of 896 are no whole number of K-quant blocks)."""
    model, path = _tiny(tmp_path, layer_kind="Q5_0")
    weights, reason = q.read_gguf_weights(path, model.config)
    assert reason is None and all(len(passes) == 2 for passes in weights.values())  # the 8-bit form, as Q8_0
    target = _int4_target(model, path, kernel)
    methods = ("pld:budget=off", "hd", "sd:draft=self:1,k=4,budget=off")
    accepted = accepted_drafts_of_methods_equal_to_plain(
        target, ([4, 8, 15, 16, 23, 42, 4, 8, 15], [5, 6, 7, 5, 6, 7, 5, 6]), methods,
        GenerationConfig(max_new_tokens=30, stop_at_eos=False))
    assert accepted > 0


def test_every_method_batched_on_the_int4_path_equals_its_plain_decoding(tmp_path, prefill, kernel):
    """Requests verified together (one int4 product over every request's rows) give each its tokens alone."""
    target = _int4_target(*_tiny(tmp_path), kernel)
    assert target.runtime.kind == "int4" and target.runtime.batches
    config = GenerationConfig(max_new_tokens=30, stop_at_eos=False)
    plain = SpeculativeDecoder(target, NoDrafter())
    prompts = [[4, 8, 15, 16, 23, 42, 4, 8, 15], [5, 6, 7, 5, 6, 7, 5, 6], [9, 9, 2], [3, 1, 4, 1, 5, 9, 2, 6]]
    prompts = [p + plain.generate(p, config).token_ids[:10] for p in prompts]
    references = [plain.generate(p, config).token_ids for p in prompts]
    context = DrafterContext(target)
    accepted = 0
    methods = ("pld:budget=off", "hd", "sd:draft=self:1,k=4,budget=off", "hsddw:first=pld,middle=self:1,budget=off")
    for method in methods:
        results = decode_batch(target, prompts, lambda: make_drafter(method, context), config, BatchConfig(max_batch=3))
        assert [r.token_ids for r in results] == references, method
        accepted += sum(r.stats.accepted_drafts for r in results)
    assert accepted > 0


def test_batched_generation_on_the_int4_path_gives_its_own_plain_decoding(tmp_path):
    """Building a model store answers prompts through the runtime's batched forward (the int4 products and its
    float16 cache), so each answer is the int4 target's own greedy answer alone — not a float32 model's — whatever
    the prompts beside it, and a prompt that fills the context gets none."""
    from hierspec.batch_generate import generate_greedy_batches

    model, path = _tiny(tmp_path)
    target = _int4_target(model, path, "compiled")
    prompts = [[4, 8, 15, 16, 23], [5, 6, 7], [9, 9, 2, 1], [3, 1, 4, 1, 5], [2] * target.max_context]
    answers = dict(generate_greedy_batches(target, prompts, 6, batch_size=2))
    plain = SpeculativeDecoder(target, NoDrafter())
    expected = [plain.generate(p, GenerationConfig(max_new_tokens=6)).token_ids for p in prompts[:4]]
    assert [answers[i] for i in range(4)] == expected and answers[4] == []
    assert max(len(answer) for answer in expected) == 6


def test_unsupported_blocks_fall_back_to_dequantized_weights_or_fail_clearly_when_int4_is_asked(tmp_path):
    model, path = _tiny(tmp_path, plain=("blk.1.ffn_down.weight",))
    weights, reason = q.read_gguf_weights(path, model.config)
    assert weights is None and "blk.1.ffn_down.weight is stored as F32" in reason
    target = TargetModel(model, make_tokenizer(VOCAB), "tiny", RuntimeConfig(gguf=str(path)))
    assert target.runtime.kind in ("packed", "eager")
    with pytest.raises(InputError, match="int4 runtime is unavailable.*F32"):
        TargetModel(model, make_tokenizer(VOCAB), "tiny", RuntimeConfig(kind="int4", gguf=str(path)))
    with pytest.raises(InputError, match="not loaded from a GGUF file"):
        TargetModel(model, make_tokenizer(VOCAB), "tiny", RuntimeConfig(kind="int4"))


def test_decoded_weights_are_cached_beside_the_file_and_a_damaged_cache_is_rebuilt(tmp_path, caplog):
    model, path = _tiny(tmp_path)
    cache_dir = tmp_path / "converted"
    cache_dir.mkdir()
    first, _ = q.load_gguf_weights(path, model.config, cache_dir)
    cache = cache_dir / q.CACHE_FILE
    assert cache.is_file()
    second, _ = q.load_gguf_weights(path, model.config, cache_dir)
    for name in first:
        for a, b in zip(first[name], second[name]):
            assert torch.equal(a.codes, b.codes) and torch.equal(a.scales, b.scales) and torch.equal(a.zeros, b.zeros)
            assert a.factors is b.factors is None  # Q4_1 and Q8_0 weights have none
    cache.write_bytes(b"\x00" * 64)
    third, _ = q.load_gguf_weights(path, model.config, cache_dir)
    assert "rebuilding the damaged int4 weight cache" in caplog.text
    assert torch.equal(third["lm_head"][0].codes, first["lm_head"][0].codes)
    assert q._read_cache(cache, str(q.CACHE_VERSION))  # rewritten whole
    assert not list(cache_dir.glob("*.tmp"))
    caplog.clear()
    data = bytearray(cache.read_bytes())  # bytes flipped inside a tensor: still a readable safetensors file
    data[-100:-90] = bytes(b ^ 0x5A for b in data[-100:-90])
    cache.write_bytes(bytes(data))
    fourth, _ = q.load_gguf_weights(path, model.config, cache_dir)
    assert "does not match its SHA-256" in caplog.text
    for name in first:
        for a, b in zip(first[name], fourth[name]):
            assert torch.equal(a.codes, b.codes) and torch.equal(a.scales, b.scales) and torch.equal(a.zeros, b.zeros)


def test_weights_requantized_to_4_bits_are_cached_in_a_file_of_their_own(tmp_path, monkeypatch):
    model, path = _tiny(tmp_path, layer_kind="Q8_0")
    cache_dir = tmp_path / "converted"
    cache_dir.mkdir()
    plain, _ = q.load_gguf_weights(path, model.config, cache_dir)
    first, _ = q.load_gguf_weights(path, model.config, cache_dir, requantize=True)
    assert (cache_dir / q.CACHE_FILE).is_file() and (cache_dir / q.REQUANTIZED_CACHE_FILE).is_file()
    assert all(len(passes) == 2 for passes in plain.values()) and all(len(passes) == 1 for passes in first.values())

    def refuse(passes):
        raise AssertionError("the cached requantized weights should have been read")

    monkeypatch.setattr(q, "requantize_4bit", refuse)
    second, _ = q.load_gguf_weights(path, model.config, cache_dir, requantize=True)
    for name in first:
        (a,), (b,) = first[name], second[name]
        assert torch.equal(a.codes, b.codes) and torch.equal(a.scales, b.scales) and torch.equal(a.zeros, b.zeros)
    again, _ = q.load_gguf_weights(path, model.config, cache_dir)  # the file's own cache untouched
    assert torch.equal(again["lm_head"][1].codes, plain["lm_head"][1].codes)


def test_a_cache_of_another_format_version_is_rebuilt_without_calling_it_damaged(tmp_path, caplog, monkeypatch):
    """Each cache file carries its own format version: a new version of the rounded (draft) weights rebuilds only
    that file, and says why at INFO level rather than warning of damage."""
    model, path = _tiny(tmp_path, layer_kind="Q8_0")
    cache_dir = tmp_path / "converted"
    cache_dir.mkdir()
    q.load_gguf_weights(path, model.config, cache_dir)
    q.load_gguf_weights(path, model.config, cache_dir, requantize=True)
    plain_bytes = (cache_dir / q.CACHE_FILE).read_bytes()
    monkeypatch.setattr(q, "REQUANTIZED_CACHE_VERSION", q.REQUANTIZED_CACHE_VERSION + 1)
    caplog.set_level("INFO", logger=q.log.name)
    rounded, _ = q.load_gguf_weights(path, model.config, cache_dir, requantize=True)
    assert "rebuilding the int4 weight cache" in caplog.text and "format version" in caplog.text
    assert "damaged" not in caplog.text
    assert q._read_cache(cache_dir / q.REQUANTIZED_CACHE_FILE, str(q.REQUANTIZED_CACHE_VERSION))
    assert (cache_dir / q.CACHE_FILE).read_bytes() == plain_bytes  # the file's own cache kept as it was
    assert all(len(passes) == 1 for passes in rounded.values())


def test_a_k_quant_files_scale_factors_are_cached_with_its_passes(tmp_path):
    model, path = _tiny_k_quant(tmp_path)
    first, _ = q.load_gguf_weights(path, model.config, tmp_path)
    again, _ = q.load_gguf_weights(path, model.config, tmp_path)  # from the cache
    assert (tmp_path / q.CACHE_FILE).is_file()
    for name in ("model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.v_proj", "lm_head"):
        for a, b in zip(first[name], again[name]):
            assert a.factors is not None and b.factors is not None, name
            for x, y in zip(a.factors.parts(), b.factors.parts()):
                assert (x is None and y is None) or torch.equal(x, y), name


def _bytes(packed) -> int:
    return sum(t.numel() * t.element_size() for t in (packed.codes, packed.scales, packed.bias, packed.units))


def test_the_vnni_kernel_reads_a_k_quant_files_scales_factored_with_the_same_products(tmp_path):
    """With the AVX512-VNNI products a ``Q4_K``/``Q6_K`` stack keeps a byte per scale (and offset) and a unit per
    256 inputs instead of float32 scales: the same weights, so the same products as the scales stored whole."""
    kernels, reason = q.resolve_kernel("vnni")
    if kernels is None:
        pytest.skip(reason)
    model, path = _tiny_k_quant(tmp_path)
    weights, _ = q.read_gguf_weights(path, model.config)
    rows = torch.randn(5, 256, generator=torch.Generator().manual_seed(0))
    for name in ("model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.v_proj", "model.layers.0.mlp.up_proj"):
        projection = q.Int4Projection([weights[name]], [None], kernel="vnni")
        (stack,) = projection.stacks
        assert stack.units.numel() > 0 and stack.scales.dtype in (torch.uint8, torch.int8), name
        whole = q.Int4Projection([[q.Int4Weight(p.codes, p.scales, p.zeros) for p in weights[name]]], [None],
                                 kernel="vnni")
        assert whole.stacks[0].units.numel() == 0
        assert _bytes(stack) < 0.9 * _bytes(whole.stacks[0]), name
        got, expected = projection(rows)[0], whole(rows)[0]
        if name.endswith("v_proj"):  # Q6_K: scales d sc exactly, so the very same products
            assert torch.equal(got, expected), name
        else:  # Q4_K: offsets -dmin m exactly, against zero - 8 scale folded in float32
            assert torch.allclose(got, expected, rtol=1e-5, atol=1e-5), name


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_the_compiled_layer_halves_equal_the_decoders_own_operations_bit_for_bit(tmp_path, kernel, arch):
    """With the compiled extension each int4 layer half around attention is one call; its results are those of the
    decoder's own operations (Qwen2: q/k/v biases, a four-pass Q6_K value stack beside one-pass Q4_K ones)."""
    model, path = _tiny_k_quant(tmp_path) if arch == "qwen2" else _tiny(tmp_path)
    decoder = _int4_target(model, path, kernel).runtime.decoder
    if decoder._fused is None:
        pytest.skip("the compiled extension cannot be built here")
    width = decoder.embedding.shape[1]
    generator = torch.Generator().manual_seed(5)
    with torch.inference_mode():
        for rows in (1, 3, 7):
            hidden = torch.randn(rows, width, generator=generator)
            attended = torch.randn(rows, decoder.heads * decoder.head_dim, generator=generator)
            cos, sin = decoder._rotation(torch.arange(20, 20 + rows))
            for layer in decoder.layers:
                fused = decoder._fused.attention_inputs(layer, hidden, cos, sin)
                own = decoder._attention_inputs(layer, decoder._norm(hidden, layer.norm1, decoder.eps), cos, sin, rows)
                for a, b in zip(fused, own):
                    assert a.shape == b.shape and torch.equal(a, b)
                fused_mlp = decoder._fused.mlp(layer, hidden, attended)
                halves, decoder._fused = decoder._fused, None
                try:
                    assert torch.equal(fused_mlp, decoder._mlp(layer, hidden, attended))
                finally:
                    decoder._fused = halves


def test_a_new_build_of_the_compiled_kernels_gets_its_own_cost_curve(tmp_path, monkeypatch):
    from hierspec.calibration import default_curve_path
    from hierspec.runtime import int4_kernel

    target = _int4_target(*_tiny(tmp_path), int4_kernel="compiled")
    before = default_curve_path(target, tmp_path)
    assert default_curve_path(target, tmp_path) == before  # stable while the build is
    monkeypatch.setattr(int4_kernel, "build_id", lambda: "another-build")
    assert default_curve_path(target, tmp_path) != before


def test_a_head_over_some_tokens_computes_those_columns_of_the_whole_head_bit_for_bit(tmp_path, kernel):
    """A draft's shortlist head on the int4 path: the chosen rows of the file's head, each logit the very sum the
    whole head computes (per-output products), whatever the kernel and however many tokens (not a whole block)."""
    model, path = _tiny_k_quant(tmp_path)
    target = _int4_target(model, path, kernel)
    prompt, tree = [3, 14, 15, 9, 26, 5], build_tree(35, [[8, 9, 7], [8, 2], [11]])
    for tokens in ([5, 1, 40, 63, 7], list(range(0, VOCAB, 2))):
        outputs = []
        for head in (None, target.head_over(tokens)):
            cache = target.new_cache()
            target.prefill(cache, prompt)
            outputs.append(target.forward_tree(cache, tree, head=head).logits)
        whole, short = outputs
        assert torch.equal(short, whole[:, tokens])


def test_where_prompts_are_read_expanded_short_ones_are_read_by_the_tree_products(tmp_path, monkeypatch):
    """``auto`` reads a prompt of up to the timed crossover's length through the products that verify trees, a longer
    one expanded: each reading is bit for bit that path's own; the crossover is timed with this model's key only
    where ``auto`` chose the expanded weights."""
    model, path = _tiny(tmp_path)
    asked = []

    def crossover(rows):
        return lambda key, threads, time_prompt: asked.append((key, time_prompt)) or rows

    monkeypatch.setattr(prompt_kernel, "timed_short_prompt_rows", crossover(8))
    target = _int4_target(model, path, "compiled")
    assert target.runtime.prompt_kernel == "expanded" and target.runtime.describe()["short_prompt_rows"] == 8
    monkeypatch.setattr(prompt_kernel, "timed_short_prompt_rows", crossover(10**6))
    by_trees = _int4_target(model, path, "compiled")
    monkeypatch.setattr(prompt_kernel, "timed_short_prompt_rows", lambda *args: pytest.fail("timed"))
    expanded = _int4_target(model, path, "compiled", prompt_kernel="expanded")
    assert expanded.runtime.short_prompt_rows == 0

    def layers(t, prompt):
        cache = t.new_cache()
        t.prefill(cache, prompt)
        return [(layer.keys, layer.values) for layer in cache.layers]

    def same(a, b):
        return all(torch.equal(x, y) for pair_a, pair_b in zip(a, b) for x, y in zip(pair_a, pair_b))

    short, long = [3, 14, 15, 9, 26, 5, 35, 2], [3, 14, 15, 9, 26, 5, 35, 2, 2, 7, 11]
    assert same(layers(target, short), layers(by_trees, short))
    assert not same(layers(target, short), layers(expanded, short))
    assert same(layers(target, long), layers(expanded, long))
    assert not same(layers(target, long), layers(by_trees, long))
    # both models' keys are the same (one shape, one kernel, one file) and the timing reads each path
    assert asked[0][0] == asked[1][0] and len(asked) == 2
    for tree in (True, False):
        assert 0 < asked[0][1](4, tree) < 10

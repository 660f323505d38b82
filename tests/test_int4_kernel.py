"""hierspec's compiled int4 product (:mod:`hierspec.runtime.int4_kernel`): its layout, its products against float64,
row invariance, the per-CPU build key, the choice between it and PyTorch's kernel, and the fallbacks."""

import dataclasses
import functools
import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny import make_model, make_tokenizer

from hierspec import runtime
from hierspec.errors import InputError
from hierspec.runtime import RuntimeConfig
from hierspec.runtime import int4_kernel as k
from hierspec.runtime import quantized as q
from hierspec.target import TargetModel
from hierspec.tree import build_tree

MODULE, REASON = k.compiled_kernel()
needs_kernel = pytest.mark.skipif(MODULE is None, reason=str(REASON))


def _random_weight(out_features, in_features, passes, seed=0):
    generator = torch.Generator().manual_seed(seed)
    codes = [torch.randint(0, 16, (out_features, in_features), generator=generator, dtype=torch.uint8)
             for _ in range(passes)]
    scales = [torch.rand(out_features, in_features // 32, generator=generator) * 0.1 for _ in range(passes)]
    zeros = [torch.randn(out_features, in_features // 32, generator=generator) * 0.1 for _ in range(passes)]
    dense = sum((c.double() - 8) * s.double().repeat_interleave(32, 1) + z.double().repeat_interleave(32, 1)
                for c, s, z in zip(codes, scales, zeros))
    return k.pack_passes(codes, scales, zeros), dense


def test_packing_puts_element_j_and_j_plus_16_in_one_byte_and_folds_the_offsets_into_one_bias():
    codes = torch.arange(32, dtype=torch.uint8).remainder(16).reshape(1, 32)
    packed = k.pack_passes([codes], [torch.tensor([[2.0]])], [torch.tensor([[16.5]])])
    # element j (low nibble) and j + 16 (high): codes j % 16 both, so byte j is 0x11 * j
    assert packed.codes.tolist() == [[[0x11 * j for j in range(16)]]]
    assert packed.scales.tolist() == [[[2.0]]]
    assert packed.bias.tolist() == [[0.5]]  # zero - 8 * scale
    two = k.pack_passes([codes, codes], [torch.tensor([[1.0]]), torch.tensor([[3.0]])],
                        [torch.tensor([[1.0]]), torch.tensor([[2.0]])])
    assert two.codes.shape == (2, 1, 16) and two.bias.tolist() == [[(1.0 - 8) + (2.0 - 24)]]


@needs_kernel
@pytest.mark.parametrize(("out_features", "in_features", "passes"),
                         [(24, 96, 1), (67, 64, 2), (960, 576, 1), (130, 1536, 4)])
def test_products_equal_float64_up_to_float32_rounding(out_features, in_features, passes):
    weight, dense = _random_weight(out_features, in_features, passes)
    rows = torch.randn(9, in_features, generator=torch.Generator().manual_seed(1))
    got = k.int4_mm(MODULE, rows, weight).double()
    expected = rows.double() @ dense.t()
    assert got.shape == (9, out_features)
    assert ((got - expected).abs().max() / expected.abs().max()).item() < 1e-5


@needs_kernel
@settings(max_examples=25, deadline=None)
@given(st.data())
def test_a_rows_product_is_bit_identical_whatever_rows_are_multiplied_with_it(data):
    weight, _ = _random_weight(52, 128, 2, seed=3)
    _assert_row_subsets_equal(data, weight, torch.randn(17, 128, generator=torch.Generator().manual_seed(4)))


def _assert_row_subsets_equal(data, weight, rows) -> None:
    """A drawn range and a drawn pick of ``rows`` multiplied alone equal their rows of the whole product."""
    whole = k.int4_mm(MODULE, rows, weight)
    count = rows.shape[0]
    start = data.draw(st.integers(0, count - 1))
    stop = data.draw(st.integers(start + 1, count))
    picked = data.draw(st.lists(st.integers(0, count - 1), min_size=1, max_size=max(9, count // 2)))
    assert torch.equal(k.int4_mm(MODULE, rows[start:stop].contiguous(), weight), whole[start:stop])
    assert torch.equal(k.int4_mm(MODULE, rows[picked].contiguous(), weight), whole[picked])


@needs_kernel
@pytest.mark.parametrize("rows", [1, 3, 6])
def test_the_eight_bit_product_equals_float64_and_is_row_invariant(rows):
    generator = torch.Generator().manual_seed(6)
    codes = torch.randint(-128, 128, (70, 96), generator=generator, dtype=torch.int8)
    scales = torch.rand(70, 6, generator=generator) * 0.01
    x = torch.randn(rows, 96, generator=generator)
    got = k.int4_mm(MODULE, x, k.PackedInt8(codes, scales))
    expected = x.double() @ (codes.double() * scales.double().repeat_interleave(16, 1)).t()
    assert ((got.double() - expected).abs().max() / expected.abs().max()).item() < 1e-5
    for row in range(rows):
        assert torch.equal(k.int4_mm(MODULE, x[row : row + 1].contiguous(), k.PackedInt8(codes, scales))[0], got[row])


@needs_kernel
def test_the_kernel_refuses_inputs_of_the_wrong_shape_or_dtype():
    weight, _ = _random_weight(16, 64, 1)
    with pytest.raises(RuntimeError, match="x: contiguous float32"):
        k.int4_mm(MODULE, torch.randn(2, 64, dtype=torch.float64), weight)
    with pytest.raises(RuntimeError, match="K must be a multiple of 32"):
        k.int4_mm(MODULE, torch.randn(2, 32), weight)


AMX_REASON = k.amx_reason()
needs_amx = pytest.mark.skipif(AMX_REASON is not None, reason=str(AMX_REASON))
BF16_REASON = k.bf16_reason()
needs_bf16 = pytest.mark.skipif(BF16_REASON is not None, reason=str(BF16_REASON))
VNNI_REASON = k.vnni_reason()
needs_vnni = pytest.mark.skipif(VNNI_REASON is not None, reason=str(VNNI_REASON))


def _bfloat16_expected(rows, weight):
    """The bfloat16 products' model in float64: the rows rounded to bfloat16 times the weights as the kernels decode
    them (computed in float32, rounded to bfloat16)."""
    return rows.bfloat16().double() @ weight.float().bfloat16().double().t()


def _vnni_expected(rows, weight):
    """The AVX512-VNNI products' model in float64: the rows rounded to 8-bit codes per 32 inputs times the weights."""
    return k.vnni_rounded(rows) @ weight.t()


def _vnni8_expected(rows, weight):
    """The one-code integer products' model: the rows rounded to one 8-bit code an input times the weights."""
    return k.vnni_rounded(rows, one_code=True) @ weight.t()


#: the tile-decoding products, each with its layouts of 4-bit and 8-bit codes, its packed weights' class and its model
#: in float64: the AMX tiles and the AVX512-BF16 dot products decode the same bfloat16 weights, the AVX512-VNNI ones
#: multiply the codes by the rows' 8-bit codes; all are held to the same tests
DECODING_KERNELS = [
    pytest.param((k.pack_amx, k.pack_amx_int8, k.PackedAmx, _bfloat16_expected), marks=needs_amx, id="amx"),
    pytest.param((k.pack_bf16, k.pack_bf16_int8, k.PackedBf16, _bfloat16_expected), marks=needs_bf16, id="bf16"),
    pytest.param((k.pack_vnni, k.pack_vnni_int8, k.PackedVnni, _vnni_expected), marks=needs_vnni, id="vnni"),
    pytest.param((functools.partial(k.pack_vnni, one_code=True), functools.partial(k.pack_vnni_int8, one_code=True),
                  k.PackedVnni, _vnni8_expected), marks=needs_vnni, id="vnni8"),
]


def test_amx_packing_puts_two_outputs_in_one_byte_and_32_codes_of_an_output_together():
    codes = ((torch.arange(16).reshape(16, 1) + torch.arange(64).reshape(1, 64)) % 16).to(torch.uint8)  # (n + k) % 16
    packed = k.pack_amx([codes], [torch.full((16, 2), 2.0)], [torch.full((16, 2), 16.5)])
    assert packed.codes.shape == (1, 1, 2, 256)
    # byte i of pair j: output 2j, input i (low nibble) and output 2j + 1, input i (high nibble)
    first = packed.codes[0, 0, 0]
    assert first[:3].tolist() == [0x10, 0x21, 0x32]  # (0,0)|(1,0); (0,1)|(1,1); (0,2)|(1,2)
    assert first[32].item() == 0x32  # pair 1: outputs 2 and 3, input 0
    assert packed.codes[0, 0, 1, 0].item() == 0x10  # step 1: inputs 32.. (32 % 16 = 0)
    assert packed.scales.shape == (1, 1, 2, 16) and packed.scales.flatten().tolist() == [2.0] * 32
    assert packed.bias.shape == (1, 2, 16) and packed.bias.flatten().tolist() == [0.5] * 32  # zero - 8 * scale
    signed = (torch.arange(16 * 32).reshape(16, 32) - 256).clamp(-128, 127).to(torch.int8)  # 32 n + k - 256
    eight = k.pack_amx_int8(signed, torch.ones(16, 2))
    assert eight.codes.shape == (1, 1, 1, 512) and eight.codes.dtype == torch.int8
    assert torch.equal(eight.codes[0, 0, 0].reshape(16, 32), signed)  # output n's 32 codes at bytes 32 n..
    with pytest.raises(ValueError, match="one pass"):
        k.pack_amx([codes, codes], [torch.ones(16, 2)] * 2, [torch.zeros(16, 2)] * 2)


def test_the_avx512_bf16_packing_holds_the_amx_bytes_with_a_blocks_pairs_one_after_another():
    generator = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 16, (32, 96), generator=generator, dtype=torch.uint8)
    scales, zeros = [torch.rand(32, 3, generator=generator)], [torch.randn(32, 3, generator=generator)]
    tiles, pairs = k.pack_amx([codes], scales, zeros), k.pack_bf16([codes], scales, zeros)
    assert pairs.codes.shape == (1, 2, 8, 3, 32)
    for block, pair, step in ((0, 0, 0), (1, 5, 2), (0, 7, 1)):
        assert torch.equal(pairs.codes[0, block, pair, step], tiles.codes[0, block, step, 32 * pair:32 * pair + 32])
    assert torch.equal(pairs.scales, tiles.scales) and torch.equal(pairs.bias, tiles.bias)
    signed = torch.randint(-128, 128, (16, 64), generator=generator, dtype=torch.int8)
    eight, eight_tiles = k.pack_bf16_int8(signed, torch.ones(16, 4)), k.pack_amx_int8(signed, torch.ones(16, 4))
    assert eight.codes.shape == (1, 1, 8, 2, 64) and eight.codes.dtype == torch.int8
    assert torch.equal(eight.codes[0, 0, 3, 1], eight_tiles.codes[0, 0, 1, 192:256])  # outputs 6 and 7, step 1
    assert torch.equal(eight.codes[0, 0, 3, 1, :32], signed[6, 32:])


def test_the_avx512_vnni_packing_puts_four_inputs_of_each_output_together_and_two_quads_in_one_byte():
    # code (n + k) % 16 of output n at input k; scales and bias as the AMX layout's
    codes = ((torch.arange(32).reshape(32, 1) + torch.arange(64).reshape(1, 64)) % 16).to(torch.uint8)
    scales, zeros = [torch.full((32, 2), 2.0)], [torch.full((32, 2), 16.5)]
    packed, tiles = k.pack_vnni([codes], scales, zeros), k.pack_amx([codes], scales, zeros)
    assert packed.codes.shape == (1, 2, 2, 4, 16, 4) and packed.codes.dtype == torch.uint8
    # byte (c, n, i) of step s: input 32 s + 4 c + i (low nibble) and 32 s + 16 + 4 c + i (high) of output 16 b + n
    assert packed.codes[0, 0, 0, 0, 0].tolist() == [0x00, 0x11, 0x22, 0x33]
    assert packed.codes[0, 1, 1, 2, 3].tolist() == [(19 + 40 + i) % 16 | ((19 + 56 + i) % 16) << 4 for i in range(4)]
    assert torch.equal(packed.scales, tiles.scales) and torch.equal(packed.bias, tiles.bias)
    signed = (torch.arange(16 * 64).reshape(16, 64) % 251 - 125).to(torch.int8)
    eight = k.pack_vnni_int8(signed, torch.ones(16, 4))
    assert eight.codes.shape == (1, 1, 2, 8, 16, 4) and eight.codes.dtype == torch.int8
    assert torch.equal(eight.codes[0, 0, 1, 5, 9], signed[9, 32 + 20:32 + 24])  # step 1, quad 5, output 9
    with pytest.raises(ValueError, match="one pass"):
        k.pack_vnni([codes, codes], scales * 2, zeros * 2)


@needs_vnni
def test_the_avx512_vnni_products_round_each_row_to_15_bits_per_32_inputs_as_vnni_rounded_says():
    """An identity weight (8-bit code 1 at scale 1) returns the rounded rows themselves, bit for bit: the kernel's
    rounding is the model the other tests compare with. Each input lands within 1/256 of its step's scale
    (max |x| / 127); multiples of 1/128 of it come back exactly; a step of zeros stays zero."""
    generator = torch.Generator().manual_seed(12)
    rows = torch.randn(11, 64, generator=generator) * torch.logspace(-3, 3, 64)
    rows[3, 32:] = 0
    rows[4, :5] = torch.tensor([0.5, -0.5, 1.5, 2.5 + 1 / 128, 127.0])  # the step's scale is 1
    identity = k.pack_vnni_int8(torch.eye(64, dtype=torch.int8), torch.ones(64, 4))
    got = k.int4_mm(MODULE, rows, identity)
    assert torch.equal(got, k.vnni_rounded(rows).float())
    assert got[4, :5].tolist() == rows[4, :5].tolist() and got[3, 32:].abs().max() == 0
    step_scale = (rows.reshape(11, 2, 32).abs().amax(-1) / 127).repeat_interleave(32, 1)
    assert ((got - rows).abs() <= step_scale / 256 * (1 + 1e-4)).all()
    assert (got != rows).any()


@needs_vnni
def test_the_one_code_integer_products_round_each_row_to_8_bits_per_32_inputs_as_vnni_rounded_says():
    """``vnni8``: the identity weight returns each input as one 8-bit code times its step's scale (max |x| / 127),
    within half that scale; whole multiples of it come back exactly."""
    generator = torch.Generator().manual_seed(13)
    rows = torch.randn(7, 64, generator=generator) * torch.logspace(-3, 3, 64)
    rows[2, :4] = torch.tensor([1.0, -3.0, 127.0, 0.5])  # the step's scale is 1; 0.5 rounds to even: 0
    identity = k.pack_vnni_int8(torch.eye(64, dtype=torch.int8), torch.ones(64, 4), one_code=True)
    got = k.int4_mm(MODULE, rows, identity)
    assert torch.equal(got, k.vnni_rounded(rows, one_code=True).float())
    assert got[2, :4].tolist() == [1.0, -3.0, 127.0, 0.0]
    step_scale = (rows.reshape(7, 2, 32).abs().amax(-1) / 127).repeat_interleave(32, 1)
    assert ((got - rows).abs() <= step_scale / 2 * (1 + 1e-4)).all()
    assert ((got - k.vnni_rounded(rows).float()).abs() > step_scale / 256).any()  # coarser than two codes


@needs_vnni
@pytest.mark.parametrize("eight", [False, True], ids=["q4_k", "q6_k"])
def test_avx512_vnni_products_with_factored_scales_equal_those_with_the_scales_stored_whole(eight):
    """K-quant scales as a byte per group and output times a float32 unit per 256 inputs: the same weights, so the
    same products bit for bit, for any number of rows; the packing keeps the steps and units per block of 16 outputs."""
    generator = torch.Generator().manual_seed(13)
    factors, scales, zeros = k.random_factors(generator, 48, 768, eight)
    if eight:
        signed = torch.randint(-128, 128, (48, 768), generator=generator, dtype=torch.int8)
        factored, whole = k.pack_vnni_int8(signed, scales, factors), k.pack_vnni_int8(signed, scales)
        assert factored.units.shape == (1, 3, 3, 16) and factored.scales.dtype == torch.int8 and not factored.bias.numel()
    else:
        codes = torch.randint(0, 16, (48, 768), generator=generator, dtype=torch.uint8)
        factored, whole = (k.pack_vnni([codes], [scales], [zeros], factors=factors),
                           k.pack_vnni([codes], [scales], [zeros]))
        assert factored.units.shape == (2, 3, 3, 16) and factored.bias.dtype == torch.uint8
        assert torch.equal(factored.units[1, 2, 1], factors.offset_units[32:48, 1])  # block 2, super-block 1
    assert factored.scales.shape == whole.scales.shape and torch.equal(factored.codes, whole.codes)
    assert torch.equal(factored.scales[0, 1, 5], factors.steps[16:32, 5])  # block 1, group 5: outputs 16..31
    rows = torch.randn(19, 768, generator=generator)
    for count in (1, 8, 9, 19):
        got = k.int4_mm(MODULE, rows[:count].contiguous(), factored)
        assert torch.equal(got, k.int4_mm(MODULE, rows[:count].contiguous(), whole)), count
        assert got.abs().max() > 0


needs_six_bit = pytest.mark.skipif(not k.six_bit_products(MODULE), reason="no integer products in this build")


def test_the_six_bit_form_holds_low_nibbles_as_the_four_bit_form_and_high_bits_in_two_chunks():
    """Codes within -32..31 as u = code + 32: chunks 0..3 the 4-bit layout's bytes of u's low nibbles (quad c low,
    c + 4 high), chunk 4 + p the high 2 bits of quads p, p + 2, p + 4, p + 6 at bits 0, 2, 4, 6."""
    signed = ((torch.arange(16 * 64).reshape(16, 64) * 7) % 64 - 32).to(torch.int8)
    six = k.pack_vnni_int8(signed, torch.ones(16, 4), six_bit=True)
    assert six.codes.shape == (1, 1, 2, 6, 16, 4) and six.codes.dtype == torch.uint8
    u = signed.to(torch.int16) + 32  # [16, 64]; output 9, step 1: inputs 32..63
    step = u[9, 32:64]
    quad = [step[4 * c:4 * c + 4] for c in range(8)]
    assert six.codes[0, 0, 1, 2, 9].tolist() == (quad[2] % 16 | (quad[6] % 16) << 4).tolist()
    expected_high = [sum(((quad[p + 2 * j] >> 4) << 2 * j) for j in range(4)) for p in (0, 1)]
    assert [six.codes[0, 0, 1, 4 + p, 9].tolist() for p in (0, 1)] == [h.tolist() for h in expected_high]
    assert not k.six_bit_quads(torch.full((1, 1, 1, 8, 16, 4), -32, dtype=torch.int8)).any()
    assert (k.six_bit_quads(torch.full((1, 1, 1, 8, 16, 4), 31, dtype=torch.int8)) == 0xFF).all()
    for outside in (-33, 32):
        with pytest.raises(ValueError, match="-32..31"):
            k.pack_vnni_int8(torch.full((16, 32), outside, dtype=torch.int8), torch.ones(16, 2), six_bit=True)


@needs_vnni
@needs_six_bit
@pytest.mark.parametrize("one_code", [False, True], ids=["vnni", "vnni8"])
def test_six_bit_products_equal_the_same_codes_in_eight_bits_for_every_row_count(one_code):
    """A Q6_K weight's codes (-32..31) in the 6-bit form give the 8-bit form's products bit for bit — factored scales
    and scales stored whole (float32 and float16), 1 to 20 rows (every pass shape), the codes' extremes included."""
    generator = torch.Generator().manual_seed(21)
    factors, scales, _ = k.random_factors(generator, 48, 512, eight=True)
    signed = torch.randint(-32, 32, (48, 512), generator=generator, dtype=torch.int8)
    signed[0, :40], signed[1, :40] = -32, 31
    rows = torch.randn(20, 512, generator=generator) * torch.logspace(-2, 2, 512)
    halves = scales.half().float()
    for pack_args in ((scales, factors), (scales, None), (halves, None)):
        six = k.pack_vnni_int8(signed, *pack_args, one_code=one_code, six_bit=True)
        eight = k.pack_vnni_int8(signed, *pack_args, one_code=one_code)
        assert six.codes.numel() * 4 == eight.codes.numel() * 3
        whole = k.int4_mm(MODULE, rows, eight)
        assert whole.abs().max() > 0
        for count in range(1, 21):
            assert torch.equal(k.int4_mm(MODULE, rows[:count].contiguous(), six), whole[:count]), count


@needs_vnni
@needs_six_bit
def test_a_q6_k_stack_is_packed_in_six_bits_where_the_kernel_takes_them():
    """``Int4Projection`` packs a Q6_K member (four passes with scale factors) in the 6-bit form on the integer products,
    and its products equal the 8-bit form's."""
    rng = np.random.default_rng(22)
    raw = rng.integers(0, 256, size=(32, 2, 210), dtype=np.uint8)  # Q6_K blocks: 2 super-blocks a row
    raw[..., 208:210] = rng.uniform(2e-4, 8e-4, (32, 2, 1)).astype(np.float16).view(np.uint8)
    passes = q.decode_blocks("Q6_K", raw.reshape(32, -1), 32, 512)
    projection = q.Int4Projection([passes], [None], kernel="vnni8")
    (stack,) = projection.stacks
    assert stack.codes.shape[3] == 6 and stack.codes.dtype == torch.uint8
    rows = torch.randn(3, 512, generator=torch.Generator().manual_seed(22))
    codes, scales = q.as_int8(passes)
    eight = k.pack_vnni_int8(codes, scales, passes[0].factors, one_code=True)
    assert torch.equal(projection(rows)[0], k.int4_mm(MODULE, rows, eight))


@needs_vnni
@needs_six_bit
def test_a_q5_0_stack_is_packed_in_six_bits_and_a_q8_0_one_in_eight():
    """A Q5_0 weight's codes (-16..15, two passes, scales stored whole) fit the 6-bit form, and its products equal
    the 8-bit form's; a Q8_0 weight's codes (-128..127) stay in 8 bits."""
    rng = np.random.default_rng(23)
    raw = rng.integers(0, 256, size=(32, 16, 22), dtype=np.uint8)  # Q5_0 blocks: 16 of 32 inputs a row
    raw[..., 0:2] = rng.uniform(2e-3, 8e-3, (32, 16, 1)).astype(np.float16).view(np.uint8)
    passes = q.decode_blocks("Q5_0", raw.reshape(32, -1), 32, 512)
    projection = q.Int4Projection([passes], [None], kernel="vnni8")
    (stack,) = projection.stacks
    assert stack.codes.shape[3] == 6 and stack.codes.dtype == torch.uint8
    codes, scales = q.as_int8(passes)
    assert int(codes.min()) == -16 and int(codes.max()) == 15
    rows = torch.randn(5, 512, generator=torch.Generator().manual_seed(23))
    eight = k.pack_vnni_int8(codes, scales, one_code=True)
    assert torch.equal(projection(rows)[0], k.int4_mm(MODULE, rows, eight))
    wide = q.quantize_q8_0(torch.randn(32, 512, generator=torch.Generator().manual_seed(24)))
    (stack,) = q.Int4Projection([wide], [None], kernel="vnni8").stacks
    assert stack.codes.shape[3] == 8 and stack.codes.dtype == torch.int8


@needs_vnni
def test_avx512_vnni_products_refuse_factored_scales_of_the_wrong_shape_or_dtype():
    generator = torch.Generator().manual_seed(14)
    factors, scales, zeros = k.random_factors(generator, 16, 256, eight=False)
    codes = torch.randint(0, 16, (16, 256), generator=generator, dtype=torch.uint8)
    packed = k.pack_vnni([codes], [scales], [zeros], factors=factors)
    x = torch.randn(2, 256)
    with pytest.raises(RuntimeError, match="units"):
        k.int4_mm(MODULE, x, k.PackedVnni(packed.codes, packed.scales, packed.bias, packed.units[:1].contiguous()))
    with pytest.raises(RuntimeError, match="factored scale"):
        k.int4_mm(MODULE, x, k.PackedVnni(packed.codes, packed.scales.to(torch.int8), packed.bias, packed.units))
    with pytest.raises(RuntimeError, match="factored bias"):
        k.int4_mm(MODULE, x, k.PackedVnni(packed.codes, packed.scales, packed.bias.float(), packed.units))
    short = k.pack_vnni([codes[:, :224].contiguous()], [scales[:, :7].contiguous()], [zeros[:, :7].contiguous()])
    with pytest.raises(RuntimeError, match="multiple of 256"):
        k.int4_mm(MODULE, x[:, :224].contiguous(), k.PackedVnni(short.codes, packed.scales[:, :, :7].contiguous(),
                                                                packed.bias[:, :7].contiguous(), packed.units))


def test_amx_packing_keeps_scales_in_float16_only_where_every_value_is_exactly_one():
    codes = torch.zeros(16, 64, dtype=torch.uint8)
    exact = k.pack_amx([codes], [torch.full((16, 2), 0.375)], [torch.full((16, 2), 5.0)])  # bias 5 - 8 * 0.375 = 2
    assert exact.scales.dtype == exact.bias.dtype == torch.float16 and exact.bias.flatten().tolist() == [2.0] * 32
    offset = k.pack_amx([codes], [torch.full((16, 2), 0.375)], [torch.full((16, 2), 3.1)])  # bias 0.1: no float16
    assert offset.scales.dtype == offset.bias.dtype == torch.float32
    signed = torch.zeros(16, 32, dtype=torch.int8)
    assert k.pack_amx_int8(signed, torch.full((16, 2), 1e5)).scales.dtype == torch.float32  # beyond float16
    assert k.pack_amx_int8(signed, torch.full((16, 2), 2.0 ** -20)).scales.dtype == torch.float16  # a subnormal


@pytest.mark.parametrize("kernel", DECODING_KERNELS)
@pytest.mark.parametrize(("out_features", "in_features", "rows"),
                         [(16, 32, 1), (48, 96, 9), (960, 576, 17), (144, 1536, 40)])
def test_decoding_products_equal_their_model_in_float64(kernel, out_features, in_features, rows):
    pack4, pack8, _, model = kernel
    generator = torch.Generator().manual_seed(2)
    codes = torch.randint(0, 16, (out_features, in_features), generator=generator, dtype=torch.uint8)
    scales = torch.rand(out_features, in_features // 32, generator=generator) * 0.1
    zeros = torch.randn(out_features, in_features // 32, generator=generator) * 0.1
    x = torch.randn(rows, in_features, generator=generator)
    got = k.int4_mm(MODULE, x, pack4([codes], [scales], [zeros])).double()
    bias = (zeros - 8 * scales).double()  # folded in float32, as the packing does
    weight = codes.double() * scales.double().repeat_interleave(32, 1) + bias.repeat_interleave(32, 1)
    expected = model(x, weight)
    assert got.shape == (rows, out_features)
    assert ((got - expected).abs().max() / expected.abs().max()).item() < 1e-5
    signed = torch.randint(-128, 128, (out_features, in_features), generator=generator, dtype=torch.int8)
    signed_scales = torch.rand(out_features, in_features // 16, generator=generator) * 0.01
    got = k.int4_mm(MODULE, x, pack8(signed, signed_scales)).double()
    expected = model(x, signed.double() * signed_scales.double().repeat_interleave(16, 1))
    assert ((got - expected).abs().max() / expected.abs().max()).item() < 1e-5


@pytest.mark.parametrize("kernel", DECODING_KERNELS)
@settings(max_examples=25, deadline=None)
@given(st.data())
def test_a_decoding_products_rows_are_bit_identical_whatever_rows_are_multiplied_with_them(kernel, data):
    """One tile or pass (up to 16 or 8 rows), several (a prompt): every row's operations are the same."""
    pack4, pack8, *_ = kernel
    generator = torch.Generator().manual_seed(3)
    weight, _ = _random_weight(48, 128, 2, seed=3)
    four = pack4([torch.randint(0, 16, (48, 128), generator=generator, dtype=torch.uint8)],
                 [weight.scales[0]], [torch.ones(48, 4)])
    eight = pack8(torch.randint(-128, 128, (48, 128), generator=generator, dtype=torch.int8),
                  torch.rand(48, 8, generator=generator))
    rows = torch.randn(37, 128, generator=torch.Generator().manual_seed(4))
    _assert_row_subsets_equal(data, data.draw(st.sampled_from([four, eight])), rows)


@pytest.mark.parametrize("kernel", DECODING_KERNELS)
def test_decoding_products_rows_are_bit_identical_across_every_way_of_splitting_them(kernel):
    """AMX: one column tile (up to 16 rows), two at once (17-32), a prompt's decoded block (33 on, in pairs and a
    last single tile); AVX512-BF16: one pass decoding as it goes (up to 8 rows), several passes over the decoded
    steps (9 on, the last pass of 1 to 8 rows); AVX512-VNNI: passes of up to 12 rows; AVX2: passes of up to 8 rows
    (8-bit codes, and 4-bit ones of one row), else tiles of 2 to 6 rows (one of 2-6, more of 3 or 4). The rows'
    products never change."""
    pack4, pack8, *_ = kernel
    generator = torch.Generator().manual_seed(5)
    codes = torch.randint(0, 16, (32, 96), generator=generator, dtype=torch.uint8)
    packs = [pack4([codes], [torch.rand(32, 3, generator=generator)], [torch.randn(32, 3, generator=generator)]),
             pack8(torch.randint(-128, 128, (32, 96), generator=generator, dtype=torch.int8),
                   torch.rand(32, 6, generator=generator))]
    rows = torch.randn(70, 96, generator=generator)
    for packed in packs:
        whole = k.int4_mm(MODULE, rows, packed)
        for count in (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 15, 16, 17, 31, 32, 33, 48, 49, 64, 65):
            assert torch.equal(k.int4_mm(MODULE, rows[:count].contiguous(), packed), whole[:count]), count
            assert torch.equal(k.int4_mm(MODULE, rows[70 - count:].contiguous(), packed), whole[70 - count:]), count


@pytest.mark.parametrize("kernel", DECODING_KERNELS)
def test_decoding_products_with_float16_scales_equal_those_with_the_same_scales_in_float32(kernel):
    """Float16 scales and offsets widen exactly (subnormal ones too): the same decoded weights, bit for bit."""
    pack4, pack8, packed_class, _ = kernel
    generator = torch.Generator().manual_seed(6)
    scales = torch.randint(1, 1024, (48, 4), generator=generator) / 4096
    zeros = torch.randint(-512, 512, (48, 4), generator=generator) / 256  # offsets zeros - 8 scales: 512ths
    signed_scales = torch.randint(1, 2048, (48, 8), generator=generator) * 2.0 ** -24  # below 2^-14: subnormal
    packs = [pack4([torch.randint(0, 16, (48, 128), generator=generator, dtype=torch.uint8)], [scales], [zeros]),
             pack8(torch.randint(-128, 128, (48, 128), generator=generator, dtype=torch.int8), signed_scales)]
    rows = torch.randn(21, 128, generator=generator)
    for half in packs:
        assert half.scales.dtype == torch.float16
        wide = dataclasses.replace(half, scales=half.scales.float(), bias=half.bias.float())
        for count in (1, 16, 21):
            got = k.int4_mm(MODULE, rows[:count].contiguous(), half)
            assert torch.equal(got, k.int4_mm(MODULE, rows[:count].contiguous(), wide)), count
            assert got.abs().max() > 0


@pytest.mark.parametrize("kernel", DECODING_KERNELS)
def test_the_decoding_products_of_no_rows_are_empty_as_the_compiled_ones(kernel):
    pack4, pack8, *_ = kernel
    codes = torch.randint(0, 16, (32, 64), generator=torch.Generator().manual_seed(9), dtype=torch.uint8)
    scales, zeros = torch.ones(32, 2), torch.zeros(32, 2)
    for packed in (pack4([codes], [scales], [zeros]), pack8(codes.to(torch.int8), torch.ones(32, 4)),
                   k.pack_passes([codes], [scales], [zeros])):
        assert k.int4_mm(MODULE, torch.zeros(0, 64), packed).shape == (0, 32)


@pytest.mark.parametrize("kernel", DECODING_KERNELS)
def test_the_decoding_products_refuse_operands_of_the_wrong_shape(kernel):
    pack4, _, packed_class, _ = kernel
    packed = pack4([torch.zeros(16, 64, dtype=torch.uint8)], [torch.ones(16, 2)], [torch.zeros(16, 2)])
    with pytest.raises(RuntimeError, match="K must match"):
        k.int4_mm(MODULE, torch.randn(2, 32), packed)
    with pytest.raises(RuntimeError, match="bias"):
        k.int4_mm(MODULE, torch.randn(2, 64), packed_class(packed.codes, packed.scales, torch.empty(0)))
    with pytest.raises(RuntimeError, match="the scale's dtype"):
        k.int4_mm(MODULE, torch.randn(2, 64), packed_class(packed.codes, packed.scales.float(), packed.bias.half()))
    with pytest.raises(RuntimeError, match="codes: contiguous"):
        k.int4_mm(MODULE, torch.randn(2, 64), packed_class(packed.codes[..., :2].contiguous(), packed.scales, packed.bias))


def test_decoding_products_that_are_wrong_or_missing_are_reported(monkeypatch):
    class NoTiles:
        @staticmethod
        def amx_ready():
            return False

        @staticmethod
        def bf16_ready():
            return False

        @staticmethod
        def vnni_ready():
            return False

    class Wrong(NoTiles):
        @staticmethod
        def int4_amx_mm(rows, codes, scales, bias):
            return torch.zeros(rows.shape[0], codes.shape[1] * 16)

        @staticmethod
        def int4_bf16_mm(rows, codes, scales, bias):
            return torch.zeros(rows.shape[0], codes.shape[1] * 16)

        @staticmethod
        def int4_vnni_mm(rows, codes, scales, bias, units):
            return torch.zeros(rows.shape[0], codes.shape[1] * 16)

    assert k._check_amx(Wrong()) == "the AMX products compute wrong products"
    assert k._check_bf16(Wrong()) == "the AVX512-BF16 products compute wrong products"
    assert k._check_vnni(Wrong()) == "the integer (VNNI) products compute wrong products"
    monkeypatch.setattr(k, "compiled_kernel", lambda: (NoTiles(), None))
    assert k.amx_reason() == "this CPU (or its operating system) offers no AMX-BF16 tiles"
    assert k.bf16_reason() == "this CPU has no AVX512_BF16 instructions"
    assert k.vnni_reason() == "this CPU has neither AVX512_VNNI nor AVX2 with FMA and F16C"
    monkeypatch.setattr(k, "compiled_kernel", lambda: (None, "no compiler"))
    assert k.amx_reason() == k.bf16_reason() == k.vnni_reason() == "no compiler"


def test_the_build_key_changes_with_the_source_pytorch_and_the_cpu():
    base = k.build_key(b"source", "2.13.0", "model name: A\nflags: avx2")
    assert base == k.build_key(b"source", "2.13.0", "model name: A\nflags: avx2")
    assert len({base, k.build_key(b"source!", "2.13.0", "model name: A\nflags: avx2"),
                k.build_key(b"source", "2.14.0", "model name: A\nflags: avx2"),
                k.build_key(b"source", "2.13.0", "model name: A\nflags: avx2 avx512f")}) == 4


def test_weights_read_once_are_fetched_non_temporally_on_amd_cpus_only():
    amd = "model name\t: AMD EPYC 7B13 64-Core Processor\nflags\t\t: avx2 fma"
    intel = "model name\t: Intel(R) Xeon(R) Processor\nflags\t\t: avx2 avx512f amx_tile AMD_fake_flag"
    assert k.compile_flags(amd) == k.CFLAGS + ("-DHIERSPEC_STREAM_NTA",)
    assert k.compile_flags(intel) == k.CFLAGS  # a flag naming AMD is not the model name
    source = (Path(k.__file__).parent / "int4_vnni.cpp").read_text()
    assert "#ifdef HIERSPEC_STREAM_NTA" in source and "_MM_HINT_NTA" in source


@pytest.mark.parametrize(("timings", "expected"), [
    ({"torch": [1.0, 2.0], "compiled": [0.5, 2.4]}, "compiled"),  # 2.9 < 3.0
    ({"torch": [1.0, 2.0], "compiled": [0.5, 2.6]}, "torch"),  # 3.1 > 3.0: never the slower one
    ({"torch": [1.0, 2.0], "compiled": [2.0, 1.0]}, "torch"),  # a tie keeps the kernel that needs no compiler
    ({"compiled": [1.0, 1.0], "torch": [1.0, 1.5]}, "compiled"),
    ({"torch": [1.0, 2.0], "compiled": [0.5, 2.4], "amx": [0.6, 0.7]}, "amx"),
    ({"torch": [1.0, 2.0], "compiled": [0.5, 2.4], "bf16": [0.7, 1.0]}, "bf16"),
])
def test_the_automatic_choice_takes_the_faster_kernel_on_hand_made_timings(timings, expected):
    assert k.choose_kernel(timings) == expected


def test_a_kernel_that_cannot_be_built_is_reported_and_the_int4_path_keeps_pytorchs(tmp_path, monkeypatch):
    from test_quantized import write_tiny_gguf

    def fail(directory):
        raise OSError("no C++ compiler here")

    monkeypatch.setattr(k, "_build", fail)
    module, reason = k.compiled_kernel.__wrapped__()  # the cached result stays this CPU's real kernel
    assert module is None and "could not be built (OSError: no C++ compiler here)" in reason
    monkeypatch.setattr(k, "compiled_kernel", lambda: (None, reason))
    assert q.resolve_kernel("compiled") == (None, reason)
    if q.kernel_reason() is not None:
        return
    assert q.resolve_kernel("auto") == (q.Int4Kernels("torch", "torch"), None)
    model = make_model("llama", vocab_size=64, seed=7, dtype=torch.float32, layers=2, hidden=64)
    target = TargetModel(model, make_tokenizer(64), "tiny", RuntimeConfig(gguf=str(write_tiny_gguf(
        tmp_path / "tiny.gguf", model))))
    assert target.runtime.describe()["int4_kernel"] == "torch"
    assert target.runtime.decoder._fused is None  # operation by operation, as before the extension
    cache = target.new_cache()
    target.prefill(cache, [3, 14, 15, 9])
    assert target.forward_tree(cache, build_tree(26, [[5, 35]])).logits.shape == (3, 64)


def test_a_kernel_that_computes_wrong_products_is_not_used():
    class Wrong:
        @staticmethod
        def int4_mm(rows, codes, scales, bias):
            return torch.zeros(rows.shape[0], codes.shape[1])

    assert k._check(Wrong()) == "the compiled int4 kernel computes wrong products"


def test_the_cli_and_the_model_config_offer_exactly_the_runtimes_kernels():
    """cli.py and config.py spell the kernel names out (they load without torch): they must match the runtime's."""
    import argparse

    from hierspec.cli import _add_model_options
    from hierspec.config import ModelConfig

    parser = argparse.ArgumentParser()
    _add_model_options(parser)
    option = next(action for action in parser._actions if action.dest == "int4_kernel")
    assert tuple(option.choices) == k.KERNEL_CHOICES
    for name in k.KERNEL_CHOICES:
        assert ModelConfig(int4_kernel=name).int4_kernel == name
    with pytest.raises(InputError, match="unknown int4 kernel"):
        ModelConfig(int4_kernel="avx2")


def test_asking_for_an_int4_kernel_that_cannot_run_is_a_clear_error(tmp_path, monkeypatch):
    from test_quantized import write_tiny_gguf

    model = make_model("llama", vocab_size=64, seed=7, dtype=torch.float32, layers=2, hidden=64)
    path = write_tiny_gguf(tmp_path / "tiny.gguf", model)
    reason = "the compiled int4 kernel could not be built (x)"
    monkeypatch.setattr(runtime, "resolve_kernel", lambda choice: (None, reason))
    with pytest.raises(InputError, match="int4 runtime is unavailable: the compiled int4 kernel could not be built"):
        TargetModel(model, make_tokenizer(64), "tiny", RuntimeConfig(kind="int4", gguf=str(path),
                                                                     int4_kernel="compiled"))
    with pytest.raises(InputError, match="unknown int4 kernel"):
        RuntimeConfig(int4_kernel="fast")


def test_the_automatic_choice_is_kept_per_machine_and_read_back_without_timing(tmp_path, monkeypatch):
    path = tmp_path / "choice-t2.json"
    k.write_choice(path, "torch", "compiled", {"four_bit": {"torch": [1.0, 2.0], "compiled": [1.5, 3.0]}})
    assert k.read_choice(path) == ("torch", "compiled")
    for damaged in ("{not json", '{"version": 3, "four_bit": "fastest", "eight_bit": "torch"}', '{"kernel": "torch"}',
                    '{"version": 2, "four_bit": "torch", "eight_bit": "torch"}',  # before the AMX products
                    '{"four_bit": "torch", "eight_bit": "torch"}', "[]"):  # the last two: before versions
        path.write_text(damaged)
        assert k.read_choice(path) is None
    monkeypatch.setattr(k, "choice_path", lambda threads: tmp_path / f"choice-t{threads}.json")
    k.write_choice(tmp_path / "choice-t3.json", "compiled", "torch", {})
    monkeypatch.setattr(k, "time_kernels", lambda *args, **kwargs: pytest.fail("timed although a choice was kept"))
    q._timed_choice.cache_clear()
    try:
        assert q._timed_choice(3, ("torch", "compiled")) == q.Int4Kernels("compiled", "torch")
        # a kept choice naming a kernel that no longer runs here is timed again among those that do
        k.write_choice(tmp_path / "choice-t4.json", "amx", "amx", {})
        monkeypatch.setattr(k, "time_kernels", lambda products, *args, **kwargs: {
            name: [1.0 if name == "compiled" else 2.0] for name in products})
        assert q._timed_choice(4, ("torch", "compiled")) == q.Int4Kernels("compiled", "compiled")
    finally:
        q._timed_choice.cache_clear()


def test_a_choice_another_process_kept_while_this_one_timed_is_the_one_this_process_runs(tmp_path, monkeypatch):
    """Of two processes timing the kernels at once, the first to keep its choice wins and the other follows it; a
    kept choice naming a kernel that cannot run here is replaced by this process's own."""
    monkeypatch.setattr(k, "choice_path", lambda threads: tmp_path / f"choice-t{threads}.json")

    def timed_beside(theirs):
        def time_kernels(products, *args, **kwargs):
            if theirs is not None:
                k.write_choice(tmp_path / "choice-t6.json", *theirs, {})
            return {name: [1.0 if name == "compiled" else 2.0] for name in products}
        return time_kernels

    for theirs, expected in ((("torch", "torch"), ("torch", "torch")), (("amx", "amx"), ("compiled", "compiled"))):
        (tmp_path / "choice-t6.json").unlink(missing_ok=True)
        monkeypatch.setattr(k, "time_kernels", timed_beside(theirs))
        q._timed_choice.cache_clear()
        try:
            assert q._timed_choice(6, ("torch", "compiled")) == q.Int4Kernels(*expected)
        finally:
            q._timed_choice.cache_clear()
        assert k.read_choice(tmp_path / "choice-t6.json") == expected


def test_kernel_timings_are_the_fastest_of_the_repeats_so_a_busy_machine_does_not_pick_the_kernel(monkeypatch):
    """Another process on the same cores only adds time: "tiles" takes 3 ms but is held up 20 ms in 12 of 20 calls,
    "ints" always 5 ms. Medians would pick "ints" (and keep that choice for every later process); the fastest of the
    repeats picks "tiles", the faster kernel on the quiet machine."""
    clock = [0.0]
    monkeypatch.setattr(k.time, "perf_counter", lambda: clock[0])
    calls = {"tiles": 0}

    def tiles(rows):
        calls["tiles"] += 1
        clock[0] += 0.003 + (0.020 if calls["tiles"] % 5 in (1, 2, 3) else 0.0)

    def ints(rows):
        clock[0] += 0.005

    timings = k.time_kernels({"tiles": tiles, "ints": ints}, 32, repeats=20, row_counts=(1,))
    assert timings == {"tiles": [pytest.approx(0.003)], "ints": [pytest.approx(0.005)]}
    assert k.choose_kernel(timings) == "tiles"


def test_a_choice_timed_on_a_busy_machine_is_kept_with_a_warning_naming_the_remedy(tmp_path, monkeypatch, caplog):
    assert k.busy_while_timing({"vnni8": [5.1e-3, 5.0e-3], "amx": [4.9e-3, 5.2e-3]})
    assert not k.busy_while_timing({"vnni8": [5.1e-3, 5.0e-3], "torch": [8.0e-5, 9.0e-5]})  # one kernel ran freely
    assert not k.busy_while_timing({})
    monkeypatch.setattr(k, "choice_path", lambda threads: tmp_path / f"choice-t{threads}.json")
    for busy, warned in ((True, True), (False, False)):
        (tmp_path / "choice-t5.json").unlink(missing_ok=True)
        monkeypatch.setattr(k, "time_kernels", lambda products, *args, **kwargs: {
            name: [(5e-3 if busy else 5e-5) * (1 if name == "compiled" else 2)] * 2 for name in products})
        q._timed_choice.cache_clear()
        caplog.clear()
        try:
            with caplog.at_level(logging.WARNING, logger=q.__name__):
                assert q._timed_choice(5, ("torch", "compiled")) == q.Int4Kernels("compiled", "compiled")
        finally:
            q._timed_choice.cache_clear()
        assert k.read_choice(tmp_path / "choice-t5.json") == ("compiled", "compiled")  # kept either way
        assert ("--retime-kernels" in caplog.text) is warned


def test_auto_times_the_one_code_integer_products_beside_the_amx_tiles_and_never_the_two_code_ones(monkeypatch):
    candidates = []
    monkeypatch.setattr(q, "_timed_choice", lambda threads, names: candidates.append(names) or q.Int4Kernels(
        names[-1], names[-1]))
    for name in ("amx", "bf16", "vnni", "vnni8", "compiled"):
        monkeypatch.setattr(k, f"{name}_reason" if name != "compiled" else "compiled_kernel",
                            (lambda: None) if name != "compiled" else (lambda: (object(), None)))
    monkeypatch.setattr(q, "kernel_reason", lambda: None)
    assert q.resolve_kernel("auto")[0] is not None
    assert candidates[-1] == ("torch", "compiled", "amx", "bf16", "vnni8")
    monkeypatch.setattr(k, "amx_reason", lambda: "no tiles")
    assert q.resolve_kernel("auto") == (q.Int4Kernels("vnni8", "vnni8"), None)
    assert candidates[-1] == ("torch", "compiled", "bf16", "vnni8")  # two codes per row never timed by auto
    assert q.resolve_kernel("vnni")[0] == q.Int4Kernels("vnni", "vnni")  # asked for by name, it runs


def test_a_choice_that_cannot_be_kept_is_logged_and_leaves_no_file(tmp_path, caplog):
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    k.write_choice(blocker / "choice-t2.json", "torch", "torch", {})
    assert "is timed again at the next load" in caplog.text
    assert list(tmp_path.iterdir()) == [blocker]


@needs_kernel
def test_the_compiled_activation_is_silu_times_up_to_float32_rounding_and_row_by_row():
    generator = torch.Generator().manual_seed(11)
    both = torch.randn(7, 2 * 37, generator=generator) * 6  # a width with a tail past whole vectors
    gate, up = both[:, :37], both[:, 37:]
    act = MODULE.silu_product(gate, up)
    exact = torch.nn.functional.silu(gate.double()) * up.double()
    assert ((act.double() - exact).abs() / exact.abs().clamp_min(1e-30)).max().item() < 1e-6
    assert torch.equal(MODULE.silu_product(gate[3:4].contiguous(), up[3:4].contiguous())[0], act[3])
    with pytest.raises(RuntimeError, match="gate, up"):
        MODULE.silu_product(gate.t(), up.t())


def test_only_the_bindings_include_pytorchs_python_headers():
    """A first build's time is mostly header parsing (``torch/extension.h`` alone takes about a minute on a Zen 3
    core): the kernels include ATen's tensor header, and only ``bindings.cpp`` pulls in pybind11 and PyTorch's Python
    headers."""
    assert Path(k.__file__).with_name("bindings.cpp") in k.SOURCES
    for path in k.SOURCES + k.HEADERS:
        text = path.read_text()
        if path.name == "bindings.cpp":
            assert "PYBIND11_MODULE" in text
            continue
        assert "torch/extension.h" not in text and "pybind" not in text.lower() and "torch/csrc" not in text, path.name

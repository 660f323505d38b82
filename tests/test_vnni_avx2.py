"""The integer (VNNI) products' AVX2 build (``int4_vnni.cpp`` for CPUs without AVX512-VNNI, e.g. AMD Zen 3): built here
with ``-march=haswell`` where this CPU's own build is the AVX-512 one (a Zen 4, a Xeon; elsewhere this CPU's build is
the AVX2 one), it must give the float64 model's products and, bit for bit, those of the extension hierspec builds for
this CPU, for 4-bit and 8-bit codes (and the 6-bit form against the same codes in 8 bits), stored and
factored scales and any number of rows. The float32 dense products (``dense_f32.cpp``) are built with them and
compared the same way; a prompt's attention (``prompt_attention.cpp``, 8-lane vectors there) against SDPA."""

from pathlib import Path

import pytest
import torch

from hierspec.machine import cpuinfo_fields
from hierspec.runtime import int4_kernel as k
from test_prompt_attention import _prompt, _sdpa

SOURCES = [Path(k.__file__).with_name("int4_vnni.cpp"), Path(k.__file__).with_name("int4_vnni8.cpp"),
           Path(k.__file__).with_name("dense_f32.cpp"), Path(k.__file__).with_name("prompt_attention.cpp"),
           Path(__file__).with_name("native") / "vnni_products.cpp"]
MODULE, REASON = k.compiled_kernel()


@pytest.fixture(scope="module")
def avx2(kernel_builds):
    """The integer products compiled for Haswell's instruction set (AVX2, FMA, F16C; no AVX-512), once per source
    (kept with the compiled kernels in the real cache). On a CPU without AVX512-VNNI (a Zen 3) this CPU's own build
    is already the AVX2 build, and is used as it is: a second build of the same code would only cost minutes."""
    if MODULE is None:
        pytest.skip(str(REASON))
    if MODULE.vnni_width() == 256:
        return MODULE
    from torch.utils.cpp_extension import load

    flags = ["-O3", "-march=haswell", "-ffp-contract=fast", "-fopenmp"]
    source = b"".join(p.read_bytes() for p in SOURCES + list(k.HEADERS))
    key = k.build_key(source + " ".join(flags).encode(), torch.__version__, "haswell")
    directory = kernel_builds / f"vnni-haswell-{key}"
    directory.mkdir(parents=True, exist_ok=True)
    module = load(name=f"hierspec_vnni_haswell_{key}", sources=[str(p) for p in SOURCES],
                  build_directory=str(directory), extra_cflags=flags, extra_ldflags=["-fopenmp"], verbose=False)
    assert module.vnni_ready()
    return module


def _weights(eight: bool, factored: bool, half: bool, generator: torch.Generator):
    """A packed 48 x 768 weight of one form and its float64 values."""
    if factored:
        factors, scales, zeros = k.random_factors(generator, 48, 768, eight)
    else:
        factors = None
        shape = (48, 768 // (16 if eight else 32))
        if half:  # dyadic values float16 holds exactly (the folded bias too): the packing stores them as float16
            scales = torch.randint(1, 64, shape, generator=generator) / 1024
            zeros = torch.randint(-64, 64, (48, 768 // 32), generator=generator) / 64
        else:
            scales = torch.rand(shape, generator=generator) * 0.1
            zeros = torch.randn(48, 768 // 32, generator=generator) * 0.1
    if eight:
        codes = torch.randint(-128, 128, (48, 768), generator=generator, dtype=torch.int8)
        return k.pack_vnni_int8(codes, scales, factors), codes.double() * scales.double().repeat_interleave(16, 1)
    codes = torch.randint(0, 16, (48, 768), generator=generator, dtype=torch.uint8)
    packed = k.pack_vnni([codes], [scales], [zeros], factors=factors)
    bias = (zeros - 8 * scales).double()
    return packed, codes.double() * scales.double().repeat_interleave(32, 1) + bias.repeat_interleave(32, 1)


@pytest.mark.parametrize("one_code", [False, True], ids=["two-codes", "one-code"])
@pytest.mark.parametrize("eight", [False, True], ids=["4-bit", "8-bit"])
@pytest.mark.parametrize("scales", ["float32", "float16", "factored"])
def test_the_avx2_build_of_the_integer_products_equals_their_model_and_this_cpus_build(avx2, eight, scales,
                                                                                     one_code):
    generator = torch.Generator().manual_seed(21)
    packed, weight = _weights(eight, scales == "factored", scales == "float16", generator)
    if scales == "float16":
        assert packed.scales.dtype == torch.float16
    rows = torch.randn(19, 768, generator=generator) * torch.logspace(-2, 2, 768)
    native = k.vnni_reason() is None
    name = "int4_vnni8_mm" if one_code else "int4_vnni_mm"
    product, native_product = getattr(avx2, name), getattr(MODULE, name)
    for count in (1, 3, 8, 9, 19):
        x = rows[:count].contiguous()
        got = product(x, packed.codes, packed.scales, packed.bias, packed.units)
        expected = k.vnni_rounded(x, one_code=one_code) @ weight.t()
        assert ((got.double() - expected).abs().max() / expected.abs().max()).item() < 1e-5, count
        if native:
            assert torch.equal(got, native_product(x, packed.codes, packed.scales, packed.bias, packed.units))
        if count > 1:  # each row as alone
            assert torch.equal(got[-1:], product(x[-1:].contiguous(), packed.codes, packed.scales, packed.bias,
                                                 packed.units))


@pytest.mark.parametrize("one_code", [False, True], ids=["two-codes", "one-code"])
@pytest.mark.parametrize("factored", [False, True], ids=["stored", "factored"])
def test_the_six_bit_form_equals_the_model_and_the_same_codes_in_eight_bits_in_both_builds(avx2, factored, one_code):
    """Q6_K's codes (-32..31) in the 6-bit form: the float64 model's products, and bit for bit the AVX2 build's and
    this CPU's build's products of the same codes in the 8-bit form and in the 6-bit form (on a Zen 4 or a Xeon the
    AVX-512 build's VPDPBUSD path), for 1 to 9 rows (AVX2: one tile of 2-4, passes beyond) and 19; each row as
    alone."""
    generator = torch.Generator().manual_seed(23)
    factors, scales, _ = k.random_factors(generator, 48, 768, eight=True)
    codes = torch.randint(-32, 32, (48, 768), generator=generator, dtype=torch.int8)
    codes[:2, :64] = torch.tensor([[-32], [31]], dtype=torch.int8)
    six = k.pack_vnni_int8(codes, scales, factors if factored else None, six_bit=True)
    eight = k.pack_vnni_int8(codes, scales, factors if factored else None)
    weight = codes.double() * scales.double().repeat_interleave(16, 1)
    rows = torch.randn(19, 768, generator=generator) * torch.logspace(-2, 2, 768)
    name = "int4_vnni8_mm" if one_code else "int4_vnni_mm"
    for count in (*range(1, 10), 19):
        x = rows[:count].contiguous()
        got = getattr(avx2, name)(x, six.codes, six.scales, six.bias, six.units)
        expected = k.vnni_rounded(x, one_code=one_code) @ weight.t()
        assert ((got.double() - expected).abs().max() / expected.abs().max()).item() < 1e-5, count
        for module in (avx2, MODULE):
            assert torch.equal(got, getattr(module, name)(x, eight.codes, eight.scales, eight.bias, eight.units))
            assert torch.equal(got, getattr(module, name)(x, six.codes, six.scales, six.bias, six.units))
        assert torch.equal(got[-1:], getattr(avx2, name)(x[-1:].contiguous(), six.codes, six.scales, six.bias,
                                                          six.units)), count


@pytest.mark.parametrize("one_code", [False, True], ids=["two-codes", "one-code"])
def test_the_avx2_build_rounds_each_row_exactly_as_vnni_rounded_says(avx2, one_code):
    """An identity weight (8-bit code 1 at scale 1) returns the rounded rows themselves: the AVX2 build's vector
    rounding (four 8-lane vectors a step, packed back into input order) gives the model's codes bit for bit — ties
    to even, a step of zeros, a step whose scale is 1, inputs of every magnitude, for any number of rows."""
    generator = torch.Generator().manual_seed(31)
    rows = torch.randn(21, 96, generator=generator) * torch.logspace(-3, 3, 96)
    rows[3, 32:64] = 0
    rows[4, :6] = torch.tensor([0.5, -0.5, 1.5, 2.5 + 1 / 128, 127.0, -126.5])  # the step's scale is 1
    identity = k.pack_vnni_int8(torch.eye(96, dtype=torch.int8), torch.ones(96, 6), one_code=one_code)
    name = "int4_vnni8_mm" if one_code else "int4_vnni_mm"
    for count in (1, 2, 21):
        x = rows[:count].contiguous()
        got = getattr(avx2, name)(x, identity.codes, identity.scales, identity.bias, identity.units)
        assert torch.equal(got, k.vnni_rounded(x, one_code=one_code).float()), count
    if one_code:
        assert got[4, :6].tolist() == [0.0, -0.0, 2.0, 3.0, 127.0, -126.0]
    assert got[3, 32:64].abs().max() == 0


def test_this_cpus_build_has_the_integer_products_its_flags_allow():
    """The build's vector width follows the CPU's flags (``-march=native``): AVX512-VNNI's where it has it, else AVX2's
    where it has AVX2, FMA and F16C — the width the fixture above relies on."""
    if MODULE is None:
        pytest.skip(str(REASON))
    try:
        _, flags = cpuinfo_fields(Path("/proc/cpuinfo").read_text())
    except OSError:
        flags = frozenset()
    if not flags:
        pytest.skip("no /proc/cpuinfo flags here")
    if {"avx512f", "avx512bw", "avx512_vnni"} <= flags:
        assert MODULE.vnni_width() == 512
    elif {"avx2", "fma", "f16c"} <= flags:
        assert MODULE.vnni_width() == 256
    else:
        assert MODULE.vnni_width() == 0 and not MODULE.vnni_ready()


def test_the_avx2_build_of_the_float32_dense_products_equals_this_cpus_build(avx2):
    """``dense_f32.cpp``'s AVX2 passes (2 blocks x 2 rows) against this CPU's build (4 x 6 with AVX-512): each output
    is the same fused multiply-adds in input order, so every row's result is the same bits, whatever the row count."""
    from hierspec.runtime.dense_kernel import pack_dots

    generator = torch.Generator().manual_seed(5)
    weight = torch.randn(112, 72, generator=generator)  # 7 blocks: whole passes and a rest on either build
    packed = pack_dots(weight)
    rows = torch.randn(13, 72, generator=generator)
    ours = MODULE.dense_f32_mm(rows, packed)
    torch.testing.assert_close(ours.double(), rows.double() @ weight.double().T, rtol=1e-5, atol=1e-5)
    for count in (1, 2, 3, 7, 13):
        assert torch.equal(avx2.dense_f32_mm(rows[:count], packed), ours[:count]), count


@pytest.mark.parametrize("heads,kv_heads,dim,rows", [(9, 3, 64, 1), (9, 3, 64, 77), (12, 2, 128, 30), (2, 2, 8, 19)])
def test_the_avx2_build_of_the_prompt_attention_is_close_to_sdpa(avx2, heads, kv_heads, dim, rows):
    query, keys, values = _prompt(rows, heads, kv_heads, dim, seed=rows)
    assert avx2.prompt_attention_fits(dim)
    out = avx2.prompt_attention(query, keys, values, dim ** -0.5)
    torch.testing.assert_close(out, _sdpa(query, keys, values, dim ** -0.5), rtol=1e-5, atol=2e-6)

"""hierspec's own quantized products (``int4_kernel.cpp``, ``int4_amx.cpp``, ``int4_bf16.cpp``, ``int4_vnni.cpp``) and
the int4 decoder's layer halves around attention (``int4_blocks.cpp``), compiled once per CPU; the choice between
those products and PyTorch's.

PyTorch's weight-only int4 kernel (``aten._weight_int4pack_mm_for_cpu``) streams a GGUF file's 4-bit weights at
about half the machine's memory bandwidth for one row and takes bfloat16 inputs only (BENCHMARKS.md, "Compiled int4
kernel"). The compiled kernel multiplies float32 rows by the file's codes with float32 scales and offsets, decoding
each group of 32 codes once for up to four rows, threaded by PyTorch's own pool (``at::parallel_for``: no second
set of threads competing for the two cores); a second product takes ``Q8_0``/``Q6_K`` weights as signed 8-bit
codes with a scale per 16 inputs (:class:`PackedInt8`). Both cost a multiply-add per weight per row, so 16 rows cost
several times one. On CPUs with AMX-BF16 tiles (Intel Xeon from Sapphire Rapids on) the AMX products
(:class:`PackedAmx`) decode each tile of codes once to bfloat16 and multiply it with up to 16 rows (rounded to
bfloat16) in one tile instruction: a 16-row product takes ~1.4x a one-row one's time. On CPUs with AVX512_BF16 but
no AMX (AMD Zen 4) the AVX512-BF16 products (:class:`PackedBf16`) decode the same weights once for all rows and
multiply them by dot-product instructions, 8 rows a pass: a one-row product ~1.4x faster than PyTorch's kernel, a
16-row one ~1.7x (BENCHMARKS.md, "Twenty-third session"). On CPUs with AVX512_VNNI (AMD Zen 4, Intel from
Cascade Lake on) the AVX512-VNNI products (:class:`PackedVnni`) keep the codes as integers and round each row to two
8-bit codes an input (~15 bits per 32 inputs, closer to float32 than bfloat16 rows): integer dot products need no
decoding to bfloat16, so a one-row product takes ~0.6x the AVX512-BF16 one's time (BENCHMARKS.md, "Twenty-fourth
session"); on AVX2 CPUs without AVX-512 (AMD Zen 3, Intel from Haswell on) the same products run on AVX2's byte
products (VPMADDUBSW, VPMADDWD: the same exact integer sums in halves of 8 outputs, the same bits). All five are
batch-invariant by construction (see the
sources' headers), so a tree row's products equal the chain's. The layer halves (``rms_norm``,
``attention_inputs``, ``mlp_block``) run a layer's small operations from C++, with any kernel's products
(:mod:`~hierspec.runtime.decoder`).

It is built with ``torch.utils.cpp_extension`` for this CPU's instruction set (``-march=native``) on first use —
one to two minutes of compiling on two cores, with one log line — into ``<cache>/kernels/int4-<key>``, where the key
covers the source, PyTorch's version and the CPU's model and flags (a binary built for one CPU is never loaded on
another).
After a build its products are checked against a float64 reference; where the compiler, ninja or the check fails,
:func:`compiled_kernel` returns ``None`` with the reason and the int4 path keeps PyTorch's kernel.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import torch

from hierspec.paths import user_cache_dir
from hierspec.storage import write_json_atomic, write_json_first

log = logging.getLogger(__name__)

#: what a kept choice file stands for (:func:`keep_choice`)
Kept = TypeVar("Kept")

#: the integer (VNNI) products with rows as two codes and as one (the longest to compile: first), the Python
#: bindings, the product (``int4_kernel.cpp``), the layer halves around attention (``int4_blocks.cpp``), the AMX and
#: AVX512-BF16 products, the compiled layers' exact attention, the draft head's guess, the verifier's row top-k, the
#: cache's path move and the product of weights prepacked by oneDNN
SOURCES = tuple(Path(__file__).with_name(name) for name in (
    "int4_vnni.cpp", "int4_vnni8.cpp", "bindings.cpp", "int4_kernel.cpp", "int4_blocks.cpp", "int4_amx.cpp",
    "int4_bf16.cpp", "int4_attention.cpp", "head_guess.cpp", "row_topk.cpp", "cache_keep.cpp", "dense_onednn.cpp",
    "dense_bf16.cpp", "dense_f32.cpp", "prompt_attention.cpp"))
#: included by the sources: part of what a build depends on
HEADERS = (Path(__file__).with_name("int4_vectors.h"), Path(__file__).with_name("int4_layers.h"),
           Path(__file__).with_name("int4_tiles.h"), Path(__file__).with_name("int4_team.h"),
           Path(__file__).with_name("int4_scratch.h"))
#: ``-fopenmp``: ``at::parallel_for`` is header code whose ``omp parallel`` is ignored without it (one thread); the
#: binary then binds to the OpenMP runtime PyTorch has already loaded (the same soname), so both share one pool
CFLAGS = ("-O3", "-march=native", "-ffp-contract=fast", "-fopenmp")
#: the flag that makes the integer products fetch weights read once non-temporally (``int4_vnni.cpp``): on AMD CPUs
#: only, where it measured faster (a Zen 3); on an Intel Xeon it made one row's products 1.6-3x slower
STREAM_NTA_FLAG = "-DHIERSPEC_STREAM_NTA"
#: elements per scale group (GGUF's 32-element blocks and Q4_K's sub-blocks)
GROUP = 32
#: ``RuntimeConfig.int4_kernel`` values
KERNEL_CHOICES = ("auto", "compiled", "torch", "amx", "bf16", "vnni", "vnni8")
#: hierspec's own kernels, built here (their cost curves are their own)
OWN_KERNELS = ("compiled", "amx", "bf16", "vnni", "vnni8")
#: the kernels ``auto`` chooses among (each where it runs). Its integer products take rows as one 8-bit code an input
#: (``vnni8``: llama.cpp's activation precision, the prompts' since the twenty-eighth session); ``vnni``'s two codes
#: only where asked for: twice the dot products a row, so every tree and batch row costs more, for closer agreement
#: with float32 rows only where the top two logits nearly tie (BENCHMARKS.md, "Thirty-second session"). Where AMX
#: tiles run, ``vnni8`` is timed against them too: until the forty-fourth session ``auto`` left it out there, the AMX
#: tiles having measured faster at every row count while ``vnni8``'s one-row products were slowed 1.6-3x by
#: non-temporal prefetches on that Xeon; with the default hint SmolLM2's one-token forward took 5.2 against 8.5 ms
#: and Qwen2.5-Coder-1.5B's 60.8 against 68.2 (BENCHMARKS.md, "Forty-fourth session")
KERNELS = ("torch", "compiled", "amx", "bf16", "vnni8")
#: row counts the automatic choice times each kernel at: one token, and a small tree
CHOICE_ROWS = (1, 4)
#: the weight the automatic choice times, ``[out, in]`` (a SmolLM2 gate/up product's size)
CHOICE_SHAPE = (3072, 576)
#: what a choice file's entries mean (2: ``four_bit`` for 4-bit and Q8_0 weights, ``eight_bit`` for Q6_K ones;
#: 3: the AMX products among the candidates; 4: the AVX512-BF16 ones too; 5: the AVX512-VNNI ones too; 6: the integer
#: products on AVX2 CPUs too; 7: the integer products with rows as one code, ``vnni8``, instead of two; 8: ``vnni8``
#: timed where AMX tiles run too); a file of another version is timed again
CHOICE_VERSION = 8


@dataclass(frozen=True)
class PackedInt4:
    """A weight's passes in the compiled kernel's layout.

    Attributes:
        codes: uint8 ``[passes, out, in / 2]``; group ``g``'s 16 bytes hold element ``32g + j`` in the low nibble
            and ``32g + j + 16`` in the high one.
        scales: float32 ``[passes, out, in / 32]``.
        bias: float32 ``[out, in / 32]``, the passes' offsets summed (a pass's element is ``code * scale`` plus
            its group's share of the bias).
    """

    codes: torch.Tensor
    scales: torch.Tensor
    bias: torch.Tensor


@dataclass(frozen=True)
class PackedInt8:
    """An 8-bit weight (``Q8_0``, ``Q6_K``) in the compiled kernel's layout: ``weight = codes * scales`` per group of
    16 inputs.

    Attributes:
        codes: int8 ``[out, in]``; scales: float32 ``[out, in / 16]``.
    """

    codes: torch.Tensor
    scales: torch.Tensor


def pack_passes(codes: Sequence[torch.Tensor], scales: Sequence[torch.Tensor], zeros: Sequence[torch.Tensor]
                ) -> PackedInt4:
    """The compiled layout of passes ``w = (code - 8) * scale + zero`` (codes uint8 ``[out, in]`` 0..15, scales
    and zeros float32 ``[out, in / 32]``): each pass's offset ``zero - 8 scale`` goes into the one bias.

    Example: one pass of codes ``0..31`` (one group) with scale 1 and zero 8 packs to bytes ``0x10, 0x11, …``
    (element 0 and 16, 1 and 17, …) and bias 0.
    """
    packed = []
    for pass_codes in codes:
        rows, cols = pass_codes.shape
        halves = pass_codes.reshape(rows, cols // GROUP, 2, GROUP // 2)
        packed.append((halves[:, :, 0] | (halves[:, :, 1] << 4)).reshape(rows, cols // 2))
    return PackedInt4(torch.stack(packed).contiguous(), torch.stack(list(scales)).float().contiguous(),
                      _folded_bias(scales, zeros).float().contiguous())


def _folded_bias(scales: Sequence[torch.Tensor], zeros: Sequence[torch.Tensor]) -> torch.Tensor:
    """The passes' offsets ``zero - 8 scale`` summed: one bias per output and group (both compiled layouts)."""
    return sum(zero - 8 * scale for zero, scale in zip(zeros, scales))


@dataclass(frozen=True)
class PackedAmx:
    """A weight in the AMX products' layout (``int4_amx.cpp``): tiles of 16 outputs by a step of 32 inputs, which
    the kernel decodes to bfloat16 weights (scale and offset applied in float32, then rounded).

    Attributes:
        codes: uint8 ``[1, out / 16, in / 32, 256]`` (one 4-bit pass: outputs ``2j`` and ``2j + 1`` share byte
            ``i`` of the tile's pair ``j``, low and high nibble) or int8 ``[1, out / 16, in / 32, 512]`` (8-bit
            codes, 32 per output).
        scales: ``[1, out / 16, groups, 16]`` (a group being 32 inputs for 4-bit codes, 16 for 8-bit).
        bias: ``[out / 16, in / 32, 16]`` for a 4-bit pass (its offset), empty for 8-bit codes.

    Scales and bias are float16 where every value of both is exactly one (the files' own float16 scales: Q4_0,
    Q4_1, Q8_0), float32 otherwise (Q4_K and Q6_K scales are products of two factors): the same weights either way,
    in fewer bytes for the first (less memory held; a forward measured only ~2 % faster on an Intel Xeon, whose
    products are not bound by their bytes alone: BENCHMARKS.md, "Twenty-second session").
    """

    codes: torch.Tensor
    scales: torch.Tensor
    bias: torch.Tensor


def _per_block(values: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Per-output, per-group values ``[out, groups]`` as ``[out / 16, groups, 16]`` of ``dtype``."""
    rows, groups = values.shape
    return values.reshape(rows // 16, 16, groups).permute(0, 2, 1).to(dtype).contiguous()


def _stored(*values: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``values`` (float32) as float16 when every one of them is exactly a float16 value, else as they are."""
    narrow = tuple(v.half() for v in values)
    if all(torch.equal(n.float(), v) for n, v in zip(narrow, values)):
        return narrow
    return values


def pack_amx(codes: Sequence[torch.Tensor], scales: Sequence[torch.Tensor], zeros: Sequence[torch.Tensor]
             ) -> PackedAmx:
    """The AMX layout of one 4-bit pass ``w = (code - 8) * scale + zero`` (as :func:`pack_passes` takes it; ``out``
    a multiple of 16). Weights of several passes take the 8-bit form (:func:`pack_amx_int8`), as
    :class:`~hierspec.runtime.quantized.Int4Projection` packs them.

    Example: outputs 0 and 1 with codes 3 and 5 at input 0 pack to byte ``0x53`` (the first byte of the tile).
    """
    pass_codes = _one_pass(codes)
    rows, cols = pass_codes.shape
    pairs = pass_codes.reshape(rows // 16, 8, 2, cols // GROUP, GROUP).permute(0, 3, 1, 2, 4)
    packed = (pairs[:, :, :, 0] | (pairs[:, :, :, 1] << 4)).reshape(rows // 16, cols // GROUP, 256)
    scale, bias = _pass_scales(scales, zeros)
    return PackedAmx(packed.unsqueeze(0).contiguous(), scale, bias)


def _one_pass(codes: Sequence[torch.Tensor]) -> torch.Tensor:
    """The codes of the one 4-bit pass the 4-bit forms take."""
    if len(codes) != 1:
        raise ValueError(f"the 4-bit forms take one pass, not {len(codes)} (several passes: the 8-bit form)")
    return codes[0]


def _pass_scales(scales: Sequence[torch.Tensor], zeros: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """A 4-bit pass's scales ``[1, out / 16, in / 32, 16]`` and folded offsets ``[out / 16, in / 32, 16]`` as the
    4-bit forms store them (:func:`_stored`)."""
    return _stored(_per_block(scales[0]).unsqueeze(0).contiguous(), _per_block(_folded_bias(scales, zeros)))


def pack_amx_int8(codes: torch.Tensor, scales: torch.Tensor) -> PackedAmx:
    """The AMX layout of signed 8-bit codes ``[out, in]`` with a scale per 16 inputs (:class:`PackedInt8`)."""
    rows, cols = codes.shape
    tiles = codes.reshape(rows // 16, 16, cols // GROUP, GROUP).permute(0, 2, 1, 3).reshape(rows // 16, cols // GROUP,
                                                                                           512)
    (scale,) = _stored(_per_block(scales).unsqueeze(0).contiguous())
    return PackedAmx(tiles.unsqueeze(0).contiguous(), scale, torch.empty(0))


@dataclass(frozen=True)
class PackedBf16:
    """A weight for the AVX512-BF16 products (``int4_bf16.cpp``): :class:`PackedAmx`'s weights, decoded the same,
    with each block's pairs of outputs one after another — codes ``[1, out / 16, 8, in / 32, 32]`` (4-bit) or
    ``[…, 64]`` (8-bit), scales and bias as :class:`PackedAmx`'s."""

    codes: torch.Tensor
    scales: torch.Tensor
    bias: torch.Tensor


def pack_bf16(codes: Sequence[torch.Tensor], scales: Sequence[torch.Tensor], zeros: Sequence[torch.Tensor]
              ) -> PackedBf16:
    """The AVX512-BF16 layout of one 4-bit pass (as :func:`pack_amx` takes it)."""
    return _pairs_in_turn(pack_amx(codes, scales, zeros))


def pack_bf16_int8(codes: torch.Tensor, scales: torch.Tensor) -> PackedBf16:
    """The AVX512-BF16 layout of signed 8-bit codes ``[out, in]`` with a scale per 16 inputs."""
    return _pairs_in_turn(pack_amx_int8(codes, scales))


def _pairs_in_turn(tiles: PackedAmx) -> PackedBf16:
    """The AMX layout's codes ``[1, blocks, steps, bytes]`` as ``[1, blocks, 8 pairs, steps, bytes / 8]``."""
    _, blocks, steps, size = tiles.codes.shape
    codes = tiles.codes.reshape(1, blocks, steps, 8, size // 8).permute(0, 1, 3, 2, 4).contiguous()
    return PackedBf16(codes, tiles.scales, tiles.bias)


@dataclass(frozen=True)
class PackedVnni:
    """A weight for the AVX512-VNNI products (``int4_vnni.cpp``): each step of 32 inputs as 8 quads of 4 inputs by
    16 outputs, the byte layout VPDPBUSD reads.

    Attributes:
        codes: uint8 ``[1, out / 16, in / 32, 4, 16, 4]`` (one 4-bit pass: byte ``(c, n, i)`` of a step holds input
            ``4c + i`` of output ``n`` in its low nibble and input ``16 + 4c + i`` in its high one) or int8
            ``[1, out / 16, in / 32, 8, 16, 4]`` (8-bit codes, byte ``(c, n, i)`` input ``4c + i``), or uint8
            ``[1, out / 16, in / 32, 6, 16, 4]`` (a ``Q6_K`` weight's codes in the 6-bit form,
            :func:`six_bit_quads`; scaled as 8-bit codes).
        scales, bias: as :class:`PackedAmx`'s (the same weights: ``code * scale + bias``, or ``code * scale``); or,
            with ``units``, a K-quant weight's integer steps: uint8 ``[1, out / 16, in / 32, 16]`` and uint8
            ``[out / 16, in / 32, 16]`` (``Q4_K``), int8 ``[1, out / 16, in / 16, 16]`` and empty (``Q6_K``).
        units: empty, or float32 ``[2, out / 16, in / 256, 16]`` (the scales' units, then the offsets') or
            ``[1, out / 16, in / 256, 16]``: each scale (offset) is its step times its output's unit for its 256
            inputs (:class:`~hierspec.runtime.quantized.ScaleFactors`).
        one_code: rows rounded to one 8-bit code an input (``int4_vnni8_mm``, ``--int4-kernel vnni8``) instead of
            two.
    """

    codes: torch.Tensor
    scales: torch.Tensor
    bias: torch.Tensor
    units: torch.Tensor = field(default_factory=lambda: torch.empty(0))
    one_code: bool = False


def pack_vnni(codes: Sequence[torch.Tensor], scales: Sequence[torch.Tensor], zeros: Sequence[torch.Tensor],
              factors=None, one_code: bool = False) -> PackedVnni:
    """The AVX512-VNNI layout of one 4-bit pass (as :func:`pack_amx` takes it), with the scales and folded offsets
    as ``factors`` give them (a ``Q4_K`` weight's :class:`~hierspec.runtime.quantized.ScaleFactors`) where given;
    ``one_code``: for rows as one 8-bit code an input.

    Example: output 0 with codes 3 at input 0 and 5 at input 16 packs to byte ``0x53`` (the first of the step).
    """
    pass_codes = _one_pass(codes)
    rows, cols = pass_codes.shape
    quads = pass_codes.reshape(rows // 16, 16, cols // GROUP, 2, 4, 4).permute(0, 2, 3, 4, 1, 5)
    packed = quads[:, :, 0] | (quads[:, :, 1] << 4)  # [blocks, steps, 4, 16, 4]
    if factors is None:  # the AMX layout's scales and offsets
        return PackedVnni(packed.unsqueeze(0).contiguous(), *_pass_scales(scales, zeros), one_code=one_code)
    units = torch.stack((_per_block(factors.units), _per_block(factors.offset_units))).contiguous()
    return PackedVnni(packed.unsqueeze(0).contiguous(), _per_block(factors.steps, torch.uint8).unsqueeze(0),
                      _per_block(factors.offset_steps, torch.uint8), units, one_code)


def pack_vnni_int8(codes: torch.Tensor, scales: torch.Tensor, factors=None, one_code: bool = False,
                   six_bit: bool = False) -> PackedVnni:
    """The AVX512-VNNI layout of signed 8-bit codes ``[out, in]`` with a scale per 16 inputs, as ``factors`` give
    them (a ``Q6_K`` weight's :class:`~hierspec.runtime.quantized.ScaleFactors`) where given; ``one_code``: for rows
    as one 8-bit code an input; ``six_bit``: codes within -32..31 (``Q6_K``'s) in the 6-bit form
    (:func:`six_bit_quads`; the same products, three quarters of the bytes).

    Raises:
        ValueError: ``six_bit`` with a code outside -32..31.
    """
    rows, cols = codes.shape
    quads = codes.reshape(rows // 16, 16, cols // GROUP, 8, 4).permute(0, 2, 3, 1, 4).unsqueeze(0).contiguous()
    if six_bit:
        quads = six_bit_quads(quads)
    if factors is not None:
        return PackedVnni(quads, _per_block(factors.steps, torch.int8).unsqueeze(0), torch.empty(0),
                          _per_block(factors.units).unsqueeze(0).contiguous(), one_code)
    (scale,) = _stored(_per_block(scales).unsqueeze(0).contiguous())
    return PackedVnni(quads, scale, torch.empty(0), one_code=one_code)


def six_bit_quads(quads: torch.Tensor) -> torch.Tensor:
    """Signed codes within -32..31 in the 8-bit quads ``[1, out / 16, in / 32, 8, 16, 4]`` as the 6-bit form's
    ``[1, out / 16, in / 32, 6, 16, 4]`` (uint8) of ``u = code + 32``: chunk ``c`` (0..3) holds quad ``c``'s low 4
    bits of ``u`` in its low nibble and quad ``c + 4``'s in its high one (the 4-bit form's layout), chunk ``4 + p``
    (``p`` 0 or 1) the high 2 bits of quads ``p``, ``p + 2``, ``p + 4``, ``p + 6`` at bits 0, 2, 4 and 6.

    Example: a code of -32 everywhere (``u = 0``) packs to zeros; a code of 31 (``u = 63``) to ``0xff`` everywhere.

    Raises:
        ValueError: a code outside -32..31.
    """
    if not fits_six_bits(quads):
        raise ValueError("6-bit codes must lie within -32..31 (a Q6_K weight's)")
    unsigned = quads.view(torch.uint8) + 32  # code + 32 in 0..63, in wrapping uint8 arithmetic
    low, high = unsigned & 15, unsigned >> 4
    nibbles = low[:, :, :, :4] | (low[:, :, :, 4:] << 4)
    tops = [high[:, :, :, p] | (high[:, :, :, p + 2] << 2) | (high[:, :, :, p + 4] << 4) | (high[:, :, :, p + 6] << 6)
            for p in (0, 1)]
    return torch.cat((nibbles, torch.stack(tops, dim=3)), dim=3).contiguous()


def fits_six_bits(codes: torch.Tensor) -> bool:
    """Whether signed 8-bit ``codes`` all lie within -32..31, the 6-bit form's range (a ``Q6_K`` weight's always do,
    a ``Q5_0`` weight's -16..15 too)."""
    if codes.numel() == 0:
        return True
    low, high = torch.aminmax(codes)  # one pass over the codes (a 1.5B's output head holds 233 M of them)
    return int(low) >= -32 and int(high) <= 31


def six_bit_products(kernel) -> bool:
    """Whether ``kernel`` (the compiled module) multiplies the 6-bit form: its integer products do, in the AVX2 and
    the AVX-512 build alike."""
    return kernel is not None and kernel.vnni_width() > 0


def vnni_rounded(rows: torch.Tensor, one_code: bool = False) -> torch.Tensor:
    """float32 ``rows`` ``[m, in]`` as the AVX512-VNNI products take them, in float64: per 32 inputs, with
    ``d = max |x| / 127``, two 8-bit codes an input, ``high = round(x / d)`` and ``low = round((x - high d) 128 / d)``
    (ties to even; ``x / d`` as ``x`` times ``1 / d``), for ``x ~ d / 128 (128 high + low)`` within ``d / 256`` —
    computed in float32 as ``int4_vnni.cpp`` computes them; ``one_code``: ``high`` alone, ``x ~ d high``."""
    steps = rows.float().reshape(rows.shape[0], -1, GROUP)
    scale = steps.abs().amax(dim=-1, keepdim=True) / 127
    inverse = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    high = torch.round(steps * inverse).clamp(-127, 127)
    if one_code:
        return (high.double() * scale.double()).reshape(rows.shape)
    rest = (steps.double() - high.double() * scale.double()).float()  # exact in float64, then rounded once
    low = torch.round(rest * (inverse * 128)).clamp(-127, 127)
    return ((128 * high.double() + low.double()) * (scale / 128).double()).reshape(rows.shape)


def int4_mm(kernel, rows: torch.Tensor, weight: PackedInt4 | PackedInt8 | PackedAmx | PackedBf16 | PackedVnni
            ) -> torch.Tensor:
    """``rows`` (float32 ``[m, in]``) times the packed weight, float32 ``[m, out]``."""
    if isinstance(weight, PackedInt8):
        return kernel.int8_mm(rows, weight.codes, weight.scales)
    if isinstance(weight, PackedVnni):
        product = kernel.int4_vnni8_mm if weight.one_code else kernel.int4_vnni_mm
        return product(rows, weight.codes, weight.scales, weight.bias, weight.units)
    if isinstance(weight, PackedBf16):
        return kernel.int4_bf16_mm(rows, weight.codes, weight.scales, weight.bias)
    if isinstance(weight, PackedAmx):
        return kernel.int4_amx_mm(rows, weight.codes, weight.scales, weight.bias)
    return kernel.int4_mm(rows, weight.codes, weight.scales, weight.bias)


@functools.lru_cache(maxsize=1)
def compiled_kernel() -> tuple[object | None, str | None]:
    """``(module, None)`` with the compiled kernel for this CPU, or ``(None, reason)`` where it cannot be built or
    computes wrong products."""
    try:
        module = _build(build_directory())
    except Exception as exc:  # noqa: BLE001 - a compiler, ninja or loader failure of any kind means: not here
        return None, f"the compiled int4 kernel could not be built ({type(exc).__name__}: {_first_line(exc)})"
    problem = _check(module)
    return (None, problem) if problem else (module, None)


def loaded_kernel():
    """The compiled extension where this process has already loaded it (the int4 path runs on it), else ``None``:
    for helpers that may use it but must never start a build."""
    return compiled_kernel()[0] if compiled_kernel.cache_info().currsize else None


def build_id() -> str:
    """The compiled extension's build key (its sources, flags, PyTorch and CPU), whether or not it is built yet."""
    return build_directory().name.split("-")[-1]


def _build(directory: Path):
    from torch.utils.cpp_extension import load

    directory.mkdir(parents=True, exist_ok=True)
    if not any(directory.glob("*.so")):
        log.warning("compiling hierspec's int4 kernel for this CPU (once, one to two minutes) into %s", directory)
    return load(name=f"hierspec_int4_{directory.name.split('-')[-1]}", sources=[str(path) for path in SOURCES],
                build_directory=str(directory), extra_cflags=list(compile_flags(_cpu_identity())),
                extra_ldflags=["-fopenmp"], verbose=False)


def compile_flags(cpu: str) -> tuple[str, ...]:
    """The compiler flags for a CPU whose identity (:func:`_cpu_identity`) is ``cpu``: :data:`CFLAGS`, with
    :data:`STREAM_NTA_FLAG` where the CPU is an AMD one.

    Example: ``compile_flags("model name : AMD EPYC 7B13")[-1]`` is ``"-DHIERSPEC_STREAM_NTA"``.
    """
    return CFLAGS + ((STREAM_NTA_FLAG,) if "AMD" in cpu.split("\n")[0] else ())


def build_directory() -> Path:
    """Where the compiled extension for these sources, flags, PyTorch and CPU is built (and this machine's timed path
    choices kept): ``<cache>/kernels/int4-<build key>``."""
    cpu = _cpu_identity()
    source = b"".join(path.read_bytes() for path in SOURCES + HEADERS) + " ".join(compile_flags(cpu)).encode()
    return user_cache_dir() / "kernels" / f"int4-{build_key(source, torch.__version__, cpu)}"


def build_key(source: bytes, torch_version: str, cpu: str) -> str:
    """A short hash of everything the binary depends on: its source (and flags), PyTorch's headers and the CPU it
    targets."""
    digest = hashlib.sha256(source + b"\0" + torch_version.encode() + b"\0" + cpu.encode())
    return digest.hexdigest()[:16]


@functools.lru_cache(maxsize=1)
def _cpu_identity() -> str:
    """The CPU's model name and its whole flag list (``-march=native`` uses every flag), from ``/proc/cpuinfo``
    (read once a process: the build directory and the compile flags both ask)."""
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        import platform

        return f"{platform.machine()} {platform.processor()}"
    lines = [line for line in text.splitlines() if line.split(":")[0].strip() in ("model name", "flags")]
    return "\n".join(dict.fromkeys(lines))


def _random_passes(generator: torch.Generator, out_features: int, in_features: int, passes: int = 2
                   ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """Codes, scales and zeros of a random weight of ``passes`` 4-bit passes (the load-time checks' weight)."""
    codes = [torch.randint(0, 16, (out_features, in_features), generator=generator, dtype=torch.uint8)
             for _ in range(passes)]
    scales = [torch.rand(out_features, in_features // GROUP, generator=generator) for _ in range(passes)]
    zeros = [torch.randn(out_features, in_features // GROUP, generator=generator) for _ in range(passes)]
    return codes, scales, zeros


def _check(module) -> str | None:
    """Why the kernel's products are wrong (against float64 on a small random weight, 1 and 5 rows), or ``None``."""
    generator = torch.Generator().manual_seed(0)
    out_features, in_features = 24, 96
    codes, scales, zeros = _random_passes(generator, out_features, in_features)
    rows = torch.randn(5, in_features, generator=generator)
    weight = sum((c.double() - 8) * s.double().repeat_interleave(GROUP, 1) + z.double().repeat_interleave(GROUP, 1)
                 for c, s, z in zip(codes, scales, zeros))
    expected = rows.double() @ weight.t()
    packed = pack_passes(codes, scales, zeros)
    try:
        got = int4_mm(module, rows, packed)
        alone = int4_mm(module, rows[2:3].contiguous(), packed)
    except RuntimeError as exc:
        return f"the compiled int4 kernel fails ({_first_line(exc)})"
    if not torch.allclose(got.double(), expected, rtol=1e-4, atol=1e-4):
        return "the compiled int4 kernel computes wrong products"
    if not torch.equal(alone[0], got[2]):
        return "the compiled int4 kernel's rows depend on the rows beside them"
    return None


def amx_reason() -> str | None:
    """Why the AMX products (``int4_amx.cpp``) cannot run here — no compiled kernel, a CPU without AMX-BF16, tiles
    the operating system refuses, wrong products — or ``None`` when they can."""
    return _own_kernel_reason("amx_ready", "this CPU (or its operating system) offers no AMX-BF16 tiles", _check_amx)


def bf16_reason() -> str | None:
    """Why the AVX512-BF16 products (``int4_bf16.cpp``) cannot run here — no compiled kernel, a CPU without
    AVX512_BF16, wrong products — or ``None`` when they can."""
    return _own_kernel_reason("bf16_ready", "this CPU has no AVX512_BF16 instructions", _check_bf16)


def vnni_reason(one_code: bool = False) -> str | None:
    """Why the integer (VNNI) products (``int4_vnni.cpp``; ``one_code``: with rows as one 8-bit code an input,
    ``--int4-kernel vnni8``) cannot run here — no compiled kernel, a CPU with neither AVX512_VNNI nor AVX2 (with FMA
    and F16C), wrong products — or ``None`` when they can."""
    return _own_kernel_reason("vnni_ready", "this CPU has neither AVX512_VNNI nor AVX2 with FMA and F16C",
                              functools.partial(_check_vnni, one_code=one_code))


def vnni8_reason() -> str | None:
    """:func:`vnni_reason` for rows as one 8-bit code an input (``--int4-kernel vnni8``)."""
    return vnni_reason(one_code=True)


def _own_kernel_reason(ready: str, missing: str, check: Callable) -> str | None:
    """Why one of the extension's CPU-specific products cannot run: the build's reason, ``missing`` where its
    ``ready`` binding says this build lacks the instructions, else ``check``'s verdict on its products."""
    module, reason = compiled_kernel()
    if module is None:
        return reason
    if not getattr(module, ready)():
        return missing
    return check(module)


def _as_bfloat16(values: torch.Tensor) -> torch.Tensor:
    return values.float().bfloat16().double()


@functools.lru_cache(maxsize=None)
def _check_amx(module) -> str | None:
    """Why the AMX products are wrong or depend on the rows beside them (:func:`_check_decoding_products`)."""
    return _check_decoding_products(module, pack_amx, pack_amx_int8, _as_bfloat16, _as_bfloat16, "the AMX products")


@functools.lru_cache(maxsize=None)
def _check_bf16(module) -> str | None:
    """Why the AVX512-BF16 products are wrong or depend on the rows beside them."""
    return _check_decoding_products(module, pack_bf16, pack_bf16_int8, _as_bfloat16, _as_bfloat16,
                                    "the AVX512-BF16 products")


@functools.lru_cache(maxsize=None)
def _check_vnni(module, one_code: bool = False) -> str | None:
    """Why the integer (VNNI) products (rows as one 8-bit code an input with ``one_code``) are wrong or depend on the
    rows beside them (their weights exact, their rows rounded by :func:`vnni_rounded`), or differ with factored scales
    from the same scales stored whole."""
    name = "the one-code integer (VNNI) products" if one_code else "the integer (VNNI) products"
    return (_check_decoding_products(module, functools.partial(pack_vnni, one_code=one_code),
                                     functools.partial(pack_vnni_int8, one_code=one_code),
                                     functools.partial(vnni_rounded, one_code=one_code), lambda w: w, name)
            or _check_vnni_factors(module, one_code))


def random_factors(generator: torch.Generator, out_features: int, in_features: int, eight: bool):
    """Random K-quant scale factors (``Q6_K``'s with ``eight``, else ``Q4_K``'s) of small dyadic units, so that
    every scale, offset and folded zero is exact in float32; with the scales and zeros they stand for."""
    from hierspec.runtime.quantized import ScaleFactors

    supers = in_features // 256
    units = torch.randint(1, 64, (out_features, supers), generator=generator) / 64
    if eight:
        steps = torch.randint(-128, 128, (out_features, in_features // 16), generator=generator, dtype=torch.int8)
        return ScaleFactors(units, steps), units.repeat_interleave(16, 1) * steps, None
    steps = torch.randint(0, 64, (out_features, in_features // GROUP), generator=generator, dtype=torch.uint8)
    offset_units = -torch.randint(1, 64, (out_features, supers), generator=generator) / 64
    offset_steps = torch.randint(0, 64, (out_features, in_features // GROUP), generator=generator, dtype=torch.uint8)
    scales = units.repeat_interleave(8, 1) * steps
    zeros = offset_units.repeat_interleave(8, 1) * offset_steps + 8 * scales
    return ScaleFactors(units, steps, offset_units, offset_steps), scales, zeros


def _check_vnni_factors(module, one_code: bool = False) -> str | None:
    generator = torch.Generator().manual_seed(1)
    rows = torch.randn(5, 512, generator=generator)
    codes = torch.randint(0, 16, (32, 512), generator=generator, dtype=torch.uint8)
    signed = torch.randint(-128, 128, (32, 512), generator=generator, dtype=torch.int8)
    four, scales, zeros = random_factors(generator, 32, 512, eight=False)
    eight, signed_scales, _ = random_factors(generator, 32, 512, eight=True)
    pairs = [(pack_vnni([codes], [scales], [zeros], four, one_code), pack_vnni([codes], [scales], [zeros],
                                                                             one_code=one_code)),
             (pack_vnni_int8(signed, signed_scales, eight, one_code),
              pack_vnni_int8(signed, signed_scales, one_code=one_code))]
    if six_bit_products(module):  # Q6_K's codes in the 6-bit form against the same codes in the 8-bit one
        six = signed.div(4, rounding_mode="floor")
        pairs.append((pack_vnni_int8(six, signed_scales, eight, one_code, six_bit=True),
                      pack_vnni_int8(six, signed_scales, eight, one_code)))
    try:
        same = all(torch.equal(int4_mm(module, rows, factored), int4_mm(module, rows, whole))
                   for factored, whole in pairs)
    except RuntimeError as exc:
        return f"the integer (VNNI) products with factored scales fail ({_first_line(exc)})"
    return None if same else ("the integer (VNNI) products with factored scales differ from the same scales stored "
                              "whole, or 6-bit codes from the same codes in 8 bits")


def _check_decoding_products(module, pack4: Callable, pack8: Callable, rounded_rows: Callable,
                             rounded_weights: Callable, name: str) -> str | None:
    """Why a product of hierspec's tile-decoding kernels (``pack4``/``pack8`` its layouts) is wrong (against float64
    with the inputs and the decoded weights rounded as it takes them: ``rounded_rows``, ``rounded_weights``) or
    depends on the rows beside them (1, 5 and 17 rows), or ``None``; both forms, with float32 scales and with float16
    ones."""
    generator = torch.Generator().manual_seed(0)
    out_features, in_features = 32, 96
    codes, scales, zeros = _random_passes(generator, out_features, in_features, passes=1)
    signed = torch.randint(-128, 128, (out_features, in_features), generator=generator, dtype=torch.int8)
    signed_scales = torch.rand(out_features, in_features // 16, generator=generator)
    rows = torch.randn(17, in_features, generator=generator)
    inputs = rounded_rows(rows)
    # eighths and 64ths: scales and folded offsets that float16 holds exactly (packed as float16)
    half_scales = torch.randint(1, 64, scales[0].shape, generator=generator) / 64
    half_zeros = torch.randint(-64, 64, zeros[0].shape, generator=generator) / 8
    cases = []
    for scale, zero in ((scales[0], zeros[0]), (half_scales, half_zeros)):
        bias = (zero - 8 * scale).double()  # folded in float32, as the packing does
        four = codes[0].double() * scale.double().repeat_interleave(GROUP, 1) + bias.repeat_interleave(GROUP, 1)
        cases.append((pack4(codes, [scale], [zero]), inputs @ rounded_weights(four).t()))
    for scale in (signed_scales, signed_scales.half().float()):
        eight = signed.double() * scale.double().repeat_interleave(16, 1)
        cases.append((pack8(signed, scale), inputs @ rounded_weights(eight).t()))
    if [packed.scales.dtype for packed, _ in cases] != [torch.float32, torch.float16] * 2:
        return f"the packing of {name} does not store exact float16 scales as float16"
    for packed, expected in cases:
        try:
            whole = int4_mm(module, rows, packed)
            parts = [int4_mm(module, rows[2:3].contiguous(), packed), int4_mm(module, rows[:5].contiguous(), packed)]
        except RuntimeError as exc:
            return f"{name} fail ({_first_line(exc)})"
        if not torch.allclose(whole.double(), expected, rtol=1e-4, atol=1e-4):
            return f"{name} compute wrong products"
        if not (torch.equal(parts[0][0], whole[2]) and torch.equal(parts[1], whole[:5])):
            return f"{name}' rows depend on the rows beside them"
    return None


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [""])[0][:160]


def choose_kernel(timings: Mapping[str, Sequence[float]]) -> str:
    """The kernel with the smallest total time over :data:`CHOICE_ROWS` (``timings``: kernel -> seconds per row
    count); PyTorch's on a tie, as the one that needs no compiler.

    Example: ``choose_kernel({"torch": [1.0, 2.0], "compiled": [0.5, 2.4]})`` is ``"compiled"``.
    """
    return min(sorted(timings, key=lambda name: name != "torch"), key=lambda name: sum(timings[name]))


def time_kernels(products: Mapping[str, Callable[[torch.Tensor], torch.Tensor]], in_features: int,
                 repeats: int = 20, row_counts: Sequence[int] = CHOICE_ROWS) -> dict[str, list[float]]:
    """The fastest of ``repeats`` timings of each product at each of ``row_counts`` (:data:`CHOICE_ROWS`), in
    seconds, the kernels interleaved.

    The fastest, not the median: the choice is kept for every later process, and another process busy on the same
    cores only ever adds time. A choice timed while ``make stores`` ran beside it had every median near 6 ms against
    0.03-0.07 ms on the quiet machine, and kept the AMX kernel, 1.4x slower there for a one-token forward."""
    samples: dict[str, list[list[float]]] = {name: [[] for _ in row_counts] for name in products}
    inputs = [torch.randn(rows, in_features) for rows in row_counts]
    for _ in range(repeats):
        for name, product in products.items():
            for i, rows in enumerate(inputs):
                start = time.perf_counter()
                product(rows)
                samples[name][i].append(time.perf_counter() - start)
    return {name: [min(s) for s in per_rows] for name, per_rows in samples.items()}


#: seconds above which even the fastest kernel's one-row product of :data:`CHOICE_SHAPE` (~1 MB of weights) says
#: the machine was busy while the kernels were timed: idle CPUs took 0.03-0.3 ms; beside ``make stores`` on both
#: cores every kernel took ~5 ms (forty-ninth session)
BUSY_SECONDS = 2e-3


def busy_while_timing(timings: Mapping[str, Sequence[float]]) -> bool:
    """Whether :func:`time_kernels`' ``timings`` (one-row time first) show a machine kept busy by another process:
    even the fastest kernel's one-row product took longer than :data:`BUSY_SECONDS`.

    Example: ``busy_while_timing({"vnni8": [5.1e-3, 5.0e-3], "amx": [4.9e-3, 5.2e-3]})`` is ``True``.
    """
    return bool(timings) and min(times[0] for times in timings.values()) > BUSY_SECONDS


def choice_path(threads: int) -> Path:
    """Where the automatic choice for ``threads`` threads is kept: beside this CPU's compiled kernel."""
    return build_directory() / f"choice-t{threads}.json"


def read_choice(path: Path, candidates: Sequence[str] = KERNELS) -> tuple[str, str] | None:
    """The kernels a choice file names for 4-bit and 8-bit weights, or ``None`` when there is none, it cannot be
    read or it names a kernel outside ``candidates`` (they are then timed again)."""
    return choice_names(read_kept_choice(path, CHOICE_VERSION), candidates)


def choice_names(data: dict | None, candidates: Sequence[str] = KERNELS) -> tuple[str, str] | None:
    """The 4-bit and 8-bit kernels a choice file's contents name, or ``None`` where either is not among
    ``candidates``."""
    chosen = None if data is None else (data.get("four_bit"), data.get("eight_bit"))
    return chosen if chosen is not None and all(name in candidates for name in chosen) else None


def write_choice(path: Path, four_bit: str, eight_bit: str, timings: Mapping[str, Mapping[str, Sequence[float]]],
                 candidates: Sequence[str] = KERNELS) -> tuple[str, str]:
    """Keep the automatic choice (with the timings behind it, per form) unless another process kept one of
    ``candidates`` first (:func:`keep_choice`): the 4-bit and 8-bit kernels to run with."""
    seconds = {form: {name: list(times) for name, times in per.items()} for form, per in timings.items()}
    return keep_choice(path, {"version": CHOICE_VERSION, "four_bit": four_bit, "eight_bit": eight_bit,
                              "rows": list(CHOICE_ROWS), "shape": list(CHOICE_SHAPE), "seconds": seconds},
                       "int4 kernel choice", lambda data: choice_names(data, candidates))


def read_kept_choice(path: Path, version: int) -> dict | None:
    """A kept choice file's contents when it reads as a JSON object of ``version``, else ``None`` (timed again)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        return data if data.get("version") == version else None
    except (OSError, ValueError, AttributeError):
        return None


def keep_choice(path: Path, data: dict, what: str, parse: Callable[[dict | None], Kept | None]) -> Kept:
    """Keep a timed choice beside the kernel unless another process has kept a usable one there since this one
    looked: the choice to run with, ``parse`` (a file's contents → the choice, or ``None`` where unusable) of the
    other process's file or of ``data``. Two processes timing at once (a fresh machine, a server and a benchmark
    started together) could otherwise each run with its own choice while every later process reads the last one
    written — different products, different outputs for the same prompt. A kept file that is damaged or unusable
    (why this process timed) is replaced; a disk that refuses the write only costs a timing at the next load (said
    once, naming ``what``)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if not write_json_first(path, data):
            other = parse(read_kept_choice(path, data["version"]))
            if other is not None:
                log.info("the %s kept by another process in %s is used instead of this one's timing", what, path)
                return other
            write_json_atomic(path, data)
    except OSError as exc:
        log.warning("the %s cannot be kept in %s (%s); it is timed again at the next load", what, path, exc)
    return parse(data)

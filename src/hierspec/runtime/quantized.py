"""A GGUF file's 4-bit and 8-bit weights in every forward on the CPU, through PyTorch's weight-only int4 kernel or
hierspec's compiled one (:mod:`~hierspec.runtime.int4_kernel`; :class:`Int4Kernels` and :func:`resolve_kernel` say
which runs each weight form).

Expanding a Q4_1 file to float32 makes every forward stream ~6x the bytes the file holds (SmolLM2-135M: 540 MB
instead of ~90 MB). ``aten._weight_int4pack_mm_for_cpu`` multiplies bfloat16 rows by 4-bit codes in groups of 32
along the input dimension, each group with a scale and an offset: ``w = (code - 8) * scale + zero``. GGUF's blocks
are 32 elements too, so the file's codes are kept exactly:

* ``Q4_0`` (``w = (q - 8) * d``): code ``q``, scale ``d``, zero 0;
* ``Q4_1`` (``w = q * d + m``): code ``q``, scale ``d``, zero ``m + 8 d``;
* ``Q8_0`` (``w = q * d``, ``q`` a signed byte): two 4-bit passes whose sum is ``q * d`` — the high nibble with scale
  ``16 d`` and the low nibble with zero ``8 d``;
* ``Q5_0`` (``w = (q - 16) * d``, a 5-bit ``q``; what llama.cpp writes where a row is not a whole number of K-quant
  super-blocks, e.g. most of Qwen2.5-Coder-0.5B's ``Q4_K_M`` file): the signed value ``q - 16`` as ``Q8_0``'s two
  passes, so the kernels multiply it as 8-bit codes;
* ``Q4_K`` (256-element super-blocks of eight 32-element sub-blocks, ``w = d sc q - dmin m``): code ``q``, scale
  ``d sc``, zero ``8 d sc - dmin m``;
* ``Q6_K`` (sixteen 16-element sub-blocks, ``w = D (q - 32)`` with ``D = d sc`` and a 6-bit ``q = l + 16 h``): four
  passes, a low (``l``) and a high (``h``) pass for each half of a 32-element group. A pass gives the elements of
  the other half code 0 (low, zero ``8 D``) or 4 (high: scale ``16 D``, zero ``64 D``), which decode to exactly 0,
  and its own half ``l D`` or ``(h - 2) 16 D``; the four sum to ``D (q - 32)``. Scales times powers of two stay
  exact in bfloat16, so the zeros cancel in the kernel too. A ``Q6_K`` tensor streams 2 bytes per weight this way
  (as bfloat16 would) against 4 expanded to float32.

Decoded in float32, every one of these reproduces ``gguf``'s own dequantization bit for bit (``Q4_K``: wherever
``8 d sc - dmin m`` is exact in float32, i.e. nearly always; within one rounding elsewhere)
(``tests/test_quantized.py``). The kernel takes its scales and offsets in bfloat16 and returns bfloat16 products, so
the model that runs is the file's codes with scales rounded to bfloat16 and bfloat16 activations at each product —
the same model for every method and every row count (the kernel is row-invariant), which is what "lossless" is
measured against on this path. Other block types (``Q5_1``, ``Q5_K``, ``Q3_K``, …) are not supported yet: such
files run dequantized, with the reason logged.
"""

from __future__ import annotations

import copy
import functools
import itertools
import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path

import numpy as np
import torch

from hierspec import checksums
from hierspec.runtime import int4_kernel
from hierspec.runtime.dense_kernel import DENSE_STACKS
from hierspec.storage import write_file_atomic

log = logging.getLogger(__name__)

#: elements per scale/offset group, GGUF's block size for Q4_0, Q4_1 and Q8_0 (and Q4_K's sub-block)
GROUP = 32
#: elements per K-quant super-block
SUPER_BLOCK = 256
#: GGUF block types this module keeps quantized
SUPPORTED_BLOCKS = ("Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q6_K")
#: bytes per block of each supported type
_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q8_0": 34, "Q4_K": 144, "Q6_K": 210}
#: the decoded-weights cache beside a GGUF file's converted weights, and the same rounded to 4 bits
CACHE_FILE = "int4-weights.safetensors"
REQUANTIZED_CACHE_FILE = "int4-weights-4bit.safetensors"
CACHE_MAGIC = "hierspec-int4-weights"
#: 2: K-quant weights' scale factors (``Int4Weight.factors``) kept beside their passes
CACHE_VERSION = 2
#: the version of the weights rounded to 4 bits (:data:`REQUANTIZED_CACHE_FILE`): 3, their minimums float16
#: (:func:`requantize_4bit`)
REQUANTIZED_CACHE_VERSION = 3
#: the kernel packs output rows in tiles of this many
ROW_MULTIPLE = 16
#: the kernel's activation, scale and output dtype on the CPU (float32 activations run ~20x slower there)
KERNEL_DTYPE = torch.bfloat16

_LAYER_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                "ffn_down": "mlp.down_proj"}


@dataclass(frozen=True)
class ScaleFactors:
    """A K-quant weight's scales as its file holds them: an integer step per group of inputs times a float32 unit per
    256 inputs (its float16 super-block scale), so that a kernel can read a byte per group and output instead of a
    float32 (:func:`~hierspec.runtime.int4_kernel.pack_vnni`). Every product is exact in float32.

    ``Q4_K``: ``scale = d sc`` per 32 inputs (``units`` d, ``steps`` sc, uint8 0..63) and the folded offset
    ``zero - 8 scale = -dmin m`` (``offset_units`` -dmin, ``offset_steps`` m, uint8 0..63). ``Q6_K``: ``scale = d sc``
    per 16 inputs (``steps`` int8), no offset.

    Attributes:
        units, offset_units: float32 ``[out, in / 256]`` (``offset_units`` ``None`` without an offset).
        steps, offset_steps: ``[out, groups]`` (``offset_steps`` ``None`` without an offset).
    """

    units: torch.Tensor
    steps: torch.Tensor
    offset_units: torch.Tensor | None = None
    offset_steps: torch.Tensor | None = None

    def take_rows(self, order: torch.Tensor) -> ScaleFactors:
        """The same factors with their output rows reordered."""
        return ScaleFactors(*(None if part is None else part[order] for part in self.parts()))

    def parts(self) -> tuple[torch.Tensor | None, ...]:
        """The fields' values, in :data:`_FACTOR_PARTS` order."""
        return tuple(getattr(self, name) for name in _FACTOR_PARTS)


#: :class:`ScaleFactors`' fields, as the decoded-weights cache names them
_FACTOR_PARTS = tuple(f.name for f in fields(ScaleFactors))


@dataclass(frozen=True)
class Int4Weight:
    """One 4-bit pass of a weight ``[out, in]``: ``weight = (codes - 8) * scales + zeros`` per group of 32 inputs.

    Attributes:
        codes: uint8 ``[out, in]``, values 0..15.
        scales, zeros: float32 ``[out, in / 32]``.
        factors: a K-quant weight's scales as its file holds them (``Q4_K``: this pass's; ``Q6_K``: the 8-bit form's
            of :func:`as_int8`, on each of its four passes), or ``None``.
    """

    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    factors: ScaleFactors | None = None

    def dequantize(self) -> torch.Tensor:
        """The pass's weight in float32 (one multiply and one add per element, as ``gguf`` rounds them)."""
        scales = self.scales.repeat_interleave(GROUP, dim=1)
        zeros = self.zeros.repeat_interleave(GROUP, dim=1)
        return (self.codes.to(torch.float32) - 8) * scales + zeros

    def take_rows(self, order: torch.Tensor) -> Int4Weight:
        """The same pass with its output rows reordered."""
        return Int4Weight(self.codes[order], self.scales[order], self.zeros[order],
                          None if self.factors is None else self.factors.take_rows(order))


def as_int8(passes: Sequence[Int4Weight]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The signed 8-bit codes ``[out, in]`` and scales ``[out, in / 16]`` (``weight = code * scale``) of a ``Q8_0``
    weight (two passes) or a ``Q6_K`` one (four), rebuilt exactly from its passes; ``None`` for a 4-bit weight.

    ``Q8_0``: the high pass holds ``(v >> 4) + 8``, the low pass ``v & 15`` at scale ``d``, so ``v = (h - 8) * 16 + l``.
    ``Q6_K``: each half of a 32-element group has a low pass ``l`` at scale ``D`` and a high pass ``h + 2``, so the
    half's code is ``l + 16 h - 32`` at ``D``. A ``Q6_K`` weight then streams 1.25 bytes per weight instead of four
    4-bit passes' ~2.5.
    """
    # in uint8 arithmetic, wrapping, then read as int8: no int16 copies of a weight (Qwen2.5-Coder-1.5B's Q6_K and
    # Q8_0 weights went through ~4 GB of them at every load)
    if len(passes) == 2:
        high, low = passes
        codes = torch.add(low.codes, high.codes, alpha=16).sub_(128)  # 16 h + l - 128, h = (v >> 4) + 8
        return codes.view(torch.int8), low.scales.repeat_interleave(2, dim=1).contiguous()
    if len(passes) != 4:
        return None
    rows, cols = passes[0].codes.shape
    codes = torch.empty(rows, cols // GROUP, 2, GROUP // 2, dtype=torch.uint8)
    scales = torch.empty(rows, cols // GROUP, 2)
    for half in (0, 1):
        low, high = passes[2 * half], passes[2 * half + 1]
        own_low = low.codes.reshape(rows, -1, 2, GROUP // 2)[:, :, half]
        own_high = high.codes.reshape(rows, -1, 2, GROUP // 2)[:, :, half]
        torch.add(own_low, own_high, alpha=16, out=codes[:, :, half])  # l + 16 (h + 2), then less 64
        scales[:, :, half] = low.scales
    return codes.sub_(64).view(torch.int8).reshape(rows, cols), scales.reshape(rows, -1)


def quantize_q8_0(weight: torch.Tensor) -> list[Int4Weight]:
    """A float weight ``[out, in]`` (``in`` a multiple of 32) rounded as GGUF's ``Q8_0`` rounds it — a scale ``d``
    per 32 inputs, ``q = round(w / d)`` in [-127, 127] — and split into the two 4-bit passes :func:`decode_blocks`
    makes of a ``Q8_0`` tensor, so that any of the int4 path's kernels multiplies it (for small networks of
    hierspec's own, e.g. a draft head)."""
    values = weight.detach().to(torch.float32).reshape(weight.shape[0], -1, GROUP)
    scale = values.abs().amax(dim=-1) / 127.0
    codes = torch.round(values / torch.where(scale > 0, scale, 1.0)[..., None]).clamp(-127, 127).to(torch.int16)
    return _signed_passes(codes.reshape(weight.shape).numpy(), scale.numpy())


def requantize_4bit(passes: Sequence[Int4Weight]) -> list[Int4Weight]:
    """A weight of more than 4 bits (``Q8_0``, ``Q5_0``, ``Q6_K``: several passes) rounded to one 4-bit pass with a
    float16 scale and minimum per 32 inputs, as ``Q4_1`` stores them — for a draft model, whose weights decide only
    what is proposed, never what is output; a 4-bit weight (one pass) is returned as it is.

    ``w = code * d + b``: ``b`` is the largest float16 at or below the group's least value and ``d`` the smallest
    float16 step with which codes 0..15 reach its greatest, so every element lands within ``d / 2`` of its value and
    no code is clipped. The pass's ``zeros`` (``b + 8 d``) give ``b`` back exactly in float32, so the kernels' packing
    stores both per-group values as float16 (:func:`~hierspec.runtime.int4_kernel.pack_vnni`): 20 bytes a group and
    output instead of 24 with float32 ones (the 0.5B draft's products 0.90-0.95x the time at 1-8 rows, BENCHMARKS.md,
    "Fifty-first session")."""
    if len(passes) == 1:
        return list(passes)
    weight = passes[0].dequantize()
    for other in passes[1:]:
        weight += other.dequantize()
    return quantize_4bit(weight)


#: elements of a weight rounded at a time by :func:`quantize_4bit`
QUANTIZE_CHUNK = 1 << 22


def quantize_4bit(weight: torch.Tensor) -> list[Int4Weight]:
    """A float weight ``[out, in]`` (``in`` a multiple of 32) rounded to one 4-bit pass as :func:`requantize_4bit`
    rounds a GGUF file's wider weights: a draft model loaded from a float checkpoint on the int4 path."""
    weight = weight.detach()
    rows, cols = weight.shape
    codes = torch.empty(rows, cols, dtype=torch.uint8)
    steps = torch.empty(rows, cols // GROUP)
    minimums = torch.empty(rows, cols // GROUP)
    per = max(1, QUANTIZE_CHUNK // max(cols, 1))
    for first in range(0, rows, per):
        part = slice(first, first + per)
        # a float32 copy of a few rows, rounded in place: the same operations as on the whole weight, in a block the
        # caches hold (a 0.5B model's weights 6.9 s -> ~1.3 s on a Zen 4, and no whole-weight temporaries)
        groups = weight[part].to(torch.float32, copy=True).reshape(-1, cols // GROUP, GROUP)
        low, high = groups.amin(dim=-1), groups.amax(dim=-1)  # two reductions: faster here than aminmax's one
        bias, step = _float16_grid(low, high)
        groups.sub_(bias[..., None]).div_(torch.where(step > 0, step, 1.0)[..., None]).round_().clamp_(0, 15)
        codes[part] = groups.reshape(-1, cols).to(torch.uint8)
        steps[part] = step
        minimums[part] = bias
    return [Int4Weight(codes, steps, minimums + 8 * steps)]


def _float16_grid(low: torch.Tensor, high: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each group's float16 minimum ``b <= low`` and step ``d`` with ``b + 15 d >= high``, chosen so that
    ``(b + 8 d) - 8 d == b`` in float32: a minimum much nearer zero than a step (whose low bits the sum would drop)
    moves down to a whole number of steps, ``-d`` or 0. Where ``|b| >= d`` the difference always gives ``b`` back."""
    bias = _float16_at_most(low)
    step = _float16_at_least((high - bias) / 15)
    small = ((bias + 8 * step) - 8 * step != bias) & (bias.abs() < step)
    if bool(small.any()):
        bias = torch.where(small, torch.floor(low / step) * step, bias)
        step = torch.where(small, _float16_at_least((high - bias) / 15), step)
    return bias, step


def _float16_at_most(values: torch.Tensor) -> torch.Tensor:
    """The largest float16 at or below each float32 value (within float16's range)."""
    rounded = values.to(torch.float16)
    above = rounded.to(torch.float32) > values
    return torch.where(above, torch.nextafter(rounded, torch.full_like(rounded, -torch.inf)), rounded).to(torch.float32)


def _float16_at_least(values: torch.Tensor) -> torch.Tensor:
    """The smallest float16 at or above each float32 value (non-negative, within float16's range)."""
    rounded = values.to(torch.float16)
    below = rounded.to(torch.float32) < values
    return torch.where(below, torch.nextafter(rounded, torch.full_like(rounded, torch.inf)), rounded).to(torch.float32)


def decode_blocks(kind: str, raw: np.ndarray, rows: int, cols: int) -> list[Int4Weight]:
    """The 4-bit passes of one GGUF tensor ``[rows, cols]`` stored as ``kind`` blocks in ``raw`` (its bytes).

    Raises:
        ValueError: for a block type outside :data:`SUPPORTED_BLOCKS` or a size that does not match.
    """
    if kind not in SUPPORTED_BLOCKS:
        raise ValueError(f"GGUF block type {kind} is not supported by the int4 path")
    size = SUPER_BLOCK if kind.endswith("_K") else GROUP
    if cols % size:
        raise ValueError(f"a row of {cols} elements is not a whole number of {size}-element {kind} blocks")
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(rows, cols // size, _BLOCK_BYTES[kind])
    if kind == "Q4_K":
        return _q4_k_passes(blocks)
    if kind == "Q6_K":
        return _q6_k_passes(blocks)
    scale = _halves(blocks[..., :2])
    if kind in ("Q8_0", "Q5_0"):
        values = blocks[..., 2:].copy().view(np.int8).astype(np.int16) if kind == "Q8_0" else _q5_0_values(blocks)
        return _signed_passes(values, scale)
    packed = blocks[..., 4:] if kind == "Q4_1" else blocks[..., 2:]
    codes = np.concatenate((packed & 15, packed >> 4), axis=-1)  # element j in the low nibble, j + 16 in the high
    if kind == "Q4_0":
        return [_weight(codes, scale, np.zeros_like(scale))]
    minimum = _halves(blocks[..., 2:4])
    return [_weight(codes, scale, minimum + 8 * scale)]


def _signed_passes(values: np.ndarray, scale: np.ndarray) -> list[Int4Weight]:
    """Signed values (int16, -128..127) times a scale per 32 as two 4-bit passes: the high nibble ``(v >> 4) + 8`` at
    scale ``16 d``, the low one ``v & 15`` at scale ``d`` with zero ``8 d`` (what :func:`as_int8` reads back)."""
    high, low = (values >> 4) + 8, values & 15
    return [_weight(high, 16 * scale, np.zeros_like(scale)), _weight(low, scale, 8 * scale)]


def _q5_0_values(blocks: np.ndarray) -> np.ndarray:
    """The signed values ``q - 16`` (-16..15) of ``Q5_0`` blocks ``[rows, groups, 22]``: after the scale, 32 high bits
    (bit ``j`` for element ``j``, little-endian) and 16 bytes of low nibbles (element ``j`` low, ``j + 16`` high)."""
    high_bits = blocks[..., 2:6].copy().view("<u4")  # [rows, groups, 1]
    packed = blocks[..., 6:]
    low = np.concatenate((packed & 15, packed >> 4), axis=-1).astype(np.int16)
    high = ((high_bits >> np.arange(GROUP, dtype=np.uint32)) & 1).astype(np.int16)
    return (low | (high << 4)) - 16


def _halves(pairs: np.ndarray) -> np.ndarray:
    """float16 values stored as byte pairs ``[..., 2]``, in float32."""
    return pairs.copy().view(np.float16)[..., 0].astype(np.float32)


def _q4_k_passes(blocks: np.ndarray) -> list[Int4Weight]:
    """``Q4_K`` blocks ``[rows, super-blocks, 144]``: one pass, a group per sub-block (layout as in ``gguf``)."""
    from gguf.quants import Q4_K

    rows, supers, _ = blocks.shape
    d, dmin = _halves(blocks[..., 0:2])[..., None], _halves(blocks[..., 2:4])[..., None]
    sc, m = (part.reshape(rows, supers, 8) for part in Q4_K.get_scale_min(blocks[..., 4:16].reshape(-1, 12)))
    scale = d * sc.astype(np.float32)
    minimum = dmin * m.astype(np.float32)
    packed = blocks[..., 16:].reshape(rows, supers, 4, 1, 32)  # 32 bytes: sub-block 2c low nibbles, 2c + 1 high
    codes = (packed >> np.array([0, 4], dtype=np.uint8).reshape(2, 1)) & 15
    factors = ScaleFactors(*(torch.from_numpy(np.ascontiguousarray(part.reshape(rows, -1)))
                             for part in (d, sc.astype(np.uint8), -dmin, m.astype(np.uint8))))
    return [_weight(codes.reshape(rows, -1), scale.reshape(rows, -1), (8 * scale - minimum).reshape(rows, -1),
                    factors)]


def _q6_k_passes(blocks: np.ndarray) -> list[Int4Weight]:
    """``Q6_K`` blocks ``[rows, super-blocks, 210]``: four passes (see the module's docstring)."""
    rows, supers, _ = blocks.shape
    low = blocks[..., :128].reshape(rows, supers, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(2, 1)
    high = blocks[..., 128:192].reshape(rows, supers, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(4, 1)
    low = (low & 15).reshape(rows, -1, 2, 16)  # [rows, groups, half, element]
    high = (high & 3).reshape(rows, -1, 2, 16)
    steps = blocks[..., 192:208].copy().view(np.int8)
    d = _halves(blocks[..., 208:210])
    scale = (d[..., None] * steps.astype(np.float32)).reshape(rows, -1, 2)  # D per half of each group
    factors = ScaleFactors(torch.from_numpy(np.ascontiguousarray(d)),
                           torch.from_numpy(np.ascontiguousarray(steps.reshape(rows, -1))))
    passes = []
    for half in (0, 1):
        own = np.zeros((1, 1, 2, 1), dtype=bool)
        own[0, 0, half] = True
        part = scale[..., half]
        passes.append(_weight(np.where(own, low, 0).reshape(rows, -1), part, 8 * part, factors))
        passes.append(_weight(np.where(own, high + 2, 4).reshape(rows, -1), 16 * part, 64 * part, factors))
    return passes


def _weight(codes: np.ndarray, scales: np.ndarray, zeros: np.ndarray, factors: ScaleFactors | None = None
            ) -> Int4Weight:
    rows = codes.shape[0]
    return Int4Weight(torch.from_numpy(np.ascontiguousarray(codes.reshape(rows, -1), dtype=np.uint8)),
                      torch.from_numpy(np.ascontiguousarray(scales, dtype=np.float32)),
                      torch.from_numpy(np.ascontiguousarray(zeros, dtype=np.float32)), factors)


@functools.lru_cache(maxsize=1)
def kernel_reason() -> str | None:
    """Why the int4 kernel cannot run here (missing operator, wrong results), or ``None`` when it can."""
    try:
        codes = torch.arange(ROW_MULTIPLE * GROUP, dtype=torch.int32).remainder(16).reshape(ROW_MULTIPLE, GROUP)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
        scales = torch.ones(1, ROW_MULTIPLE, 2, dtype=KERNEL_DTYPE)
        scales[..., 1] = 0
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(torch.eye(32, dtype=KERNEL_DTYPE), packed, GROUP, scales)
    except (AttributeError, RuntimeError, NotImplementedError) as exc:
        return f"PyTorch's int4 CPU kernel is unavailable ({type(exc).__name__}: {str(exc).splitlines()[0][:120]})"
    if not torch.equal(out.t().float(), (codes - 8).float()):
        return "PyTorch's int4 CPU kernel decodes codes differently from what this module expects"
    return None


@dataclass(frozen=True)
class Int4Kernels:
    """Which kernel multiplies each form of a GGUF weight, ``"compiled"``, ``"torch"``, ``"amx"``, ``"bf16"``,
    ``"vnni"`` or ``"vnni8"``:
    ``four_bit`` for ``Q4_0``, ``Q4_1``, ``Q4_K`` (one 4-bit pass) and ``Q8_0`` (two; PyTorch's passes and the
    compiled 8-bit product stream the same bytes, and on SmolLM2's head the compiled one measured 2.5–4.5 % slower end
    to end on an Intel Xeon; the AMX, AVX512-BF16 and integer (VNNI) products take it as 8-bit codes), and
    ``eight_bit`` for ``Q6_K`` (four passes for PyTorch's kernel, ~2.5 bytes a weight, against the 8-bit products'
    1.25)."""

    four_bit: str
    eight_bit: str


#: each compiled kernel's layout of one 4-bit pass and of 8-bit codes
_FOUR_BIT_PACKS = {"compiled": int4_kernel.pack_passes, "amx": int4_kernel.pack_amx, "bf16": int4_kernel.pack_bf16,
                   "vnni": int4_kernel.pack_vnni, "vnni8": functools.partial(int4_kernel.pack_vnni, one_code=True)}
_EIGHT_BIT_PACKS = {"compiled": int4_kernel.PackedInt8, "amx": int4_kernel.pack_amx_int8,
                    "bf16": int4_kernel.pack_bf16_int8, "vnni": int4_kernel.pack_vnni_int8,
                    "vnni8": functools.partial(int4_kernel.pack_vnni_int8, one_code=True)}
#: the integer products' kernels (they take K-quant scale factors as the file holds them)
INTEGER_KERNELS = ("vnni", "vnni8")
_COMPILED_LAYOUTS = (int4_kernel.PackedInt4, int4_kernel.PackedInt8, int4_kernel.PackedAmx, int4_kernel.PackedBf16,
                     int4_kernel.PackedVnni)


class Int4Projection:
    """Several quantized linears applied to one input (q/k/v, gate/up): one product of their stacked weights,
    outputs in float32 (plus the float32 biases). Neighbouring members with the same number of passes are stacked
    together (a ``Q6_K`` value projection beside ``Q4_K`` queries and keys is a stack of its own).

    A stack runs on one kernel for every row count (see :class:`Int4Kernels` and :func:`resolve_kernel`): the
    compiled one (:mod:`~hierspec.runtime.int4_kernel`: float32 rows and scales; a ``Q8_0``/``Q6_K`` weight as signed
    8-bit codes with a scale per 16 inputs), the AMX or the AVX512-BF16 one (bfloat16 rows, float32 scales — float16
    where exact; ``Q8_0``/``Q6_K`` as 8-bit codes too), the AVX512-VNNI one (the same weights, rows as two 8-bit codes
    an input) or PyTorch's (bfloat16 rows and scales, one call per 4-bit
    pass). Call it like :class:`~hierspec.runtime.decoder.Projection`; ``packed`` is true (one tensor for all
    members).
    """

    packed = True

    def __init__(self, members: Sequence[Sequence[Int4Weight]] | None, biases: Sequence[torch.Tensor | None],
                 kernel: str = "torch", eight_bit: str | None = None, *, widths: Sequence[int] | None = None,
                 stacks: list | None = None) -> None:
        """``members`` packed for ``kernel`` (and ``eight_bit`` for weights of more than two passes); or, with
        ``stacks`` (:func:`pack_stacks`' result, e.g. read back by :class:`~hierspec.runtime.packed_store.
        PackedStore`), those stacks for members of ``widths`` outputs (``members`` then unused)."""
        if stacks is None:
            widths, stacks = [passes[0].codes.shape[0] for passes in members], pack_stacks(members, kernel, eight_bit)
        self.widths = list(widths)
        self.stacks: list = list(stacks)
        ends = list(itertools.accumulate(self.widths))
        self._bounds = list(zip([0] + ends[:-1], ends))
        self.bias = None if all(b is None for b in biases) else torch.cat(
            [b.detach().float() if b is not None else torch.zeros(w) for w, b in zip(self.widths, biases)])
        #: the stacks as the compiled layer halves take them (int4_blocks.cpp, which tells the kernel by the codes):
        #: ``[int8 codes, scales]``, ``[3-D uint8 codes, scales, bias]``, the AMX ``[4-D codes, scales, bias]``, the
        #: AVX512-BF16 ``[5-D codes, scales, bias]``, the integer ``[6-D codes, scales, bias, units]`` (a fifth,
        #: empty tensor: rows as one 8-bit code an input), PyTorch's ``[packed, table]`` per pass or a dense weight
        #: prepacked by oneDNN ``[weight]`` or ``[weight, rows a call]``, a bfloat16 weight packed for the dot products
        #: ``[weight]`` (4-D) or a prompt's members' own bfloat16 weights
        self.native = [stack.native if isinstance(stack, DENSE_STACKS)
                       else [stack.codes, stack.scales] if isinstance(stack, int4_kernel.PackedInt8)
                       else [stack.codes, stack.scales, stack.bias, stack.units] + (
                           [torch.empty(0)] if stack.one_code else [])
                       if isinstance(stack, int4_kernel.PackedVnni)
                       else [stack.codes, stack.scales, stack.bias] if isinstance(stack, _COMPILED_LAYOUTS)
                       else [tensor for packed in stack for tensor in packed] for stack in self.stacks]

    def with_row_codes(self, one_code: bool) -> Int4Projection:
        """This projection with every integer (VNNI) stack taking its rows as one 8-bit code an input (``vnni8``'s
        products) or as two (``vnni``'s): the same packed weights, shared, not copied; other stacks unchanged."""
        view = copy.copy(self)
        view.stacks = [replace(stack, one_code=one_code) if isinstance(stack, int4_kernel.PackedVnni) else stack
                       for stack in self.stacks]
        view.native = [tensors[:4] + ([torch.empty(0)] if one_code else [])
                       if isinstance(stack, int4_kernel.PackedVnni) else tensors
                       for stack, tensors in zip(self.stacks, self.native)]
        return view

    def with_whole_products(self) -> Int4Projection:
        """This projection with every dense stack multiplying any number of rows in one call (a prompt's rows, which
        every method reads alike): oneDNN's the same prepacked weights, the dot products' the members' own weights, both
        shared; other stacks unchanged."""
        view = copy.copy(self)
        view.stacks = [stack.whole() if isinstance(stack, DENSE_STACKS) else stack for stack in self.stacks]
        view.native = [stack.native if isinstance(stack, DENSE_STACKS) else tensors
                       for stack, tensors in zip(view.stacks, self.native)]
        return view

    def __call__(self, rows: torch.Tensor, split: bool = True) -> list[torch.Tensor]:
        if len(self.stacks) == 1:
            product = _product(rows, self.stacks[0])
        else:
            product = torch.cat([_product(rows, stack) for stack in self.stacks], dim=-1)
        if self.bias is not None:
            product = product + self.bias
        if not split or len(self.widths) == 1:
            return [product]
        return [product[:, start:stop] for start, stop in self._bounds]


def pack_stacks(members: Sequence[Sequence[Int4Weight]], kernel: str, eight_bit: str | None = None) -> list:
    """The stacks of an :class:`Int4Projection` of ``members``: neighbours with equal pass counts stacked together,
    for ``kernel`` (one or two passes) or ``eight_bit`` (more)."""
    return [_stack(list(run), kernel if depth <= 2 else (eight_bit or kernel))
            for depth, run in itertools.groupby(members, key=len)]


def _stack(members: Sequence[Sequence[Int4Weight]], kernel: str):
    """One stack of members with equal pass counts, in ``kernel``'s layout (the AVX512-VNNI one with K-quant weights'
    scale factors where every member has them: fewer bytes a forward for the same weights)."""
    depth = len(members[0])
    factors = _stacked_factors([passes[0].factors for passes in members]) if kernel in INTEGER_KERNELS else None
    one_code = kernel == "vnni8"
    if kernel != "torch" and depth > 1:
        forms = [as_int8(member) for member in members]
        codes = torch.cat([codes for codes, _ in forms]).contiguous()
        scales = torch.cat([scales for _, scales in forms]).contiguous()
        if kernel in INTEGER_KERNELS:  # Q6_K's codes (-32..31) and Q5_0's (-16..15) in 6 bits where the kernel can
            six_bit = int4_kernel.six_bit_products(int4_kernel.loaded_kernel()) and int4_kernel.fits_six_bits(codes)
            return int4_kernel.pack_vnni_int8(codes, scales, factors, one_code, six_bit=six_bit)
        return _EIGHT_BIT_PACKS[kernel](codes, scales)
    per_pass = [[passes[i] for passes in members] for i in range(depth)]
    if kernel == "torch":
        return [_pack(ws) for ws in per_pass]
    parts = [[torch.cat([getattr(w, part) for w in ws]) for ws in per_pass] for part in ("codes", "scales", "zeros")]
    if factors is not None:
        return int4_kernel.pack_vnni(*parts, factors=factors, one_code=one_code)
    return _FOUR_BIT_PACKS[kernel](*parts)


def _stacked_factors(factors: Sequence[ScaleFactors | None]) -> ScaleFactors | None:
    """The members' scale factors stacked along the outputs, or ``None`` unless every member has them."""
    if any(f is None for f in factors):
        return None
    return ScaleFactors(*(None if parts[0] is None else torch.cat(parts).contiguous()
                          for parts in zip(*(f.parts() for f in factors))))


def _product(rows: torch.Tensor, stack) -> torch.Tensor:
    if isinstance(stack, DENSE_STACKS):
        return stack(rows)
    if isinstance(stack, _COMPILED_LAYOUTS):
        module, _ = int4_kernel.compiled_kernel()
        return int4_kernel.int4_mm(module, rows.to(torch.float32).contiguous(), stack)
    return _stack_product(rows.to(KERNEL_DTYPE).contiguous(), stack)


def _stack_product(inputs: torch.Tensor, passes: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """The sum, in float32, of one int4 product per pass (each pass's bfloat16 product converted exactly)."""
    packed, scales = passes[0]
    product = _INT4_MM(inputs, packed, GROUP, scales).float()
    for packed, scales in passes[1:]:
        product += _INT4_MM(inputs, packed, GROUP, scales)
    return product


try:  # the operator's one overload, resolved once (a call through the operator packet resolves it every time)
    _INT4_MM = torch.ops.aten._weight_int4pack_mm_for_cpu.default
except AttributeError:  # a PyTorch without it: kernel_reason() says so and the int4 path is never built
    _INT4_MM = None


def resolve_kernel(choice: str = "auto") -> tuple[Int4Kernels | None, str | None]:
    """``(kernels, None)`` — which kernel runs each weight form for ``choice`` (``"auto"``, ``"compiled"``,
    ``"torch"``, ``"amx"``, ``"bf16"``, ``"vnni"`` or ``"vnni8"``) — or ``(None, reason)`` when the asked kernel (with
    ``auto``: every one) cannot run here. ``auto`` chooses among :data:`~hierspec.runtime.int4_kernel.KERNELS`
    (its integer products ``vnni8``'s, rows as one 8-bit code an input).

    A kernel's name runs both forms on it. ``auto`` takes the only one of
    :data:`~hierspec.runtime.int4_kernel.KERNELS` that works, or, when several do, the faster
    for each form in a short interleaved timing at 1 and 4 rows (:func:`~hierspec.runtime.int4_kernel.choose_kernel`),
    timed once per machine and thread count and kept in a file beside the compiled kernel.
    """
    if choice not in int4_kernel.KERNEL_CHOICES:
        raise ValueError(f"unknown int4 kernel {choice!r}: use {', '.join(int4_kernel.KERNEL_CHOICES)}")
    reasons = {"torch": kernel_reason, "compiled": lambda: int4_kernel.compiled_kernel()[1],
               "amx": int4_kernel.amx_reason, "bf16": int4_kernel.bf16_reason, "vnni": int4_kernel.vnni_reason,
               "vnni8": int4_kernel.vnni8_reason}
    if choice != "auto":
        reason = reasons[choice]()
        return (None, reason) if reason else (Int4Kernels(choice, choice), None)
    found = {name: reasons[name]() for name in int4_kernel.KERNELS}
    working = tuple(name for name, reason in found.items() if reason is None)
    if not working:
        return None, "; ".join(dict.fromkeys(found.values()))
    if len(working) == 1:
        log.info("int4 products by the %s kernel: %s", working[0],
                 "; ".join(dict.fromkeys(reason for reason in found.values() if reason)))
        return Int4Kernels(working[0], working[0]), None
    return _timed_choice(torch.get_num_threads(), working), None


@functools.lru_cache(maxsize=None)
def _timed_choice(threads: int, candidates: tuple[str, ...]) -> Int4Kernels:
    """The faster of ``candidates`` for each weight form here: read from the choice file beside the compiled kernel
    (one per thread count), or timed and written there, so that every process on this machine runs the same model
    (a fresh timing could flip between two close kernels and, with it, the last bits of every product). The 8-bit
    form is timed as a ``Q6_K`` weight (four passes for PyTorch's kernel)."""
    path = int4_kernel.choice_path(threads)
    kept = int4_kernel.read_choice(path, candidates)
    if kept is not None:
        return Int4Kernels(*kept)
    generator = torch.Generator().manual_seed(0)
    out_features, in_features = int4_kernel.CHOICE_SHAPE
    passes = [Int4Weight(torch.randint(0, 16, (out_features, in_features), generator=generator, dtype=torch.uint8),
                         torch.rand(out_features, in_features // GROUP, generator=generator),
                         torch.rand(out_features, in_features // GROUP, generator=generator)) for _ in range(4)]
    timings, chosen = {}, {}
    for form, weight in (("four_bit", passes[:1]), ("eight_bit", passes)):
        projections = {name: Int4Projection([weight], [None], kernel=name) for name in candidates}
        timings[form] = int4_kernel.time_kernels(projections, in_features)
        chosen[form] = int4_kernel.choose_kernel(timings[form])
        log.info("int4 path, %s weights: the %s kernel (ms at %s rows: %s)", form.replace("_", "-"), chosen[form],
                 "/".join(map(str, int4_kernel.CHOICE_ROWS)), "; ".join(
                     f"{name} " + "/".join(f"{t * 1e3:.3f}" for t in times) for name, times in timings[form].items()))
    kept = int4_kernel.write_choice(path, chosen["four_bit"], chosen["eight_bit"], timings, candidates)
    if kept != (chosen["four_bit"], chosen["eight_bit"]):
        return Int4Kernels(*kept)
    if int4_kernel.busy_while_timing(timings["four_bit"]):
        log.warning("the int4 kernels were timed while this machine was busy (the fastest took %.2f ms for a product "
                    "an idle CPU runs in well under 1 ms), so the kept choice may be a slow one; run `hierspec "
                    "calibrate --retime-kernels` when nothing else is running",
                    1e3 * min(times[0] for times in timings["four_bit"].values()))
    return Int4Kernels(chosen["four_bit"], chosen["eight_bit"])


def _pack(weights: Sequence[Int4Weight]) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's packed codes ``[out, in / 2]`` and its ``[in / 32, out, 2]`` scale/offset table."""
    codes = torch.cat([w.codes for w in weights]).to(torch.int32)
    scales = torch.cat([w.scales for w in weights])
    zeros = torch.cat([w.zeros for w in weights])
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    table = torch.stack((scales.t(), zeros.t()), dim=-1).to(KERNEL_DTYPE).contiguous()
    return packed, table


def load_gguf_weights(path: str | Path, config, cache_dir: str | Path | None = None, requantize: bool = False
                      ) -> tuple[dict[str, list[Int4Weight]] | None, str | None]:
    """:func:`read_gguf_weights`, through a cache file in ``cache_dir`` (the directory of the file's converted
    weights): reading a GGUF file's metadata takes seconds (its tokenizer's strings), the cache a fraction of that.
    With ``requantize``, the weights rounded to 4 bits (:func:`requantize_4bit`), cached in a file of their own
    (rounding a 0.5B model's takes several seconds). A cache that does not match its checksum or cannot be read is
    rebuilt; one that cannot be written is skipped with a log line."""
    cache = None if cache_dir is None else Path(cache_dir) / (REQUANTIZED_CACHE_FILE if requantize else CACHE_FILE)
    version = str(REQUANTIZED_CACHE_VERSION if requantize else CACHE_VERSION)
    if cache is not None and cache.is_file():
        from safetensors import SafetensorError

        try:
            problem = checksums.damage(cache.parent, [cache.name])
            if problem is None:
                return _read_cache(cache, version), None
        except _OtherVersion as exc:
            log.info("rebuilding the int4 weight cache %s (%s)", cache, exc)
            problem = None
        except (OSError, ValueError, KeyError, RuntimeError, SafetensorError) as exc:
            problem = str(exc)
        if problem is not None:
            log.warning("rebuilding the damaged int4 weight cache %s (%s)", cache, problem)
    if requantize:
        weights, reason = load_gguf_weights(path, config, cache_dir)
        weights = None if weights is None else {module: requantize_4bit(passes) for module, passes in weights.items()}
    else:
        weights, reason = read_gguf_weights(path, config)
    if weights is not None and cache is not None:
        _write_cache(cache, weights, version)
    return weights, reason


class _OtherVersion(ValueError):
    """A cache another version of hierspec wrote: rebuilt, not damaged."""


def _read_cache(cache: Path, version: str) -> CachedWeights:
    from safetensors import safe_open

    with safe_open(str(cache), framework="pt") as handle:
        meta = handle.metadata() or {}
        if meta.get("magic") != CACHE_MAGIC:
            raise ValueError("not a hierspec int4 cache")
        if meta.get("version") != version:
            raise _OtherVersion(f"format version {meta.get('version')}, this hierspec writes {version}")
        counts = json.loads(meta["modules"])
        names = set(handle.keys())
        if not all(f"{module}/{i}/codes" in names for module, count in counts.items() for i in range(count)):
            raise KeyError("a module's passes are missing from the int4 cache")
    return CachedWeights(cache, counts, names)


class CachedWeights(Mapping):
    """A checked int4 cache file's passes by module name, each module's read (its codes unpacked) when first asked
    for: a load whose projections come packed (:class:`~hierspec.runtime.packed_store.PackedStore`) reads none."""

    def __init__(self, path: Path, counts: dict[str, int], names: set[str]) -> None:
        self.path = path
        self._counts = counts
        self._names = names  # the file's tensors

    def __getitem__(self, module: str) -> list[Int4Weight]:
        from safetensors import safe_open

        count = self._counts[module]
        with safe_open(str(self.path), framework="pt") as handle:
            factors = _read_factors(handle, self._names, module)
            passes = []
            for i in range(count):
                nibbles = handle.get_tensor(f"{module}/{i}/codes")
                codes = torch.stack((nibbles & 15, nibbles >> 4), dim=-1).reshape(nibbles.shape[0], -1)
                passes.append(Int4Weight(codes, handle.get_tensor(f"{module}/{i}/scales"),
                                         handle.get_tensor(f"{module}/{i}/zeros"), factors))
        return passes

    def __iter__(self):
        return iter(self._counts)

    def __len__(self) -> int:
        return len(self._counts)


def _read_factors(handle, names: set[str], module: str) -> ScaleFactors | None:
    """A weight's scale factors (one for all its passes; ``names`` the cache's tensors), or ``None`` where it has
    none."""
    parts = [handle.get_tensor(f"{module}/factors/{part}") if f"{module}/factors/{part}" in names else None
             for part in _FACTOR_PARTS]
    return None if parts[0] is None else ScaleFactors(*parts)


def _write_cache(cache: Path, weights: Mapping[str, Sequence[Int4Weight]], version: str) -> None:
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    tensors = {}
    for module, passes in weights.items():
        for i, weight in enumerate(passes):
            tensors[f"{module}/{i}/codes"] = (weight.codes[:, 0::2] | (weight.codes[:, 1::2] << 4)).contiguous()
            tensors[f"{module}/{i}/scales"] = weight.scales.contiguous()
            tensors[f"{module}/{i}/zeros"] = weight.zeros.contiguous()
        factors = passes[0].factors  # one for all of a weight's passes (a Q6_K weight's four share it)
        if factors is not None:
            for part, tensor in zip(_FACTOR_PARTS, factors.parts()):
                if tensor is not None:
                    tensors[f"{module}/factors/{part}"] = tensor.contiguous().clone()
    meta = {"magic": CACHE_MAGIC, "version": version,
            "modules": json.dumps({module: len(passes) for module, passes in weights.items()})}
    try:
        write_file_atomic(cache, lambda tmp: save_file(tensors, tmp, metadata=meta))
        checksums.record(cache.parent, [cache.name])
    except (OSError, SafetensorError, RuntimeError) as exc:  # safetensors' own errors: a full disk, shared memory
        log.warning("the int4 weight cache %s cannot be written (%s); the next load reads the GGUF file again",
                    cache, exc)


def read_gguf_weights(path: str | Path, config) -> tuple[dict[str, list[Int4Weight]] | None, str | None]:
    """The int4 passes of every linear of a Llama-family GGUF file, keyed by transformers module name
    (``model.layers.0.self_attn.q_proj``, …, ``lm_head``), or ``(None, reason)`` when some tensor's block type is
    not supported.

    ``config`` is the transformers config of the same model: Llama files store q/k rows permuted for llama.cpp's
    rotary layout, and the rows are put back in transformers' order as transformers' own GGUF loader does.
    """
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    tensors = {t.name: t for t in reader.tensors}
    weights: dict[str, list[Int4Weight]] = {}
    for gguf_name, module in _module_names(tensors, int(config.num_hidden_layers)).items():
        tensor = tensors[gguf_name]
        kind = tensor.tensor_type.name
        if kind not in SUPPORTED_BLOCKS:
            return None, f"{gguf_name} is stored as {kind} (the int4 path reads {', '.join(SUPPORTED_BLOCKS)})"
        cols, rows = (int(n) for n in tensor.shape[:2])
        if rows % ROW_MULTIPLE:
            return None, f"{gguf_name} has {rows} output rows (the int4 kernel needs a multiple of {ROW_MULTIPLE})"
        passes = decode_blocks(kind, tensor.data, rows, cols)
        order = _unpermuted_rows(gguf_name, rows, config)
        weights[module] = passes if order is None else [p.take_rows(order) for p in passes]
    return weights, None


def float_weights_4bit(model) -> tuple[dict[str, list[Int4Weight]] | None, str | None]:
    """Every linear of a Llama-family float model (``model.layers.N.self_attn.q_proj``, …, ``lm_head``) rounded to
    4-bit passes (:func:`quantize_4bit`), keyed as :func:`read_gguf_weights` keys a file's; or ``(None, reason)``
    where a weight's shape does not fit the kernels. For draft models loaded from a checkpoint without a GGUF file:
    what a draft proposes never changes the output."""
    modules = dict(model.named_modules())
    layers = int(model.config.get_text_config(decoder=True).num_hidden_layers)
    names = [f"model.layers.{i}.{name}" for i in range(layers) for name in _LAYER_NAMES.values()] + ["lm_head"]
    weights: dict[str, list[Int4Weight]] = {}
    for name in names:
        module = modules.get(name)
        if module is None or getattr(module, "weight", None) is None:
            return None, f"the model has no linear {name}"
        rows, cols = module.weight.shape
        if cols % GROUP or rows % ROW_MULTIPLE:
            return None, (f"{name} is {rows} x {cols} (4-bit rounding needs inputs in groups of {GROUP} and output "
                          f"rows in multiples of {ROW_MULTIPLE})")
        weights[name] = quantize_4bit(module.weight)
    return weights, None


def _module_names(tensors: Mapping[str, object], layers: int) -> dict[str, str]:
    names = {f"blk.{i}.{short}.weight": f"model.layers.{i}.{long}"
             for i in range(layers) for short, long in _LAYER_NAMES.items()}
    missing = [name for name in names if name not in tensors]
    if missing:
        raise ValueError(f"the GGUF file has no tensor {missing[0]}")
    names["output.weight" if "output.weight" in tensors else "token_embd.weight"] = "lm_head"
    return names


def _unpermuted_rows(gguf_name: str, rows: int, config) -> torch.Tensor | None:
    """Row order undoing llama.cpp's q/k permutation for Llama models (transformers'
    ``LlamaTensorProcessor._reverse_permute_weights`` applied to row indices), ``None`` where nothing moves."""
    if getattr(config, "model_type", None) != "llama" or not (".attn_q." in gguf_name
                                                                               or ".attn_k." in gguf_name):
        return None
    heads = int(config.num_attention_heads)
    if ".attn_k." in gguf_name:
        heads = int(getattr(config, "num_key_value_heads", None) or heads)
    dim = rows // heads // 2
    return torch.arange(rows).reshape(heads, dim, 2).transpose(1, 2).reshape(rows)

"""oneDNN prepacked linear layers on CPU — the one module that calls PyTorch's private ``mkldnn`` ops.

``torch.ops.mkldnn._reorder_linear_weight`` reorders a weight once into oneDNN's blocked layout and
``torch.ops.mkldnn._linear_pointwise`` multiplies by it; they are what Inductor's freezing pass emits for CPU linear
layers. For the few rows a verification forward has, PyTorch's eager ``F.linear`` (MKL) is far slower: measured on
the project's 2-core Zen 4 (BENCHMARKS.md, "Runtime"), SmolLM2's LM head (49152 x 576) takes 10.6 ms for one row
in float32 eagerly and 5.6 ms prepacked, 5.1 and 1.8 ms in bfloat16. The packed product is also *batch-invariant*:
a row's result does not depend on how many rows are multiplied with it (except float32 with one row, which the
runtime never sends; see :mod:`hierspec.runtime.buckets`), so a verified tree node gets the very logits a plain
decoding step would.

Both ops are private. :func:`probe` checks them once against ``F.linear``; when they are missing or wrong (another
CPU architecture, another PyTorch) the runtime logs one line and stays eager. ``tests/test_runtime.py`` fails
loudly when PyTorch changes them.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)

#: dtypes oneDNN packs (float16 and float64 stay eager)
PACKED_DTYPES = (torch.float32, torch.bfloat16)


def native_bfloat16() -> bool:
    """Whether oneDNN computes bfloat16 natively on this CPU (AVX512_BF16 or AMX); elsewhere it is emulated."""
    try:
        return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


@functools.lru_cache(maxsize=None)
def probe(dtype: torch.dtype) -> str | None:
    """``None`` when prepacked linears work for ``dtype`` on this CPU, else the reason they do not."""
    if dtype not in PACKED_DTYPES:
        return f"oneDNN prepacking is not used for {dtype}"
    if not torch.backends.mkldnn.is_available():
        return "this PyTorch build has no oneDNN (mkldnn)"
    if dtype == torch.bfloat16 and not native_bfloat16():
        return "this CPU has no native bfloat16 support for oneDNN"
    try:
        generator = torch.Generator().manual_seed(0)
        weight = torch.randn(48, 40, generator=generator).to(dtype)
        bias = torch.randn(48, generator=generator).to(dtype)
        rows = torch.randn(3, 40, generator=generator).to(dtype)
        packed = pack_weight(weight)
        got = packed_linear(rows, packed, bias)
    except (AttributeError, RuntimeError, TypeError) as exc:
        return f"PyTorch's oneDNN linear ops are unavailable ({type(exc).__name__}: {exc})"
    expected = F.linear(rows.float(), weight.float(), bias.float())
    if got.shape != expected.shape or not torch.allclose(got.float(), expected, rtol=2e-2, atol=2e-2):
        return "PyTorch's oneDNN linear ops returned wrong results"
    return None


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """A ``[out, in]`` weight reordered into oneDNN's layout (a new tensor; the weight is left as it is)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach())


def packed_linear(rows: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``rows @ W.T + bias`` for 2-D ``rows`` and a weight from :func:`pack_weight`."""
    return torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [], "")


#: the most rows one product of the compiled layers over float weights takes: on an Intel Xeon with AMX, oneDNN's
#: bfloat16 products of SmolLM2's and Qwen2.5-Coder's shapes round some rows in other last bits from 33 rows on than
#: with 32 or fewer (in ~half of random draws of a weight: too rare for a probe to find every time), which a tree
#: verified in one forward would turn into another output than plain decoding's
MAX_ROWS_PER_CALL = 32
#: outputs of the weights :func:`invariant_rows` probes at most, and the random draws it probes
PROBE_OUTPUTS = 4096
PROBE_DRAWS = 4


def invariant_rows(dtype: torch.dtype, outputs: int, inputs: int) -> int:
    """The most rows one packed product of ``dtype`` and shape ``[outputs, inputs]`` takes in the compiled layers:
    :data:`MAX_ROWS_PER_CALL`, or fewer where a probe on this CPU finds a row's result changing at a smaller row
    count (once per process and shape, :func:`_probed_rows`)."""
    return _probed_rows(dtype, min(outputs, PROBE_OUTPUTS), inputs)


@functools.lru_cache(maxsize=None)
def _probed_rows(dtype: torch.dtype, outputs: int, inputs: int) -> int:
    """:func:`invariant_rows` on :data:`PROBE_DRAWS` random weights of that shape: each call of ``m`` rows compared
    with the call of ``m - 1`` rows on their common rows, from 5 rows up to the first that differs."""
    generator = torch.Generator().manual_seed(0)
    limit = MAX_ROWS_PER_CALL
    for _ in range(PROBE_DRAWS):
        weight = pack_weight(torch.randn(outputs, inputs, generator=generator).to(dtype))
        rows = torch.randn(limit, inputs, generator=generator).to(dtype)
        before = packed_linear(rows[:4], weight, None)
        for count in range(5, limit + 1):
            product = packed_linear(rows[:count], weight, None)
            if not torch.equal(product[: count - 1], before):
                limit = count - 1
                break
            before = product
    return limit


@dataclass(frozen=True)
class DenseStack:
    """One stack of a projection of the compiled layers over float weights: the members' weights one below the
    other, prepacked (:func:`pack_weight`) in the products' dtype. Float32 rows are rounded to that dtype, multiplied
    and widened back to float32 — here and in the compiled layers (``dense_onednn.cpp`` calls the same op), with the
    same bits. With ``rows_per_call`` (:func:`invariant_rows`), more rows than that are multiplied in as few calls of
    near-equal size (each of at least half as many rows), so that a row's result does not depend on how many rows
    travel with it; 0: one call whatever the count (a prompt's rows, read alike by every method)."""

    weight: torch.Tensor
    rows_per_call: int = 0

    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        inputs = rows.to(self.weight.dtype)
        calls = -(-inputs.shape[0] // self.rows_per_call) if self.rows_per_call else 1
        if calls == 1:
            return packed_linear(inputs.contiguous(), self.weight, None).float()
        return torch.cat([packed_linear(part.contiguous(), self.weight, None) for part in inputs.tensor_split(calls)]
                         ).float()

    def whole(self) -> DenseStack:
        """The stack that reads prompts: the same prepacked weight, any number of rows in one call."""
        return replace(self, rows_per_call=0)

    @property
    def native(self) -> list[torch.Tensor]:
        """The stack as the compiled layers take it: ``[weight]``, or ``[weight, rows_per_call]`` (a 0-d int64)."""
        if not self.rows_per_call:
            return [self.weight]
        return [self.weight, torch.tensor(self.rows_per_call, dtype=torch.int64)]


class PackedLinear(nn.Module):
    """A drop-in for one ``nn.Linear`` computing with a prepacked copy of its weight.

    The original ``weight`` and ``bias`` stay registered under the same names (state dicts, tied embeddings and
    fingerprints see the model unchanged); the packed copy is a plain attribute, outside the state dict. A module
    that joined a :class:`~hierspec.runtime.fusion.SharedInputGroup` gives up its own packed weight and reads its
    columns of the group's product.
    """

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self.packed: torch.Tensor | None = pack_weight(linear.weight)
        self.group = None
        self.index = 0

    def join(self, group, index: int) -> None:
        """Compute as member ``index`` of ``group`` from now on."""
        self.group, self.index, self.packed = group, index, None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.group is not None:
            return self.group.output(self.index, x)
        rows = x.reshape(-1, self.in_features)
        bias = None if self.bias is None else self.bias.detach()
        return packed_linear(rows, self.packed, bias).view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


@dataclass(frozen=True)
class _Swap:
    parent: nn.Module
    name: str
    stock: nn.Linear
    packed: PackedLinear


class LinearPacking:
    """Every ``nn.Linear`` of a model swapped for a :class:`PackedLinear`, reversibly.

    :meth:`stock` swaps the original modules back (transformers' own ``generate`` in the benchmark runs on the model
    exactly as transformers loaded it); :meth:`packed` swaps the packed ones in again. Keeping both costs one extra
    copy of the linear weights in memory.
    """

    def __init__(self, model: nn.Module) -> None:
        packed: dict[int, PackedLinear] = {}  # a linear shared by several parents is packed once
        self._swaps = []
        for parent in list(model.modules()):
            for name, child in parent.named_children():
                if type(child) is nn.Linear:
                    if id(child) not in packed:
                        packed[id(child)] = PackedLinear(child)
                    self._swaps.append(_Swap(parent, name, child, packed[id(child)]))
        self.packed()

    def __len__(self) -> int:
        return len(self._swaps)

    def packed(self) -> None:
        """Use the packed modules."""
        for swap in self._swaps:
            setattr(swap.parent, swap.name, swap.packed)

    def stock(self) -> None:
        """Use the original ``nn.Linear`` modules."""
        for swap in self._swaps:
            setattr(swap.parent, swap.name, swap.stock)

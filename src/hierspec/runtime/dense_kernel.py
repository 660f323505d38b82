"""Which products multiply a float model's tree and batch rows in the compiled layers (``RuntimeConfig.
dense_kernel``).

* ``onednn``: oneDNN's products over a prepacked copy of the weights (:class:`~hierspec.runtime.onednn.DenseStack`,
  at most 32 rows a call where larger calls round rows otherwise);
* ``dots``: hierspec's own products over a copy packed in blocks of 16 outputs (:class:`DotsStack`): AVX512-BF16
  dot products for bfloat16 weights (``dense_bf16.cpp``), fused multiply-adds on the CPU's vectors for float32 ones
  (``dense_f32.cpp``, AVX-512 or AVX2). Each thread streams its outputs' weights without oneDNN's per-call cost, and
  each row's result is one fixed sequence of products whatever the rows beside it. Prompts, whose many rows are
  compute-bound, are read by oneDNN through ATen's public ``linear`` over the model's own weights (no third copy).

On a 2-core Zen 4, SmolLM2-135M's 121 bfloat16 products of one row took 10.7 ms by the dot products against 19.1 by
oneDNN's (streamed from memory; 16 rows 17.6 against 23.1; BENCHMARKS.md, "Fifty-sixth session"). ``auto`` times
both once per machine, dtype and thread count (:func:`timed_dense_choice`) and keeps the choice beside the compiled
kernel, as the int4 path keeps its own: every process on a machine then multiplies alike, so its outputs do not
change from one process to the next. A shape the packing does not fit (outputs not a multiple of 16; for bfloat16,
inputs not of 32) and bfloat16 weights on a CPU without AVX512-BF16 run on oneDNN.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from hierspec.errors import InputError
from hierspec.runtime import int4_kernel
from hierspec.runtime.onednn import DenseStack, invariant_rows, pack_weight

log = logging.getLogger(__name__)

#: ``RuntimeConfig.dense_kernel`` values
DENSE_KERNELS = ("auto", "onednn", "dots")
#: outputs of one packed block, and the inputs one dot product reads per row
BLOCK_OUTPUTS, INPUT_STEP = 16, 32
#: row counts the automatic choice times: one token, and a tree
CHOICE_ROWS = (1, 16)
#: weights the automatic choice streams through at each timing: SmolLM2's gate/up shape, enough copies (~57 MB) to
#: pass a Zen 4's or a Xeon's last-level cache, as a forward's weights do
CHOICE_SHAPE, CHOICE_COPIES = (3072, 576), 16
#: 1: the first choice file
CHOICE_VERSION = 1


def pack_dots(weight: torch.Tensor) -> torch.Tensor:
    """A weight ``[N, K]`` in the dot products' layout: bfloat16 ``[N / 16, K / 2, 16, 2]`` (block ``b``'s 16 outputs
    at inputs ``2p`` and ``2p + 1`` side by side, one 64-byte vector), float32 ``[N / 16, K, 16]`` (its 16 outputs at
    input ``i``)."""
    n, k = weight.shape
    if weight.dtype == torch.float32:
        return weight.reshape(n // BLOCK_OUTPUTS, BLOCK_OUTPUTS, k).permute(0, 2, 1).contiguous()
    return weight.to(torch.bfloat16).reshape(n // BLOCK_OUTPUTS, BLOCK_OUTPUTS, k // 2, 2).permute(0, 2, 1, 3
                                                                                                  ).contiguous()


def dots_fit(outputs: int, inputs: int, dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether a weight of ``[outputs, inputs]`` in ``dtype`` packs for the dot products."""
    return outputs % BLOCK_OUTPUTS == 0 and outputs > 0 and (dtype == torch.float32 or inputs % INPUT_STEP == 0)


@dataclass(frozen=True)
class MembersStack:
    """A prompt's products on the ``dots`` kernel: float32 rows rounded to bfloat16, times each member's own weight
    (``[N_i, K]``, as the model holds it) through ATen's ``linear``, side by side, widened to float32 — here and in
    the compiled layers (``dense_members_mm``), with the same bits."""

    members: tuple[torch.Tensor, ...]

    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        inputs = rows.to(self.members[0].dtype)
        return torch.cat([torch.nn.functional.linear(inputs, member) for member in self.members], dim=-1).float()

    @property
    def native(self) -> list[torch.Tensor]:
        """The stack as the compiled layers take it: the members' weights."""
        return list(self.members)

    def whole(self) -> MembersStack:
        return self


@dataclass(frozen=True)
class DotsStack:
    """One stack of a projection on the ``dots`` kernel: the members' weights one below the other, packed by
    :func:`pack_dots`; ``prompt``: the same members as :class:`MembersStack` (their own weights), for prompts."""

    weight: torch.Tensor
    prompt: MembersStack

    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        return _dots_product(self.weight.dtype)(rows.to(torch.float32).contiguous(), self.weight)

    @property
    def native(self) -> list[torch.Tensor]:
        """The stack as the compiled layers take it: ``[packed weight]``."""
        return [self.weight]

    def whole(self) -> MembersStack:
        """The stack that reads prompts (any number of rows in one product)."""
        return self.prompt


def _dots_product(dtype: torch.dtype):
    """The compiled dot products of ``dtype`` weights: ``dense_f32_mm`` or ``dense_bf16_mm``."""
    module, _ = int4_kernel.compiled_kernel()
    return module.dense_f32_mm if dtype == torch.float32 else module.dense_bf16_mm


#: every stack type of the compiled layers over a model's float weights
DENSE_STACKS = (DenseStack, DotsStack, MembersStack)


def dense_stack(weights: Sequence[torch.Tensor], stacked: torch.Tensor, kernel: str
                ) -> DenseStack | DotsStack:
    """The stack of ``weights`` (the members' own tensors) for ``kernel``, from ``stacked`` (them one below the other,
    in the products' dtype, bfloat16 or float32): :class:`DotsStack` for ``dots`` where the shape fits, else oneDNN's
    :class:`~hierspec.runtime.onednn.DenseStack`."""
    outputs, inputs = stacked.shape
    if kernel == "dots" and dots_fit(outputs, inputs, stacked.dtype):
        members = tuple(w.detach().to(stacked.dtype) for w in weights)  # the model's own tensors where the dtype is
        return DotsStack(pack_dots(stacked), MembersStack(members))
    return DenseStack(pack_weight(stacked), invariant_rows(stacked.dtype, outputs, inputs))


def dots_reason(dtype: torch.dtype = torch.bfloat16) -> str | None:
    """Why the dot products of ``dtype`` weights cannot run here, or ``None`` when they can."""
    module, reason = int4_kernel.compiled_kernel()
    if module is None:
        return f"the compiled kernels are unavailable ({reason})"
    if dtype == torch.bfloat16 and not module.dense_bf16_ready():
        return "this CPU has no AVX512-BF16"
    return None


def resolve_dense_kernel(choice: str, dtype: torch.dtype, threads: int) -> str:
    """The kernel of a model's dense products in ``dtype`` (bfloat16 or float32): ``"onednn"`` or ``"dots"`` (``auto``:
    timed once per machine, dtype and ``threads``, :func:`timed_dense_choice`; ``onednn`` where the dot products
    cannot run)."""
    if choice not in DENSE_KERNELS:
        raise InputError(f"unknown dense kernel {choice!r}: use {', '.join(DENSE_KERNELS)}")
    if choice == "onednn":
        return "onednn"
    reason = dots_reason(dtype)
    if choice == "dots":
        if reason is not None:
            raise InputError(f"--dense-kernel dots cannot run: {reason}; use auto or onednn")
        return "dots"
    return "onednn" if reason is not None else timed_dense_choice(_dtype_name(dtype), threads)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dense_choice_path(threads: int, dtype: str = "bfloat16") -> Path:
    """Where the automatic choice for ``dtype`` weights and ``threads`` threads is kept: beside the compiled kernel's
    own choices."""
    return int4_kernel.choice_path(threads).with_name(f"dense-choice-{dtype}-t{threads}.json")


@functools.lru_cache(maxsize=None)
def timed_dense_choice(dtype: str, threads: int) -> str:
    """``"dots"`` or ``"onednn"`` for ``dtype`` (``"bfloat16"`` or ``"float32"``) weights: read from the choice file,
    or timed here and kept there."""
    path = dense_choice_path(threads, dtype)
    kept = dense_choice_in(int4_kernel.read_kept_choice(path, CHOICE_VERSION))
    if kept is not None:
        return kept
    seconds = time_dense_products(getattr(torch, dtype))
    chosen = choose_dense_kernel(seconds)
    log.info("a %s model's tree rows multiplied by the %s products (ms for %s rows: %s)", dtype, chosen,
             "/".join(map(str, CHOICE_ROWS)),
             ", ".join(f"{name} {'/'.join(f'{t * 1e3:.2f}' for t in times)}" for name, times in seconds.items()))
    return int4_kernel.keep_choice(path, {"version": CHOICE_VERSION, "dense_kernel": chosen, "dtype": dtype,
                                          "rows": list(CHOICE_ROWS), "shape": list(CHOICE_SHAPE),
                                          "copies": CHOICE_COPIES, "seconds": seconds},
                                   "dense kernel choice", dense_choice_in)


def dense_choice_in(data: dict | None) -> str | None:
    """The kernel a choice file's contents name, or ``None`` where they name none the choice can pick."""
    chosen = None if data is None else data.get("dense_kernel")
    return chosen if chosen in ("onednn", "dots") else None


def choose_dense_kernel(seconds: dict[str, Sequence[float]]) -> str:
    """The kernel with the smallest total time over :data:`CHOICE_ROWS`; oneDNN's on a tie (the path that needs no
    compiled kernel).

    Example: ``choose_dense_kernel({"onednn": [2.0e-3, 3.0e-3], "dots": [1.2e-3, 2.5e-3]})`` is ``"dots"``.
    """
    return min(sorted(seconds, key=lambda name: name != "onednn"), key=lambda name: sum(seconds[name]))


def time_dense_products(dtype: torch.dtype = torch.bfloat16, repeats: int = 5) -> dict[str, list[float]]:
    """The fastest seconds, at each of :data:`CHOICE_ROWS`, of multiplying float32 rows by :data:`CHOICE_COPIES`
    random ``dtype`` weights of :data:`CHOICE_SHAPE` one after another (streamed from memory, as a forward's are), by
    each kernel as the compiled layers call it, interleaved; the first round warms up."""
    module, _ = int4_kernel.compiled_kernel()
    generator = torch.Generator().manual_seed(0)
    outputs, inputs = CHOICE_SHAPE
    weights = [torch.randn(outputs, inputs, generator=generator).to(dtype) for _ in range(CHOICE_COPIES)]
    rows_per_call = invariant_rows(dtype, outputs, inputs)
    packed = {"onednn": [pack_weight(w) for w in weights], "dots": [pack_dots(w) for w in weights]}
    calls = {"onednn": lambda x, w: module.dense_mm(x, w, rows_per_call), "dots": _dots_product(dtype)}
    rows = [torch.randn(count, inputs, generator=generator) for count in CHOICE_ROWS]
    best = {name: [float("inf")] * len(CHOICE_ROWS) for name in packed}
    for round_ in range(repeats + 1):
        for name, call in calls.items():
            for index, x in enumerate(rows):
                start = time.perf_counter()
                for weight in packed[name]:
                    call(x, weight)
                if round_:
                    best[name][index] = min(best[name][index], time.perf_counter() - start)
    return best

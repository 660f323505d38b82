"""Which products read a prompt on the int4 path (``RuntimeConfig.prompt_kernel``).

A prompt's rows are many (tens to thousands) and read once, where every product is compute-bound; a step's rows are
few and the products stream weights. Prompts are therefore read by one of:

* ``expanded``: the file's weights expanded (the float32 copy the loaded model holds anyway), their products in
  bfloat16 on a bfloat16 copy of the layers' weights where the CPU computes bfloat16 natively, else in float32;
* ``vnni``: the integer products that verify trees, rows as two 8-bit codes an input (~15 bits);
* ``vnni8``: the same packed weights with rows as one 8-bit code an input, llama.cpp's activation precision: half
  the integer dot products (no second copy of any weight).

``auto`` takes ``vnni8`` or ``expanded``, whichever multiplies a prompt-sized block of rows faster here, timed once
per machine and thread count and kept beside the compiled kernel, so that every process on a machine reads prompts
the same way (a prompt's keys and values are part of the model that runs: every method reads the same ones, so each
stays lossless against plain decoding). Where trees are verified by another kernel than the integer ones, prompts
are read expanded. What the choice changes is measured in BENCHMARKS.md ("Twenty-eighth session").
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import torch
from torch import nn

from hierspec.errors import InputError
from hierspec.runtime import int4_kernel, onednn
from hierspec.runtime.decoder import Projection
from hierspec.runtime.quantized import GROUP, INTEGER_KERNELS, Int4Kernels, Int4Projection, Int4Weight

log = logging.getLogger(__name__)

#: ``RuntimeConfig.prompt_kernel`` values
PROMPT_KERNELS = ("auto", "expanded", "vnni", "vnni8")
#: rows the automatic choice times (a short prompt)
PROMPT_ROWS = 128
#: 1: the first choice file
CHOICE_VERSION = 1


def expanded_product_dtype(dtype: torch.dtype) -> torch.dtype | None:
    """The dtype of the expanded weights' prompt products for a model loaded in ``dtype``: bfloat16 where the CPU
    computes it natively and the model is float32 (2.4x faster than float32 on prompt-sized products), else ``None``
    (the model's own dtype)."""
    return torch.bfloat16 if dtype == torch.float32 and onednn.native_bfloat16() else None


def resolve_prompt_kernel(choice: str, kernels: Int4Kernels, threads: int) -> str:
    """The products that read prompts on an int4 runtime whose trees are verified by ``kernels``: ``"expanded"``,
    ``"vnni"`` or ``"vnni8"`` (see the module docstring; ``auto`` is timed once per machine and ``threads``)."""
    if choice not in PROMPT_KERNELS:
        raise InputError(f"unknown prompt kernel {choice!r}: use {', '.join(PROMPT_KERNELS)}")
    integer = kernels.four_bit in INTEGER_KERNELS
    if choice in INTEGER_KERNELS and not integer:
        raise InputError(f"--prompt-kernel {choice} reads prompts through the integer (VNNI) products' packed "
                         f"weights; this runtime verifies with the {kernels.four_bit} kernel: use --int4-kernel vnni "
                         "or vnni8, or --prompt-kernel expanded")
    if choice != "auto":
        return choice
    return timed_prompt_choice(threads) if integer else "expanded"


def prompt_choice_path(threads: int) -> Path:
    """Where the automatic choice for ``threads`` threads is kept: beside the compiled kernel's own choice."""
    return int4_kernel.choice_path(threads).with_name(f"prompt-choice-t{threads}.json")


@functools.lru_cache(maxsize=None)
def timed_prompt_choice(threads: int) -> str:
    """``"vnni8"`` or ``"expanded"``: read from the choice file, or timed here and written there."""
    path = prompt_choice_path(threads)
    kept = read_prompt_choice(path)
    if kept is not None:
        return kept
    seconds = time_prompt_products()
    chosen = choose_prompt_kernel(seconds)
    log.info("prompts read by the %s products (ms for %d rows: %s)", chosen, PROMPT_ROWS,
             ", ".join(f"{name} {t * 1e3:.2f}" for name, t in seconds.items()))
    int4_kernel.keep_choice(path, {"version": CHOICE_VERSION, "prompt_kernel": chosen, "rows": PROMPT_ROWS,
                            "shape": list(int4_kernel.CHOICE_SHAPE), "seconds": seconds}, "prompt kernel choice")
    return chosen


def read_prompt_choice(path: Path) -> str | None:
    """The prompt kernel a choice file names, or ``None`` when there is none or it cannot be read (timed again)."""
    data = int4_kernel.read_kept_choice(path, CHOICE_VERSION)
    chosen = None if data is None else data.get("prompt_kernel")
    return chosen if chosen in ("expanded", "vnni8") else None


def choose_prompt_kernel(seconds: dict[str, float]) -> str:
    """The faster of the timed products; the expanded weights' on a tie (the path that needs no compiled kernel).

    Example: ``choose_prompt_kernel({"expanded": 2.0e-3, "vnni8": 1.2e-3})`` is ``"vnni8"``.
    """
    return min(sorted(seconds, key=lambda name: name != "expanded"), key=lambda name: seconds[name])


def time_prompt_products(repeats: int = 9) -> dict[str, float]:
    """Median seconds of one product of :data:`PROMPT_ROWS` rows by a random 4-bit weight of
    :data:`~hierspec.runtime.int4_kernel.CHOICE_SHAPE`, expanded (as :func:`expanded_product_dtype` runs it) and as
    one-code integer products, interleaved (:func:`~hierspec.runtime.int4_kernel.time_kernels`)."""
    generator = torch.Generator().manual_seed(0)
    out_features, in_features = int4_kernel.CHOICE_SHAPE
    groups = (out_features, in_features // GROUP)
    weight = Int4Weight(torch.randint(0, 16, (out_features, in_features), generator=generator, dtype=torch.uint8),
                        torch.rand(groups, generator=generator) / 16, torch.rand(groups, generator=generator) - 0.5)
    linear = nn.Linear(in_features, out_features, bias=False)
    linear.weight.data = weight.dequantize()
    products = {"expanded": Projection([linear], packed=False, product_dtype=expanded_product_dtype(torch.float32)),
                "vnni8": Int4Projection([[weight]], [None], kernel="vnni8")}
    with torch.inference_mode():
        seconds = int4_kernel.time_kernels(products, in_features, repeats, row_counts=(PROMPT_ROWS,))
    return {name: times[0] for name, times in seconds.items()}

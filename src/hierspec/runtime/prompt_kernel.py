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

Where ``auto`` reads prompts expanded, short prompts are still read by the tree products: the expanded products
stream twice the bytes (bfloat16 against 4-bit codes) and win only once a prompt has enough rows to be compute-bound
(Qwen2.5-Coder-1.5B on an Intel Xeon with AMX: 32 tokens 206 ms expanded against ~100 by the tree products, 150
tokens 412 against ~500). The longest prompt the tree products read is timed once per machine, thread count and
model shape (:func:`timed_short_prompt_rows`) and kept, for the same reason as the choice itself.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from torch import nn

from hierspec.errors import InputError
from hierspec.runtime import int4_kernel, onednn
from hierspec.runtime.decoder import Projection
from hierspec.runtime.dense_kernel import dense_choice_path
from hierspec.runtime.quantized import GROUP, INTEGER_KERNELS, Int4Kernels, Int4Projection, Int4Weight

log = logging.getLogger(__name__)

#: ``RuntimeConfig.prompt_kernel`` values
PROMPT_KERNELS = ("auto", "expanded", "vnni", "vnni8")
#: what the automatic choice can pick
PROMPT_CHOICES = ("expanded", "vnni8")
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
    return int4_kernel.keep_choice(path, {"version": CHOICE_VERSION, "prompt_kernel": chosen, "rows": PROMPT_ROWS,
                                          "shape": list(int4_kernel.CHOICE_SHAPE), "seconds": seconds},
                                   "prompt kernel choice", prompt_choice_in)


def kept_choices(threads: int) -> list[Path]:
    """Every timed choice kept beside the compiled kernel for ``threads`` threads: the int4 kernels', the prompt
    products', the dense products' (:mod:`~hierspec.runtime.dense_kernel`) and each model shape's short-prompt
    crossover."""
    crossovers = short_prompt_path("*", threads)
    found = [int4_kernel.choice_path(threads), prompt_choice_path(threads)]
    found += [dense_choice_path(threads, dtype) for dtype in ("bfloat16", "float32")]
    found += sorted(crossovers.parent.glob(crossovers.name))
    return [path for path in found if path.is_file()]


def forget_choices(threads: int) -> list[Path]:
    """Remove :func:`kept_choices` (``hierspec calibrate --retime-kernels``), so that the next load times them
    again; the paths removed. What this process has already chosen stays as it is."""
    removed = kept_choices(threads)
    for path in removed:
        path.unlink(missing_ok=True)
    return removed


def read_prompt_choice(path: Path) -> str | None:
    """The prompt kernel a choice file names, or ``None`` when there is none or it cannot be read (timed again)."""
    return prompt_choice_in(int4_kernel.read_kept_choice(path, CHOICE_VERSION))


def prompt_choice_in(data: dict | None) -> str | None:
    """The prompt kernel a choice file's contents name, or ``None`` where they name none the choice can pick."""
    chosen = None if data is None else data.get("prompt_kernel")
    return chosen if chosen in PROMPT_CHOICES else None


def choose_prompt_kernel(seconds: dict[str, float]) -> str:
    """The faster of the timed products; the expanded weights' on a tie (the path that needs no compiled kernel).

    Example: ``choose_prompt_kernel({"expanded": 2.0e-3, "vnni8": 1.2e-3})`` is ``"vnni8"``.
    """
    return min(sorted(seconds, key=lambda name: name != "expanded"), key=lambda name: seconds[name])


def time_prompt_products(repeats: int = 9) -> dict[str, float]:
    """The fastest seconds of one product of :data:`PROMPT_ROWS` rows by a random 4-bit weight of
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


#: prompt lengths the short-prompt crossover is timed at, shortest first (timing stops at the first the expanded
#: weights read faster)
SHORT_PROMPT_LENGTHS = (16, 32, 64, 128, 256)
#: 1: the first short-prompt file
SHORT_CHOICE_VERSION = 1


def choose_short_prompt_rows(seconds: Mapping[int, tuple[float, float]]) -> int:
    """The longest timed prompt length up to which the tree products read every timed length faster than the
    expanded weights (``seconds``: length -> (tree products, expanded) seconds); 0 when they lose at the shortest.

    Example: ``choose_short_prompt_rows({16: (0.08, 0.17), 32: (0.10, 0.21), 64: (0.21, 0.27), 128: (0.45, 0.38)})``
    is 64.
    """
    chosen = 0
    for rows in sorted(seconds):
        tree, expanded = seconds[rows]
        if tree >= expanded:
            break
        chosen = rows
    return chosen


def short_prompt_path(key: str, threads: int) -> Path:
    """Where the crossover of a model's shapes and kernels (``key``) for ``threads`` threads is kept: beside the
    compiled kernel's own choices."""
    return int4_kernel.choice_path(threads).with_name(f"short-prompts-{key}-t{threads}.json")


def timed_short_prompt_rows(key: str, threads: int, time_prompt: Callable[[int, bool], float]) -> int:
    """The longest prompt the tree products read (the rest are read expanded): kept in :func:`short_prompt_path`, or
    timed here and kept there, so that every process on a machine reads a prompt of a given length alike.
    ``time_prompt(length, tree)``: seconds of one reading; after one untimed reading by each path, each length's two
    readings are interleaved, best of three, up to the first length the expanded weights read faster."""
    path = short_prompt_path(key, threads)
    kept = _kept_rows(int4_kernel.read_kept_choice(path, SHORT_CHOICE_VERSION))
    if kept is not None:
        return kept
    seconds: dict[int, tuple[float, float]] = {}
    time_prompt(SHORT_PROMPT_LENGTHS[0], True)  # untimed: both paths' weights read once (a first read faults pages)
    time_prompt(SHORT_PROMPT_LENGTHS[0], False)
    for length in SHORT_PROMPT_LENGTHS:
        samples = [(time_prompt(length, True), time_prompt(length, False)) for _ in range(3)]
        seconds[length] = (min(s[0] for s in samples), min(s[1] for s in samples))
        if seconds[length][0] >= seconds[length][1]:
            break
    rows = choose_short_prompt_rows(seconds)
    log.info("prompts of up to %d tokens read by the tree products, longer ones expanded (ms, tree / expanded: %s)",
             rows, ", ".join(f"{n}: {t * 1e3:.0f} / {e * 1e3:.0f}" for n, (t, e) in seconds.items()))
    return int4_kernel.keep_choice(path, {"version": SHORT_CHOICE_VERSION, "rows": rows,
                                          "seconds": {str(n): list(pair) for n, pair in seconds.items()}},
                                   "short-prompt crossover", _kept_rows)


def _kept_rows(data: dict | None) -> int | None:
    """The prompt length (a count of rows, 0 or more) a short-prompt file's contents name, else ``None``."""
    rows = None if data is None else data.get("rows")
    return rows if isinstance(rows, int) and not isinstance(rows, bool) and rows >= 0 else None

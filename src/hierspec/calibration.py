"""The target's verification cost curve on this machine: ``hierspec calibrate`` measures it, drafters read it.

``measure_cost_curve`` times one verification forward of ``K`` tree tokens (root included) on top of a fixed context
for a range of ``K``, and again over a long context (attention's work grows with rows x context, so a tree that pays
over a short prompt may not over a long one). The curve is saved as JSON (magic, version, the model's identity and
the settings it was measured with) under ``~/.cache/hierspec/calibration/``, one file per model, device, dtype and
thread count. Curves saved before the long context was measured still read (their cost does not grow with it).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from hierspec.drafters.scored import ContextCost, linear_cost
from hierspec.errors import InputError
from hierspec.loading import user_cache_dir
from hierspec.machine import cpu_info, gpu_name
from hierspec.runtime import int4_kernel
from hierspec.runtime.inputs import bucket_for
from hierspec.runtime.quantized import REQUANTIZED_CACHE_VERSION
from hierspec.storage import write_json_atomic
from hierspec.target import TargetModel
from hierspec.tree import build_tree

log = logging.getLogger(__name__)

MAGIC = "hierspec-cost-curve"
VERSION = 1
DEFAULT_SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)


@dataclass(frozen=True)
class CostCurve:
    """Median milliseconds of one verification forward of ``sizes[i]`` tree tokens (root included) over ``context``
    cached tokens, and (``long_ms``, where measured) over ``long_context``."""

    sizes: tuple[int, ...]
    ms: tuple[float, ...]
    identity: dict
    context: int = 0
    long_context: int = 0
    long_ms: tuple[float, ...] = ()

    def cost(self, tokens: int) -> float:
        """Interpolated cost of verifying ``tokens`` tree tokens (clamped to the measured range)."""
        return float(np.interp(tokens, self.sizes, self.ms))

    def context_cost(self, buckets: tuple[int, ...] = ()) -> ContextCost:
        """The cost of ``rows`` tree nodes read at the runtime's padded bucket sizes, made non-decreasing in the
        rows (a larger tree never costs less, whatever the timing noise), and growing with the context where the
        long context was measured."""
        sizes = np.asarray(self.sizes)

        def reader(ms: tuple[float, ...]) -> Callable[[int], float]:
            rising = np.maximum.accumulate(np.asarray(ms))
            return lambda rows: float(np.interp(bucket_for(rows, buckets), sizes, rising))

        long = reader(self.long_ms) if self.long_ms else None
        return ContextCost(reader(self.ms), self.context, long, self.long_context, milliseconds=True)

    def to_json(self) -> dict:
        data = {"magic": MAGIC, "version": VERSION, "identity": self.identity,
                "sizes": list(self.sizes), "ms": list(self.ms)}
        if self.long_ms:
            data.update(context=self.context, long_context=self.long_context, long_ms=list(self.long_ms))
        return data

    @classmethod
    def from_json(cls, data: dict, where: str) -> CostCurve:
        """Validate and read a curve: positive whole sizes, strictly increasing, each with a finite time > 0 ms
        (a NaN or negative time would silently turn drafting off)."""
        if not isinstance(data, dict) or data.get("magic") != MAGIC:
            raise InputError(f"{where} is not a hierspec cost curve")
        if data.get("version") != VERSION:
            raise InputError(f"{where} has cost-curve version {data.get('version')}; this hierspec reads {VERSION}")
        sizes, ms, identity = data.get("sizes"), data.get("ms"), data.get("identity", {})
        if not (isinstance(sizes, list) and isinstance(ms, list) and isinstance(identity, dict)
                and len(sizes) == len(ms) > 0
                and all(isinstance(x, int) and not isinstance(x, bool) and x >= 1 for x in sizes)
                and all(_positive_ms(x) for x in ms)
                and all(a < b for a, b in zip(sizes, sizes[1:]))):
            raise InputError(f"{where} holds a malformed cost curve (sizes must be increasing whole numbers >= 1, "
                             "times finite and > 0 ms); run `hierspec calibrate` again")
        long_ms = data.get("long_ms", [])
        context, long_context = data.get("context", 0), data.get("long_context", 0)
        if long_ms and not (isinstance(long_ms, list) and len(long_ms) == len(sizes)
                            and all(_positive_ms(x) for x in long_ms)
                            and all(isinstance(x, int) and not isinstance(x, bool) for x in (context, long_context))
                            and 0 <= context < long_context):
            raise InputError(f"{where} holds a malformed long-context cost curve (one finite time > 0 ms per size, "
                             "0 <= context < long_context); run `hierspec calibrate` again")
        return cls(tuple(sizes), tuple(float(x) for x in ms), dict(identity), int(context) if long_ms else 0,
                   int(long_context) if long_ms else 0, tuple(float(x) for x in long_ms))


def _positive_ms(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def machine_identity(target: TargetModel) -> dict:
    """What a cost curve depends on: the model, device (and which CPU), dtype, CPU threads and runtime."""
    device = str(target.device)
    hardware = cpu_info().describe() if target.device.type == "cpu" else gpu_name(target.device) or device
    return {"model": target.name, "tokenizer": target.tokenizer_fingerprint[:16], "device": device,
            "dtype": str(target.dtype).replace("torch.", ""), "threads": torch.get_num_threads(),
            "hardware": hardware, "runtime": target.runtime.kind,
            "decoder": target.runtime.decoder_name,
            "layers": target.runtime.layer_calls, "kv_cache": str(target.runtime.cache_dtype).replace("torch.", ""),
            **_int4_kernels(target), **_requantized(target), **_dense_kernel(target)}


def _dense_kernel(target: TargetModel) -> dict:
    """The dot products' kernel where it multiplies a float model's rows (another kernel, another curve); nothing
    for oneDNN's (their curves' identity is unchanged)."""
    return {"dense_kernel": "dots"} if target.runtime.dense_kernel == "dots" else {}


def _requantized(target: TargetModel) -> dict:
    """For weights rounded to 4 bits (a draft model's), their format's version: another rounding is another model
    with another curve. Nothing for weights as stored (their curves' identity is unchanged)."""
    return {"requantized": REQUANTIZED_CACHE_VERSION} if target.runtime.requantized else {}


def _int4_kernels(target: TargetModel) -> dict:
    """The int4 path's kernels for 4-bit and 8-bit weights and the compiled extension's build (all ``None`` off that
    path)."""
    kernels = target.runtime.int4_kernel if target.runtime.kind == "int4" else None
    return {"int4_kernel": kernels and kernels.four_bit, "int8_kernel": kernels and kernels.eight_bit,
            "kernel_build": kernels and int4_kernel.build_id()}


def default_curve_path(target: TargetModel, root: str | Path | None = None) -> Path:
    """Where the cost curve of this model on this machine setting lives."""
    name = _curve_name(machine_identity(target))
    return Path(root) if root and Path(root).suffix == ".json" else Path(root or user_cache_dir() / "calibration") / name


def _curve_name(ident: dict) -> str:
    """The file name of the curve of a :func:`machine_identity`."""
    model = hashlib.sha256(ident["model"].encode()).hexdigest()[:8]
    # curves with hierspec's own int4 kernels are their own; PyTorch's kernel keeps the name its curves always had
    four, eight = ident.get("int4_kernel"), ident.get("int8_kernel")
    kernel = (f"|{four}" if four in int4_kernel.OWN_KERNELS else "") + (
        f"|int8-{eight}" if eight in int4_kernel.OWN_KERNELS else "")
    # whole compiled layers with their exact attention cost less per row than the halves: their curves are their own
    layers = "|compiled-exact" if ident.get("layers") == "compiled-exact" else ""
    # a float16 cache reads half the bytes per attended entry: its curves are their own
    layers += "|kv-float16" if ident.get("kv_cache") == "float16" and ident.get("dtype") != "float16" else ""
    layers += "|dots" if ident.get("dense_kernel") == "dots" else ""
    # and every build of the compiled kernels (another source, another speed) measures its own
    build = f"|{ident['kernel_build']}" if (kernel or layers) and ident.get("kernel_build") else ""
    setting = f"{ident['hardware']}|{ident['runtime']}|{ident['decoder']}{kernel}{layers}{build}"
    setting = hashlib.sha256(setting.encode()).hexdigest()[:8]
    return (f"{ident['tokenizer']}-{model}-{ident['device'].replace(':', '')}-{ident['dtype']}-t{ident['threads']}"
            f"-{setting}.json")


def prefilled_cache(target: TargetModel, ids: list[int], capacity: int) -> tuple[object, int]:
    """A new cache of ``capacity`` entries holding ``ids`` read by ``target``, and its length (what the cost curves
    time forwards over; ``scripts/weight_floor.py`` too)."""
    cache = target.new_cache(capacity=capacity)
    target.prefill(cache, ids)
    return cache, cache.get_seq_length()


def forward_ms(target: TargetModel, cache, past: int, tree) -> float:
    """Milliseconds of one verification forward of ``tree`` over ``cache`` (``past`` entries), whose entries are then
    dropped again."""
    target.synchronize()
    start = time.perf_counter()
    target.forward_tree(cache, tree)
    target.synchronize()
    elapsed = 1000 * (time.perf_counter() - start)
    target.keep_path(cache, past, [0])
    cache.crop(-1)
    return elapsed


def measure_cost_curve(target: TargetModel, sizes: tuple[int, ...] = DEFAULT_SIZES, context: int = 128,
                       repeats: int = 5, seed: int = 0, desc: str = "calibrating",
                       long_context: int = 0) -> CostCurve:
    """The time of a verification forward of each size over a random ``context``-token prefix (and, with
    ``long_context`` > ``context``, over a ``long_context``-token prefix too, shortened to what the model's context
    holds beside the largest tree).

    One prefilled cache per context serves every forward (the tree's entries are dropped after each). Every forward
    of a size is paired with a one-token forward over ``context``, just before it and just after it in alternate
    rounds (so that whatever going first or second does to a forward's time falls on both sides alike): a size's
    cost is the median of its ratios to its pair times the median one-token time. A machine whose speed drifts, or
    that another process slows for a moment, moves both forwards of a pair alike, so the curve's shape — what sizes
    the trees — does not rest on a few one-token forwards (on a 2-core Zen 3 whose one-token forward varied from 7.5
    to 17 ms within a minute, curves of two unpaired rounds put 2 rows at 0.89-1.22x one row).
    """
    if not sizes or min(sizes) < 1:
        raise InputError("cost-curve sizes must be >= 1")
    if context + max(sizes) >= target.max_context:
        raise InputError(f"context {context} + {max(sizes)} tree tokens exceed the model's {target.max_context}")
    long_context = min(long_context, target.max_context - max(sizes) - 1)
    contexts = [context] + ([long_context] if long_context > context else [])
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, target.vocab_size, size=contexts[-1]).tolist()
    sizes = tuple(sorted(set(sizes)))
    root = ids[context - 1]
    one = build_tree(root, [])
    trees = [build_tree(root, [rng.integers(0, target.vocab_size, size=size - 1).tolist()] if size > 1 else [])
             for size in sizes]
    caches = [prefilled_cache(target, ids[: length - 1], length + max(sizes) + 1) for length in contexts]

    ones: list[float] = []
    ratios = [[[] for _ in sizes] for _ in contexts]
    for repeat in tqdm(range(repeats + 1), desc=desc, unit="round"):
        for index, tree in enumerate(trees):
            if repeat % 2 == 0:  # the pair goes first in alternate rounds
                pair = forward_ms(target, *caches[0], one)
                spent = [forward_ms(target, cache, past, tree) for cache, past in caches]
            else:
                spent = [forward_ms(target, cache, past, tree) for cache, past in caches]
                pair = forward_ms(target, *caches[0], one)
            if repeat:  # the first round warms up
                ones.append(pair)
                for ratio, ms in zip(ratios, spent):
                    ratio[index].append(ms / pair)
    one_ms = statistics.median(ones)
    curves = [tuple(one_ms * statistics.median(r) for r in ratio) for ratio in ratios]
    long = (contexts[1], curves[1]) if len(contexts) > 1 else (0, ())
    return CostCurve(sizes, curves[0], machine_identity(target), context, *long)


def verification_cost(target: TargetModel, measure: bool = True) -> Callable[[int], float]:
    """The cost of verifying a tree of ``rows`` nodes on this target, read at the runtime's padded bucket size (made
    non-decreasing: a larger tree never costs less, whatever the timing noise).

    The curve is the one ``hierspec calibrate`` saved for this model, device, CPU, dtype, threads and runtime. When
    there is none and ``measure`` is on, a short curve is measured now (seconds; a progress bar) and saved there, so
    a user who never runs ``hierspec calibrate`` still gets trees sized for this machine. Without a curve: one step
    plus 2 % per padded row.
    """
    buckets = tuple(target.runtime.buckets)
    path = default_curve_path(target)
    curve = None
    if path.is_file():
        try:
            curve = load_curve(path)
        except InputError as exc:
            log.warning("ignoring a damaged cost curve: %s", exc)
    if curve is None and measure:
        curve = measure_default_curve(target, path)
    if curve is None:
        return lambda rows: linear_cost(bucket_for(rows, buckets))
    return curve.context_cost(buckets)


#: one-token forward pairs timed for a draft model's cost against its target's, and the context they run over
RATIO_PAIRS = 15
RATIO_CONTEXT = 64


def paired_cost_ratio(model: TargetModel, reference: TargetModel, pairs: int = RATIO_PAIRS,
                      context: int = RATIO_CONTEXT, seed: int = 0) -> float:
    """The time of ``model``'s one-token forward over a ``context``-token prefix as a share of ``reference``'s: the
    median ratio of ``pairs`` pairs timed back to back, which of the two goes first alternating.

    Two curves saved at different moments each carry the machine's speed of their moment (on a 2-core Zen 3, a
    Qwen2.5-Coder-0.5B draft's curve put its step at 0.44 of the 1.5B's one minute and 0.31 another hour, where
    pairs of forwards measure 0.33-0.36): what decides whether a draft model pays is this ratio, so it is measured
    in pairs, as a curve's shape is.
    """
    if pairs < 1:
        raise InputError("paired_cost_ratio needs at least one pair")
    context = max(2, min(context, model.max_context - 2, reference.max_context - 2))
    ids = np.random.default_rng(seed).integers(0, min(model.vocab_size, reference.vocab_size), size=context).tolist()
    one = build_tree(ids[-1], [])
    states = [(m, *prefilled_cache(m, ids[:-1], context + 2), one) for m in (model, reference)]

    ratios = []
    for index in range(pairs + 1):
        if index % 2:
            own, other = forward_ms(*states[0]), forward_ms(*states[1])
        else:
            other, own = forward_ms(*states[1]), forward_ms(*states[0])
        if index:  # the first pair warms up
            ratios.append(own / other)
    return statistics.median(ratios)


RATIO_MAGIC = "hierspec-cost-ratio"
RATIO_VERSION = 1


def default_ratio_path(model: TargetModel, reference: TargetModel, root: str | Path | None = None) -> Path:
    """Where the paired cost ratio of ``model`` against ``reference`` on this machine setting lives: beside the
    curves, named for both models' curve files (another model, dtype, thread count, CPU or kernel, another file)."""
    return _ratio_path(machine_identity(model), machine_identity(reference), root)


def _ratio_path(model: dict, reference: dict, root: str | Path | None = None) -> Path:
    names = f"{_curve_name(model)}|{_curve_name(reference)}"
    name = f"ratio-{hashlib.sha256(names.encode()).hexdigest()[:16]}.json"
    return Path(root or user_cache_dir() / "calibration") / name


def saved_paired_cost_ratio(model: TargetModel, reference: TargetModel, path: Path | None = None) -> float:
    """:func:`paired_cost_ratio`, measured once per machine setting and read back after that (~1.6 s of every
    process that loads Qwen2.5-Coder-0.5B as the 1.5B's draft, BENCHMARKS.md, "Fifty-fourth session"). A ratio of
    forwards timed in pairs does not carry the machine's speed of its moment, as a saved curve's milliseconds do, so
    a saved one serves later processes; one saved for other models or settings, damaged or unreadable is measured
    again, and a ratio that cannot be saved serves this process only."""
    identities = {"model": machine_identity(model), "reference": machine_identity(reference)}
    path = path or _ratio_path(identities["model"], identities["reference"])
    saved = _read_ratio(path, identities)
    if saved is not None:
        return saved
    ratio = paired_cost_ratio(model, reference)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, {"magic": RATIO_MAGIC, "version": RATIO_VERSION, **identities, "ratio": ratio,
                                 "pairs": RATIO_PAIRS, "context": RATIO_CONTEXT})
    except OSError as exc:
        log.warning("could not save the draft's cost ratio to %s (%s); it is used for this run only", path, exc)
    return ratio


def _read_ratio(path: Path, identities: dict) -> float | None:
    """The ratio saved at ``path`` for these two identities, or ``None`` (missing, damaged, another setting)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        log.warning("measuring the draft's cost ratio again: %s cannot be read (%s)", path, type(exc).__name__)
        return None
    ratio = data.get("ratio") if isinstance(data, dict) else None
    if (not isinstance(data, dict) or data.get("magic") != RATIO_MAGIC or data.get("version") != RATIO_VERSION
            or not _positive_ms(ratio)):
        log.warning("measuring the draft's cost ratio again: %s is not a saved cost ratio of this version", path)
        return None
    if any(data.get(key) != identity for key, identity in identities.items()):
        return None  # the same file name for other models or settings (a hash collision, or a stale field)
    return float(ratio)


def relative_verification_cost(model: TargetModel, reference: TargetModel,
                               reference_cost: Callable[[int], float]) -> Callable[[int], float]:
    """``model``'s verification cost by rows (:func:`verification_cost`: its saved or measured curve's shape), scaled
    so that its one-token forward costs :func:`paired_cost_ratio` times ``reference_cost(1)`` (saved per machine
    setting: :func:`saved_paired_cost_ratio`): a draft model's cost in its target's milliseconds, whatever the
    machine's speed when either curve was measured."""
    own = verification_cost(model)
    scale = saved_paired_cost_ratio(model, reference) * reference_cost(1) / own(1)
    log.info("%s costs %.3f of %s's step (one-token forwards timed in pairs)", model.name,
             scale * own(1) / reference_cost(1), reference.name)
    return lambda rows: own(rows) * scale


#: tree sizes and paired rounds of the curve measured when none was saved (~8 s for a 135M model on 2 cores)
AUTO_SIZES = (1, 2, 4, 8, 16, 32, 64)
AUTO_REPEATS = 6
#: the long context the automatic curve is also measured over
AUTO_LONG_CONTEXT = 1024


def measure_default_curve(target: TargetModel, path: Path) -> CostCurve | None:
    """Measure a short cost curve for ``target`` and save it at ``path``; ``None`` when the model's context is too
    short for it or the file cannot be written (the curve is then used for this process only)."""
    sizes = tuple(k for k in AUTO_SIZES if 64 + k < target.max_context)
    if not sizes:
        return None
    log.info("no cost curve for %s on this machine yet: measuring one (once; `hierspec calibrate` measures a finer "
             "one)", target.name)
    curve = measure_cost_curve(target, sizes, context=64, repeats=AUTO_REPEATS,
                               desc="measuring this machine's verification cost (once)", long_context=AUTO_LONG_CONTEXT)
    try:
        save_curve(curve, path)
    except OSError as exc:
        log.warning("could not save the cost curve to %s (%s); it is used for this run only", path, exc)
    return curve


def save_curve(curve: CostCurve, path: Path) -> None:
    """Write atomically (a temporary file renamed into place: :func:`~hierspec.storage.write_json_atomic`)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, curve.to_json())


def load_curve(path: str | Path) -> CostCurve:
    """Read a saved cost curve; a clear error when missing or not one."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"no cost curve at {path}: run `hierspec calibrate` first (same model, device, dtype and "
                         "--threads)")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InputError(f"{path} cannot be read as a cost curve ({type(exc).__name__}: {exc}); run `hierspec "
                         "calibrate` again") from None
    return CostCurve.from_json(data, str(path))

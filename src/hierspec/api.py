"""Convenience functions: one call from a prompt string to generated text."""

from __future__ import annotations

import inspect
import os
import threading
import weakref
from collections.abc import Callable, Sequence

from hierspec.batching import BatchConfig, decode_batch
from hierspec.config import GenerationConfig, SamplingConfig
from hierspec.decode import GenerationResult, GenerationStream, SpeculativeDecoder
from hierspec.drafters import Drafter
from hierspec.drafters.carried import default_learned_dir
from hierspec.errors import InputError
from hierspec.methods import DrafterContext, make_drafter
from hierspec.target import TargetModel


def _decoder(model: TargetModel, method: str | Drafter, datastores, keep_learned: bool) -> SpeculativeDecoder:
    if isinstance(method, Drafter):
        _context(model, datastores, keep_learned)
        return SpeculativeDecoder(model, method)
    if not isinstance(method, str):
        raise InputError(f"method must be a method name such as 'hd' or a Drafter, not {method!r}")
    return SpeculativeDecoder(model, make_drafter(method, _context(model, datastores, keep_learned)))


#: one drafter context per loaded model, datastore list and learned-state choice, so that repeated calls open stores
#: and draft models once (~70 ms a call for SmolLM2's default stores, seconds for a draft model) and keep what learns
#: across generations, as the server does; dropped with the model
_CONTEXTS: weakref.WeakKeyDictionary[TargetModel, dict[tuple, DrafterContext]] = weakref.WeakKeyDictionary()
_CONTEXTS_LOCK = threading.Lock()


def _context(model: TargetModel, datastores, keep_learned: bool = False) -> DrafterContext:
    if not isinstance(model, TargetModel):
        raise InputError(f"model must be a loaded hierspec model (hierspec.load_model()), not {type(model).__name__}")
    if isinstance(datastores, (str, os.PathLike)):
        datastores = (datastores,)  # one directory, not a sequence of characters
    if not all(isinstance(d, (str, os.PathLike)) for d in datastores):
        raise InputError("datastores must be directory paths")
    if not isinstance(keep_learned, bool):
        raise InputError(f"keep_learned must be True or False, not {keep_learned!r}")
    stores = tuple(map(str, datastores))
    key = (stores, keep_learned)
    with _CONTEXTS_LOCK:
        contexts = _CONTEXTS.setdefault(model, {})
        if key not in contexts:
            learned_dir = str(default_learned_dir()) if keep_learned else None
            contexts[key] = DrafterContext(model, stores, learned_dir=learned_dir)
        return contexts[key]


def make_config(
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int | None = None,
    stop: tuple[str, ...] | list[str] | str | None = (),
    max_draft_tokens: int | None = None,
) -> GenerationConfig:
    """Build a validated :class:`GenerationConfig` from flat keyword arguments."""
    extra = {} if max_draft_tokens is None else {"max_draft_tokens": max_draft_tokens}
    return GenerationConfig(
        max_new_tokens=max_new_tokens,
        sampling=SamplingConfig(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed),
        stop=stop,
        **extra,
    )


def _config(options: dict) -> GenerationConfig:
    unknown = sorted(set(options) - set(inspect.signature(make_config).parameters))
    if unknown:
        raise InputError(f"unknown generation option(s) {', '.join(unknown)}; options: "
                         f"{', '.join(inspect.signature(make_config).parameters)}")
    return make_config(**options)


def generate(
    model: TargetModel,
    prompt: str,
    method: str | Drafter = "hd",
    raw: bool = False,
    datastores: tuple[str, ...] | list[str] = (),
    keep_learned: bool = False,
    **options,
) -> GenerationResult:
    """Generate text for a prompt.

    Args:
        model: a loaded target (:func:`hierspec.load_model`).
        prompt: user text; wrapped in the chat template unless ``raw``.
        method: a method name such as ``"ar"``, ``"pld:max_ngram=4"`` or ``"rest"``, or a drafter instance.
        datastores: datastore directories for methods that use them (``rest`` takes a ``suffix`` store); one path
            may be given as a string. Stores and draft models are opened by the first call for a loaded model and
            these directories, and reused by later calls (with what learns across generations: ``hd``'s successor
            table and earlier outputs); a store rebuilt in place is read after loading the model again.
        keep_learned: also start from what earlier *processes* learned with this model and method, and keep what
            this one learns, in ``~/.cache/hierspec/learned`` (as ``hierspec generate`` does by default; within a
            process, calls always carry it: :mod:`hierspec.drafters.carried`). Outputs never depend on it.
        options: :func:`make_config` keywords (``max_new_tokens``, ``temperature``, ``top_p``, ``top_k``, ``seed``,
            ``stop``, ``max_draft_tokens``).
    """
    config = _config(options)
    return _decoder(model, method, datastores, keep_learned).generate(model.encode_prompt(prompt, raw=raw), config)


def stream(
    model: TargetModel,
    prompt: str,
    method: str | Drafter = "hd",
    raw: bool = False,
    datastores: tuple[str, ...] | list[str] = (),
    keep_learned: bool = False,
    **options,
) -> GenerationStream:
    """Like :func:`generate`, but iterate the returned stream for text deltas; ``stream.result`` is set at the end."""
    config = _config(options)
    return _decoder(model, method, datastores, keep_learned).stream(model.encode_prompt(prompt, raw=raw), config)


def generate_batch(
    model: TargetModel,
    prompts: Sequence[str],
    method: str | Callable[[], Drafter] = "hd",
    raw: bool = False,
    datastores: tuple[str, ...] | list[str] = (),
    max_batch: int = 8,
    max_rows: int = 64,
    keep_learned: bool = False,
    **options,
) -> list[GenerationResult]:
    """Generate for many prompts at once: up to ``max_batch`` verified together per forward (continuous batching,
    :mod:`hierspec.batching`); each result is the one :func:`generate` gives that prompt alone.

    Args:
        method: a method name (each concurrent generation gets its own drafter of it, stores opened once), or a
            function returning a new drafter.
        max_rows: tree rows per forward, all generations together.
        Others as for :func:`generate`.
    """
    config = _config(options)
    if isinstance(prompts, str) or not all(isinstance(p, str) for p in prompts):
        raise InputError("prompts must be a list of strings")
    if isinstance(method, str):
        context = _context(model, datastores, keep_learned)
        method_name = method
        new_drafter = lambda: make_drafter(method_name, context)  # noqa: E731
    elif callable(method) and not isinstance(method, Drafter):
        _context(model, datastores, keep_learned)
        new_drafter = method
    else:
        raise InputError("method must be a method name such as 'hd' or a function returning a new Drafter "
                         "(one drafter cannot serve concurrent generations)")
    ids = [model.encode_prompt(prompt, raw=raw) for prompt in prompts]
    return decode_batch(model, ids, new_drafter, config, BatchConfig(max_batch=max_batch, max_rows=max_rows))

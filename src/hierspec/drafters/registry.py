"""Decoding methods by name: each drafter module registers its own method, its options and how to build it.

A method is written ``name:key=value,key=value`` (``pld:max_ngram=4,draft_len=8``). The module that implements a
drafter declares it with :func:`register` — the name, a dataclass of its options (their defaults and types) and a
builder — so a new drafter is a new file in this package: :func:`methods` imports every module here once and
collects what they registered. Every method also takes ``budget=auto|off``: cost-aware drafting
(:class:`~hierspec.drafters.cost_aware.CostAwareDrafter`, added by :func:`build_drafter`) is on by default for every
method that does not size its own trees (those register with ``sizes_itself=True``: ``hd``'s scored tree, ``ar``);
``budget=off`` drafts as the method's paper does, ``budget=auto`` also wraps a method that sizes itself.

Builders get a :class:`BuildContext`: the loaded target, datastore look-ups, draft models and cost curves. The
object passed in is :class:`hierspec.methods.DrafterContext`; this module only names what builders may ask of it,
so drafters never import the layers above them.
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from hierspec.errors import InputError

if TYPE_CHECKING:
    from hierspec.drafters.base import Drafter


class BuildContext(Protocol):
    """What a method's builder may use besides its options (:class:`hierspec.methods.DrafterContext`)."""

    target: Any
    draft_model: str | None
    middle_model: str | None
    self_verify: bool

    def datastore(self, kind: str, method: str) -> str: ...

    def optional_datastore(self, kind: str, default_name: str | None = None) -> str | None: ...

    def fingerprint(self) -> tuple[str, str]: ...

    def load_draft_lm(self, spec: str, method: str): ...

    def verification_cost(self) -> Callable[[int], float]: ...

    def learning_store(self, model_dir: str | None, max_grams: int, successor_k: int): ...

    def shared(self, key: tuple, open_it: Callable[[], Any]) -> Any: ...


@dataclass(frozen=True)
class Method:
    """A registered method: its name, its options' dataclass (``None``: no options) and its builder, called as
    ``build(options, written, context)`` with the parsed options, the ``key=value`` pairs as written, and the
    :class:`BuildContext`; ``sizes_itself``: its drafts are already sized on the cost curve (no cost-aware wrapper
    by default)."""

    name: str
    options: type | None
    build: Callable[[Any, dict[str, str], BuildContext], Drafter]
    summary: str = ""
    sizes_itself: bool = False


_REGISTERED: dict[str, Method] = {}
_LOADED = False


def register(name: str, options: type | None = None, summary: str = "", sizes_itself: bool = False):
    """Decorator for a builder ``(options, written, context) -> Drafter`` of method ``name``."""

    def wrap(build: Callable[[Any, dict[str, str], BuildContext], Drafter]):
        if name in _REGISTERED and _REGISTERED[name].build is not build:
            raise ValueError(f"method {name!r} is registered twice")
        _REGISTERED[name] = Method(name, options, build, summary, sizes_itself)
        return build

    return wrap


def methods() -> dict[str, Method]:
    """Every registered method by name (the modules of this package are imported on first use)."""
    global _LOADED
    if not _LOADED:
        package = importlib.import_module("hierspec.drafters")
        for module in pkgutil.iter_modules(package.__path__):
            importlib.import_module(f"hierspec.drafters.{module.name}")
        _LOADED = True
    return dict(_REGISTERED)


@dataclass(frozen=True)
class MethodSpec:
    """A method name with its options, parsed from ``name:key=value,...``."""

    name: str
    options: tuple[tuple[str, str], ...] = ()

    @classmethod
    def parse(cls, text: str) -> MethodSpec:
        name, _, rest = text.strip().partition(":")
        options = []
        for item in filter(None, (part.strip() for part in rest.split(","))):
            key, sep, value = item.partition("=")
            if not sep or not key:
                raise InputError(f"method option {item!r} in {text!r} is not key=value")
            options.append((key.strip(), value.strip()))
        known = methods()
        if name not in known:
            raise InputError(f"unknown method {name!r}; known methods: {', '.join(sorted(known))}")
        return cls(name, tuple(options))

    @property
    def label(self) -> str:
        """The spec written back as text, used as the method's name in reports."""
        opts = ",".join(f"{k}={v}" for k, v in self.options)
        return f"{self.name}:{opts}" if opts else self.name


def options_from(config_type: type | None, written: dict[str, str], method: str):
    """The options dataclass filled from ``key=value`` text, each value converted to its field's default's type."""
    if config_type is None:
        if written:
            raise InputError(f"method {method!r} takes no options")
        return None
    fields = {f.name for f in dataclasses.fields(config_type)}
    defaults = config_type()
    values = {}
    for key, raw in written.items():
        if key not in fields:
            raise InputError(f"method {method!r} has no option {key!r}; options: {', '.join(sorted(fields))}")
        default = getattr(defaults, key)
        try:
            values[key] = raw.lower() in {"1", "true", "yes"} if isinstance(default, bool) else type(default)(raw)
        except ValueError as exc:
            raise InputError(f"option {key}={raw!r} of method {method!r}: {exc}") from exc
    return config_type(**values)


#: values of every method's ``budget`` option
BUDGETS = ("auto", "off")


def build_drafter(method: str | MethodSpec, context: BuildContext, cost_aware: bool = True) -> Drafter:
    """The drafter of a method given as text or a parsed :class:`MethodSpec`, wrapped in
    :class:`~hierspec.drafters.cost_aware.CostAwareDrafter` with the target's cost curve unless the method sizes
    itself, ``budget=off`` is written or ``cost_aware`` is false (a drafter inside another that sizes the drafts,
    such as HSDDW's first level); ``budget=auto`` wraps any method."""
    spec = MethodSpec.parse(method) if isinstance(method, str) else method
    written = dict(spec.options)
    budget = written.pop("budget", None)
    if budget is not None and budget not in BUDGETS:
        raise InputError(f"budget={budget!r}: use auto (cost-aware drafting, the default) or off (the method's "
                         "own draft sizes)")
    entry = methods()[spec.name]
    drafter = entry.build(options_from(entry.options, written, spec.name), written, context)
    wrap = budget == "auto" or (budget is None and cost_aware and not entry.sizes_itself)
    if not wrap:
        return drafter
    from hierspec.drafters.cost_aware import CostAwareDrafter

    return CostAwareDrafter(drafter, context.verification_cost())


def split_methods(text: str) -> list[str]:
    """Split a comma-separated method list whose entries may carry comma-separated options.

    A chunk written ``key=value`` (no method name) continues the options of the method before it:
    ``"ar,pld:max_ngram=4,draft_len=8,hf-ar"`` → ``["ar", "pld:max_ngram=4,draft_len=8", "hf-ar"]``.
    """
    found: list[str] = []
    for chunk in (c.strip() for c in text.split(",")):
        if not chunk:
            continue
        if "=" in chunk and ":" not in chunk.split("=", 1)[0] and found and ":" in found[-1]:
            found[-1] = f"{found[-1]},{chunk}"
        else:
            found.append(chunk)
    return found

"""Decoding methods by name: ``ar``, ``pld``, ``rest``, ``hd`` … with options written ``name:key=value,key=value``.

Example: ``make_drafter("pld:max_ngram=4,draft_len=8")``.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass

from hierspec.datastore.format import default_store_dir, read_header
from hierspec.drafters import Drafter, NoDrafter, PromptLookupConfig, PromptLookupDrafter
from hierspec.errors import InputError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DrafterContext:
    """What a method may need besides its options: the target (for tokenizer checks) and datastore directories.

    Each datastore's header names its kind; a method takes the stores of the kinds it uses. Methods whose stores
    are optional (``hd``) also look in ``store_root`` (see :func:`~hierspec.datastore.format.default_store_dir`;
    ``None`` means ``~/.cache/hierspec/datastores``) unless ``find_default_stores`` is off.
    """

    target: object | None = None
    datastores: tuple[str, ...] = ()
    store_root: str | None = None
    find_default_stores: bool = True

    def datastore(self, kind: str, method: str) -> str:
        """The first given datastore of ``kind``, or a clear error naming the option to add."""
        for path in self.datastores:
            if read_header(path).get("kind") == kind:
                return path
        raise InputError(f"method {method!r} needs a {kind!r} datastore: pass --datastore DIR "
                         f"(build one with `hierspec datastore build --kind {kind}`)")

    def optional_datastore(self, kind: str) -> str | None:
        """A given datastore of ``kind``, else the default location's one for this tokenizer, else ``None``."""
        for path in self.datastores:
            if read_header(path).get("kind") == kind:
                return path
        fingerprint, _ = self.fingerprint()
        if not self.find_default_stores or fingerprint is None:
            return None
        candidate = default_store_dir(fingerprint, self.store_root) / kind
        return str(candidate) if (candidate / "header.json").is_file() else None

    def fingerprint(self) -> tuple[str | None, str]:
        if self.target is None:
            return None, ""
        return self.target.tokenizer_fingerprint, self.target.name


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
        if name not in METHODS:
            raise InputError(f"unknown method {name!r}; known methods: {', '.join(sorted(METHODS))}")
        return cls(name, tuple(options))

    @property
    def label(self) -> str:
        """The spec written back as text, used as the method's name in reports."""
        opts = ",".join(f"{k}={v}" for k, v in self.options)
        return f"{self.name}:{opts}" if opts else self.name


def _config_from_options(config_type: type, options: tuple[tuple[str, str], ...], method: str):
    fields = {f.name: f for f in dataclasses.fields(config_type)}
    values = {}
    for key, raw in options:
        if key not in fields:
            raise InputError(f"method {method!r} has no option {key!r}; options: {', '.join(fields)}")
        default = getattr(config_type(), key)
        try:
            values[key] = type(default)(raw) if not isinstance(default, bool) else raw.lower() in {"1", "true", "yes"}
        except ValueError as exc:
            raise InputError(f"option {key}={raw!r} of method {method!r}: {exc}") from exc
    return config_type(**values)


def _make_ar(spec: MethodSpec, context: DrafterContext) -> Drafter:
    if spec.options:
        raise InputError("method 'ar' takes no options")
    return NoDrafter()


def _make_pld(spec: MethodSpec, context: DrafterContext) -> Drafter:
    return PromptLookupDrafter(_config_from_options(PromptLookupConfig, spec.options, spec.name))


def _make_rest(spec: MethodSpec, context: DrafterContext) -> Drafter:
    from hierspec.datastore.suffix import SuffixStore
    from hierspec.drafters.rest import RestConfig, RestDrafter

    config = _config_from_options(RestConfig, spec.options, spec.name)
    fingerprint, name = context.fingerprint()
    store = SuffixStore.open(context.datastore("suffix", spec.name), fingerprint=fingerprint, tokenizer_name=name)
    return RestDrafter(store, config)


def _make_hd(spec: MethodSpec, context: DrafterContext) -> Drafter:
    from hierspec.datastore.ngram import NgramTable
    from hierspec.datastore.suffix import SuffixStore
    from hierspec.drafters.hierarchy import HierarchyConfig, HierarchyDrafter, ModelDatabase, StatisticsDatabase

    config = _config_from_options(HierarchyConfig, spec.options, spec.name)
    fingerprint, name = context.fingerprint()
    model_dir = context.optional_datastore("model") if "m" in config.order else None
    suffix_dir = context.optional_datastore("suffix") if "s" in config.order else None
    model = statistics = None
    if model_dir:
        model = ModelDatabase(NgramTable.open(model_dir, fingerprint, name, top_k=config.top_k), config.min_count,
                              config.m_min_share)
    if suffix_dir:
        statistics = StatisticsDatabase(SuffixStore.open(suffix_dir, fingerprint, name), config.m,
                                        n_min=config.s_n_min, k=config.s_k, min_share=config.s_min_share)
    drafter = HierarchyDrafter(config, model, statistics)
    log.info("hd reads %s", " > ".join(drafter.sources))
    return drafter


METHODS: dict[str, Callable[[MethodSpec, DrafterContext], Drafter]] = {
    "ar": _make_ar,
    "pld": _make_pld,
    "rest": _make_rest,
    "hd": _make_hd,
}


def split_methods(text: str) -> list[str]:
    """Split a comma-separated method list whose entries may carry comma-separated options.

    A chunk written ``key=value`` (no method name) continues the options of the method before it:
    ``"ar,pld:max_ngram=4,draft_len=8,hf-ar"`` → ``["ar", "pld:max_ngram=4,draft_len=8", "hf-ar"]``.
    """
    methods: list[str] = []
    for chunk in (c.strip() for c in text.split(",")):
        if not chunk:
            continue
        if "=" in chunk and ":" not in chunk.split("=", 1)[0] and methods and ":" in methods[-1]:
            methods[-1] = f"{methods[-1]},{chunk}"
        else:
            methods.append(chunk)
    return methods


def make_drafter(method: str | MethodSpec, context: DrafterContext | None = None) -> Drafter:
    """Build the drafter of a method given as text (``"pld:max_ngram=4"``) or a parsed :class:`MethodSpec`.

    ``context`` supplies the target model and datastore directories for methods that need them (``rest``).
    """
    spec = MethodSpec.parse(method) if isinstance(method, str) else method
    return METHODS[spec.name](spec, context or DrafterContext())

"""Decoding methods by name: ``ar``, ``pld``, ``rest``, ``hd`` … with options written ``name:key=value,key=value``.

Example: ``make_drafter("pld:max_ngram=4,draft_len=8")``.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hierspec.datastore.format import default_store_dir, read_header
from hierspec.drafters import Drafter, NoDrafter, PromptLookupConfig, PromptLookupDrafter
from hierspec.errors import InputError

if TYPE_CHECKING:
    from hierspec.target import TargetModel

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DrafterContext:
    """What a method may need besides its options: the loaded target and datastore directories.

    Every drafter is built for one loaded model (``hd`` reads the target's vocabulary for its successor table,
    ``rest`` and ``hd`` check a store's tokenizer against it, ``sd`` shares its layers), so ``target`` is required.

    ``draft_model`` / ``middle_model`` / ``self_verify`` are the command line's defaults for ``sd`` and ``hsddw``
    (a method's own ``draft=`` / ``middle=`` options win); ``model_config`` is how to load such models.

    Each datastore's header names its kind; a method takes the stores of the kinds it uses. Methods whose stores
    are optional (``hd``) also look in ``store_root`` (see :func:`~hierspec.datastore.format.default_store_dir`;
    ``None`` means ``~/.cache/hierspec/datastores``) unless ``find_default_stores`` is off.
    """

    target: TargetModel
    datastores: tuple[str, ...] = ()
    store_root: str | None = None
    find_default_stores: bool = True
    draft_model: str | None = None
    middle_model: str | None = None
    self_verify: bool = False
    model_config: object | None = None
    cost_curve: str | None = None

    def load_cost_curve(self):
        """The target's verification cost curve: ``cost_curve`` if given, else this model's default location."""
        from hierspec.calibration import default_curve_path, load_curve

        if self.cost_curve:
            return load_curve(self.cost_curve)
        return load_curve(default_curve_path(self.target))

    def load_draft_lm(self, spec: str, method: str):
        """A :class:`~hierspec.draft_lm.DraftLM` for ``self:K`` (the target's first K layers) or a model to load
        (id, directory or ``.gguf``; it must share the target's tokenizer)."""
        from hierspec.draft_lm import SELF_PREFIX, DraftLM, check_same_tokenizer, self_drafting_model
        from hierspec.target import load_model

        if spec.startswith(SELF_PREFIX):
            return DraftLM(self_drafting_model(self.target, self_layers(spec, self.target)), self.target.vocab_size)
        draft = load_model(spec, self.model_config) if self.model_config is not None else load_model(spec)
        check_same_tokenizer(draft, self.target)
        return DraftLM(draft, self.target.vocab_size)

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
        if not self.find_default_stores:
            return None
        candidate = default_store_dir(fingerprint, self.store_root) / kind
        return str(candidate) if (candidate / "header.json").is_file() else None

    def fingerprint(self) -> tuple[str, str]:
        """The target's tokenizer fingerprint and name, which every store it reads must match."""
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
    from hierspec.drafters.dense import DenseConfig, DenseRetriever
    from hierspec.drafters.hierarchy import HierarchyConfig, HierarchyDrafter, ModelDatabase, StatisticsDatabase
    from hierspec.datastore.successors import SuccessorTable

    config = _config_from_options(HierarchyConfig, spec.options, spec.name)
    fingerprint, name = context.fingerprint()
    model_dir = context.optional_datastore("model") if "m" in config.order else None
    suffix_dir = context.optional_datastore("suffix") if "s" in config.order else None
    dense_dir = context.optional_datastore("dense") if "d" in config.order else None
    model = statistics = dense = None
    if model_dir:
        model = ModelDatabase(NgramTable.open(model_dir, fingerprint, name, top_k=config.top_k), config.min_count,
                              config.m_min_share)
    if suffix_dir:
        statistics = StatisticsDatabase(SuffixStore.open(suffix_dir, fingerprint, name), config.m,
                                        n_min=config.s_n_min, k=config.s_k, min_share=config.s_min_share)
    if dense_dir:
        dense = DenseRetriever(_open_dense_store(dense_dir, context),
                               DenseConfig(k=config.d_k, min_score=config.d_min_score))
    learning = successors = None
    if config.learn:
        learning = _learning_store(model_dir, context, config, spec)
    elif "t" in config.order:
        successors = SuccessorTable(context.target.vocab_size, config.t_k)
    drafter = HierarchyDrafter(config, model, statistics, dense, cost=_verification_cost(context),
                               successors=successors, learning=learning)
    log.info("hd reads %s", " > ".join(drafter.sources))
    return drafter


def _learning_store(model_dir: str | None, context: DrafterContext, config, spec: MethodSpec):
    """The model store ``hd:learn=true`` learns into: the one given or found, else a new one at the default place."""
    from hierspec.datastore.learning import LearningStore

    target = context.target
    directory = model_dir or default_store_dir(target.tokenizer_fingerprint, context.store_root) / "model"
    shape = read_header(directory) if model_dir else {}
    return LearningStore.open(directory, target.name, target.tokenizer_fingerprint, target.vocab_size,
                              key_len=int(shape.get("key_len", 1)), value_len=int(shape.get("value_len", 4)),
                              max_grams=config.top_k, successor_k=config.t_k)


def _verification_cost(context: DrafterContext):
    from hierspec.calibration import verification_cost

    if context.cost_curve:
        return context.load_cost_curve().cost
    return verification_cost(context.target)


def _open_dense_store(directory: str, context: DrafterContext):
    from hierspec.datastore.dense import DenseStore

    return DenseStore.open(directory, context.target)


def _make_dense(spec: MethodSpec, context: DrafterContext) -> Drafter:
    from hierspec.drafters.dense import DenseConfig, DenseDrafter

    config = _config_from_options(DenseConfig, spec.options, spec.name)
    return DenseDrafter(_open_dense_store(context.datastore("dense", spec.name), context), config)


def self_layers(spec: str, target) -> int:
    """Layers of a ``self:K`` spec: ``K`` itself, or a fraction of the target's layers for ``0 < K < 1``
    (``self:0.9`` = 27 of SmolLM2's 30)."""
    text = spec.split(":", 1)[1]
    try:
        value = float(text)
    except ValueError:
        raise InputError(f"{spec!r}: write self:K with K a number of the target's layers or a fraction") from None
    if 0 < value < 1:
        total = int(target.model.config.num_hidden_layers)
        return min(max(1, round(value * total)), total - 1)
    if value != int(value):
        raise InputError(f"{spec!r}: K must be a whole number of layers or a fraction below 1")
    return int(value)


@dataclass(frozen=True)
class SdOptions:
    """``sd`` options: the draft model (``self:K`` or a model) and :class:`DraftModelConfig`'s fields.

    The default draft, 90 % of the target's layers, was the fastest self-drafting depth measured on SmolLM2
    (BENCHMARKS.md); shallower self-drafts are cheaper but almost never accepted.
    """

    draft: str = "self:0.9"
    k: int = 4
    self_verify: bool = False
    tau: float = 1.0


@dataclass(frozen=True)
class HsddwOptions:
    """``hsddw`` options: the first drafter (``sd`` = a draft model, or a retrieval method name), the two models,
    the first drafter's window and threshold, and the middle model's threshold and block size.

    Defaults measured on SmolLM2 (BENCHMARKS.md): prompt lookup first (free to run) and 90 % of the target's layers
    as the middle model; with ``--draft-model`` (or ``first=sd``) the first level is a draft model, by default two
    thirds of the target's layers.
    """

    first: str = "pld"
    draft: str = "self:0.67"
    middle: str = "self:0.9"
    k: int = 4
    tau1: float = 1.0
    tau: float = 1.0
    max_block: int = 16


def _make_sd(spec: MethodSpec, context: DrafterContext) -> Drafter:
    from hierspec.drafters.draft_model import DraftModelConfig, DraftModelDrafter

    options = _config_from_options(SdOptions, spec.options, spec.name)
    draft = _given(spec, "draft", context.draft_model, options.draft)
    config = DraftModelConfig(k=options.k, self_verify=options.self_verify or context.self_verify, tau=options.tau)
    return DraftModelDrafter(context.load_draft_lm(draft, spec.name), config)


def _make_hsddw(spec: MethodSpec, context: DrafterContext) -> Drafter:
    from hierspec.drafters.draft_model import DraftModelConfig, DraftModelDrafter
    from hierspec.drafters.hsddw import HSDDWConfig, HSDDWDrafter

    options = _config_from_options(HsddwOptions, spec.options, spec.name)
    if "first" not in dict(spec.options) and context.draft_model:
        options = dataclasses.replace(options, first="sd")  # --draft-model names the first level
    if options.first == "sd":
        draft = _given(spec, "draft", context.draft_model, options.draft)
        first = DraftModelDrafter(context.load_draft_lm(draft, spec.name),
                                  DraftModelConfig(k=options.k, self_verify=True, tau=options.tau1))
    elif options.first in METHODS and options.first not in {"ar", "hsddw"}:
        first = make_drafter(options.first, context)
    else:
        raise InputError(f"hsddw's first drafter must be sd or a retrieval method (pld, rest, hd), not "
                         f"{options.first!r}")
    middle = context.load_draft_lm(_given(spec, "middle", context.middle_model, options.middle), spec.name)
    return HSDDWDrafter(first, middle, HSDDWConfig(tau=options.tau, max_block=options.max_block))


def _given(spec: MethodSpec, key: str, from_cli: str | None, default: str) -> str:
    """A model option: the method's own ``key=`` first, then the command line's flag, then the default."""
    written = dict(spec.options).get(key)
    return written or from_cli or default


METHODS: dict[str, Callable[[MethodSpec, DrafterContext], Drafter]] = {
    "ar": _make_ar,
    "pld": _make_pld,
    "rest": _make_rest,
    "hd": _make_hd,
    "dense": _make_dense,
    "sd": _make_sd,
    "hsddw": _make_hsddw,
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


def make_drafter(method: str | MethodSpec, context: DrafterContext | TargetModel) -> Drafter:
    """Build the drafter of a method given as text (``"pld:max_ngram=4"``) or a parsed :class:`MethodSpec`.

    This is the one way hierspec turns a method name into a drafter: the command line (``generate``, ``demo``,
    ``serve``), the Python API, the benchmark and the store builder all call it. ``context`` is a
    :class:`DrafterContext` (the target plus datastores and draft-model choices) or just the loaded target.
    Every method takes ``budget=auto``: its trees are trimmed by
    :class:`~hierspec.drafters.cost_aware.CostAwareDrafter` with the cost curve ``hierspec calibrate`` measured.

    Raises:
        InputError: for an unknown method or option, a context without a loaded model, or a missing store.
    """
    from hierspec.target import TargetModel

    spec = MethodSpec.parse(method) if isinstance(method, str) else method
    if isinstance(context, TargetModel):
        context = DrafterContext(context)
    if not isinstance(context, DrafterContext) or not isinstance(context.target, TargetModel):
        raise InputError(f"make_drafter({spec.label!r}, ...) needs the loaded target model "
                         "(hierspec.load_model()) or a DrafterContext holding it")
    budget = dict(spec.options).get("budget")
    if budget is None:
        return METHODS[spec.name](spec, context)
    if budget != "auto":
        raise InputError(f"budget={budget!r}: the only value is auto (cost-aware drafting from `hierspec calibrate`)")
    from hierspec.drafters.cost_aware import CostAwareDrafter

    inner = MethodSpec(spec.name, tuple(item for item in spec.options if item[0] != "budget"))
    return CostAwareDrafter(METHODS[spec.name](inner, context), context.load_cost_curve())

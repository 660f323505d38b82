"""Drafters for a loaded model by method name: ``make_drafter("pld:max_ngram=4,draft_len=8", model)``.

The methods, their options and their builders live with their drafters (:mod:`hierspec.drafters.registry`); this
module holds what builders get from the caller — the :class:`DrafterContext`: the target, datastores, draft-model
choices and the cost curves, which it may read from :mod:`hierspec.calibration` because it sits above the drafters.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from hierspec.config import DRAFT_DTYPE, DRAFT_DTYPES, DRAFT_REQUANTIZE, DRAFT_VOCAB, ModelConfig
from hierspec.datastore.format import default_store_dir, read_header
from hierspec.drafters.base import Drafter
from hierspec.drafters.carried import CarriedState, learned_path
from hierspec.drafters.registry import MethodSpec, build_drafter, methods, split_methods
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
    (a method's own ``draft=`` / ``middle=`` options win); ``model_config`` is how to load such models;
    ``draft_vocab``: the tokens a draft model's head computes (the most frequent in this tokenizer's suffix
    stores, see :meth:`draft_shortlist`; 0 = its whole vocabulary); ``draft_requantize``: how a draft model's GGUF
    weights are held (``"4bit"``: rounded to 4 bits at load, fewer bytes a draft step; ``"none"``: as stored —
    :attr:`~hierspec.config.ModelConfig.requantize`); ``draft_dtype``: how a draft model runs beside the target
    (:func:`draft_model_config`); ``learned_dir``: where what drafters learn is kept across
    processes (``None``: within this process only; :meth:`carried_state`).

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
    draft_vocab: int = DRAFT_VOCAB
    draft_requantize: str = DRAFT_REQUANTIZE
    draft_dtype: str = DRAFT_DTYPE
    learned_dir: str | None = None
    _opened: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.draft_dtype not in DRAFT_DTYPES:
            raise InputError(f"--draft-dtype must be one of {', '.join(DRAFT_DTYPES)}, not {self.draft_dtype!r}")

    def shared(self, key: tuple, open_it: Callable[[], Any]) -> Any:
        """The object ``open_it()`` made for ``key`` the first time any drafter built from this context asked: the
        drafters of concurrent generations (batched serving) share stores, draft models and what learns across
        generations, each opened once."""
        if key not in self._opened:
            self._opened[key] = open_it()
        return self._opened[key]

    def carried_state(self, spec: MethodSpec) -> CarriedState:
        """Where drafters of ``spec`` leave what they learned: this process only, or with ``learned_dir`` also a
        file there that later processes start from, keyed by the model, tokenizer, method, drafting settings and
        the machine (CPU or GPU, dtype, runtime: the gates learn milliseconds; :mod:`hierspec.drafters.carried`)."""
        from hierspec.calibration import machine_identity

        if self.learned_dir is None:
            return CarriedState()
        machine = machine_identity(self.target)
        key = {"method": spec.label, "model": self.target.name, "tokenizer": self.target.tokenizer_fingerprint[:16],
               "hardware": machine["hardware"], "dtype": machine["dtype"], "runtime": machine["runtime"],
               "datastores": list(self.datastores), "draft_model": self.draft_model,
               "middle_model": self.middle_model, "self_verify": self.self_verify}
        return CarriedState(learned_path(self.learned_dir, key), key)

    def load_cost_curve(self):
        """The target's verification cost curve: ``cost_curve`` if given, else this model's default location."""
        from hierspec.calibration import default_curve_path, load_curve

        if self.cost_curve:
            return load_curve(self.cost_curve)
        return load_curve(default_curve_path(self.target))

    def load_draft_lm(self, spec: str, method: str, dtype: str | None = None):
        """A :class:`~hierspec.draft_lm.DraftLM` for ``self:K`` (the target's first K layers) or a model to load
        (id, directory or ``.gguf``; it must share the target's tokenizer), run as ``dtype`` says (default:
        ``draft_dtype``; :func:`draft_model_config`)."""
        from hierspec.draft_lm import SELF_PREFIX, DraftLM, check_same_tokenizer, self_drafting_model, shortlist_share
        from hierspec.target import load_model

        from hierspec.calibration import relative_verification_cost

        dtype = dtype or self.draft_dtype

        def load():
            if spec.startswith(SELF_PREFIX):
                return self_drafting_model(self.target, self_layers(spec, self.target))
            model = load_model(spec, draft_model_config(self.model_config or ModelConfig(), spec,
                                                        self.draft_requantize, dtype))
            check_same_tokenizer(model, self.target)
            return model

        key = (spec, self.draft_requantize, dtype)
        draft = self.shared(("draft-model", *key), load)
        shortlist = self.draft_shortlist()
        head = None if shortlist is None else self.shared(("draft-head", *key, self.draft_vocab),
                                                          lambda: draft.head_over(shortlist))

        def step_cost(rows: int) -> float:
            # the draft's own cost curve (measured once per machine when missing, with its whole head) in the
            # target's milliseconds (its step against the target's timed in pairs, once per process), read when
            # cost-aware drafting asks; with a shortlist head, times the share of a forward it leaves (measured once
            # per head, however many generations draft with it)
            cost = self.shared(("draft-cost", *key),
                               lambda: relative_verification_cost(draft, self.target, self.verification_cost()))(rows)
            return cost if head is None else cost * self.shared(("draft-head-share", *key, self.draft_vocab),
                                                                lambda: shortlist_share(draft, head))

        return DraftLM(draft, self.target.vocab_size, step_cost=step_cost, head=head)

    def draft_shortlist(self) -> np.ndarray | None:
        """The ``draft_vocab`` tokens a draft model's head computes: the most frequent ones in this tokenizer's
        suffix stores (those given with ``--datastore``, else the default ShareGPT and code stores), with the
        end-of-sequence tokens; ``None`` (the whole head) without such a store or with ``draft_vocab`` 0 or as large
        as the vocabulary."""
        from hierspec.datastore.suffix import SuffixStore
        from hierspec.draft_lm import shortlist_tokens

        if self.draft_vocab <= 0:
            return None
        paths = [p for p in self.datastores if read_header(p).get("kind") == "suffix"]
        if not paths and self.find_default_stores:
            root = default_store_dir(self.fingerprint()[0], self.store_root)
            paths = [str(root / name) for name in ("suffix", "code") if (root / name / "header.json").is_file()]
        if not paths:
            return None

        def count() -> np.ndarray | None:
            fingerprint, name = self.fingerprint()
            vocab = self.target.vocab_size
            counts = np.zeros(vocab, dtype=np.int64)
            for path in paths:
                counts += self.shared(("suffix", path), lambda: SuffixStore.open(path, fingerprint, name)
                                      ).token_counts(vocab)
            return shortlist_tokens(counts, self.draft_vocab, sorted(self.target.eos_token_ids))

        return self.shared(("draft-shortlist", self.draft_vocab, tuple(paths)), count)

    def datastore(self, kind: str, method: str) -> str:
        """The first given datastore of ``kind``, or a clear error naming the option to add."""
        for path in self.datastores:
            if read_header(path).get("kind") == kind:
                return path
        raise InputError(f"method {method!r} needs a {kind!r} datastore: pass --datastore DIR "
                         f"(build one with `hierspec datastore build --kind {kind}`)")

    def optional_datastore(self, kind: str, default_name: str | None = None) -> str | None:
        """A given datastore of ``kind``, else the default location's one for this tokenizer (its directory
        ``default_name``, by default the kind's name), else ``None``."""
        for path in self.datastores:
            if read_header(path).get("kind") == kind:
                return path
        fingerprint, _ = self.fingerprint()
        if not self.find_default_stores:
            return None
        candidate = default_store_dir(fingerprint, self.store_root) / (default_name or kind)
        return str(candidate) if (candidate / "header.json").is_file() else None

    def verification_cost(self) -> Callable[[int], float]:
        """The target's cost of verifying ``rows`` tree nodes: ``cost_curve`` if given, else this machine's saved
        curve, measured once when there is none (:func:`hierspec.calibration.verification_cost`)."""
        from hierspec.calibration import verification_cost

        if self.cost_curve:
            return self.load_cost_curve().context_cost()
        return verification_cost(self.target)

    def learning_store(self, model_dir: str | None, max_grams: int, successor_k: int):
        """The model store ``hd:learn=true`` learns into: the one given or found, else a new one at the default
        place for this tokenizer."""
        from hierspec.datastore.learning import LearningStore

        target = self.target
        directory = model_dir or default_store_dir(target.tokenizer_fingerprint, self.store_root) / "model"
        shape = read_header(directory) if model_dir else {}
        return self.shared(("learning", str(directory)), lambda: LearningStore.open(
            directory, target.name, target.tokenizer_fingerprint, target.vocab_size,
            key_len=int(shape.get("key_len", 1)), value_len=int(shape.get("value_len", 4)), max_grams=max_grams,
            successor_k=successor_k))

    def fingerprint(self) -> tuple[str, str]:
        """The target's tokenizer fingerprint and name, which every store it reads must match."""
        return self.target.tokenizer_fingerprint, self.target.name


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


def draft_model_config(target_config: ModelConfig, spec: str, requantize: str, dtype: str) -> ModelConfig:
    """How the draft model ``spec`` is loaded beside a target loaded with ``target_config``.

    ``dtype``: ``"auto"`` runs the draft on the CPU's int4 path whatever dtype the target was given — a GGUF draft
    on its own 4- or 8-bit weights (as a GGUF target loads by default), a checkpoint's float32 weights rounded to 4
    bits at load when ``requantize`` is ``"4bit"`` — and elsewhere (CUDA; a checkpoint with ``requantize`` ``"none"``)
    in the target's dtype; ``"target"`` takes the target's dtype and runtime; a dtype name loads the draft in it. What
    a draft proposes never changes the output, so this is a speed choice only: a bfloat16 Qwen2.5-Coder-1.5B target
    drafted by the 0.5B's 4-bit weights pays ~12 ms a draft step on a Zen 4 instead of ~31 in bfloat16
    (BENCHMARKS.md, "Fifty-seventh session"). A checkpoint whose architecture or shapes the int4 path does not take
    runs in float32 (logged). ``requantize``: :attr:`~hierspec.config.ModelConfig.requantize` for the draft.
    """
    from hierspec.loading import gguf_source, resolve_device

    if dtype not in DRAFT_DTYPES:
        raise InputError(f"draft dtype must be one of {', '.join(DRAFT_DTYPES)}, not {dtype!r}")
    config = replace(target_config, spec=spec, requantize=requantize)
    gguf_file = gguf_source(config) is not None
    if dtype != "auto":
        config = config if dtype == "target" else replace(config, dtype=dtype)
        # rounded only where the GGUF file's own blocks run: a draft loaded in float stays as loaded
        return config if config.dtype == "auto" and gguf_file else replace(config, requantize="none")
    if gguf_file:
        return replace(config, dtype="auto", runtime="auto")
    if requantize != "4bit" or resolve_device(config.device).type == "cuda":
        return config
    return replace(config, dtype="float32", runtime="auto")


def make_drafter(method: str | MethodSpec, context: DrafterContext | TargetModel) -> Drafter:
    """Build the drafter of a method given as text (``"pld:max_ngram=4"``) or a parsed :class:`MethodSpec`.

    This is the one way hierspec turns a method name into a drafter: the command line (``generate``, ``demo``,
    ``serve``), the Python API, the benchmark and the store builder all call it. ``context`` is a
    :class:`DrafterContext` (the target plus datastores and draft-model choices) or just the loaded target. The
    methods themselves are registered by their drafter modules (:mod:`hierspec.drafters.registry`). Methods that do
    not size their own trees draft cost-aware by default (:class:`~hierspec.drafters.cost_aware.CostAwareDrafter`,
    on this machine's cost curves; ``budget=off`` turns it off, ``budget=auto`` turns it on for any method). The
    drafter starts from what the last finished generation of the same method with this context learned, and leaves
    what it learns there (:mod:`hierspec.drafters.carried`).

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
    drafter = build_drafter(spec, context)
    drafter.carried = context.shared(("carried", spec.label), lambda: context.carried_state(spec))
    state = drafter.carried.latest()
    if state is not None:
        drafter.resume(state)
    return drafter


__all__ = ["DrafterContext", "MethodSpec", "make_drafter", "methods", "self_layers", "split_methods"]

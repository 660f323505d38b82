"""``hierspec datastore build`` and ``info``: turning inputs and presets into a datastore directory."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from itertools import chain
from pathlib import Path

import numpy as np

from hierspec.config import ModelConfig
from hierspec.datastore.corpus import iter_documents, preset_inputs
from hierspec.datastore.dense import KIND as DENSE_KIND
from hierspec.datastore.dense import DenseBuildConfig, DenseStore, TokenDocument, build_dense_store
from hierspec.datastore.format import DatastoreError, default_store_dir, read_header
from hierspec.datastore.model_store import (
    GENERATIONS_FILE,
    ModelStoreConfig,
    build_model_store,
    iter_prompts,
    select_prompts,
)
from hierspec.datastore.ngram import KIND as MODEL_KIND
from hierspec.datastore.ngram import NgramTable
from hierspec.datastore.suffix import KIND as SUFFIX_KIND
from hierspec.datastore.suffix import SuffixBuildConfig, SuffixStore, build_suffix_store
from hierspec.errors import InputError
from hierspec.jsonl import iter_jsonl
from hierspec.loading import load_tokenizer, tokenizer_fingerprint
from hierspec.tree import root_only

log = logging.getLogger(__name__)

KINDS = (SUFFIX_KIND, MODEL_KIND, DENSE_KIND)
#: what ``--preset default`` builds: the model store answers this many ShareGPT prompts (first user turns)
DEFAULT_MODEL_STORE = ModelStoreConfig(max_new_tokens=128, limit=200)


@dataclass(frozen=True)
class BuildRequest:
    """One datastore build.

    Attributes:
        kind: store kind (``suffix``, ``model`` or ``dense``).
        out_dir: the directory to create (for ``--preset default``: the root holding ``suffix/`` and ``model/``;
            ``None`` = :func:`~hierspec.datastore.format.default_store_dir`).
        inputs: ``(path, format)`` pairs; formats as in :mod:`hierspec.datastore.corpus`.
        presets: named corpora (``sharegpt``, ``python-stdlib``) added to the inputs.
        model: the model (or tokenizer) whose tokenizer the store uses.
        overwrite: replace an existing directory.
        chat_template: index each document rendered as an assistant turn of the tokenizer's chat template
            (so the store also holds the template's markup the model generates around answers).
        suffix: suffix-store builder settings.
        prompts: prompt files (jsonl of user turns, or a ShareGPT ``.json``) for a ``model`` store.
        exclude_questions: question files whose questions are kept out of the prompts (evaluation data).
        model_store: model-store builder settings (``None``: :class:`ModelStoreConfig` defaults, or
            :data:`DEFAULT_MODEL_STORE` for ``--preset default``).
        dense: dense-store builder settings.
    """

    kind: str
    out_dir: str | None
    inputs: tuple[tuple[str, str], ...] = ()
    presets: tuple[str, ...] = ()
    model: ModelConfig = ModelConfig()
    overwrite: bool = False
    chat_template: bool = False
    suffix: SuffixBuildConfig = SuffixBuildConfig()
    prompts: tuple[str, ...] = ()
    exclude_questions: tuple[str, ...] = ()
    model_store: ModelStoreConfig | None = None
    dense: DenseBuildConfig = DenseBuildConfig()


def build(request: BuildRequest) -> dict:
    """Build the requested store and return its header (``preset default``: a dict of both headers)."""
    if "default" in request.presets:
        return build_default(request)
    if request.kind not in KINDS:
        raise InputError(f"unknown datastore kind {request.kind!r}; kinds: {', '.join(KINDS)}")
    if request.out_dir is None:
        raise InputError("pass --out DIR (only --preset default has a default location)")
    if request.kind == MODEL_KIND:
        return build_model(request)
    if request.kind == DENSE_KIND:
        return build_dense(request)
    return build_suffix(request)


def build_suffix(request: BuildRequest) -> dict:
    """A suffix-array store from the request's inputs and corpus presets."""
    inputs = _checked_inputs(request)
    tokenizer, name = load_tokenizer(request.model)
    documents = chain.from_iterable(iter_documents(path, fmt) for path, fmt in inputs)
    if request.chat_template:
        documents = map(assistant_turn_renderer(tokenizer), documents)
    return build_suffix_store(
        documents, tokenizer, name, tokenizer_fingerprint(tokenizer), request.out_dir, request.suffix,
        sources=[f"{fmt}:{path}" for path, fmt in inputs], overwrite=request.overwrite,
    )


def build_dense(request: BuildRequest) -> dict:
    """A dense store of the target's hidden states over the request's inputs (model stores' generations included)."""
    from hierspec.target import load_model

    inputs = _checked_inputs(request)
    target = load_model(config=request.model)
    documents = (doc for path, fmt in inputs for doc in token_documents(target, path, fmt, request.chat_template))
    return build_dense_store(target, documents, request.out_dir, request.dense,
                             sources=[f"{fmt}:{path}" for path, fmt in inputs], overwrite=request.overwrite)


def token_documents(target, path: Path, fmt: str, chat_template: bool = False):
    """Token documents of one input: a model store (its directory or ``generations.jsonl``) gives each answer
    after its prompt in the chat template, only the answer indexed; other inputs are read as for a suffix store."""
    generations = path / GENERATIONS_FILE if path.is_dir() and (path / GENERATIONS_FILE).is_file() else path
    if generations.suffix == ".jsonl" and _holds_generations(generations):
        for _, record in iter_jsonl(generations):
            prompt = target.encode_prompt(record["prompt"])
            yield TokenDocument(np.asarray(prompt + list(record["token_ids"]), dtype=np.int64), len(prompt) - 1)
        return
    render = assistant_turn_renderer(target.tokenizer) if chat_template else None
    for text in iter_documents(path, fmt):
        ids = target.tokenizer(render(text) if render else text, add_special_tokens=render is None)["input_ids"]
        yield TokenDocument(np.asarray(ids, dtype=np.int64))


def _holds_generations(path: Path) -> bool:
    for _, record in iter_jsonl(path):
        return isinstance(record, dict) and "token_ids" in record and isinstance(record.get("prompt"), str)
    return False


def _checked_inputs(request: BuildRequest) -> list[tuple[Path, str]]:
    inputs = [(Path(p), f) for p, f in request.inputs]
    for preset in request.presets:
        inputs += preset_inputs(preset)
    if not inputs:
        raise InputError("nothing to index: pass --input PATH or --preset NAME")
    for path, _ in inputs:
        if not path.exists():
            raise InputError(f"input not found: {path}")
    return inputs


def build_model(request: BuildRequest) -> dict:
    """A model store: the target answers the request's prompts (resumably), then its n-grams are counted."""
    from hierspec.target import load_model

    if not request.prompts:
        raise InputError("a model store needs --prompts FILE (jsonl of user turns)")
    for path in request.prompts:
        if not Path(path).is_file():
            raise InputError(f"prompt file not found: {path}")
    prompts = select_prompts(chain.from_iterable(iter_prompts(p) for p in request.prompts), _excluded(request))
    target = load_model(config=request.model)
    config = request.model_store or ModelStoreConfig()
    return build_model_store(target, prompts, request.out_dir, config, overwrite=request.overwrite,
                             prompt_source=", ".join(request.prompts))


def build_default(request: BuildRequest) -> dict:
    """``--preset default``: a ShareGPT suffix store and a model store of ShareGPT prompts, for one model."""
    from hierspec.target import load_model

    target = load_model(config=request.model)
    root = Path(request.out_dir) if request.out_dir else default_store_dir(target.tokenizer_fingerprint)
    (sharegpt, _), = preset_inputs("sharegpt")
    config = request.model_store or DEFAULT_MODEL_STORE
    print(f"building the default stores for {target.name} in {root}:\n"
          f"  1. suffix store of ShareGPT answers (about 20 M tokens; ~1 minute)\n"
          f"  2. model store: the model answers {config.limit} ShareGPT prompts, up to {config.max_new_tokens} "
          f"tokens each; estimated {estimate_minutes(target, config):.0f} minutes on this machine", flush=True)
    headers = {}
    suffix_dir = root / SUFFIX_KIND
    if (suffix_dir / "header.json").is_file() and not request.overwrite:
        print(f"  {suffix_dir} exists; kept (pass --overwrite to rebuild)", flush=True)
        headers[SUFFIX_KIND] = read_header(suffix_dir)
    else:
        headers[SUFFIX_KIND] = build_suffix_store(
            map(assistant_turn_renderer(target.tokenizer), iter_documents(sharegpt, "sharegpt")), target.tokenizer,
            target.name, target.tokenizer_fingerprint, suffix_dir, request.suffix, sources=[f"sharegpt:{sharegpt}"],
            overwrite=request.overwrite,
        )
    prompts = select_prompts(iter_prompts(sharegpt), _excluded(request), english_only=True)
    headers[MODEL_KIND] = build_model_store(target, prompts, root / MODEL_KIND, config,
                                            overwrite=request.overwrite, prompt_source=f"sharegpt:{sharegpt}")
    return headers


def estimate_minutes(target, config: ModelStoreConfig, steps: int = 8) -> float:
    """Rough time to generate a model store from timed one-token steps, assuming answers use 80% of
    ``max_new_tokens`` and speculative decoding saves 15% (tqdm's ETA refines it while generating)."""
    cache = target.new_cache()
    ids = target.encode_prompt("Hello")
    target.prefill(cache, ids[:-1])
    start = time.perf_counter()
    for _ in range(steps):
        target.forward_tree(cache, root_only(ids[-1]))  # the cache grows by one token per step, as in decoding
    target.synchronize()
    per_token = (time.perf_counter() - start) / steps
    return (config.limit or 1) * 0.8 * config.max_new_tokens * per_token * 0.85 / 60


def _excluded(request: BuildRequest) -> list[str]:
    from hierspec.bench.questions import load_questions

    return [turn for path in request.exclude_questions for q in load_questions(path) for turn in q.turns]


def assistant_turn_renderer(tokenizer):
    """A function rendering a text as one assistant turn of the tokenizer's chat template."""
    if not getattr(tokenizer, "chat_template", None):
        raise InputError("--chat-template asked for, but this tokenizer has no chat template")

    def render(text: str) -> str:
        return tokenizer.apply_chat_template([{"role": "assistant", "content": text}], tokenize=False)

    return render


def info(directory: str, verify: bool = False) -> dict:
    """Header and sizes of a datastore; with ``verify``, every array is read and checked too (``"verified"``)."""
    header = read_header(directory)
    opener = {SUFFIX_KIND: SuffixStore.open, MODEL_KIND: NgramTable.open, DENSE_KIND: DenseStore.open}.get(
        header["kind"])
    if opener is None:
        raise DatastoreError(f"{directory} is a datastore of unknown kind {header['kind']!r}")
    store = opener(directory)
    described = store.info()
    if verify:
        described["verified"] = store.verify(header.get("vocab_size")) if header["kind"] == DENSE_KIND else (
            store.verify())
    return described

"""``hierspec datastore build`` and ``info``: turning inputs and presets into a datastore directory.

Building runs the model (a model store's answers, a dense store's hidden states), so this module sits above
:mod:`hierspec.datastore` (formats, readers, counting) and :mod:`hierspec.decode`; nothing below imports it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from itertools import chain
from pathlib import Path

import numpy as np
from tqdm import tqdm

from hierspec.batch_generate import generate_greedy_batches
from hierspec.bench.questions import load_questions
from hierspec.config import GenerationConfig, ModelConfig
from hierspec.datastore.corpus import iter_documents, preset_inputs
from hierspec.datastore.dense import KIND as DENSE_KIND
from hierspec.datastore.dense import DenseBuildConfig, DenseStore, TokenDocument, build_dense_store
from hierspec.datastore.draft_head import KIND as HEAD_KIND
from hierspec.datastore.draft_head import HeadBuildConfig, HeadStore, build_head_store
from hierspec.datastore.format import DatastoreError, default_store_dir, read_header
from hierspec.datastore.model_store import (
    GENERATIONS_FILE,
    ModelStoreConfig,
    iter_prompts,
    load_generations,
    select_prompts,
)
from hierspec.datastore.ngram import KIND as MODEL_KIND
from hierspec.datastore.ngram import NgramTable, count_ngrams, top_ngrams, write_ngram_table
from hierspec.datastore.output import (
    BUILD_FILE,
    check_replaceable,
    claimed_output,
    put_in_place,
    read_build_params,
    resumable_work_dir,
)
from hierspec.decode import SpeculativeDecoder
from hierspec.datastore.suffix import KIND as SUFFIX_KIND
from hierspec.datastore.suffix import SuffixBuildConfig, SuffixStore, build_suffix_store
from hierspec.errors import InputError
from hierspec.jsonl import iter_jsonl
from hierspec.loading import load_tokenizer, tokenizer_fingerprint
from hierspec.methods import DrafterContext, make_drafter
from hierspec.storage import write_file_atomic
from hierspec.target import load_model

log = logging.getLogger(__name__)

KINDS = (SUFFIX_KIND, MODEL_KIND, DENSE_KIND, HEAD_KIND)
#: what ``--preset default`` builds: the model store answers this many ShareGPT prompts (first user turns)
DEFAULT_MODEL_STORE = ModelStoreConfig(max_new_tokens=128, limit=2000)


@dataclass(frozen=True)
class BuildRequest:
    """One datastore build.

    Attributes:
        kind: store kind (``suffix``, ``model``, ``dense`` or ``head``).
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
        head: draft-head builder settings.
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
    head: HeadBuildConfig = HeadBuildConfig()


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
    if request.kind == HEAD_KIND:
        return build_head(request)
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
    return _build_from_hidden_states(request, build_dense_store, request.dense)


def build_head(request: BuildRequest) -> dict:
    """A draft head trained on the target's hidden states over the request's inputs (rendered as assistant turns
    with ``--chat-template``, as the model generates them)."""
    return _build_from_hidden_states(request, build_head_store, request.head)


def _build_from_hidden_states(request: BuildRequest, builder, config) -> dict:
    """Load the target and run ``builder`` (a dense or head store's) over the request's inputs as token documents."""
    inputs = _checked_inputs(request)
    target = load_model(config=request.model)
    documents = (doc for path, fmt in inputs for doc in token_documents(target, path, fmt, request.chat_template))
    return builder(target, documents, request.out_dir, config, sources=[f"{fmt}:{path}" for path, fmt in inputs],
                   overwrite=request.overwrite)


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


#: the suffix stores ``--preset default`` builds: directory under the store root, corpus preset, and whether its
#: documents are indexed as assistant turns of the chat template (ShareGPT answers) or as they are (source files)
DEFAULT_SUFFIX_STORES = (("suffix", "sharegpt", True), ("code", "python-stdlib", False))


def build_default(request: BuildRequest) -> dict:
    """``--preset default``: for one model, a suffix store of ShareGPT answers (``suffix/``, read by ``hd`` and
    ``rest``), one of the Python standard library's sources (``code/``, ``rest:corpus=code``), a model store of its
    own answers to ShareGPT prompts (``model/``) and a draft head trained on its hidden states over those answers and
    ShareGPT's (``head/``, read by ``hd``)."""
    target = load_model(config=request.model)
    root = Path(request.out_dir) if request.out_dir else default_store_dir(target.tokenizer_fingerprint)
    return build_default_stores(target, root, request)


def build_default_stores(target, root: Path, request: BuildRequest) -> dict:
    """The default stores of a loaded model under ``root``; stores already there are kept unless ``overwrite``
    (the model store resumes an interrupted build). Returns their headers by directory name."""
    config = request.model_store or DEFAULT_MODEL_STORE
    print(f"building the default stores for {target.name} in {root}:\n"
          f"  1. suffix store of ShareGPT answers (about 20 M tokens; ~1 minute)\n"
          f"  2. suffix store of the Python standard library's sources (about 9 M tokens; under a minute)\n"
          f"  3. model store: the model answers {config.limit} ShareGPT prompts, up to {config.max_new_tokens} "
          f"tokens each (its time estimate is printed when it starts)\n"
          f"  4. draft head: the model reads {request.head.max_keys} tokens of its answers and ShareGPT's, then a "
          f"small head is trained on its hidden states (for SmolLM2-135M ~{_head_minutes(request.head.max_keys)} "
          f"minutes on a 2-core Zen 4, several times that on an AVX2-only Zen 1; the progress bars give this "
          f"machine's pace)",
          flush=True)
    headers = {}
    for name, preset, as_answers in DEFAULT_SUFFIX_STORES:
        directory = root / name
        if (directory / "header.json").is_file() and not request.overwrite:
            print(f"  {directory} exists; kept (pass --overwrite to rebuild)", flush=True)
            headers[name] = read_header(directory)
            continue
        inputs = preset_inputs(preset)
        documents = chain.from_iterable(iter_documents(path, fmt) for path, fmt in inputs)
        if as_answers:
            documents = map(assistant_turn_renderer(target.tokenizer), documents)
        headers[name] = build_suffix_store(
            documents, target.tokenizer, target.name, target.tokenizer_fingerprint, directory, request.suffix,
            sources=[f"{fmt}:{path}" for path, fmt in inputs], overwrite=request.overwrite,
        )
    (sharegpt, _), = preset_inputs("sharegpt")
    prompts = select_prompts(iter_prompts(sharegpt), _excluded(request), english_only=True)
    prompts = list(prompts if config.limit is None else _take(prompts, config.limit))
    answers_before = _answers_in(root / MODEL_KIND)
    if not request.overwrite and _holds_more_answers(root / MODEL_KIND, _build_params(target, prompts, config),
                                                     prompts):
        print(f"  {root / MODEL_KIND} holds answers to {answers_before} prompts, these {len(prompts)} first; kept "
              f"(pass --overwrite to rebuild)", flush=True)
        headers[MODEL_KIND] = read_header(root / MODEL_KIND)
    else:
        headers[MODEL_KIND] = build_model_store(target, prompts, root / MODEL_KIND, config,
                                                overwrite=request.overwrite, prompt_source=f"sharegpt:{sharegpt}")
    answers = headers[MODEL_KIND]["num_prompts"]
    headers[HEAD_KIND] = _default_head(target, root, sharegpt, request, answers, unchanged=answers_before == answers)
    return headers


def _head_minutes(positions: int) -> int:
    """The default head's build time for SmolLM2-135M on a 2-core Zen 4, in whole minutes: each stage reads every
    position once (300,000 positions 9.2 minutes, 892,078 28.2 in the seventy-third session)."""
    return max(1, round(positions * 28.2 / 892_078))


def _answers_in(model_dir: Path) -> int | None:
    """How many prompts a finished model store answered (``None``: no finished store there)."""
    return read_header(model_dir).get("num_prompts") if (model_dir / "header.json").is_file() else None


def _holds_more_answers(model_dir: Path, params: dict, prompts: list[str]) -> bool:
    """Whether a finished model store in ``model_dir`` answered more prompts than ``prompts``, these first, with the
    same model and settings (``params``: what a build of ``prompts`` would record): a smaller ``limit`` keeps it."""
    previous = _finished_build(model_dir, params)
    if previous is None or previous["num_prompts"] <= len(prompts):
        return False
    records = load_generations(model_dir / GENERATIONS_FILE)
    return all(i in records and records[i].get("prompt") == prompt for i, prompt in enumerate(prompts))


def _default_head(target, root: Path, sharegpt: Path, request: BuildRequest, answers: int, unchanged: bool) -> dict:
    """The default draft head: trained on the model store's ``answers`` answers (the text the model itself writes:
    held-out top-1 40 % against 35 % on ShareGPT's answers for SmolLM2), then ShareGPT's answers as assistant turns,
    up to the head's ``max_keys`` positions. One that exists is kept unless ``overwrite``, or unless it was trained
    with other settings (or fewer positions) or on another count of answers (a larger ``limit`` extended the model
    store; ``unchanged``: this build did not change how many it holds)."""
    directory = root / HEAD_KIND
    model_dir = root / MODEL_KIND
    sources = [f"model-store:{model_dir} ({answers} answers)", f"sharegpt:{sharegpt}"]
    stale = False
    if (directory / "header.json").is_file() and not request.overwrite:
        header = read_header(directory)
        # hierspec before 2026-12-05 did not write the count: such a head read the answers held before this build
        legacy = [f"model-store:{model_dir}", f"sharegpt:{sharegpt}"] if unchanged else None
        if header.get("sources") in (sources, legacy) and _head_serves(header, request.head):
            print(f"  {directory} exists; kept (pass --overwrite to rebuild)", flush=True)
            return header
        print(f"  {directory} was trained on other answers or settings; it is retrained (the old head is kept "
              f"until the new one is in place)", flush=True)
        stale = True
    documents = chain(token_documents(target, model_dir, "jsonl"),
                      token_documents(target, sharegpt, "sharegpt", chat_template=True))
    return build_head_store(target, documents, directory, request.head, sources=sources,
                            overwrite=request.overwrite or stale)


def _head_serves(header: dict, config: HeadBuildConfig) -> bool:
    """Whether a head's header records the build settings ``config`` asks for, or as many positions or more
    (``max_keys``) with the others the same (a setting it lacks, written before that setting existed, counts as its
    default)."""
    built = header.get("build")
    if not isinstance(built, dict):
        return False
    defaults = asdict(HeadBuildConfig())
    built = {name: built.get(name, default) for name, default in defaults.items()}
    asked = asdict(config)
    positions = built.pop("max_keys")
    return isinstance(positions, int) and positions >= asked.pop("max_keys") and built == asked


def estimate_minutes(target, lengths: list[int], config: ModelStoreConfig, width: int = 16, steps: int = 4) -> float:
    """Rough minutes to answer prompts of these token lengths with batched greedy generation, from two timed runs
    of the same path on ``batch_size`` filler prompts of ``width`` tokens (1 and ``1 + steps`` new tokens): each
    prompt is read once, and every step decodes ``batch_size`` answers together until all of them end, taken as
    ``max_new_tokens`` long (answers that end sooner make it shorter; tqdm's ETA refines it while generating)."""
    rows = max(1, config.batch_size)
    filler = (target.encode_prompt("Hello") * width)[:width]

    def timed(new_tokens: int) -> float:
        start = time.perf_counter()
        for _ in generate_greedy_batches(target, [filler] * rows, new_tokens, rows):
            pass
        target.synchronize()
        return time.perf_counter() - start

    prefill = timed(1)
    per_step = max(timed(1 + steps) - prefill, 0.0) / steps
    return batched_seconds(lengths, rows, config.max_new_tokens, prefill / (rows * width), per_step) / 60


def batched_seconds(lengths: list[int], rows: int, new_tokens: int, per_token: float, per_step: float) -> float:
    """Seconds to answer prompts of these lengths, ``rows`` generating at once (continuous batching): every prompt
    token read at ``per_token``, and ``new_tokens`` tokens per answer decoded ``rows`` at a time at ``per_step``."""
    steps = -(-len(lengths) * new_tokens // max(1, rows))
    return sum(lengths) * per_token + steps * per_step


def _excluded(request: BuildRequest) -> list[str]:
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
    opener = {SUFFIX_KIND: SuffixStore.open, MODEL_KIND: NgramTable.open, DENSE_KIND: DenseStore.open,
              HEAD_KIND: HeadStore.open}.get(
        header["kind"])
    if opener is None:
        raise DatastoreError(f"{directory} is a datastore of unknown kind {header['kind']!r}")
    store = opener(directory)
    described = store.info()
    if verify:
        described["verified"] = store.verify(header.get("vocab_size")) if header["kind"] == DENSE_KIND else (
            store.verify())
    return described


def build_model_store(target, prompts: Iterable[str], out_dir: str | Path, config: ModelStoreConfig,
                      overwrite: bool = False, prompt_source: str = "") -> dict:
    """Generate answers with ``target`` (resumably), count their n-grams and write the table; return the header.

    The build works in ``.NAME.partial/`` beside ``out_dir`` (an interrupted build resumes there) and is put in place
    at the end (:mod:`hierspec.datastore.output`). Rerunning on a finished store with the same prompts only
    recounts its n-grams: the old table stays readable until the new one replaces it. A finished store of the first
    of these prompts (same model and settings, a smaller ``limit`` before) is extended: its answers are kept and only
    the other prompts are answered.
    """
    prompts = list(prompts if config.limit is None else _take(prompts, config.limit))
    if not prompts:
        raise InputError("no prompts to generate from")
    params = _build_params(target, prompts, config)
    with claimed_output(out_dir) as out_dir:
        earlier = _answers_to_extend(out_dir, params, prompts)
        work = _work_dir(out_dir, params, overwrite, extending=earlier > 0)
        if earlier and not (work / GENERATIONS_FILE).is_file():
            write_file_atomic(work / GENERATIONS_FILE, lambda name: shutil.copyfile(out_dir / GENERATIONS_FILE, name))
            print(f"  {out_dir} holds answers to the first {earlier} of these prompts: they are kept and the other "
                  f"prompts answered", flush=True)
        start = time.perf_counter()
        done = load_generations(work / GENERATIONS_FILE)
        generate_missing(target, prompts, work / GENERATIONS_FILE, done, config)
        records = load_generations(work / GENERATIONS_FILE)
        docs = [np.asarray(r["context_tail"][-config.key_len :] + r["token_ids"], dtype=np.int64)
                for r in (records[i] for i in range(len(prompts)))]
        grams, counts = count_ngrams(docs, config.key_len + config.value_len)
        grams, counts = top_ngrams(grams, counts, config.top_k, config.key_len)
        generated = sum(len(r["token_ids"]) for r in records.values())
        seconds = sum(r.get("seconds", 0.0) for r in records.values())
        header = write_ngram_table(
            work, grams, counts, config.key_len, target.vocab_size, target.name, target.tokenizer_fingerprint,
            model=target.name, num_prompts=len(prompts), generated_tokens=generated,
            generation_seconds=round(seconds, 1), build_seconds=round(time.perf_counter() - start, 1),
            top_k=config.top_k, prompt_source=prompt_source, method=config.method,
            max_new_tokens=config.max_new_tokens,
        )
        put_in_place(work, out_dir, overwrite=overwrite or earlier > 0 or _same_build(out_dir, params))
    return header


def _answers_to_extend(out_dir: Path, params: dict, prompts: list[str]) -> int:
    """How many answers a finished store in ``out_dir`` holds that a build of ``prompts`` extends: one built with the
    same model and settings on fewer of the same prompts (its prompts are the first of ``prompts``); else 0."""
    previous = _finished_build(out_dir, params)
    count = 0 if previous is None else previous["num_prompts"]
    if not 0 < count < len(prompts):
        return 0
    return count if previous["prompts_sha256"] == _prompts_digest(prompts[:count]) else 0


def _finished_build(out_dir: Path, params: dict) -> dict | None:
    """The recorded parameters of a finished store in ``out_dir`` built with the model and settings of ``params``
    (what a build would record; its prompts aside); else ``None``."""
    previous = _recorded_build(out_dir)
    if previous is None or not (out_dir / "header.json").is_file() or not (out_dir / GENERATIONS_FILE).is_file():
        return None
    same = {**previous, "num_prompts": params["num_prompts"], "prompts_sha256": params["prompts_sha256"]} == params
    valid = isinstance(previous.get("num_prompts"), int) and isinstance(previous.get("prompts_sha256"), str)
    return previous if same and valid else None


def _work_dir(out_dir: Path, params: dict, overwrite: bool, extending: bool = False) -> Path:
    """Where this build writes: a copy of a finished store of the same prompts (a recount), an unfinished build
    left in ``out_dir`` by an older hierspec (adopted), or the resumable ``.NAME.partial`` (``extending``: the
    finished store in ``out_dir`` is one this build extends, to be replaced at the end)."""
    if _same_build(out_dir, params) and (out_dir / "header.json").is_file():
        work = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
        for name in (BUILD_FILE, GENERATIONS_FILE):
            shutil.copy2(out_dir / name, work / name)
        return work
    if _same_build(out_dir, params) and not (out_dir.parent / f".{out_dir.name}.partial").exists():
        os.rename(out_dir, out_dir.parent / f".{out_dir.name}.partial")
    elif out_dir.exists() and (out_dir / BUILD_FILE).is_file() and not (overwrite or extending):
        raise DatastoreError(f"{out_dir} holds a build of other prompts or settings; pass --overwrite to replace it")
    else:
        check_replaceable(out_dir, overwrite or extending)
    return resumable_work_dir(out_dir, params, restart=overwrite)


def _same_build(out_dir: Path, params: dict) -> bool:
    """True when ``out_dir`` holds the generations of a build with these parameters."""
    return _recorded_build(out_dir) == params


def _recorded_build(out_dir: Path) -> dict | None:
    """The parameters a build recorded in ``out_dir`` (``None``: none recorded), without ``prompt_source``: written by
    older hierspec, while the prompts' digest identifies them."""
    previous = read_build_params(out_dir)
    if previous is not None:
        previous.pop("prompt_source", None)
    return previous


def _take(items: Iterable[str], n: int) -> Iterator[str]:
    for i, item in enumerate(items):
        if i >= n:
            return
        yield item


def _build_params(target, prompts: list[str], config: ModelStoreConfig) -> dict:
    """What the generations depend on: a build with other parameters cannot resume or recount this one's."""
    return {"model": target.name, "tokenizer_fingerprint": target.tokenizer_fingerprint,
            "max_new_tokens": config.max_new_tokens, "num_prompts": len(prompts),
            "prompts_sha256": _prompts_digest(prompts)}


def _prompts_digest(prompts: list[str]) -> str:
    return hashlib.sha256("\x00".join(prompts).encode("utf-8")).hexdigest()




def generate_missing(target, prompts: list[str], path: Path, done: dict[int, dict], config: ModelStoreConfig) -> None:
    """Answer every prompt not in ``done``, appending one jsonl line (flushed) per answer — ``batch_size`` prompts
    per batched greedy generation, or one at a time with ``config.method`` when ``batch_size`` is 1."""
    todo = [i for i in range(len(prompts)) if i not in done]
    encoded: dict[int, list[int] | None] = {}
    for index in todo:
        try:
            encoded[index] = target.encode_prompt(prompts[index])
        except InputError as exc:
            log.info("prompt %d skipped: %s", index, exc)
            encoded[index] = None
    lengths = [len(ids) for ids in encoded.values() if ids is not None]
    if lengths and config.batch_size > 1:
        print(f"generating {len(lengths)} answers: estimated {estimate_minutes(target, lengths, config):.1f} minutes "
              f"on this machine", flush=True)
    bar = tqdm(total=len(prompts), initial=len(prompts) - len(todo), desc="generating", unit="prompt")
    tokens = sum(len(r["token_ids"]) for r in done.values())
    with open(path, "a", encoding="utf-8") as handle:
        for index, answer, seconds in _answers(target, encoded, config):
            ids = encoded[index]
            record = ({"index": index, "prompt": prompts[index], "context_tail": [], "token_ids": [],
                       "skipped": True} if ids is None else
                      {"index": index, "prompt": prompts[index], "text": target.decode(answer),
                       "context_tail": ids[-8:], "token_ids": answer, "seconds": round(seconds, 3)})
            handle.write(json.dumps(record) + "\n")
            handle.flush()
            done[index] = record
            tokens += len(record["token_ids"])
            bar.set_postfix(tokens=tokens, refresh=False)
            bar.update(1)
    bar.close()


def _answers(target, encoded: dict[int, list[int] | None], config: ModelStoreConfig):
    """``(index, answer ids, seconds)`` for every prompt to answer, skipped ones (``None``) with no answer."""
    for index in [i for i, ids in encoded.items() if ids is None]:
        yield index, [], 0.0
    todo = [i for i, ids in encoded.items() if ids is not None]
    if config.batch_size > 1:
        start = time.perf_counter()
        batch = generate_greedy_batches(target, [encoded[i] for i in todo], config.max_new_tokens, config.batch_size)
        for position, answer in batch:
            now = time.perf_counter()
            yield todo[position], answer, now - start  # the time since the last answer ended
            start = now
        return
    decoder = SpeculativeDecoder(target, make_drafter(config.method, DrafterContext(target)))
    generation = GenerationConfig(max_new_tokens=config.max_new_tokens)
    for index in todo:
        result = decoder.generate(encoded[index], generation)
        yield index, result.token_ids, result.stats.total_time

"""Building the model-dependent store: the target answers prompts, then its answers' n-grams are counted.

``build_model_store`` appends each generation to ``DIR/generations.jsonl`` as soon as it is done, so an interrupted
build resumes where it stopped (``build.json`` records the parameters; resuming with different ones is refused).
Once every prompt is answered, the n-gram table (:mod:`hierspec.datastore.ngram`) is written, header last.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from hierspec.datastore.corpus import iter_json_array
from hierspec.datastore.format import DatastoreError
from hierspec.datastore.output import (
    BUILD_FILE,
    build_lock,
    check_output_path,
    check_replaceable,
    put_in_place,
    remove_stale_temporaries,
    resumable_work_dir,
)
from hierspec.datastore.ngram import check_gram_shape, count_ngrams, top_ngrams, write_ngram_table
from hierspec.errors import InputError
from hierspec.jsonl import iter_jsonl

log = logging.getLogger(__name__)

GENERATIONS_FILE = "generations.jsonl"
_USER_ROLES = frozenset({"user", "human"})


@dataclass(frozen=True)
class ModelStoreConfig:
    """Model-store builder settings.

    Attributes:
        key_len: ``l``, tokens in a key.
        value_len: ``m``, tokens in a value.
        top_k: most frequent grams kept.
        max_new_tokens: longest generation per prompt.
        limit: most prompts used (``None``: all).
        method: decoding method used to generate (any lossless method: the text is the target's greedy output).
    """

    key_len: int = 1
    value_len: int = 4
    top_k: int = 100_000
    max_new_tokens: int = 256
    limit: int | None = None
    method: str = "pld"

    def __post_init__(self) -> None:
        check_gram_shape(self.key_len, self.value_len, self.top_k)
        if self.max_new_tokens < 1:
            raise InputError("max_new_tokens must be >= 1")
        if self.limit is not None and self.limit < 1:
            raise InputError("limit must be >= 1")


def first_user_turn(record) -> str | None:
    """The first user turn of a prompt record, or ``None``.

    Accepted shapes: ``{"prompt": str}``, ``{"instruction": str}``, ``{"text": str}``, Spec-Bench
    ``{"turns": [str, ...]}``, and chat ``{"messages" | "conversations": [{"role"|"from", "content"|"value"}]}``.
    """
    if not isinstance(record, dict):
        return None
    for key in ("prompt", "instruction", "text"):
        if isinstance(record.get(key), str) and record[key].strip():
            return record[key]
    turns = record.get("turns")
    if isinstance(turns, list) and turns and isinstance(turns[0], str) and turns[0].strip():
        return turns[0]
    for key in ("messages", "conversations"):
        for turn in record.get(key) or ():
            if isinstance(turn, dict) and turn.get("role", turn.get("from")) in _USER_ROLES:
                content = turn.get("content", turn.get("value"))
                return content if isinstance(content, str) and content.strip() else None
    return None


def iter_prompts(path: str | Path) -> Iterator[str]:
    """First user turns of a jsonl file (or a ShareGPT ``.json`` array) of prompt records."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"prompt file not found: {path}")
    records = iter_json_array(path) if path.suffix.lower() == ".json" else (r for _, r in iter_jsonl(path))
    for record in records:
        prompt = first_user_turn(record)
        if prompt is not None:
            yield prompt


def normalise(text: str) -> str:
    """Lower-case, whitespace-collapsed text, for recognising evaluation questions among prompts."""
    return re.sub(r"\s+", " ", text).strip().lower()


def select_prompts(
    prompts: Iterable[str], exclude: Iterable[str] = (), max_chars: int = 2000, english_only: bool = False
) -> Iterator[str]:
    """Prompts without duplicates or evaluation questions (``exclude``, compared after :func:`normalise`).

    ``english_only`` keeps prompts that are mostly ASCII letters (for multilingual chat dumps such as ShareGPT).
    """
    excluded = {normalise(t) for t in exclude}
    seen: set[str] = set()
    for prompt in prompts:
        key = normalise(prompt)
        if not key or len(prompt) > max_chars or key in seen or key in excluded:
            continue
        if any(q and (q in key or key in q) for q in excluded if len(q) > 40 and len(key) > 40):
            continue
        if english_only and not _mostly_ascii(prompt):
            continue
        seen.add(key)
        yield prompt


def _mostly_ascii(text: str) -> bool:
    letters = [c for c in text if c.isalpha()]
    return bool(letters) and sum(c.isascii() for c in letters) >= 0.95 * len(letters)


def build_model_store(target, prompts: Iterable[str], out_dir: str | Path, config: ModelStoreConfig,
                      overwrite: bool = False, prompt_source: str = "") -> dict:
    """Generate answers with ``target`` (resumably), count their n-grams and write the table; return the header.

    The build works in ``.NAME.partial/`` beside ``out_dir`` (an interrupted build resumes there) and is put in place
    at the end (:mod:`hierspec.datastore.output`). Rerunning on a finished store with the same prompts only
    recounts its n-grams: the old table stays readable until the new one replaces it.
    """
    out_dir = check_output_path(Path(out_dir))
    prompts = list(prompts if config.limit is None else _take(prompts, config.limit))
    if not prompts:
        raise InputError("no prompts to generate from")
    params = _build_params(target, prompts, config)
    with build_lock(out_dir):
        remove_stale_temporaries(out_dir)
        work = _work_dir(out_dir, params, overwrite)
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
        put_in_place(work, out_dir, overwrite=True if _same_build(out_dir, params) else overwrite)
    return header


def _work_dir(out_dir: Path, params: dict, overwrite: bool) -> Path:
    """Where this build writes: a copy of a finished store of the same prompts (a recount), an unfinished build
    left in ``out_dir`` by an older hierspec (adopted), or the resumable ``.NAME.partial``."""
    if _same_build(out_dir, params) and (out_dir / "header.json").is_file():
        work = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
        for name in (BUILD_FILE, GENERATIONS_FILE):
            shutil.copy2(out_dir / name, work / name)
        return work
    if _same_build(out_dir, params) and not (out_dir.parent / f".{out_dir.name}.partial").exists():
        os.rename(out_dir, out_dir.parent / f".{out_dir.name}.partial")
    elif out_dir.exists() and (out_dir / BUILD_FILE).is_file() and not overwrite:
        raise DatastoreError(f"{out_dir} holds a build of other prompts or settings; pass --overwrite to replace it")
    else:
        check_replaceable(out_dir, overwrite)
    return resumable_work_dir(out_dir, params, restart=overwrite)


def _same_build(out_dir: Path, params: dict) -> bool:
    """True when ``out_dir`` holds the generations of a build with these parameters."""
    try:
        previous = json.loads((out_dir / BUILD_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    previous.pop("prompt_source", None)  # written by older hierspec; the prompts' digest identifies them
    return previous == params


def _take(items: Iterable[str], n: int) -> Iterator[str]:
    for i, item in enumerate(items):
        if i >= n:
            return
        yield item


def _build_params(target, prompts: list[str], config: ModelStoreConfig) -> dict:
    """What the generations depend on: a build with other parameters cannot resume or recount this one's."""
    digest = hashlib.sha256("\x00".join(prompts).encode("utf-8")).hexdigest()
    return {"model": target.name, "tokenizer_fingerprint": target.tokenizer_fingerprint,
            "max_new_tokens": config.max_new_tokens, "num_prompts": len(prompts), "prompts_sha256": digest}


def load_generations(path: Path) -> dict[int, dict]:
    """Finished generations by prompt index; a torn last line (interrupted write) is dropped and truncated away."""
    records: dict[int, dict] = {}
    if not path.is_file():
        return records
    good_bytes = 0
    with open(path, "rb") as handle:
        for line in handle:
            try:
                record = json.loads(line)
                records[int(record["index"])] = record
            except (json.JSONDecodeError, KeyError, TypeError, ValueError, UnicodeDecodeError):
                if not line.endswith(b"\n"):
                    break
                raise DatastoreError(f"{path} has a corrupt line; remove the file to regenerate") from None
            good_bytes += len(line)
    if good_bytes < path.stat().st_size:
        with open(path, "r+b") as handle:
            handle.truncate(good_bytes)
    return records


def generate_missing(target, prompts: list[str], path: Path, done: dict[int, dict], config: ModelStoreConfig) -> None:
    """Answer every prompt not in ``done``, appending one jsonl line (flushed) per answer."""
    from hierspec.config import GenerationConfig
    from hierspec.decode import SpeculativeDecoder
    from hierspec.methods import DrafterContext, make_drafter

    todo = [i for i in range(len(prompts)) if i not in done]
    decoder = SpeculativeDecoder(target, make_drafter(config.method, DrafterContext(target)))
    generation = GenerationConfig(max_new_tokens=config.max_new_tokens)
    bar = tqdm(total=len(prompts), initial=len(prompts) - len(todo), desc="generating", unit="prompt")
    tokens = sum(len(r["token_ids"]) for r in done.values())
    with open(path, "a", encoding="utf-8") as handle:
        for index in todo:
            try:
                ids = target.encode_prompt(prompts[index])
            except InputError as exc:
                log.info("prompt %d skipped: %s", index, exc)
                ids = None
            if ids is None:
                record = {"index": index, "prompt": prompts[index], "context_tail": [], "token_ids": [],
                          "skipped": True}
            else:
                result = decoder.generate(ids, generation)
                record = {"index": index, "prompt": prompts[index], "text": result.text, "context_tail": ids[-8:],
                          "token_ids": result.token_ids, "seconds": round(result.stats.total_time, 3),
                          "mat": round(result.stats.mean_accepted, 3)}
            handle.write(json.dumps(record) + "\n")
            handle.flush()
            done[index] = record
            tokens += len(record["token_ids"])
            bar.set_postfix(tokens=tokens, refresh=False)
            bar.update(1)
    bar.close()

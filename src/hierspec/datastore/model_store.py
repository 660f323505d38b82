"""The model-dependent store's inputs and records: prompt files, the builder's settings, its generations file.

The build itself — the target answering the prompts, a batch at a time — runs the model, so it lives above this
package, in :func:`hierspec.store_builds.build_model_store`. Each generation is appended to ``generations.jsonl`` as
soon as it is done (:func:`load_generations` reads them back and drops a torn last line), so an interrupted build
resumes where it stopped; once every prompt is answered, the n-gram table (:mod:`hierspec.datastore.ngram`) is
written, header last.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from hierspec.datastore.corpus import iter_json_array
from hierspec.datastore.format import DatastoreError
from hierspec.datastore.ngram import check_gram_shape
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
        method: decoding method used to generate one prompt at a time (any lossless method: the text is the
            target's greedy output); used when ``batch_size`` is 1.
        batch_size: prompts generating at once by continuous batching (:mod:`hierspec.batch_generate`).
    """

    key_len: int = 1
    value_len: int = 4
    top_k: int = 100_000
    max_new_tokens: int = 256
    limit: int | None = None
    method: str = "pld"
    batch_size: int = 16

    def __post_init__(self) -> None:
        check_gram_shape(self.key_len, self.value_len, self.top_k)
        if self.max_new_tokens < 1:
            raise InputError("max_new_tokens must be >= 1")
        if self.limit is not None and self.limit < 1:
            raise InputError("limit must be >= 1")
        if self.batch_size < 1:
            raise InputError("batch_size must be >= 1")


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

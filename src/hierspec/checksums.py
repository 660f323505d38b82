"""Checksums of the files hierspec caches (converted GGUF weights, their int4 blocks), so that a damaged cache is
found and rebuilt instead of silently producing wrong output.

A directory's ``checksums.json`` (magic, version) records each file's size, modification time and SHA-256. A check
compares sizes, and hashes a file again only when its modification time changed since it was recorded: a normal
load costs a few ``stat`` calls, while any write to a cached file (a truncation, bytes written into it) is caught.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Iterable
from pathlib import Path

from hierspec.storage import write_json_atomic

MANIFEST = "checksums.json"
MAGIC = "hierspec-checksums"
VERSION = 1
_CHUNK = 1 << 22


def file_sha256(path: Path) -> str:
    """SHA-256 of a file, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


#: a directory's memo of the SHA-256 of files hierspec reads but does not own (GGUF model files)
SOURCES = "sources.json"


def remembered_sha256(path: Path, memo_dir: Path) -> str:
    """SHA-256 of ``path``, a file hierspec reads but does not own (a GGUF model file names its converted weights'
    directory by it), remembered in ``memo_dir``'s :data:`SOURCES` (a manifest keyed by the file's absolute path)
    by its size and modification time: hashed again only when one of those changed, so a load costs a ``stat``
    instead of reading the whole file (a 1 GB GGUF file took ~0.8 s) — the trust :func:`damage` gives the files it
    checks. A memo that cannot be read or written costs the hash, nothing else."""
    path = Path(path).resolve()
    stat = path.stat()
    memo = _read_manifest(memo_dir, SOURCES) or {}
    known = memo.get(str(path))
    if known is not None and known["size"] == stat.st_size and known["mtime_ns"] == stat.st_mtime_ns:
        return known["sha256"]
    memo[str(path)] = entry = _entry(path)
    with contextlib.suppress(OSError):
        memo_dir.mkdir(parents=True, exist_ok=True)
        _write_manifest(memo_dir, memo, SOURCES)
    return entry["sha256"]


def record(directory: str | Path, names: Iterable[str]) -> None:
    """Add (or refresh) the checksums of ``names`` in ``directory``'s manifest, written atomically."""
    directory = Path(directory)
    files = _read_manifest(directory) or {}
    for name in names:
        files[name] = _entry(directory / name)
    _write_manifest(directory, files)


def recorded_sha256(directory: str | Path, name: str) -> str | None:
    """The SHA-256 ``directory``'s manifest records for ``name`` (what was written; check it with :func:`damage`),
    or ``None``."""
    entry = (_read_manifest(Path(directory)) or {}).get(name)
    return entry["sha256"] if entry is not None else None


def damage(directory: str | Path, names: Iterable[str] | None = None, skip: tuple[str, ...] = ()) -> str | None:
    """``None`` when every recorded file (or each of ``names``, which must be recorded) matches its checksum;
    otherwise what is wrong, in a few words. Recorded files whose names start with one of ``skip`` are left out
    (caches that their own loaders check and rebuild)."""
    directory = Path(directory)
    files = _read_manifest(directory)
    if files is None:
        return f"no readable {MANIFEST} (written by an older hierspec, or damaged)"
    refreshed = False
    for name in sorted(n for n in files if not n.startswith(skip)) if names is None else names:
        expected = files.get(name)
        if expected is None:
            return f"{name} has no recorded checksum"
        path = directory / name
        try:
            stat = path.stat()
        except OSError:
            return f"{name} is missing"
        if stat.st_size != expected["size"]:
            return f"{name} has {stat.st_size} bytes, {expected['size']} were written"
        if stat.st_mtime_ns != expected["mtime_ns"]:
            if file_sha256(path) != expected["sha256"]:
                return f"{name} does not match its SHA-256"
            files[name] = {**expected, "mtime_ns": stat.st_mtime_ns}
            refreshed = True
    if refreshed:  # the next check need not hash again; a cache that cannot be written is still valid
        with contextlib.suppress(OSError):
            _write_manifest(directory, files)
    return None


def _entry(path: Path) -> dict:
    stat = path.stat()
    return {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "sha256": file_sha256(path)}


def _read_manifest(directory: Path, name: str = MANIFEST) -> dict | None:
    try:
        data = json.loads((directory / name).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("magic") != MAGIC or data.get("version") != VERSION:
        return None
    files = data.get("files")
    valid = isinstance(files, dict) and all(
        isinstance(e, dict) and isinstance(e.get("size"), int) and isinstance(e.get("mtime_ns"), int)
        and isinstance(e.get("sha256"), str) for e in files.values())
    return files if valid else None


def _write_manifest(directory: Path, files: dict, name: str = MANIFEST) -> None:
    write_json_atomic(directory / name, {"magic": MAGIC, "version": VERSION, "files": files}, indent=1,
                      sort_keys=True)

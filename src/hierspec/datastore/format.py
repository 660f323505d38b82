"""On-disk datastore format shared by every store kind.

A datastore is a directory holding ``header.json`` and raw little-endian array files. The header carries a magic
string, the format version, the store kind, the tokenizer's name and fingerprint, creation time and, for every
array file, its dtype and shape, so that a truncated or foreign file is refused before it is memory-mapped.
Directories are written under a temporary name beside the target and renamed into place at the end: an interrupted
build never leaves a directory that loads.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from hierspec.errors import HierspecError

MAGIC = "hierspec-datastore"
FORMAT_VERSION = 1
HEADER_FILE = "header.json"


class DatastoreError(HierspecError):
    """A datastore is missing, corrupt, of a newer format, or built for another tokenizer or model."""


def default_store_dir(fingerprint: str, base: str | Path | None = None) -> Path:
    """Where ``hierspec datastore build --preset default`` puts the stores of a tokenizer, and where methods look
    for them when none is given: ``<base>/<fingerprint[:16]>/{suffix,model}`` with base
    ``~/.cache/hierspec/datastores`` by default."""
    from hierspec.loading import user_cache_dir

    root = Path(base) if base is not None else user_cache_dir() / "datastores"
    return root / fingerprint[:16]


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every token id and the separator (the dtype's largest value) fit, else uint32."""
    return np.dtype(np.uint16) if vocab_size < np.iinfo(np.uint16).max else np.dtype(np.uint32)


def separator_id(dtype: np.dtype) -> int:
    """The document separator: the largest value of the token dtype, never a real token id."""
    return int(np.iinfo(dtype).max)


def new_header(kind: str, tokenizer_name: str, fingerprint: str, **fields) -> dict:
    """A header dict with the common fields filled in."""
    return {
        "magic": MAGIC,
        "format_version": FORMAT_VERSION,
        "kind": kind,
        "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "tokenizer": {"name": tokenizer_name, "fingerprint": fingerprint},
        **fields,
    }


@contextlib.contextmanager
def atomic_directory(out_dir: str | Path, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary directory that becomes ``out_dir`` only if the block finishes without error."""
    out_dir = Path(out_dir)
    if out_dir.exists() and not overwrite:
        raise DatastoreError(f"{out_dir} already exists; remove it or pass --overwrite")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        yield tmp
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def write_array(directory: Path, name: str, array: np.ndarray) -> dict:
    """Write an array as raw bytes; return its header entry (file, dtype, shape)."""
    array = np.ascontiguousarray(array)
    with open(directory / name, "wb") as handle:
        array.tofile(handle)
        handle.flush()
        os.fsync(handle.fileno())
    return {"file": name, "dtype": array.dtype.str, "shape": list(array.shape)}


def write_header(directory: Path, header: dict) -> None:
    """Write ``header.json`` (last, so that a directory without it is recognisably incomplete)."""
    (directory / HEADER_FILE).write_text(json.dumps(header, indent=2) + "\n", encoding="utf-8")


def read_header(directory: str | Path, kind: str | None = None) -> dict:
    """Read and validate a datastore header: magic, version and (optionally) kind."""
    directory = Path(directory)
    path = directory / HEADER_FILE
    if not directory.is_dir():
        raise DatastoreError(f"datastore not found: {directory}")
    if not path.is_file():
        raise DatastoreError(f"{directory} is not a hierspec datastore (no {HEADER_FILE}; an unfinished build?)")
    try:
        header = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise DatastoreError(f"{path} is corrupt: {exc}") from exc
    if not isinstance(header, dict) or header.get("magic") != MAGIC:
        raise DatastoreError(f"{directory} is not a hierspec datastore (wrong magic)")
    version = header.get("format_version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise DatastoreError(
            f"{directory} has format version {version}; this hierspec reads up to {FORMAT_VERSION}: upgrade hierspec"
        )
    if kind is not None and header.get("kind") != kind:
        raise DatastoreError(f"{directory} is a {header.get('kind')!r} datastore, not {kind!r}")
    return header


def open_array(directory: Path, entry: dict) -> np.ndarray:
    """Memory-map an array file described by a header entry, refusing files of the wrong size."""
    path = directory / entry["file"]
    dtype = np.dtype(entry["dtype"])
    shape = tuple(entry["shape"])
    expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if not path.is_file():
        raise DatastoreError(f"{path} is missing")
    actual = path.stat().st_size
    if actual != expected:
        raise DatastoreError(f"{path} has {actual} bytes but the header says {expected}: the file is truncated or "
                             "corrupt; rebuild the datastore")
    if expected == 0:
        return np.zeros(shape, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r", shape=shape)


def check_tokenizer(header: dict, directory: Path, fingerprint: str, tokenizer_name: str) -> None:
    """Refuse a store built with a different tokenizer, naming the one that built it."""
    built = header.get("tokenizer", {})
    if built.get("fingerprint") != fingerprint:
        raise DatastoreError(
            f"{directory} was built with tokenizer {built.get('name')!r} (fingerprint {built.get('fingerprint')}), "
            f"but the model uses {tokenizer_name!r} (fingerprint {fingerprint}); rebuild the datastore with this model"
        )

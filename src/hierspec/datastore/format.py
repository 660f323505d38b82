"""On-disk datastore format shared by every store kind.

A datastore is a directory holding ``header.json`` and raw little-endian array files. The header carries a magic
string, the format version, the store kind, the tokenizer's name and fingerprint, creation time and, for every
array file, its dtype and shape, so that a truncated or foreign file is refused before it is memory-mapped.
Directories are written under a temporary name beside the target and put in place at the end
(:mod:`hierspec.datastore.output`): an interrupted build never leaves a directory that loads.
"""

from __future__ import annotations

import datetime as dt
import json
import os
from pathlib import Path

import numpy as np

from hierspec.errors import HierspecError
from hierspec.storage import write_json_atomic

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


def write_array(directory: Path, name: str, array: np.ndarray) -> dict:
    """Write an array as raw bytes; return its header entry (file, dtype, shape)."""
    array = np.ascontiguousarray(array)
    path = directory / name
    try:
        with open(path, "wb") as handle:
            # not ndarray.tofile: on a full disk it raises an OSError without errno ("N requested and M written")
            handle.write(memoryview(array.reshape(-1)).cast("B"))
            handle.flush()
            os.fsync(handle.fileno())
    except OSError as exc:
        if exc.filename is None:
            exc.filename = str(path)  # the one line the user sees names the file
        raise
    return {"file": name, "dtype": array.dtype.str, "shape": list(array.shape)}


def write_header(directory: Path, header: dict) -> None:
    """Write ``header.json`` (last, so that a directory without it is recognisably incomplete)."""
    write_json_atomic(directory / HEADER_FILE, header)


def read_header(directory: str | Path, kind: str | None = None) -> dict:
    """Read and validate a datastore header: magic, version, kind and tokenizer fields (and optionally the kind)."""
    directory = Path(directory)
    path = directory / HEADER_FILE
    if not directory.is_dir():
        raise DatastoreError(f"datastore not found: {directory}")
    if not path.is_file():
        raise DatastoreError(f"{directory} is not a hierspec datastore (no {HEADER_FILE}; an unfinished build?)")
    try:
        header = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise DatastoreError(f"{path} is corrupt: {exc}") from exc
    if not isinstance(header, dict) or header.get("magic") != MAGIC:
        raise DatastoreError(f"{directory} is not a hierspec datastore (wrong magic)")
    version = header.get("format_version")
    if type(version) is not int or version < 1:
        raise DatastoreError(f"{directory}: format_version {version!r} is not a format version; the header is corrupt")
    if version > FORMAT_VERSION:
        raise DatastoreError(
            f"{directory} has format version {version}; this hierspec reads up to {FORMAT_VERSION}: upgrade hierspec"
        )
    tokenizer = header.get("tokenizer")
    if not isinstance(header.get("kind"), str) or not isinstance(tokenizer, dict) or not isinstance(
            tokenizer.get("fingerprint"), str):
        raise DatastoreError(f"{path} lacks a valid kind or tokenizer fingerprint; the header is corrupt")
    if kind is not None and header["kind"] != kind:
        raise DatastoreError(f"{directory} is a {header['kind']!r} datastore, not {kind!r}")
    return header


def header_int(header: dict, key: str, directory: Path, minimum: int = 0) -> int:
    """An integer header field of at least ``minimum``, or a clear error."""
    value = header.get(key)
    if type(value) is not int or value < minimum:
        raise DatastoreError(f"{directory}/{HEADER_FILE}: {key} must be an integer >= {minimum}, not {value!r}; "
                             "the header is corrupt")
    return value


def header_dict(header: dict, key: str, directory: Path) -> dict:
    """A dict-valued header field, or a clear error."""
    value = header.get(key)
    if not isinstance(value, dict):
        raise DatastoreError(f"{directory}/{HEADER_FILE}: {key} must be an object, not {value!r}; the header is "
                             "corrupt")
    return value


def open_array(directory: Path, entry, dtypes: tuple[str, ...] | None = None, ndim: int | None = None) -> np.ndarray:
    """Memory-map an array file described by a header entry ``{"file", "dtype", "shape"}``.

    Refuses an entry that is malformed, a file name that is not a plain name inside ``directory``, a dtype outside
    ``dtypes`` (e.g. ``("<u2", "<u4")``), a shape of another rank than ``ndim`` and a file of the wrong size.
    """
    where = f"{directory}/{HEADER_FILE}"
    if not isinstance(entry, dict):
        raise DatastoreError(f"{where}: an array entry is {entry!r}, not an object; the header is corrupt")
    name, dtype_text, shape = entry.get("file"), entry.get("dtype"), entry.get("shape")
    if not isinstance(name, str) or not name or name in {".", ".."} or "/" in name or "\\" in name or "\x00" in name:
        raise DatastoreError(f"{where}: array file {name!r} is not a plain file name inside the store")
    if not isinstance(dtype_text, str) or (dtypes is not None and dtype_text not in dtypes):
        raise DatastoreError(f"{where}: {name} has dtype {dtype_text!r}; expected one of {dtypes}")
    try:
        dtype = np.dtype(dtype_text)
    except TypeError as exc:
        raise DatastoreError(f"{where}: {name} has an unknown dtype {dtype_text!r}") from exc
    if not isinstance(shape, list) or any(type(d) is not int or d < 0 for d in shape) or (
            ndim is not None and len(shape) != ndim):
        raise DatastoreError(f"{where}: {name} has shape {shape!r}, not a list of {ndim or 'some'} sizes")
    path = directory / name
    expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if not path.is_file():
        raise DatastoreError(f"{path} is missing")
    actual = path.stat().st_size
    if actual != expected:
        raise DatastoreError(f"{path} has {actual} bytes but the header says {expected}: the file is truncated or "
                             "corrupt; rebuild the datastore")
    if expected == 0:
        return np.zeros(shape, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r", shape=tuple(shape))


def check_tokenizer(header: dict, directory: Path, fingerprint: str, tokenizer_name: str) -> None:
    """Refuse a store built with a different tokenizer, naming the one that built it."""
    built = header.get("tokenizer", {})
    if built.get("fingerprint") != fingerprint:
        raise DatastoreError(
            f"{directory} was built with tokenizer {built.get('name')!r} (fingerprint {built.get('fingerprint')}), "
            f"but the model uses {tokenizer_name!r} (fingerprint {fingerprint}); rebuild the datastore with this model"
        )

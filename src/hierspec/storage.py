"""Storage faults (a full, read-only or foreign disk) told as what they are and what to do about them.

Every place hierspec writes (stores, learning, caches, calibration curves) lets these errors reach the user as one
line, or turns the feature that needs the disk off; :func:`storage_problem` words them the same everywhere.
"""

from __future__ import annotations

import errno
import json
import os
import re
import tempfile
from collections.abc import Callable
from pathlib import Path

#: errno values that mean "this disk will not take the write", with what the user can do
_ADVICE = {
    errno.ENOSPC: "no space left on the device; free some space or choose another directory",
    errno.EDQUOT: "disk quota exceeded; free some space or choose another directory",
    errno.EROFS: "the file system is read-only; choose a writable directory",
    errno.EACCES: "permission denied; choose a directory you can write to",
    errno.EPERM: "operation not permitted; choose a directory you can write to",
    errno.EFBIG: "the file grew past the size this system allows (ulimit -f or the file system's limit); raise the "
                 "limit or choose another directory",
}


def is_storage_error(exc: BaseException) -> bool:
    """Whether ``exc`` is a disk refusing a write (full, over quota, read-only, not permitted, size limit)."""
    return isinstance(exc, OSError) and exc.errno in _ADVICE


def storage_problem(exc: OSError) -> str:
    """One line naming the path and the cause of a failed write, and what to do."""
    advice = _ADVICE.get(exc.errno) or (exc.strerror or str(exc) or type(exc).__name__)
    return f"{advice} ({exc.filename})" if exc.filename else advice


def unwritable_reason(directory: str | Path) -> str | None:
    """``None`` when a file can be created in ``directory`` (tried, not guessed: ``os.access`` ignores
    read-only mounts for root), else the :func:`storage_problem` line."""
    try:
        handle, path = tempfile.mkstemp(prefix=".hierspec-probe-", dir=directory)
    except OSError as exc:
        exc.filename = str(directory)  # the directory, not the probe's random name
        return storage_problem(exc)
    os.close(handle)
    os.unlink(path)
    return None


def write_json_first(path: Path, data) -> bool:
    """Write JSON to ``path`` atomically unless a file is already there (kept as it is): whether this call wrote it.
    The file appears whole or not at all (a temporary file hard-linked into place), so of two processes writing at
    once exactly one wins and both can read its contents; where the file system has no hard links, a file found
    there is kept and the last of two simultaneous writers wins."""
    tmp = _json_beside(path, data)
    try:
        try:
            os.link(tmp, path)
        except FileExistsError:
            return False
        except OSError as exc:
            if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK):
                raise
            if path.exists():
                return False
            os.replace(tmp, path)
        return True
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def as_os_error(exc: Exception, path: str | Path) -> OSError | None:
    """``exc`` as an ``OSError`` naming ``path`` when it reports one: safetensors (Rust) raises its own error type
    with the system's ``(os error N)`` in the message, which would otherwise escape as a traceback."""
    if isinstance(exc, OSError):
        return exc
    found = re.search(r"os error (\d+)", str(exc))
    if found is None:
        return None
    code = int(found.group(1))
    return OSError(code, os.strerror(code), str(path))


#: permissions of a file written through a temporary one (``mkstemp`` makes it ``0600``; a plain ``open`` under the
#: usual umask gives ``0644``, and a cache shared by several users must stay readable to them)
FILE_MODE = 0o644


def write_json_atomic(path: Path, data, indent: int = 2, sort_keys: bool = False) -> None:
    """Write JSON through a temporary file renamed into place; a failed write leaves neither a partial file nor
    the temporary one."""
    write_bytes_atomic(path, _json_bytes(data, indent, sort_keys))


def write_bytes_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` through a temporary file renamed into place (:data:`FILE_MODE`, flushed to the disk first); a
    failed write leaves neither a partial file nor the temporary one."""
    _replace_with(_bytes_beside(path, data), path)


def write_file_atomic(path: Path, write: Callable[[str], None]) -> None:
    """``write(name)`` fills a new temporary file beside ``path`` (a writer that takes a file name, such as
    safetensors' ``save_file``), which is then renamed into place (:data:`FILE_MODE`); a failed write leaves neither
    a partial file nor the temporary one."""
    _replace_with(_temporary_beside(path, write), path)


def _json_bytes(data, indent: int = 2, sort_keys: bool = False) -> bytes:
    """``data`` as the JSON text hierspec's files hold: indented, one newline at the end."""
    return (json.dumps(data, indent=indent, sort_keys=sort_keys) + "\n").encode("utf-8")


def _json_beside(path: Path, data) -> str:
    """``data`` as JSON in a new temporary file beside ``path`` (:func:`_bytes_beside`)."""
    return _bytes_beside(path, _json_bytes(data))


def _bytes_beside(path: Path, data: bytes) -> str:
    """``data`` in a new temporary file beside ``path``, flushed to the disk: its name (:func:`_temporary_beside`)."""

    def write(name: str) -> None:
        with open(name, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())

    return _temporary_beside(path, write)


def _temporary_beside(path: Path, write: Callable[[str], None]) -> str:
    """A new temporary file beside ``path`` filled by ``write(name)`` and given :data:`FILE_MODE`: its name (removed
    again when the write fails)."""
    handle, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(handle)
    try:
        write(tmp)
        os.chmod(tmp, FILE_MODE)
    except BaseException:
        os.unlink(tmp)
        raise
    return tmp


def _replace_with(tmp: str, path: Path) -> None:
    """Rename the temporary file ``tmp`` to ``path``; the temporary file is gone either way."""
    try:
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
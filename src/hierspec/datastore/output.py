"""Where a datastore build writes, and the rules that keep it from destroying anything it should not.

* One build per output directory at a time: a lock file ``.NAME.lock`` beside ``--out`` is held for the whole build;
  a second build into the same directory is refused at once.
* A build works in ``.NAME.tmp-*`` beside the output and puts it in place only at the end. Temporary directories left
  by builds that died are removed by the next build into the same place (it holds the lock, so no live build owns
  them).
* An existing ``--out`` is replaced only when it is an empty directory, or with ``--overwrite`` when it is a hierspec
  datastore (its header says so) or an unfinished hierspec build — never another directory, never ``/``, the home
  directory, the working directory or one of its parents. The check is made again at the very end, so a directory that appeared during the build is
  not replaced unless overwriting was asked for.
* The replacement is one atomic exchange of the two directories where the system offers it (Linux
  ``renameat2(RENAME_EXCHANGE)``), so a build killed at any moment leaves either the old store or the new one at
  ``--out``; elsewhere the old store is first renamed aside.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import fcntl
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from hierspec.datastore.format import HEADER_FILE, DatastoreError, read_header
from hierspec.storage import write_json_atomic  # noqa: F401 - re-exported: callers import it from here

log = logging.getLogger(__name__)

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def check_output_path(out_dir: Path) -> Path:
    """The absolute output path, refusing places no build may write: the root, the home directory, the working
    directory and its parents."""
    resolved = Path(os.path.abspath(out_dir))
    forbidden = {Path(resolved.anchor), Path.home().resolve()}
    cwd = Path.cwd().resolve()
    if resolved.resolve() in forbidden or cwd == resolved.resolve() or resolved.resolve() in cwd.parents:
        raise DatastoreError(f"refusing to build a datastore at {out_dir}: it is the working directory, one of its "
                             "parents, the home directory or the root; pass a new directory to --out")
    return resolved


#: the parameters of a resumable build, written first into its directory
BUILD_FILE = "build.json"
#: files an unfinished hierspec build leaves in its directory (older hierspec built model stores in place)
_BUILD_FILES = frozenset({BUILD_FILE, "generations.jsonl", "progress.json", "ngrams.tokens", "ngrams.counts"})


def replaceable(out_dir: Path) -> bool:
    """True when ``out_dir`` may be replaced with ``--overwrite``: an empty directory, a hierspec datastore, or the
    directory of an unfinished hierspec build."""
    if not out_dir.is_dir() or out_dir.is_symlink():
        return False
    names = {p.name for p in out_dir.iterdir()}
    if not names or (BUILD_FILE in names and names <= _BUILD_FILES):
        return True
    try:
        read_header(out_dir)
    except DatastoreError:
        return False
    return True


def check_replaceable(out_dir: Path, overwrite: bool) -> None:
    """Refuse an existing ``out_dir`` unless it is an empty directory, or overwriting was asked for and it is
    replaceable."""
    if not out_dir.exists() and not out_dir.is_symlink():
        return
    if out_dir.is_dir() and not out_dir.is_symlink() and not any(out_dir.iterdir()):
        return
    if not overwrite:
        raise DatastoreError(f"{out_dir} already exists; remove it or pass --overwrite")
    if not replaceable(out_dir):
        raise DatastoreError(f"{out_dir} exists and is not a hierspec datastore (no valid {HEADER_FILE}); "
                             "--overwrite only replaces datastores: remove it yourself or pick another --out")


@contextlib.contextmanager
def build_lock(out_dir: Path) -> Iterator[None]:
    """Hold ``.NAME.lock`` beside ``out_dir`` for the block; refuse at once when another build holds it."""
    lock_path = out_dir.parent / f".{out_dir.name}.lock"
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    while True:
        handle = open(lock_path, "a+")  # noqa: SIM115 — closed in the finally below
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            raise DatastoreError(f"another build is writing {out_dir} (it holds {lock_path}); wait for it to "
                                 "finish") from None
        # the holder before us may have removed the file after we opened it: lock the file that is there now
        if os.path.exists(lock_path) and os.stat(lock_path).st_ino == os.fstat(handle.fileno()).st_ino:
            break
        handle.close()
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            os.unlink(lock_path)
        handle.close()


def remove_stale_temporaries(out_dir: Path) -> list[Path]:
    """Remove ``.NAME.tmp-*`` directories of dead builds beside ``out_dir`` (call while holding its lock)."""
    removed = []
    for path in out_dir.parent.glob(f".{out_dir.name}.tmp-*"):
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
            log.warning("removed %s, left by a build that did not finish", path)
    return removed


def exchange_directories(a: Path, b: Path) -> bool:
    """Atomically swap two paths with Linux ``renameat2(RENAME_EXCHANGE)``; False where it is unavailable."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError, TypeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), str(a))


def put_in_place(work: Path, out_dir: Path, overwrite: bool) -> None:
    """Move the finished ``work`` directory to ``out_dir``, replacing a datastore there only when asked to."""
    check_replaceable(out_dir, overwrite)
    if out_dir.exists():
        if exchange_directories(work, out_dir):
            shutil.rmtree(work, ignore_errors=True)  # now holds the old store
            return
        aside = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
        os.replace(out_dir, aside / "store")
        os.replace(work, out_dir)
        shutil.rmtree(aside, ignore_errors=True)
        return
    os.rename(work, out_dir)


@contextlib.contextmanager
def claimed_output(out_dir: str | Path) -> Iterator[Path]:
    """Check ``out_dir`` (:func:`check_output_path`), hold its lock for the block and remove temporaries of dead
    builds beside it; yield its absolute path. Every build starts here."""
    out_dir = check_output_path(Path(out_dir))
    with build_lock(out_dir):
        remove_stale_temporaries(out_dir)
        yield out_dir


@contextlib.contextmanager
def build_output(out_dir: str | Path, overwrite: bool = False) -> Iterator[Path]:
    """Yield a fresh temporary directory beside ``out_dir`` that becomes ``out_dir`` when the block succeeds.

    The whole build holds ``out_dir``'s lock; stale temporaries are removed first; ``out_dir`` is checked before the
    build starts and again when it is put in place.
    """
    with claimed_output(out_dir) as out_dir:
        check_replaceable(out_dir, overwrite)
        work = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
        try:
            yield work
            put_in_place(work, out_dir, overwrite)
        finally:
            if work.exists():
                shutil.rmtree(work, ignore_errors=True)


def read_build_params(directory: Path) -> dict | None:
    """The parameters a resumable build wrote into ``directory`` (``None`` when there are none or they are unreadable)."""
    try:
        params = json.loads((directory / BUILD_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return params if isinstance(params, dict) else None


def resumable_work_dir(out_dir: Path, params: dict, restart: bool = False) -> Path:
    """The ``.NAME.partial`` directory beside ``out_dir`` where a resumable build keeps its progress.

    A new one is created with ``build.json`` holding ``params``; an existing one with the same ``params`` is resumed;
    one with other ``params`` is refused unless ``restart`` (``--overwrite``) asks to start over. Call while holding
    ``out_dir``'s lock.
    """
    work = out_dir.parent / f".{out_dir.name}.partial"
    if work.exists():
        if read_build_params(work) == params:
            log.info("resuming the build in %s", work)
            return work
        if not restart:
            raise DatastoreError(f"{work} holds an unfinished build with other inputs or settings; resume it with "
                                 "the same command, or pass --overwrite to start over")
        shutil.rmtree(work)
    work.mkdir(parents=True)
    write_json_atomic(work / BUILD_FILE, params)
    return work

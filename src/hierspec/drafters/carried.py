"""What a method's drafters learned, carried from one generation to the next.

The Python API's :func:`~hierspec.generate` and :func:`~hierspec.stream` build a new drafter for every call
(:func:`~hierspec.methods.make_drafter`), so what a drafter learns from verdicts — ``hd``'s acceptance rates per
source, confidence and depth, which databases' searches pay, the draft head's back-off; the cost-aware wrapper's
acceptance by depth and its token window's rates — started from the prior on every call, where the benchmark keeps
one drafter per method across its questions (and the batch scheduler, the server's, reuses its drafters). On
39 dev questions (SmolLM2, 128 tokens, BENCHMARKS.md, "Fifty-second session") a drafter per generation gave ``hd``
1.078x ``ar`` (MAT 1.83) and one kept across them 1.155x (MAT 1.96).

:class:`CarriedState` holds the latest snapshot of one method's learning (one per
:class:`~hierspec.methods.DrafterContext` and method): a new drafter starts from a copy of it
(:meth:`~hierspec.drafters.base.Drafter.resume`) and leaves a copy of its own when its generation ends
(:meth:`~hierspec.drafters.base.Drafter.learned`). Concurrent generations each start from the latest that finished
and never share anything mutable; stores and what learns into them (the successor table) are shared as before.
Greedy outputs never depend on it (any tree is verified losslessly), nor do sampled ones of deterministic drafts
(each token is one draw from the target's distribution, whatever the tree).

Across processes: given a file (:func:`learned_path`; the command line's ``generate`` and ``serve`` do so unless
``--no-keep-learned``), a :class:`CarriedState` starts from the snapshot the last process left there and writes each
new one through a temporary file renamed into place. The file is a JSON header line (magic, version, the key it was
learned for, the payload's SHA-256) and the snapshot pickled; it is read back with an unpickler that builds only
hierspec's own classes, NumPy arrays and plain containers. A missing, damaged or foreign file means starting from
the priors (with a warning for the last two); a disk that refuses the write turns the file off for the process, with
one warning — learning in memory goes on.
"""

from __future__ import annotations

import copy
import hashlib
import io
import json
import logging
import pickle
import threading
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

#: the first field of a learned-state file's header
MAGIC = "hierspec-learned"
#: its format; a file of another version is ignored (and replaced by the next generation's). Raised whenever a
#: pickled drafter class changes its fields (2: ``hd``'s acceptance model gained ``prior``; 3: ``credit``)
VERSION = 3

#: the plain types a snapshot may hold besides hierspec's classes and NumPy's arrays
_BUILTINS = frozenset({"dict", "list", "tuple", "set", "frozenset", "int", "float", "bool", "str", "bytes",
                       "complex", "slice", "range"})
_COLLECTIONS = frozenset({"OrderedDict", "defaultdict", "deque", "Counter"})
_NUMPY = frozenset({"numpy", "numpy.core.multiarray", "numpy._core.multiarray", "numpy.core.numeric",
                    "numpy._core.numeric"})


def default_learned_dir() -> Path:
    """Where the command line (and the Python API with ``keep_learned=True``) keeps learned-state files:
    ``~/.cache/hierspec/learned``."""
    from hierspec.paths import user_cache_dir

    return user_cache_dir() / "learned"


def learned_path(root: str | Path, key: dict) -> Path:
    """The file under ``root`` for snapshots learned under ``key`` (model, tokenizer, machine, method and drafting
    settings; see :meth:`~hierspec.methods.DrafterContext.carried_state`)."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return Path(root) / f"{key.get('method', 'method')}-{digest}.learned".replace("/", "_").replace(":", "_")


class _SnapshotUnpickler(pickle.Unpickler):
    """Builds hierspec's classes, NumPy arrays and plain containers only: a snapshot file never runs other code."""

    def find_class(self, module: str, name: str):
        if ((module == "builtins" and name in _BUILTINS) or (module == "collections" and name in _COLLECTIONS)
                or module in _NUMPY or (module == "copyreg" and name == "_reconstructor")):
            return super().find_class(module, name)
        if module.startswith("hierspec."):
            found = super().find_class(module, name)
            if isinstance(found, type):  # a class, never a function
                return found
        raise pickle.UnpicklingError(f"a learned-state file may not hold {module}.{name}")


class CarriedState:
    """The latest snapshot a finished generation of one method left, for the next drafter of that method; with
    ``path``, also the one the last process left there (see the module's text)."""

    def __init__(self, path: str | Path | None = None, key: dict | None = None) -> None:
        self._lock = threading.Lock()
        self._state: Any = None
        self._path = Path(path) if path is not None else None
        self._key = key or {}
        if self._path is not None:
            self._state = self._read()

    @property
    def path(self) -> Path | None:
        """The file snapshots are kept in across processes (``None``: this process only, or the disk refused)."""
        return self._path

    def latest(self) -> Any:
        """A copy of the latest snapshot, or ``None`` before any generation of the method finished."""
        with self._lock:
            state = self._state
        return copy.deepcopy(state)

    def leave(self, state: Any) -> None:
        """Keep a copy of ``state`` (a finished drafter's :meth:`~hierspec.drafters.base.Drafter.learned`) as the
        latest, and in the file where there is one; ``None`` keeps the one before."""
        if state is None:
            return
        snapshot = copy.deepcopy(state)
        with self._lock:
            self._state = snapshot
            if self._path is not None:
                self._write(snapshot)

    def _read(self) -> Any:
        """The snapshot in the file, or ``None`` where there is none or it is damaged, foreign or of another
        version (told in a warning)."""
        try:
            data = self._path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            log.warning("cannot read the learned drafter state %s (%s); starting from the priors", self._path, exc)
            return None
        problem, state = _parsed(data, self._key)
        if problem is not None:
            log.warning("ignoring the learned drafter state %s: %s; starting from the priors", self._path, problem)
        return state

    def _write(self, snapshot: Any) -> None:
        from hierspec.storage import storage_problem, write_bytes_atomic

        payload = pickle.dumps(snapshot, protocol=pickle.HIGHEST_PROTOCOL)
        header = {"magic": MAGIC, "version": VERSION, "key": self._key,
                  "sha256": hashlib.sha256(payload).hexdigest()}
        try:
            self._path.parent.mkdir(parents=True, exist_ok=True)
            write_bytes_atomic(self._path, json.dumps(header, sort_keys=True).encode() + b"\n" + payload)
        except OSError as exc:
            log.warning("cannot keep the learned drafter state across processes: %s; it is kept in this process "
                        "only", storage_problem(exc))
            self._path = None


def _parsed(data: bytes, key: dict) -> tuple[str | None, Any]:
    """``(None, snapshot)`` for a sound file learned under ``key``, else ``(why not, None)``."""
    line, _, payload = data.partition(b"\n")
    try:
        header = json.loads(line)
    except ValueError:
        return "not a learned-state file (no header)", None
    if not isinstance(header, dict) or header.get("magic") != MAGIC:
        return "not a learned-state file (another magic string)", None
    if header.get("version") != VERSION:
        return f"format version {header.get('version')!r}, this hierspec reads {VERSION}", None
    if header.get("key") != key:
        return "learned for another model, method or setting", None
    if hashlib.sha256(payload).hexdigest() != header.get("sha256"):
        return "damaged (its checksum does not match)", None
    try:
        return None, _SnapshotUnpickler(io.BytesIO(payload)).load()
    except Exception as exc:  # noqa: BLE001 - any failure to rebuild the snapshot means: start afresh
        return f"unreadable ({exc})", None

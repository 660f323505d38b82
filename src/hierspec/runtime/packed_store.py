"""The int4 projections' stacks in their kernels' layouts, kept in a file beside the int4 weight cache.

Building the int4 decoder unpacks every 4-bit code of the weight cache into a byte and packs it again into the
layout its kernel reads (:func:`~hierspec.runtime.quantized.pack_stacks`): on Qwen2.5-Coder-1.5B 3.5-4 s of every
load, nearly half of it. :class:`PackedStore` keeps what that produced, per projection, in
``packed-<weights>-<4-bit kernel>-<8-bit kernel>.safetensors`` next to the weights it was packed from, and a later
load reads the stacks as they are.

A packed stack that does not belong to the weights and code of this load would be a wrong answer, so the file names
everything it depends on and is used only when all of it matches: the source weight cache's SHA-256 (as its
checksum manifest records it; a rebuilt cache has another), the kernels, whether 6-bit products are available, and a
hash of the packing code itself (``quantized.py`` and ``int4_kernel.py``: any change to them packs anew). The file
carries a magic string and a version, is written through a temporary file, and is checked like every cached file
(:mod:`hierspec.checksums`); anything unreadable, damaged or foreign means packing as before, with a log line, and
the file written again. A disk that refuses the write costs the packing at the next load, nothing else.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path

import torch

from hierspec import checksums
from hierspec.storage import write_file_atomic
from hierspec.runtime import int4_kernel

log = logging.getLogger(__name__)

MAGIC = "hierspec-packed-stacks"
VERSION = 1

#: the stack types a file may hold, by name (a name outside this table is refused, never imported)
_TYPES = {cls.__name__: cls for cls in (int4_kernel.PackedInt4, int4_kernel.PackedInt8, int4_kernel.PackedAmx,
                                        int4_kernel.PackedBf16, int4_kernel.PackedVnni)}


@lru_cache(maxsize=1)
def packing_code_hash() -> str:
    """SHA-256 of the modules whose code decides the packed layouts (any edit to them packs anew)."""
    from hierspec.runtime import quantized

    digest = hashlib.sha256()
    for module in (quantized, int4_kernel):
        digest.update(Path(module.__file__).read_bytes())
    return digest.hexdigest()


def store_name(weights_file: str, four_bit: str, eight_bit: str) -> str:
    """The packed file's name for the weight cache ``weights_file`` and the kernels."""
    return f"packed-{Path(weights_file).stem}-{four_bit}-{eight_bit}.safetensors"


class PackedStore:
    """Stacks by projection key: read from ``path`` where its identity matches ``identity``, else built and, after
    :meth:`save`, written there. ``path`` ``None``: nothing is read or kept (every stack is built)."""

    def __init__(self, path: Path | None, identity: dict[str, object]) -> None:
        self.path = path
        self.identity = {"magic": MAGIC, "version": VERSION, **identity}
        self._entries, self._handle = self._open()  # the file read once, its stacks taken from it by key
        self._stacks: dict[str, list] = {}
        self.read = 0
        self.built = 0

    @classmethod
    def beside(cls, weights: Path, kernels, six_bit: bool) -> PackedStore:
        """The store next to the weight cache file ``weights`` (its recorded SHA-256 naming the weights; no recorded
        checksum, no store)."""
        recorded = checksums.recorded_sha256(weights.parent, weights.name)
        if recorded is None:
            return cls(None, {})
        return cls(weights.parent / store_name(weights.name, kernels.four_bit, kernels.eight_bit),
                   {"weights": weights.name, "weights_sha256": recorded, "four_bit": kernels.four_bit,
                    "eight_bit": kernels.eight_bit, "six_bit": bool(six_bit), "code": packing_code_hash()})

    def stacks(self, key: str, build: Callable[[], list]) -> list:
        """The stacks of projection ``key``: read from the file, or ``build()`` (and kept for :meth:`save`)."""
        stacks = self._read(key)
        if stacks is None:
            stacks = build()
            self.built += 1
        else:
            self.read += 1
        self._stacks[key] = stacks
        return stacks

    def save(self) -> None:
        """Write every stack asked for to the file when any was built (one file, replaced whole); a refused write is
        a log line."""
        if self.path is None or not self.built or not all(
                all(type(s).__name__ in _TYPES for s in stacks) for stacks in self._stacks.values()):
            return
        from safetensors import SafetensorError
        from safetensors.torch import save_file

        tensors, entries = {}, {}
        for key, stacks in self._stacks.items():
            entries[key] = []
            for i, stack in enumerate(stacks):
                fields, values = {}, {}
                for field in dataclasses.fields(stack):
                    value = getattr(stack, field.name)
                    if isinstance(value, torch.Tensor):
                        name = f"{key}/{i}/{field.name}"
                        tensors[name] = value.contiguous()
                        fields[field.name] = name
                    else:
                        values[field.name] = value
                entries[key].append({"type": type(stack).__name__, "tensors": fields, "values": values})
        meta = {"identity": json.dumps(self.identity, sort_keys=True), "entries": json.dumps(entries)}
        try:
            write_file_atomic(self.path, lambda tmp: save_file(tensors, tmp, metadata=meta))
            checksums.record(self.path.parent, [self.path.name])
        except (OSError, SafetensorError, RuntimeError) as exc:
            log.warning("the packed int4 weights %s cannot be written (%s); the next load packs them again",
                        self.path, exc)

    def _open(self) -> tuple[dict | None, object | None]:
        """The file's entries and an open handle on it when it is intact and its identity is this load's, else
        ``(None, None)``."""
        if self.path is None or not self.path.is_file():
            return None, None
        from safetensors import SafetensorError, safe_open

        try:
            problem = checksums.damage(self.path.parent, [self.path.name])
            if problem is None:
                handle = safe_open(str(self.path), framework="pt")
                meta = handle.metadata() or {}
                if json.loads(meta.get("identity", "null")) == self.identity:
                    return json.loads(meta["entries"]), handle
                problem = "packed for other weights, kernels or code"
        except (OSError, ValueError, KeyError, SafetensorError) as exc:
            problem = str(exc)
        log.info("packing the int4 weights again (%s: %s)", self.path.name, problem)
        return None, None

    def _read(self, key: str) -> list | None:
        entry = None if self._entries is None else self._entries.get(key)
        if entry is None:
            return None
        from safetensors import SafetensorError

        try:
            return [_stack_of(item, self._handle) for item in entry]
        except (OSError, ValueError, KeyError, TypeError, SafetensorError) as exc:
            log.info("packing %s again (%s)", key, exc)
            return None


def _stack_of(item: dict, handle):
    """One stack from its file entry (``type``, tensor names, other values)."""
    cls = _TYPES[item["type"]]
    fields = {name: handle.get_tensor(tensor) for name, tensor in item["tensors"].items()}
    return cls(**fields, **item["values"])

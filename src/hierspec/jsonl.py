"""Reading jsonl files record by record with errors that name the file and line."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from hierspec.errors import InputError


def iter_jsonl(path: str | Path) -> Iterator[tuple[int, object]]:
    """``(line number, record)`` for every non-blank line; invalid JSON raises :class:`InputError` at its line."""
    with open(path, encoding="utf-8") as handle:
        for line_no, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                yield line_no, json.loads(line)
            except json.JSONDecodeError as exc:
                raise InputError(f"{path}:{line_no}: invalid JSON ({exc.msg})") from exc

"""``hierspec bench --compare A B``: two benchmark summaries side by side."""

from __future__ import annotations

import json
from pathlib import Path

from hierspec.bench.metrics import forwards_known
from hierspec.errors import InputError


def load_summary(path: str | Path) -> dict:
    """A ``summary.json``, given as the file or the bench output directory holding it."""
    path = Path(path)
    if path.is_dir():
        path = path / "summary.json"
    if not path.is_file():
        raise InputError(f"no benchmark summary at {path}")
    try:
        summary = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise InputError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(summary, dict) or not isinstance(summary.get("methods"), dict):
        raise InputError(f"{path} is not a hierspec bench summary (no 'methods')")
    return summary


def compare_summaries(a: str | Path, b: str | Path) -> str:
    """A Markdown table of every method in either summary: tokens/s, speedup and MAT in A and in B."""
    left, right = load_summary(a), load_summary(b)
    lines = [
        f"A: {a} — {left.get('model', '?')}, {left.get('num_questions', '?')} questions, {left.get('date', '?')}",
        f"B: {b} — {right.get('model', '?')}, {right.get('num_questions', '?')} questions, {right.get('date', '?')}",
        "",
        "| method | tokens/s A | tokens/s B | speedup A | speedup B | MAT A | MAT B | acceptance A | acceptance B |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    labels = list(left["methods"]) + [m for m in right["methods"] if m not in left["methods"]]
    for label in labels:
        cells = []
        for key, fmt in (("tokens_per_s", "{:.2f}"), ("speedup", "{:.3f}"), ("mat", "{:.2f}"),
                         ("acceptance_rate", "{:.1%}")):
            for side in (left, right):
                method = side["methods"].get(label)
                if not method or key not in method:
                    cells.append("—")
                elif key in ("mat", "acceptance_rate") and not forwards_known(method):
                    cells.append("n/a")
                else:
                    cells.append(fmt.format(method[key]))
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)

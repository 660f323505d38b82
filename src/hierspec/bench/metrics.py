"""Benchmark metrics: per-question runs aggregated into the per-method, per-task summary."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch

from hierspec.bench.questions import Question


@dataclass
class QuestionRun:
    """One method's answer to one question."""

    token_ids: list[int]
    text: str
    wall_time: float
    accept_lengths: list[int]
    drafted: int = 0
    accepted: int = 0
    draft_time: float = 0.0
    verify_time: float = 0.0
    #: seconds spent reading the prompt before the first step (0.0 where a peer does not say)
    prefill_time: float = 0.0
    accepted_by_source: dict[str, int] = field(default_factory=dict)
    drafted_by_source: dict[str, int] = field(default_factory=dict)
    won_by_source: dict[str, int] = field(default_factory=dict)
    drafter_report: dict = field(default_factory=dict)
    turns: list[dict] = field(default_factory=list)

    @property
    def new_tokens(self) -> int:
        return len(self.token_ids)


#: drafter report counts that add up over a question's turns (by name prefix)
_SUMMED_COUNTS = ("first_", "middle_", "dense_", "deferred_")


def merge_turns(runs: list[QuestionRun], prompts: list[list[int]]) -> QuestionRun:
    """One question's turns as one run: counts and times add up, token ids concatenate; ``turns`` keeps each turn's
    prompt ids, tokens, text, time and steps (Spec-Bench answers list them per turn)."""
    windows = [w for r in runs for w in r.drafter_report.get("windows", [])]
    report: dict = {}
    for r in runs:
        for key, value in r.drafter_report.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and key.startswith(_SUMMED_COUNTS):
                report[key] = report.get(key, 0) + value
    if windows:
        report["windows"] = windows
    if any(CALIBRATION in r.drafter_report for r in runs):
        report[CALIBRATION] = _sum_calibration(r.drafter_report.get(CALIBRATION) for r in runs)
    return QuestionRun(
        token_ids=[t for r in runs for t in r.token_ids], text=runs[-1].text,
        wall_time=sum(r.wall_time for r in runs), accept_lengths=[n for r in runs for n in r.accept_lengths],
        drafted=sum(r.drafted for r in runs), accepted=sum(r.accepted for r in runs),
        draft_time=sum(r.draft_time for r in runs), verify_time=sum(r.verify_time for r in runs),
        prefill_time=sum(r.prefill_time for r in runs),
        accepted_by_source=_sum_dicts(r.accepted_by_source for r in runs),
        drafted_by_source=_sum_dicts(r.drafted_by_source for r in runs),
        won_by_source=_sum_dicts(r.won_by_source for r in runs), drafter_report=report,
        turns=[{"prompt_ids": p, "token_ids": r.token_ids, "text": r.text, "wall_time": r.wall_time,
                "steps": len(r.accept_lengths)} for r, p in zip(runs, prompts)],
    )


def _sum_calibration(reports) -> dict:
    """Element-wise sums of the scored trees' calibration counts (per decile of predicted probability)."""
    total = {"nodes": [0.0] * 10, "predicted": [0.0] * 10, "accepted": [0.0] * 10}
    for report in reports:
        for key in total:
            for i, value in enumerate((report or {}).get(key, ())):
                total[key][i] += value
    return total


def calibration(runs: list[QuestionRun]) -> list[dict]:
    """Scored trees: per decile of predicted probability of acceptance, the mean prediction, the share of nodes that
    were accepted, and the node count."""
    counts = _sum_calibration(r.drafter_report.get(CALIBRATION) for r in runs)
    return [{"decile": i, "predicted": counts["predicted"][i] / counts["nodes"][i],
             "observed": counts["accepted"][i] / counts["nodes"][i], "nodes": int(counts["nodes"][i])}
            for i in range(10) if counts["nodes"][i]]


def _sum_dicts(dicts) -> dict[str, int]:
    total: dict[str, int] = defaultdict(int)
    for d in dicts:
        for key, value in d.items():
            total[key] += value
    return dict(total)


#: the drafter report key of scored trees' calibration counts
CALIBRATION = "acceptance_calibration"


@dataclass
class MethodRecord:
    """All answers of one method, in question order."""

    label: str
    questions: list[Question] = field(default_factory=list)
    runs: list[QuestionRun] = field(default_factory=list)

    def add(self, question: Question, run: QuestionRun) -> None:
        self.questions.append(question)
        self.runs.append(run)


def aggregate(runs: list[QuestionRun]) -> dict:
    """Totals over runs: tokens/s is total tokens over total time (as Spec-Bench's speed.py), MAT is total tokens
    over total target forwards, redundancy σ = 1 − accepted/drafted, target utilisation η = target forwards /
    output tokens (HSDDW section 4.4) and the share of forwards that accepted no draft token (added only the
    target's own token)."""
    tokens = sum(r.new_tokens for r in runs)
    wall = sum(r.wall_time for r in runs)
    forwards = sum(len(r.accept_lengths) for r in runs)
    drafted = sum(r.drafted for r in runs)
    accepted = sum(r.accepted for r in runs)
    return {
        "questions": len(runs),
        "new_tokens": tokens,
        "wall_time": wall,
        "tokens_per_s": tokens / wall if wall > 0 else 0.0,
        "mat": tokens / forwards if forwards else 0.0,
        "target_forwards": forwards,
        "drafted": drafted,
        "accepted": accepted,
        "acceptance_rate": accepted / drafted if drafted else 0.0,
        "sigma": 1 - accepted / drafted if drafted else 0.0,
        "eta": forwards / tokens if tokens else 0.0,
        "nothing_accepted": sum(n <= 1 for r in runs for n in r.accept_lengths) / forwards if forwards else 0.0,
        "draft_time_share": sum(r.draft_time for r in runs) / wall if wall > 0 else 0.0,
        "verify_time_share": sum(r.verify_time for r in runs) / wall if wall > 0 else 0.0,
        "prefill_time_share": sum(r.prefill_time for r in runs) / wall if wall > 0 else 0.0,
        "per_source": per_source(runs, forwards),
        **({"levels": levels(runs)} if any("windows" in r.drafter_report or "first_drafted" in r.drafter_report
                                           for r in runs) else {}),
        **({"dense": dense_retrieval(runs)} if any("dense_queries" in r.drafter_report for r in runs) else {}),
        **({"calibration": calibration(runs)} if any(CALIBRATION in r.drafter_report for r in runs) else {}),
    }


def dense_retrieval(runs: list[QuestionRun]) -> dict:
    """Dense retrieval figures from the drafters' reports: searches, the share that gave a draft, mean latency."""
    queries = sum(r.drafter_report.get("dense_queries", 0) for r in runs)
    hits = sum(r.drafter_report.get("dense_hits", 0) for r in runs)
    seconds = sum(r.drafter_report.get("dense_search_s", 0.0) for r in runs)
    return {"queries": queries, "hit_rate": hits / queries if queries else 0.0,
            "search_ms": 1000 * seconds / queries if queries else 0.0}


def levels(runs: list[QuestionRun]) -> dict:
    """Draft-model figures from the drafters' reports: mean window (tokens per block sent to the target), steps
    taken before the draft model started on its generation (:mod:`hierspec.drafters.deferred_start`) and, for
    HSDDW, the first level's tokens drafted / accepted by the middle model with its redundancy σ."""
    windows = [w for r in runs for w in r.drafter_report.get("windows", [])]
    out: dict = {"mean_window": sum(windows) / len(windows) if windows else 0.0, "steps": len(windows),
                 "deferred_steps": sum(r.drafter_report.get("deferred_steps", 0) for r in runs)}
    drafted = sum(r.drafter_report.get("first_drafted", 0) for r in runs)
    if any("first_drafted" in r.drafter_report for r in runs):
        accepted = sum(r.drafter_report.get("first_accepted", 0) for r in runs)
        out["first"] = {"drafted": drafted, "accepted": accepted,
                        "sigma": 1 - accepted / drafted if drafted else 0.0}
        out["middle_tokens"] = sum(r.drafter_report.get("middle_tokens", 0) for r in runs)
    return out


def per_source(runs: list[QuestionRun], forwards: int) -> dict[str, dict]:
    """Per draft source: tokens drafted and accepted, acceptance rate, and steps won (deepest accepted token's
    source) with their share of all target forwards."""
    by_source: dict[str, dict] = defaultdict(lambda: {"drafted": 0, "accepted": 0, "steps_won": 0})
    for run in runs:
        for source, count in run.drafted_by_source.items():
            by_source[source]["drafted"] += count
        for source, count in run.accepted_by_source.items():
            by_source[source]["accepted"] += count
        for source, count in run.won_by_source.items():
            by_source[source]["steps_won"] += count
    for counts in by_source.values():
        counts["acceptance_rate"] = counts["accepted"] / counts["drafted"] if counts["drafted"] else 0.0
        counts["won_share"] = counts["steps_won"] / forwards if forwards else 0.0
    return dict(by_source)


def summarize(records: dict[str, MethodRecord], baseline: str, model_name: str, max_new_tokens: int) -> dict:
    """The ``summary.json`` structure: overall and per-task metrics of every method, speedups over ``baseline``."""
    base = records[baseline]
    base_overall = aggregate(base.runs)
    base_tasks = {task: aggregate([base.runs[i] for i in indices])
                  for task, indices in _task_indices(base.questions).items()}
    methods = {}
    for label, record in records.items():
        overall = aggregate(record.runs)
        overall["speedup"] = _ratio(overall["tokens_per_s"], base_overall["tokens_per_s"])
        overall["identical_to_ar"] = _identical_fraction(record.runs, base.runs)
        per_task = {}
        for task, indices in _task_indices(record.questions).items():
            runs = [record.runs[i] for i in indices]
            base_runs = [base.runs[i] for i in indices]
            task_metrics = aggregate(runs)
            per_task[task] = {
                "speedup": _ratio(task_metrics["tokens_per_s"], base_tasks[task]["tokens_per_s"]),
                "mat": task_metrics["mat"],
                "tokens_per_s": task_metrics["tokens_per_s"],
                "acceptance_rate": task_metrics["acceptance_rate"],
                "identical_to_ar": _identical_fraction(runs, base_runs),
                "questions": len(runs),
            }
        overall["per_task"] = per_task
        methods[label] = overall
    return {"model": model_name, "max_new_tokens": max_new_tokens, "baseline": baseline, "methods": methods}


def _task_indices(questions: list[Question]) -> dict[str, list[int]]:
    groups: dict[str, list[int]] = defaultdict(list)
    for i, question in enumerate(questions):
        groups[question.task].append(i)
    return dict(groups)


def _ratio(value: float, reference: float) -> float:
    return value / reference if reference > 0 else 0.0


def _identical_fraction(runs: list[QuestionRun], base_runs: list[QuestionRun]) -> float:
    if not runs:
        return 0.0
    return sum(r.token_ids == b.token_ids for r, b in zip(runs, base_runs)) / len(runs)


@torch.inference_mode()
def explain_divergence(model, prompt_ids: list[int], reference: list[int], other: list[int]) -> dict:
    """Where two greedy outputs first differ, and how close the target's top-2 logits were there.

    The logits come from one uncached forward over the prompt and the common prefix, so they are independent of both
    decoding paths. A gap near zero means a near-tie that rounding differences between a one-token and a multi-token
    forward can flip.
    """
    position = next((i for i, (a, b) in enumerate(zip(reference, other)) if a != b), min(len(reference), len(other)))
    ids = torch.tensor([prompt_ids + reference[:position]], device=model.device)
    logits = model.model(input_ids=ids).logits[0, -1].float()
    top = torch.topk(logits, 2)
    return {
        "position": position,
        "ar_token": reference[position] if position < len(reference) else None,
        "other_token": other[position] if position < len(other) else None,
        "top2_tokens": top.indices.tolist(),
        "top2_gap": float(top.values[0] - top.values[1]),
    }


def forwards_known(method: dict) -> bool:
    """Whether a method reported its target forwards (transformers' prompt lookup and assisted generation do not),
    so that MAT, acceptance, σ, η and the draft time share mean something."""
    return bool(method.get("target_forwards")) or not method.get("new_tokens")

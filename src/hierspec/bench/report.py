"""Writing benchmark outputs: Spec-Bench answer files and a Markdown report."""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path

from hierspec.bench.metrics import MethodRecord, forwards_known


def write_answers(out_dir: Path, records: dict[str, MethodRecord], model_name: str) -> None:
    """One ``answers-METHOD.jsonl`` per method, in Spec-Bench's answer format (one entry per answered turn)."""
    for label, record in records.items():
        path = out_dir / f"answers-{label.replace(':', '_').replace(',', '_').replace('=', '-')}.jsonl"
        with open(path, "w", encoding="utf-8") as handle:
            for question, run in zip(record.questions, record.runs):
                handle.write(json.dumps({
                    "question_id": question.question_id,
                    "category": question.category,
                    "answer_id": uuid.uuid4().hex,
                    "model_id": f"{model_name}/{label}",
                    "choices": [{
                        "index": 0,
                        "turns": [t["text"] for t in run.turns] or [run.text],
                        "decoding_steps": [t["steps"] for t in run.turns] or [len(run.accept_lengths)],
                        "new_tokens": [len(t["token_ids"]) for t in run.turns] or [run.new_tokens],
                        "wall_time": [t["wall_time"] for t in run.turns] or [run.wall_time],
                        "accept_lengths": run.accept_lengths,
                    }],
                    "tstamp": time.time(),
                }) + "\n")


def _decoding(summary: dict) -> str:
    sampling = summary.get("sampling") or {}
    if not sampling or sampling.get("temperature", 0.0) == 0.0:
        return "greedy"
    seeds = sampling.get("seeds") or [sampling.get("seed")]
    seed_text = f"seed {seeds[0]}" if len(seeds) == 1 else "seeds " + ", ".join(map(str, seeds))
    return (f"sampling (temperature {sampling['temperature']}, top-p {sampling.get('top_p', 1.0)}, "
            f"top-k {sampling.get('top_k', 0)}, {seed_text})")


def _cell(value: float, known: bool, spec: str, suffix: str = "") -> str:
    return f"{value:{spec}}{suffix}" if known else "n/a"


def write_report(path: Path, summary: dict) -> None:
    """A Markdown report: overall table, per-task speedup and MAT tables, divergences from ``ar``."""
    methods = summary["methods"]
    tasks = sorted({task for m in methods.values() for task in m["per_task"]})
    runtime = summary.get("runtime") or {}
    lines = [
        f"# hierspec bench — {summary['model']}",
        "",
        f"{summary.get('date', '')}, {summary.get('processor', '')} ({summary.get('cpu_count')} CPUs, "
        f"{summary.get('torch_threads')} torch threads), {summary.get('device')}"
        f"{' (' + summary['gpu'] + ')' if summary.get('gpu') else ''}, {summary.get('dtype')}, "
        f"runtime {runtime.get('kind', '?')} with {runtime.get('decoder', 'transformers')}'s decoder and "
        f"{runtime.get('attention', 'sdpa')} attention, "
        f"torch {summary.get('torch')}, transformers {summary.get('transformers')}; "
        f"{summary.get('num_questions')} questions from `{summary.get('questions_file')}`, "
        f"{summary['max_new_tokens']} new tokens, {_decoding(summary)}. Speedup = tokens/s over "
        f"`{summary['baseline']}` in this run. σ = 1 − accepted/drafted (redundancy), η = target forwards per "
        "output token (target utilisation). Nothing accepted = share of target forwards that added only the "
        "target's own token. Prompt time = share of the wall time spent reading prompts (n/a where a peer does not "
        "say).",
        "",
        "| method | tokens/s | speedup | MAT | acceptance | nothing accepted | σ | η | draft time | prompt time | "
        "identical to ar |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for label, m in methods.items():
        known = forwards_known(m)
        lines.append(
            f"| {label} | {m['tokens_per_s']:.2f} | {m['speedup']:.3f} | {_cell(m['mat'], known, '.2f')} | "
            f"{_cell(100 * m['acceptance_rate'], known, '.1f', '%')} | "
            f"{_cell(100 * m.get('nothing_accepted', 0.0), known, '.1f', '%')} | {_cell(m.get('sigma', 0.0), known, '.2f')} | "
            f"{_cell(m.get('eta', 0.0), known, '.2f')} | {_cell(100 * m['draft_time_share'], known, '.1f', '%')} | "
            f"{_cell(100 * m.get('prefill_time_share', 0.0), m.get('prefill_time_share', 0.0) > 0, '.1f', '%')} | "
            f"{m['identical_to_ar']:.2f} |"
        )
    if any(label in methods for label in ("llamacpp-ar", "llamacpp-pld")):
        lines += ["", "`llamacpp-ar` is llama.cpp decoding the same GGUF file with its own kernels (and, for a "
                  "quantized file, its quantized weights), `llamacpp-pld` the same with its binding's prompt-lookup "
                  "drafting: their tokens are shown beside `ar`'s, not expected to equal them."]
    for metric, title in (("speedup", "Speedup per task"), ("mat", "MAT per task"),
                          ("identical_to_ar", "Identical to ar per task")):
        lines += ["", f"## {title}", "", "| method | " + " | ".join(tasks) + " |",
                  "|---|" + "---:|" * len(tasks)]
        for label, m in methods.items():
            known = metric != "mat" or forwards_known(m)
            cells = [_cell(m["per_task"][t][metric], known, ".2f") if t in m["per_task"] else "" for t in tasks]
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
    sourced = [(label, m["per_source"]) for label, m in methods.items() if len(m.get("per_source", {})) > 1]
    if sourced:
        lines += ["", "## Draft sources", "", "Steps won: steps whose deepest accepted draft token came from the source.",
                  "", "| method | source | drafted | accepted | acceptance | steps won (share of forwards) |",
                  "|---|---|---:|---:|---:|---:|"]
        for label, sources in sourced:
            for source, c in sources.items():
                lines.append(f"| {label} | {source} | {c['drafted']} | {c['accepted']} | "
                             f"{100 * c['acceptance_rate']:.1f}% | {c['steps_won']} ({100 * c['won_share']:.1f}%) |")
    spread = summary.get("seeds")
    if spread:
        seeds = list(next(iter(spread.values()))["speedups"])
        lines += ["", "## Speedup per sampling seed", "", "| method | " + " | ".join(f"seed {x}" for x in seeds)
                  + " | mean ± std | min – max |", "|---|" + "---:|" * (len(seeds) + 2)]
        for label, sp in spread.items():
            cells = [f"{sp['speedups'][x]:.3f}" for x in seeds]
            lines.append(f"| {label} | " + " | ".join(cells) + f" | {sp['mean']:.3f} ± {sp['std']:.3f} | "
                         f"{sp['min']:.3f} – {sp['max']:.3f} |")
    plots = [name for name in ("speedup_per_task.png", "mat.png", "accept_lengths.png", "sources.png",
                               "calibration.png") if (path.parent / name).exists()]
    if plots:
        lines += ["", "## Plots", ""] + [f"![{name[:-4]}]({name})" for name in plots]
    leveled = [(label, m["levels"]) for label, m in methods.items() if m.get("levels")]
    if leveled:
        lines += ["", "## Draft-model levels", "",
                  "Window: draft tokens per target forward. First level (HSDDW): tokens the first drafter proposed "
                  "and the middle model accepted. Before start: target steps taken before the draft model read the "
                  "prompt (it starts once their forgone savings would pay for that).", "",
                  "| method | mean window | before start | first drafted | first accepted | first σ | middle tokens |",
                  "|---|---:|---:|---:|---:|---:|---:|"]
        for label, lv in leveled:
            first = lv.get("first")
            cells = ([str(first["drafted"]), str(first["accepted"]), f"{first['sigma']:.2f}",
                      str(lv.get("middle_tokens", ""))] if first else ["", "", "", ""])
            lines.append(f"| {label} | {lv['mean_window']:.2f} | {lv.get('deferred_steps', 0)} | "
                         + " | ".join(cells) + " |")
    dense = [(label, m["dense"]) for label, m in methods.items() if m.get("dense")]
    if dense:
        lines += ["", "## Dense retrieval", "",
                  "Searches of the dense store, the share that gave a draft (a neighbour starting with the target's "
                  "next token, similar enough), and the mean search time (normalisation + FAISS + filtering).", "",
                  "| method | searches | gave a draft | ms per search |", "|---|---:|---:|---:|"]
        for label, d in dense:
            lines.append(f"| {label} | {d['queries']} | {d['hit_rate']:.1%} | {d['search_ms']:.2f} |")
    calibrated = [(label, m["calibration"]) for label, m in methods.items() if m.get("calibration")]
    if calibrated:
        lines += ["", "## Scored trees: predicted against observed acceptance", "",
                  "Draft nodes by decile of their predicted probability of landing on the accepted path.", "",
                  "| method | decile | nodes | mean prediction | observed |", "|---|---:|---:|---:|---:|"]
        for label, rows in calibrated:
            lines += [f"| {label} | {r['decile']} | {r['nodes']} | {r['predicted']:.3f} | {r['observed']:.3f} |"
                      for r in rows]
    lines += ["", "## Outputs that differ from ar", ""]
    lines += _divergence_lines(summary)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def _divergence_lines(summary: dict) -> list[str]:
    if _decoding(summary) != "greedy":
        # Sampled outputs of lossless methods share ar's distribution, not its tokens: nothing to explain.
        return ["Not checked under sampling: a lossless method's output has `ar`'s distribution, and equals `ar`'s "
                "tokens only where it consumes the random stream the same way (see `identical to ar`)."]
    divergences = summary.get("divergences", [])
    lines: list[str] = []
    if not divergences:
        lines.append("None: every method produced `ar`'s tokens on every question.")
    else:
        lines += ["| method | question | turn | first differing position | top-2 logit gap there |",
                  "|---|---|---:|---:|---:|"]
        for d in divergences:
            lines.append(f"| {d['method']} | {d['question_id']} | {d.get('turn', 1)} | {d['position']} | "
                         f"{d['top2_gap']:.4f} |")
    return lines

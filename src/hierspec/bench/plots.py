"""PNG plots of a benchmark run (matplotlib, no display needed)."""

from __future__ import annotations

from pathlib import Path

from hierspec.bench.metrics import MethodRecord, forwards_known

PLOTS = ("speedup_per_task.png", "mat.png", "accept_lengths.png", "sources.png", "calibration.png")


def write_plots(out_dir: Path, summary: dict, records: dict[str, MethodRecord]) -> list[Path]:
    """Speedup per task per method, MAT per method, accepted-length histogram, and each hierarchical method's
    accepted tokens per draft source. Returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = summary["methods"]
    labels = list(methods)
    tasks = sorted({t for m in methods.values() for t in m["per_task"]})
    written = []

    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(tasks) * max(1, len(labels)) / 3), 4))
    width = 0.8 / max(1, len(labels))
    for i, label in enumerate(labels):
        values = [methods[label]["per_task"].get(t, {}).get("speedup", 0.0) for t in tasks]
        ax.bar([x + i * width for x in range(len(tasks))], values, width, label=label)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([x + width * (len(labels) - 1) / 2 for x in range(len(tasks))], tasks, rotation=20)
    ax.set_ylabel(f"speedup over {summary['baseline']}")
    ax.legend(fontsize="small")
    written.append(_save(fig, out_dir / PLOTS[0]))

    fig, ax = plt.subplots(figsize=(max(5, 0.9 * len(labels)), 4))
    counted = [label for label in labels if forwards_known(methods[label])]  # transformers' peers: no forwards
    ax.bar(counted, [methods[label]["mat"] for label in counted])
    ax.set_ylabel("mean accepted tokens per target forward (MAT)")
    ax.tick_params(axis="x", rotation=30)
    written.append(_save(fig, out_dir / PLOTS[1]))

    fig, ax = plt.subplots(figsize=(7, 4))
    longest = max((n for r in records.values() for run in r.runs for n in run.accept_lengths), default=1)
    bins = [x + 0.5 for x in range(0, longest + 1)]
    for label, record in records.items():
        lengths = [n for run in record.runs for n in run.accept_lengths]
        if lengths and label != summary["baseline"]:
            ax.hist(lengths, bins=bins, histtype="step", density=True, label=label)
    ax.set_xlabel("tokens added per target forward")
    ax.set_ylabel("share of forwards")
    ax.legend(fontsize="small")
    written.append(_save(fig, out_dir / PLOTS[2]))

    sourced = [(label, m["per_source"]) for label, m in methods.items() if len(m.get("per_source", {})) > 1]
    fig, ax = plt.subplots(figsize=(max(5, 1.2 * len(sourced) + 2), 4))
    sources = sorted({s for _, per in sourced for s in per})
    bottoms = [0.0] * len(sourced)
    for source in sources:
        values = [per.get(source, {}).get("accepted", 0) for _, per in sourced]
        ax.bar([label for label, _ in sourced], values, bottom=bottoms, label=source)
        bottoms = [b + v for b, v in zip(bottoms, values)]
    ax.set_ylabel("accepted draft tokens by source")
    ax.tick_params(axis="x", rotation=30)
    if sources:
        ax.legend(fontsize="small")
    else:
        ax.text(0.5, 0.5, "no method with several draft sources", ha="center", transform=ax.transAxes)
    written.append(_save(fig, out_dir / PLOTS[3]))

    calibrated = [(label, m["calibration"]) for label, m in methods.items() if m.get("calibration")]
    if calibrated:
        fig, ax = plt.subplots(figsize=(5, 5))
        ax.plot([0, 1], [0, 1], color="grey", linewidth=0.8, linestyle="--", label="perfect calibration")
        for label, rows in calibrated:
            ax.plot([r["predicted"] for r in rows], [r["observed"] for r in rows], marker="o", label=label)
        ax.set_xlabel("predicted probability that a draft node is accepted")
        ax.set_ylabel("observed share accepted")
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1)
        ax.legend(fontsize="small")
        written.append(_save(fig, out_dir / PLOTS[4]))
    return written


def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)
    return path

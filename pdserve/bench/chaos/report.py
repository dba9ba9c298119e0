"""The chaos run's report: report.json (everything), report.md (the summary a person reads)
and three plots: KV blocks per node over time with the faults marked, release latency by
reason, and request outcomes by plan."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pdserve.bench.chaos.cluster import Sample

FAULT_COLORS = {"kill": "red", "sigterm": "orange", "burst": "purple"}


def write_report(directory: Path, report: dict[str, Any], samples: list[Sample],
                 faults: list[Any]) -> None:  # fmt: skip
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "report.json").write_text(json.dumps(report, indent=2, default=str))
    plots = _plot(directory, report, samples)
    (directory / "report.md").write_text(_markdown(report, plots))


def _markdown(report: dict[str, Any], plots: list[str]) -> str:
    lines = ["# Chaos run", "", f"Config: `{json.dumps(report['config'])}`", "",
             f"- requests: {report['num_requests']}",
             f"- greedy outputs compared with the reference node: "
             f"{report['greedy_outputs_checked']}",
             f"- unauthenticated aborts refused: {report['unauthenticated_aborts_refused']}",
             f"- violations: {len(report['violations'])}", ""]  # fmt: skip
    lines += [f"  - {v}" for v in report["violations"]]
    lines += ["", "| fault | node | from (s) | to (s) | detail |", "|---|---|---|---|---|"]
    lines += [f"| {f['kind']} | {f['node']} | {f['start_s']:.1f} | {f['end_s']:.1f} | "
              f"{f['detail']} |" for f in report["faults"]]  # fmt: skip
    lines += ["", "| plan | outcomes |", "|---|---|"]
    lines += [f"| {plan} | {', '.join(f'{k}: {v}' for k, v in sorted(o.items()))} |"
              for plan, o in sorted(report["outcomes"].items())]  # fmt: skip
    lines += ["", "Release latency on the prefill nodes (trigger → blocks free), by reason:", "",
              "| reason | releases | ≤ 5 ms | ≤ 10 ms | ≤ 20 ms | ≤ 50 ms | ≤ 100 ms |",
              "|---|---|---|---|---|---|---|"]  # fmt: skip
    for reason, hist in sorted(report["release_histograms"].items()):
        total = hist.get("+Inf", 0.0)
        if not total:
            continue
        cells = [f"{100 * hist.get(le, 0.0) / total:.0f}%"
                 for le in ("0.005", "0.01", "0.02", "0.04", "0.1")]  # fmt: skip
        lines.append(f"| {reason} | {total:.0f} | {' | '.join(cells)} |")
    lines += ["", "(the 50 ms column is the 40 ms bucket, the histogram's nearest edge)", ""]
    lines += [f"![{p}]({p})" for p in plots]
    return "\n".join(lines) + "\n"


def _plot(directory: Path, report: dict[str, Any], samples: list[Sample]) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # plots are optional; the numbers are in the report
        return []
    names = sorted({s.node for s in samples})
    fig, axes = plt.subplots(len(names) or 1, 1, figsize=(10, 2.2 * max(1, len(names))),
                             sharex=True, squeeze=False)  # fmt: skip
    for ax, name in zip(axes[:, 0], names, strict=False):
        mine = [s for s in samples if s.node == name]
        ax.plot([s.t_s for s in mine], [s.num_used for s in mine], label="used", lw=1)
        ax.plot([s.t_s for s in mine], [s.num_held for s in mine], label="held for P/D", lw=1)
        for f in report["faults"]:
            if f["node"] in (name, "all"):
                ax.axvspan(f["start_s"], max(f["end_s"], f["start_s"] + 0.3), alpha=0.2,
                           color=FAULT_COLORS.get(f["kind"], "gray"), label=f["kind"])  # fmt: skip
        ax.set_ylabel(f"{name}\nblocks")
        ax.legend(loc="upper right", fontsize=7)
    axes[-1, 0].set_xlabel("seconds into the run")
    fig.suptitle("KV blocks per node (shaded: faults)")
    fig.tight_layout()
    fig.savefig(directory / "kv_blocks.png", dpi=90)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(8, 3.5))
    for reason, hist in sorted(report["release_histograms"].items()):
        edges = sorted((float(le), n) for le, n in hist.items() if le != "+Inf")
        counts = [n - (edges[i - 1][1] if i else 0.0) for i, (_, n) in enumerate(edges)]
        if sum(counts):
            ax.plot([1000 * e for e, _ in edges], counts, marker="o", label=reason)
    ax.set_xscale("log")
    ax.set_xlabel("release latency (ms, bucket upper edge)")
    ax.set_ylabel("releases")
    ax.set_title("Handoff release latency by reason")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(directory / "release_latency.png", dpi=90)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(8, 3.5))
    plans = sorted(report["outcomes"])
    kinds = sorted({k for o in report["outcomes"].values() for k in o})
    bottom = [0] * len(plans)
    for kind in kinds:
        values = [report["outcomes"][p].get(kind, 0) for p in plans]
        ax.bar(plans, values, bottom=bottom, label=kind)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax.set_title("Request outcomes by plan")
    ax.legend(fontsize=8)
    plt.setp(ax.get_xticklabels(), rotation=20, fontsize=8)
    fig.tight_layout()
    fig.savefig(directory / "outcomes.png", dpi=90)
    plt.close(fig)
    return ["kv_blocks.png", "release_latency.png", "outcomes.png"]

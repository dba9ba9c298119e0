"""The chaos run's report: report.json (everything), report.md (the summary a person reads)
and three plots: KV blocks per node over time with the faults marked, release latency (by
the stage each cancel hit, and on the prefill nodes by reason), and request outcomes by
plan.

The stage of a cancel is the proxy's record of where the request was when it noticed the
client gone (`pdserve.proxy.client.Stage`), never the plan's intent. Where the proxy cannot
tell stages apart, the label names all it may be; without a record it is unknown.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pdserve_bench.chaos.checks import is_greedy_checked

if TYPE_CHECKING:
    from pdserve_bench.chaos.cluster import Sample
    from pdserve_bench.chaos.run import ChaosRun
    from pdserve_bench.chaos.workload import RequestRecord, Workload

FAULT_COLORS = {"kill": "red", "sigterm": "orange", "burst": "purple", "partition": "blue",
                "netem": "cyan", "scale": "green"}  # fmt: skip
STAGE_LABELS = {
    "receiving": "at the proxy, before the request was read",
    "prefill": "on prefill: queued or running",
    "between_legs": "between legs",
    "decode": "on decode before the first token: queued, transfer or first step",
    "streaming": "during decode",
    "answer": "on decode, answering without a stream (a node that ignores stream)",
}
"""The issue's stages: queued on prefill, during prefill, between legs, queued on decode,
during transfer, during decode. The proxy sees the legs, not the queues inside a node."""
UNKNOWN_STAGE = "unknown: the proxy saw no departure (answered already, or never reached)"
LOCAL_ONLY = (
    "num_prefill",
    "num_decode",
    "model",
    "dtype",
    "num_kv_blocks",
    "netns",
    "ray",
    "ray_address",
    "ray_node_cpus",
)
TARGET_ONLY = ("proxy", "prefill", "decode", "reference", "unseeded")
RELEASE_EDGES_MS = (10, 20, 50, 100, 1000)


def stage_label(stage: str | None) -> str:
    """The proxy reads every decode leg as a stream, for clients that did not ask for one
    too: its stages mean the same for both kinds of client."""
    return STAGE_LABELS.get(stage or "", UNKNOWN_STAGE)


def cancels_by_stage(records: list[RequestRecord], stages: dict[str, str]) -> dict[str, Any]:
    """Per stage: how many clients left there, and departure → no prefill node lists a
    handoff for the request (ms; None: not within the watch)."""
    out: dict[str, Any] = {}
    for r in records:
        if r.departed_s is None:
            continue
        label = stage_label(stages.get(r.request_id))
        row = out.setdefault(label, {"count": 0, "prefill_release_ms": []})
        row["count"] += 1
        ms = None if r.prefill_release_s is None else round(1000 * r.prefill_release_s, 1)
        row["prefill_release_ms"].append(ms)
    return out


def summary(chaos: ChaosRun, records: list[RequestRecord], workload: Workload,
            violations: list[str]) -> dict[str, Any]:  # fmt: skip
    outcomes: dict[str, dict[str, int]] = {}
    for r in records:
        outcome = ("ok" if r.status == 200 else "client_left" if r.departed_s is not None
                   else "no_answer" if r.status == 0 else str(r.status))  # fmt: skip
        plan = outcomes.setdefault(r.plan, {})
        plan[outcome] = plan.get(outcome, 0) + 1
    greedy_checked = sum(map(is_greedy_checked, records)) if chaos.cluster.reference_url else 0
    unused = TARGET_ONLY if chaos.cluster.launched_here else LOCAL_ONLY
    config = {k: v for k, v in vars(chaos.args).items()
              if k not in ("func", "api_key", "node_api_key", *unused)}  # fmt: skip
    config["lease_s"] = chaos.lease_s
    mode = chaos.cluster.mode
    if chaos.args.netns:
        mode += " in network namespaces"
    if chaos.args.ray:
        where = chaos.args.ray_address or "a local Ray cluster"
        mode += f" on Ray ({where}): node and proxy actors"
    return {
        "config": config,
        "mode": mode,
        "num_requests": len(records),
        "outcomes": outcomes,
        "faults": [asdict(f) for f in sorted(chaos.faults, key=lambda f: f.start_s)],
        "skipped": chaos.skipped,
        "greedy_outputs_checked": greedy_checked,
        "unauthenticated_aborts_refused": workload.refused_unauthenticated,
        "kv_bytes_read": chaos.counters.kv_bytes_read(),
        # vLLM nodes' KV bytes and release histograms are not counted: pdserve node metrics.
        "vllm_nodes": sorted(chaos.cluster.vllm_urls),
        "cancels_by_stage": cancels_by_stage(records, chaos.departure_stages),
        "release_histograms": chaos.counters.release_histograms(),
        "violations": violations,
        "requests": [_request_row(r, chaos.departure_stages) for r in records],
    }


def _request_row(r: RequestRecord, stages: dict[str, str]) -> dict[str, Any]:
    row = {"index": r.index, "plan": r.plan, "request_id": r.request_id, "stream": r.stream,
           "greedy": r.greedy, "start_s": round(r.start_s, 3), "end_s": round(r.end_s, 3),
           "status": r.status, "num_tokens": None if r.token_ids is None else len(r.token_ids),
           "error": r.error[:200]}  # fmt: skip
    if r.departed_s is not None:
        row["departed_s"] = round(r.departed_s, 3)
        row["stage"] = stage_label(stages.get(r.request_id))
        row["prefill_release_s"] = r.prefill_release_s
    return row


def headline(report: dict[str, Any]) -> str:
    faults = ", ".join(f"{f['kind']} {f['node']}" for f in report["faults"]) or "none"
    status = "OK" if not report["violations"] else f"{len(report['violations'])} VIOLATIONS"
    lines = [f"chaos ({report['mode']}): {report['num_requests']} requests, faults: {faults}; "
             f"{report['greedy_outputs_checked']} greedy outputs checked; "
             f"{report['unauthenticated_aborts_refused']} unauthenticated aborts refused: "
             f"{status}"]  # fmt: skip
    lines += [f"  skipped {what}: {why}" for what, why in report["skipped"].items()]
    lines += [f"  - {v}" for v in report["violations"][:20]]
    return "\n".join(lines)


def write_report(directory: Path, report: dict[str, Any], samples: list[Sample]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "report.json").write_text(json.dumps(report, indent=2, default=str))
    plots = _plot(directory, report, samples)
    (directory / "report.md").write_text(_markdown(report, plots))


def _markdown(report: dict[str, Any], plots: list[str]) -> str:
    lines = ["# Chaos run", "", f"Mode: {report['mode']}.", "",
             f"Config: `{json.dumps(report['config'])}`", "",
             f"- requests: {report['num_requests']}",
             f"- greedy outputs compared with the reference node: "
             f"{report['greedy_outputs_checked']}",
             f"- unauthenticated aborts refused: {report['unauthenticated_aborts_refused']}",
             f"- KV read by decode nodes: {report['kv_bytes_read'] / 2**20:.1f} MiB"
             + (" (pdserve nodes only: vLLM's export no byte count)"
                if report["vllm_nodes"] else ""),
             f"- violations: {len(report['violations'])}", ""]  # fmt: skip
    lines += [f"  - {v}" for v in report["violations"]]
    if report["skipped"]:
        lines += ["", "Skipped (not failures):", ""]
        lines += [f"- {what}: {why}" for what, why in report["skipped"].items()]
    lines += ["", "| fault | node | from (s) | to (s) | detail |", "|---|---|---|---|---|"]
    lines += [f"| {f['kind']} | {f['node']} | {f['start_s']:.1f} | {f['end_s']:.1f} | "
              f"{f['detail']} |" for f in report["faults"]]  # fmt: skip
    lines += ["", "| plan | outcomes |", "|---|---|"]
    lines += [f"| {plan} | {', '.join(f'{k}: {v}' for k, v in sorted(o.items()))} |"
              for plan, o in sorted(report["outcomes"].items())]  # fmt: skip
    lines += _stage_table(report["cancels_by_stage"]) + _reason_table(report["release_histograms"])
    lines += [f"![{p}]({p})" for p in plots]
    return "\n".join(lines) + "\n"


def _stage_table(stages: dict[str, Any]) -> list[str]:
    edges = " | ".join(f"≤ {e} ms" for e in RELEASE_EDGES_MS)
    lines = ["", "Cancels by the stage they hit (the proxy's record), and the time from the "
             "client leaving until no prefill node lists a handoff for the request (polled "
             "every 10 ms: an upper bound; where nothing was held, just the first poll):", "",
             f"| stage | cancels | {edges} | later or never |",
             "|---|---|" + "---|" * (len(RELEASE_EDGES_MS) + 1)]  # fmt: skip
    for label, row in sorted(stages.items(), key=lambda kv: -kv[1]["count"]):
        values = row["prefill_release_ms"]
        cells = [f"{100 * sum(v is not None and v <= e for v in values) / len(values):.0f}%"
                 for e in RELEASE_EDGES_MS]  # fmt: skip
        late = sum(v is None or v > RELEASE_EDGES_MS[-1] for v in values)
        lines.append(f"| {label} | {row['count']} | {' | '.join(cells)} | {late} |")
    return lines


def _reason_table(histograms: dict[str, dict[str, float]]) -> list[str]:
    lines = ["", "Release latency on the prefill nodes (trigger → blocks free), by reason:", "",
             "| reason | releases | ≤ 5 ms | ≤ 10 ms | ≤ 20 ms | ≤ 50 ms | ≤ 100 ms |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for reason, hist in sorted(histograms.items()):
        total = hist.get("+Inf", 0.0)
        if not total:
            continue
        cells = [f"{100 * hist.get(le, 0.0) / total:.0f}%"
                 for le in ("0.005", "0.01", "0.02", "0.04", "0.1")]  # fmt: skip
        lines.append(f"| {reason} | {total:.0f} | {' | '.join(cells)} |")
    return [*lines, "", "(the 50 ms column is the 40 ms bucket, the histogram's nearest edge)", ""]


def _plot(directory: Path, report: dict[str, Any], samples: list[Sample]) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # plots are optional; the numbers are in the report
        return []
    _plot_kv(plt, directory, report, samples)
    _plot_releases(plt, directory, report)
    _plot_outcomes(plt, directory, report)
    return ["kv_blocks.png", "release_latency.png", "outcomes.png"]


def _plot_kv(plt: Any, directory: Path, report: dict[str, Any], samples: list[Sample]) -> None:
    names = sorted({s.node for s in samples})
    fig, axes = plt.subplots(len(names) or 1, 1, figsize=(10, 2.2 * max(1, len(names))),
                             sharex=True, squeeze=False)  # fmt: skip
    for ax, name in zip(axes[:, 0], names, strict=False):
        mine = [s for s in samples if s.node == name]
        ax.plot([s.t_s for s in mine], [s.num_used for s in mine], label="used", lw=1)
        ax.plot([s.t_s for s in mine], [s.num_held for s in mine], label="held for P/D", lw=1)
        for f in report["faults"]:
            role_wide = name.startswith(f"{f['node']}-")  # scale: every node of the role
            if f["node"] in (name, "all") or role_wide or f["kind"] in ("partition", "netem"):
                ax.axvspan(f["start_s"], max(f["end_s"], f["start_s"] + 0.3), alpha=0.2,
                           color=FAULT_COLORS.get(f["kind"], "gray"), label=f["kind"])  # fmt: skip
        ax.set_ylabel(f"{name}\nblocks")
        ax.legend(loc="upper right", fontsize=7)
    axes[-1, 0].set_xlabel("seconds into the run")
    fig.suptitle("KV blocks per node (shaded: faults)")
    fig.tight_layout()
    fig.savefig(directory / "kv_blocks.png", dpi=90)
    plt.close(fig)


def _plot_releases(plt: Any, directory: Path, report: dict[str, Any]) -> None:
    fig, (by_stage, by_reason) = plt.subplots(1, 2, figsize=(13, 4))
    for label, row in sorted(report["cancels_by_stage"].items()):
        values = sorted(v for v in row["prefill_release_ms"] if v is not None)
        if values:
            shares = [(i + 1) / len(row["prefill_release_ms"]) for i in range(len(values))]
            by_stage.step(values, shares, where="post", label=f"{label} ({row['count']})")
    by_stage.set_xscale("log")
    by_stage.set_xlabel("client left → no prefill handoff listed (ms, polled)")
    by_stage.set_ylabel("share of the stage's cancels")
    by_stage.set_title("Cancels by the stage they hit")
    by_stage.legend(fontsize=6)
    for reason, hist in sorted(report["release_histograms"].items()):
        edges = sorted((float(le), n) for le, n in hist.items() if le != "+Inf")
        counts = [n - (edges[i - 1][1] if i else 0.0) for i, (_, n) in enumerate(edges)]
        if sum(counts):
            by_reason.plot([1000 * e for e, _ in edges], counts, marker="o", label=reason)
    by_reason.set_xscale("log")
    by_reason.set_xlabel("trigger → blocks free (ms, bucket upper edge)")
    by_reason.set_ylabel("releases")
    by_reason.set_title("Prefill nodes' release latency by reason")
    by_reason.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(directory / "release_latency.png", dpi=90)
    plt.close(fig)


def _plot_outcomes(plt: Any, directory: Path, report: dict[str, Any]) -> None:
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

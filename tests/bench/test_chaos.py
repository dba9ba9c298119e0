"""The chaos harness: its checks flag what they must (no processes), and a CI-sized run on
the tiny model passes with every fault injected."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from typing import Any

import pytest

from pdserve.bench.chaos.cluster import LocalCluster
from pdserve.bench.chaos.run import ChaosRun, Fault, _check_errors
from pdserve.bench.chaos.workload import RequestRecord


def chaos_with_faults(*faults: Fault) -> ChaosRun:
    cluster = LocalCluster([], 1, 1, "k")
    return ChaosRun(argparse.Namespace(), cluster, faults=list(faults))


def test_errors_are_excused_only_near_a_fault() -> None:
    chaos = chaos_with_faults(Fault("kill", "decode-1", start_s=10.0, end_s=14.0))
    records = [
        RequestRecord(1, "complete", start_s=9.0, end_s=11.0, status=502),  # during the kill
        RequestRecord(2, "complete", start_s=15.0, end_s=15.5, status=503),  # just after
        RequestRecord(3, "complete", start_s=30.0, end_s=30.2, status=500),  # a defect
        RequestRecord(4, "complete", start_s=31.0, end_s=31.1, status=0, error="reset"),
        RequestRecord(5, "cancel", start_s=32.0, end_s=32.1, status=0),  # the client left
        RequestRecord(6, "complete", start_s=33.0, end_s=33.1, status=400),  # its own fault
    ]
    violations = _check_errors(chaos, records)
    assert [v.split()[1] for v in violations] == ["3", "4"]


@pytest.mark.timeout(400)
def test_ci_sized_chaos_run_passes_with_every_fault(tiny_model_dir: Any, tmp_path: Any) -> None:
    report_dir = tmp_path / "report"
    cmd = [sys.executable, "-m", "pdserve.cli", "bench", "chaos", "--duration-s", "40",
           "--model", str(tiny_model_dir("llama")), "--num-prefill", "2", "--num-decode", "2",
           "--seed", "1", "--rate", "6", "--long-prompt-tokens", "200", "--lease-s", "2",
           "--report", str(report_dir)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=380)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    report = json.loads((report_dir / "report.json").read_text())
    assert report["violations"] == []
    assert {f["kind"] for f in report["faults"]} == {"kill", "burst", "sigterm"}
    assert sum(1 for f in report["faults"] if f["kind"] == "kill") == 2
    assert report["num_requests"] > 100
    assert report["greedy_outputs_checked"] > 20
    assert report["unauthenticated_aborts_refused"] > 0
    for plot in ("kv_blocks.png", "release_latency.png", "outcomes.png"):
        assert (report_dir / plot).stat().st_size > 1000

"""`pdserve bench offline` end to end on a tiny model (the HF comparison runs in `make bench`)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from pdserve.cli import main


def test_offline_bench_reports_pdserve_throughput(
    tiny_model_dir: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["bench", "offline", "--model", str(tiny_model_dir("llama")), "--dtype", "float32"]
    args += ["--num-prompts", "3", "--input-len", "8", "--output-len", "4", "--repeat", "2"]
    assert main([*args, "--json"]) == 0
    out = capsys.readouterr().out
    assert "workload fixed: 3 requests, 24 prompt + 12 output tokens" in out
    assert any(line.startswith("pdserve ") for line in out.splitlines())
    assert "pdserve runs (s):" in out
    (result,) = json.loads(out.splitlines()[-1])
    assert result["system"] == "pdserve" and result["seconds"] > 0
    assert result["output_tokens_per_s"] == pytest.approx(12 / result["seconds"])


def test_unknown_peer_is_refused(tiny_model_dir: Any) -> None:
    args = ["bench", "offline", "--model", str(tiny_model_dir("llama")), "--compare", "tgi"]
    with pytest.raises(SystemExit, match="unknown --compare peer"):
        main([*args, "--num-prompts", "1", "--output-len", "2", "--repeat", "1"])

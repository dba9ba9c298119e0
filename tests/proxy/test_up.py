"""`pdserve up --ask`, what `make run` runs: a whole local cluster on the default model."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import httpx
import pytest

from tests.api.conftest import free_port


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_up_answers_a_chat_request_through_the_proxy_and_stops_everything() -> None:
    port = free_port()
    cmd = [sys.executable, "-m", "pdserve.cli", "up", "--port", str(port), "--dtype", "float32",
           "--max-tokens", "16", "--ask", "What is the capital of France?"]  # fmt: skip
    env = {**os.environ, "PDSERVE_LOG_LEVEL": "WARNING"}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Paris" in done.stdout
    [listing] = [line for line in done.stdout.splitlines() if line.startswith("nodes: ")]
    urls = re.findall(r"http://[0-9.:]+", listing)
    assert len(urls) == 2
    for url in urls:  # every node was stopped
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{url}/health", timeout=2)

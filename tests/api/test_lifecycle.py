"""Start-up and SIGTERM drain of `pdserve serve`, each on its own server process."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.api.conftest import free_port, start_server, stop_server

BODY = {"prompt": [100, 200, 300], "max_tokens": 40, "ignore_eos": True, "temperature": 0}


def _post_in_thread(url: str, body: dict[str, Any], result: dict[str, Any]) -> threading.Thread:
    def run() -> None:
        try:
            result["response"] = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
        except httpx.HTTPError as e:
            result["error"] = e

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def _wait_running(url: str) -> None:
    deadline = time.monotonic() + 30
    while httpx.get(f"{url}/admin/kv", timeout=5).json()["num_running"] == 0:
        assert time.monotonic() < deadline, "request never started"
        time.sleep(0.01)


def test_health_is_503_while_loading_then_sigterm_drains_in_flight_requests() -> None:
    statuses: list[int] = []
    server = start_server("--num-kv-blocks", "64", on_health=statuses.append)
    assert 503 in statuses and statuses[-1] == 200  # listening before the model was ready
    result: dict[str, Any] = {}
    thread = _post_in_thread(server.url, BODY, result)
    _wait_running(server.url)
    server.process.send_signal(signal.SIGTERM)
    time.sleep(0.1)
    assert httpx.get(f"{server.url}/health", timeout=5).status_code == 503
    refused = httpx.post(f"{server.url}/v1/completions", json=BODY, timeout=5)
    assert refused.status_code == 503 and refused.json()["error"]["type"] == "service_unavailable"
    thread.join(60)
    response = result["response"]
    assert response.status_code == 200
    assert response.json()["usage"]["completion_tokens"] == 40
    assert server.process.wait(30) == 0


def test_sigterm_drain_timeout_aborts_with_503s_and_exits_zero() -> None:
    """What is still running at the drain timeout is aborted and answered as such: 503,
    or, for a stream that already sent tokens, an error event then [DONE]; never a 200
    that reads like a completion."""
    server = start_server("--num-kv-blocks", "256", "--drain-timeout-s", "1")
    result: dict[str, Any] = {}
    thread = _post_in_thread(server.url, {**BODY, "max_tokens": 3000}, result)
    events: list[str] = []

    def stream() -> None:
        body = {**BODY, "max_tokens": 3000, "stream": True}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30) as r:
            events.extend(line for line in r.iter_lines() if line)

    streamer = threading.Thread(target=stream)
    streamer.start()
    deadline = time.monotonic() + 30
    while httpx.get(f"{server.url}/admin/kv", timeout=5).json()["num_running"] < 2:
        assert time.monotonic() < deadline, "requests never started"
        time.sleep(0.01)
    start = time.monotonic()
    assert stop_server(server) == 0
    assert time.monotonic() - start < 15
    thread.join(30)
    streamer.join(30)
    response = result["response"]
    assert response.status_code == 503, response.text
    assert response.json()["error"]["type"] == "service_unavailable"
    assert "shutting down" in response.json()["error"]["message"]
    assert len(events) > 2 and events[-1] == "data: [DONE]"
    assert '"type": "service_unavailable"' in events[-2]
    assert all('"finish_reason": null' in e for e in events[:-2])


def test_engine_process_death_turns_into_503s_not_hangs(
    capfd: pytest.CaptureFixture[str],
) -> None:
    server = start_server("--num-kv-blocks", "256")
    try:
        pid = server.process.pid
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        (engine_pid,) = (  # not multiprocessing's resource tracker
            int(c) for c in children if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()
        )
        result: dict[str, Any] = {}
        thread = _post_in_thread(server.url, {**BODY, "max_tokens": 900}, result)
        lines: list[str] = []

        def stream() -> None:
            body = {**BODY, "max_tokens": 900, "stream": True}
            with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30) as r:
                lines.extend(r.iter_lines())

        streamer = threading.Thread(target=stream)
        streamer.start()
        _wait_running(server.url)
        time.sleep(0.3)
        os.kill(engine_pid, signal.SIGKILL)
        thread.join(30)
        streamer.join(30)
        response = result["response"]
        assert response.status_code == 503, response.text  # an error, never a hang or a 500
        events = [line for line in lines if line]
        assert '"type": "service_unavailable"' in events[-2] and events[-1] == "data: [DONE]"
        deadline = time.monotonic() + 10
        while httpx.get(f"{server.url}/health", timeout=5).status_code != 503:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        after = httpx.post(f"{server.url}/v1/completions", json=BODY, timeout=10)
        assert after.status_code == 503 and after.json()["error"]["type"] == "service_unavailable"
        assert "engine process was ended by SIGKILL" in capfd.readouterr().err  # the log says how
    finally:
        stop_server(server)


@pytest.mark.timeout(120)
def test_a_node_whose_engine_cannot_start_exits_non_zero_naming_the_cause(
    tiny_model_dir: Any, tmp_path: Path
) -> None:
    """Not a node that listens forever answering 503: it stops, and says why."""
    import shutil
    import subprocess
    import sys

    broken = tmp_path / "broken"
    shutil.copytree(tiny_model_dir("llama"), broken)
    (broken / "model.safetensors").write_bytes(b"not safetensors")
    cmd = [sys.executable, "-m", "pdserve.cli", "serve", "--model", str(broken),
           "--port", str(free_port())]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=100)
    assert done.returncode != 0
    assert "cannot read model.safetensors" in done.stderr, done.stderr[-2000:]

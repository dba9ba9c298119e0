"""`--compare llamacpp` with many prompts: llama-server --parallel N, against a stand-in
server that speaks the part of its HTTP API the peer uses."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import pytest

from pdserve_bench import llama_server, offline

# A stand-in for llama-server: answers /health, then each /completion with `n_predict`
# tokens (at most 100) after 0.3 s; logs its argv, every body, and the requests in flight.
FAKE_SERVER = """
import json, sys, threading, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
argv = sys.argv[1:]
port = int(argv[argv.index("--port") + 1])
log = open(LOG, "a", buffering=1)
log.write(json.dumps({"argv": argv}) + "\\n")
lock, in_flight = threading.Lock(), [0]

class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def reply(self, body):
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self.reply({"status": "ok"})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with lock:
            in_flight[0] += 1
            log.write(json.dumps({"body": body, "in_flight": in_flight[0]}) + "\\n")
        time.sleep(0.3)
        with lock:
            in_flight[0] -= 1
        self.reply({"tokens": [7] * min(body["n_predict"], 100), "content": "x"})

ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()
"""


def _install_fake_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    log = tmp_path / "server.log"
    server_dir = tmp_path / "llama-server"
    (server_dir / "bin").mkdir(parents=True)
    binary = server_dir / "bin" / "llama-server"
    binary.write_text(f"#!{sys.executable}\nLOG = {str(log)!r}\n{FAKE_SERVER}")
    os.chmod(binary, 0o755)
    (server_dir / ".llama-server-0.3.36-built").touch()
    monkeypatch.setattr(llama_server, "LLAMA_SERVER_DIR", server_dir)
    return log


def test_many_prompts_go_to_llama_server_all_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = _install_fake_server(tmp_path, monkeypatch)
    planned = offline.Workload("fixed", [[1, 2, 3]] * 4, [5] * 4)
    runner = offline.llamacpp_runner(argparse.Namespace(model="default", threads=2), planned)
    try:
        assert runner.name == "llama-server-np4"
        seconds = runner(planned)
    finally:
        runner.close()  # type: ignore[attr-defined]
    assert 0.3 < seconds < 1.2  # four 0.3 s requests, concurrently
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    argv = lines[0]["argv"]
    assert argv[argv.index("--parallel") + 1] == "4"
    assert argv[argv.index("-c") + 1] == str(4 * 8)  # 4 slots of 3 + 5 tokens
    assert argv[argv.index("-t") + 1] == "2"
    bodies = [line["body"] for line in lines[1:]]
    assert all(b["prompt"] == [1, 2, 3] and b["n_predict"] == 5 for b in bodies)
    assert all(b["temperature"] == 0 and b["ignore_eos"] and not b["cache_prompt"] for b in bodies)
    assert max(line["in_flight"] for line in lines[1:]) > 1
    assert runner._proc.poll() is not None  # type: ignore[attr-defined]  # stopped


def test_a_short_answer_is_an_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _install_fake_server(tmp_path, monkeypatch)
    planned = offline.Workload("fixed", [[1]] * 2, [101, 3])
    runner = offline.llamacpp_runner(argparse.Namespace(model="default", threads=1), planned)
    try:
        with pytest.raises(RuntimeError, match="produced 103 tokens, not 104"):
            runner(planned)
    finally:
        runner.close()  # type: ignore[attr-defined]


def test_without_llama_server_the_binding_runs_them_serially(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(llama_server, "LLAMA_SERVER_DIR", tmp_path / "missing")
    monkeypatch.setattr(offline, "LLAMACPP_VENV", tmp_path / "missing-venv")
    planned = offline.Workload("fixed", [[1, 2]] * 2, [3, 3])
    with pytest.raises(SystemExit, match=r"run .*bench/llamacpp/setup\.sh"):
        offline.llamacpp_runner(argparse.Namespace(model="default", threads=1), planned)
    assert "setup_server.sh): llama.cpp runs the requests serially" in capsys.readouterr().out


def test_the_avx2_build_is_a_peer_of_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(offline, "LLAMACPP_AVX2_VENV", tmp_path / "missing-venv")
    planned = offline.Workload("fixed", [[1, 2]], [3])
    missing = r"missing-venv/bin/python not found: run LEVEL=avx2 .*setup\.sh"
    with pytest.raises(SystemExit, match=missing):
        offline.PEERS["llamacpp-avx2"](argparse.Namespace(model="default", threads=1), planned)

"""`pdserve up`: `--ask`, what `make run` runs (a whole local cluster on the default model),
and no node outliving it whichever signal stops it."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from tests.api.conftest import free_port


def _cpu_levels() -> list[Any]:
    """The machine's level as the environment leaves it (what `make run` uses), and the AVX2
    path forced where that level is above it: each with the dtype `auto` picks there (bf16
    only where it is native)."""
    from pdserve.model.cpu_isa import CpuIsa, effective

    own = os.environ.get("PDSERVE_CPU_ISA", "auto")
    reason = f"the level here is already {effective().label}: the first case runs it"
    skip = pytest.mark.skipif(effective() <= CpuIsa.AVX2, reason=reason)
    return [
        pytest.param(own, False, id=own),
        pytest.param("avx2", False, id="forced-avx2", marks=skip),
        pytest.param(own, True, id=f"{own}-tls"),  # every hop over HTTPS (pdserve/tls.py)
    ]


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("cpu_level", "tls"), _cpu_levels())
def test_up_answers_a_chat_request_through_the_proxy_and_stops_everything(
    cpu_level: str, tls: bool, chat_model_dir: Path
) -> None:
    """`make run` on the default model; over TLS on the tiny chat model (the TLS hops need
    no real answer, and a default-model cluster costs ~10 s more to start)."""
    port = free_port()
    model = ["--model", str(chat_model_dir), "--dtype", "float32"] if tls else []
    cmd = [
        sys.executable,
        "-m",
        "pdserve.cli",
        "up",
        "--port",
        str(port),
        "--max-tokens",
        "16",
        "--ask",
        "What is the capital of France?",
        *(["--tls"] if tls else []),
        *model,
    ]
    env = {**os.environ, "PDSERVE_LOG_LEVEL": "WARNING", "PDSERVE_CPU_ISA": cpu_level}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stderr[-2000:]
    if not tls:
        assert _single_node_answer(cpu_level, "What is the capital of France?") in done.stdout
    [listing] = [line for line in done.stdout.splitlines() if line.startswith("nodes: ")]
    urls = re.findall(r"https?://[0-9.:]+", listing)
    assert len(urls) == 2 and all(u.startswith("https://" if tls else "http://") for u in urls)
    for url in urls:  # every node was stopped
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{url}/health", timeout=2, verify=False)


def test_a_busy_port_fails_at_once_before_any_node_starts(tiny_model_dir: Any) -> None:
    """`up` holds its port before it starts a node: no node can pick it (CI lost a run to
    one that did), and a busy port fails in a second, not after the models have loaded."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        cmd = [sys.executable, "-m", "pdserve.cli", "up", "--port", str(port),
               "--dtype", "float32", "--model", str(tiny_model_dir("llama"))]  # fmt: skip
        started = time.monotonic()
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port}" in done.stderr, done.stderr
    assert "starting" not in done.stdout and time.monotonic() - started < 20


def _single_node_answer(cpu_level: str, question: str) -> str:
    """The default model's greedy answer on one node at `cpu_level`, which P/D must repeat.
    In float32 it is "Paris"; bf16 sits on a near tie there ("The" 0.08 above "L" in
    float32) that the order of a linear's sums decides: the AMX class's tiles answer
    "L'Étoile, la Marseillaise…", the same bf16 products summed by the AVX-512 loop "Paris"
    (docs/benchmarks.md, 2026-12-05)."""
    from pdserve import LLM, SamplingParams
    from tests.conftest import cpu_level as level

    with level(cpu_level):
        llm = LLM("default")  # the nodes' defaults: the prompt in one chunk, as they take it
    message = [{"role": "user", "content": question}]
    [out] = llm.chat(message, SamplingParams(temperature=0, max_tokens=16))
    if llm.engine.loaded.dtype == torch.float32:
        assert "Paris" in out.outputs[0].text
    return out.outputs[0].text


def _descendants(pid: int) -> dict[int, str]:
    """Every process under `pid`, by pid, with its start time (a reused pid is not it)."""
    found: dict[int, str] = {}
    frontier = [pid]
    while frontier:
        parent = frontier.pop()
        for stat in Path("/proc").glob("[0-9]*/stat"):
            with contextlib.suppress(OSError, IndexError, ValueError):
                fields = stat.read_text().rsplit(")", 1)[1].split()
                if int(fields[1]) == parent:
                    child = int(stat.parent.name)
                    found[child] = fields[19]
                    frontier.append(child)
    return found


def _alive(pid: int, started: str) -> bool:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return False
    return fields[0] != "Z" and fields[19] == started


STOPS = {signal.SIGTERM: 0, signal.SIGINT: 130, signal.SIGKILL: -signal.SIGKILL}
"""Each signal and the exit status `pdserve up` answers it with: SIGTERM is a stop asked for
(systemd, `kill PID`), Ctrl-C an interruption."""


@pytest.mark.timeout(240)
def test_no_node_outlives_pdserve_up(tiny_model_dir: Any, tmp_path: Path) -> None:
    """Only `pdserve up` gets the signal, as from systemd, `kill PID`, Ctrl-C or a CI
    timeout: its nodes' API and engine processes all end too (SIGKILL: they notice their
    parent gone). Idle before that, at the default log level, it prints nothing (it printed
    the health checks, two lines a second). One `up` per signal, side by side (a start is
    mostly waiting)."""
    env = {k: v for k, v in os.environ.items() if k != "PDSERVE_LOG_LEVEL"}
    ups: dict[signal.Signals, tuple[subprocess.Popen[bytes], int, Path]] = {}
    trees: dict[signal.Signals, dict[int, str]] = {}
    try:
        for sig in STOPS:
            port = free_port()
            cmd = [sys.executable, "-m", "pdserve.cli", "up", "--port", str(port),
                   "--dtype", "float32", "--model", str(tiny_model_dir("llama")),
                   "--num-kv-blocks", "64"]  # fmt: skip
            console = tmp_path / f"console-{sig.name}.txt"
            with console.open("wb") as output:
                ups[sig] = (
                    subprocess.Popen(cmd, env=env, stdout=output, stderr=output),
                    port,
                    console,
                )
        deadline = time.monotonic() + 180
        for sig, (up, port, _) in ups.items():
            while not _healthy(f"http://127.0.0.1:{port}"):
                assert up.poll() is None and time.monotonic() < deadline, f"{sig.name}: no start"
                time.sleep(0.2)
        time.sleep(1)  # the ready banners
        ready = {sig: console.read_text() for sig, (_, _, console) in ups.items()}
        time.sleep(2)  # two rounds of health checks of both nodes
        for sig, (up, _, console) in ups.items():
            assert console.read_text() == ready[sig], console.read_text()[len(ready[sig]) :]
            # One line for the start (its progress rewritten in place on a terminal), none
            # of the nodes' INFO, NIXL's or the loading bars.
            starts = [line for line in ready[sig].splitlines() if line.startswith("starting")]
            assert len(starts) == 1 and "ready in" in starts[0], ready[sig]
            for noise in ("NIXL", "loading", " INFO "):
                assert noise not in ready[sig], ready[sig]
            trees[sig] = _descendants(up.pid)
            assert len(trees[sig]) >= 4, trees[sig]  # two nodes, each an API and an engine
        for sig, (up, _, _) in ups.items():
            up.send_signal(sig)
        for sig, (up, _, _) in ups.items():
            up.wait(60)
            assert up.returncode == STOPS[sig], f"{sig.name}: exit status {up.returncode}"
        deadline = time.monotonic() + 20
        for sig, tree in trees.items():
            while survivors := [pid for pid, started in tree.items() if _alive(pid, started)]:
                assert time.monotonic() < deadline, f"{sig.name}: still running: {survivors}"
                time.sleep(0.1)
    finally:
        for up, _, _ in ups.values():
            up.kill()
            up.wait()
        for tree in trees.values():
            for pid, started in tree.items():
                if _alive(pid, started):
                    os.kill(pid, signal.SIGKILL)


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _flags(parser: Any) -> dict[str, Any]:
    return {s: a for a in parser._actions for s in a.option_strings if s.startswith("--")}


def test_up_takes_and_forwards_every_node_flag_serve_takes() -> None:
    """Issue 54: `pdserve up` has each flag of `serve` but what it decides per node itself
    (role, address, parent, TLS files, the config file it reads itself), and hands each node
    the ones given a value other than their default."""
    from pdserve.cli import build_parser
    from pdserve.proxy.up import node_args

    parser = build_parser(with_bench=False)
    sub = next(a for a in parser._actions if a.dest == "command").choices
    serve, up = _flags(sub["serve"]), _flags(sub["up"])
    own = {"--role", "--host", "--port", "--parent-pid", "--help", "--config"}
    own |= {s for s in serve if s.startswith("--ssl") or s.startswith("--debug-step")}
    missing = sorted(set(serve) - set(up) - own)
    assert not missing, f"`up` lacks node flags: {missing}"
    argv, expected = ["up"], []
    for flag, action in sorted(serve.items()):
        if flag in own or flag in ("--api-key", "--log-level", "--otlp-endpoint"):
            continue  # forwarded as the cluster's, below
        if action.nargs == 0:
            argv.append(flag)
            expected.append([flag])
            continue
        value = (
            action.choices[-1] if action.choices else {int: "7", float: "0.5"}.get(action.type, "x")
        )
        if str(value) == str(action.default):
            value = action.choices[0]
        argv += [flag, str(value)]
        expected.append([flag, str(action.type(value) if action.type else value)])
    args = sub["up"].parse_args(argv[1:])
    forwarded = node_args(args, "decode")
    for pair in expected:
        i = forwarded.index(pair[0])
        assert forwarded[i : i + len(pair)] == pair, (pair, forwarded)
    assert forwarded[:2] == ["--role", "decode"]

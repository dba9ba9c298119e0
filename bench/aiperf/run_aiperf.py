"""AIPerf against `pdserve up`, with requests cancelled, then every node checked idle.

    bench/aiperf/setup.sh
    .venv/bin/python bench/aiperf/run_aiperf.py [--cancel-rate 30] [--cancel-delays 0,0.3,1]

Steps: export the model's tokenizer as a Hugging Face directory (AIPerf counts tokens with
it and, offline, cannot fetch one); start `pdserve up` (1 prefill + 1 decode node behind
the proxy); run `aiperf profile` once per cancellation delay (0: right after the request
is sent, during prefill; larger delays land between the legs, on decode and mid-stream),
each cancelling `--cancel-rate` percent of its requests; after each, wait until every
node holds no KV block and no handoff, which must happen within the prefill node's lease;
print AIPerf's TTFT/ITL table and the idle times. Exit 1 if a node stays busy.

AIPerf 0.13 refuses to start with HF_HUB_OFFLINE set even with a local tokenizer, so it
runs without it; the tokenizer is a local directory, so nothing is fetched.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import IO

from pdserve_bench.routing import wait_all_idle

ROOT = Path(__file__).resolve().parents[2]
AIPERF = ROOT / "bench" / ".venv-aiperf" / "bin" / "aiperf"
LEASE_S = 5.0  # pdserve's default --lease-s


def main() -> int:
    args = parse_args()
    if not AIPERF.exists():
        print(f"{AIPERF} not found: run bench/aiperf/setup.sh", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="pdserve-aiperf-"))
    tokenizer = export_tokenizer(args.model, work / "tokenizer")
    port = free_port()
    up = subprocess.Popen(
        [sys.executable, "-m", "pdserve.cli", "up", "--port", str(port), "--model", args.model],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        nodes = wait_for_cluster(up)
        failures = 0
        for delay in [float(d) for d in args.cancel_delays.split(",")]:
            out = work / f"delay-{delay:g}"
            run_aiperf(args, port, tokenizer, delay, out)
            idle_s = wait_all_idle(nodes, timeout_s=LEASE_S + 5)
            verdict = "ok" if idle_s <= LEASE_S else "NOT within the lease"
            print(f"cancel delay {delay:g} s: every node idle {idle_s:.2f} s after AIPerf ended "
                  f"({verdict})", flush=True)  # fmt: skip
            failures += idle_s > LEASE_S
        return 1 if failures else 0
    finally:
        up.send_signal(signal.SIGINT)
        up.wait(60)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="default")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--requests", type=int, default=120, help="per cancellation delay")
    p.add_argument("--input-tokens", type=int, default=256)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--cancel-rate", type=float, default=30.0, help="percent of requests")
    p.add_argument("--cancel-delays", default="0,0.3,1.0", help="seconds after sending")
    return p.parse_args()


def export_tokenizer(model: str, path: Path) -> Path:
    from pdserve.model.files import load_tokenizer

    tokenizer = load_tokenizer(model)
    if tokenizer is None:
        raise SystemExit(f"{model} has no tokenizer")
    path.mkdir(parents=True)
    tokenizer.save_hf(path)
    return path


def free_port() -> int:
    from pdserve.launch import free_port as free

    return free()


def wait_for_cluster(up: subprocess.Popen[str]) -> list[str]:
    """The node URLs `pdserve up` prints, once its proxy is ready."""
    nodes: list[str] = []
    assert up.stdout is not None
    for line in up.stdout:
        print(f"  up: {line.rstrip()}", flush=True)
        if line.startswith("nodes: "):
            nodes = [part.split()[-1] for part in line[len("nodes: ") :].split(",")]
        if "cluster ready" in line:
            threading.Thread(target=_echo, args=(up.stdout,), daemon=True).start()
            return nodes
    raise SystemExit(f"pdserve up exited ({up.wait()})")


def _echo(stream: IO[str]) -> None:
    """Keep printing the cluster's console, so that its pipe never fills."""
    for line in stream:
        print(f"  up: {line.rstrip()}", flush=True)


def run_aiperf(
    args: argparse.Namespace, port: int, tokenizer: Path, delay: float, out: Path
) -> None:
    cmd = [
        str(AIPERF), "profile", "--model", args.model, "--url", f"http://127.0.0.1:{port}",
        "--endpoint-type", "chat", "--streaming", "--tokenizer", str(tokenizer),
        "--concurrency", str(args.concurrency), "--request-count", str(args.requests),
        "--synthetic-input-tokens-mean", str(args.input_tokens),
        "--output-tokens-mean", str(args.output_tokens),
        "--request-cancellation-rate", str(args.cancel_rate),
        "--request-cancellation-delay", str(delay),
        "--ui-type", "none", "--artifact-dir", str(out),
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    print(f"aiperf, {args.cancel_rate:g}% cancelled {delay:g} s after sending:", flush=True)
    subprocess.run(cmd, env=env, check=True)


if __name__ == "__main__":
    sys.exit(main())

"""llama.cpp serving concurrent requests: `llama-server --parallel N` as a peer of
`pdserve bench offline --compare llamacpp` when the workload has more than one prompt.

The binding (run_llamacpp.py) runs one sequence at a time; llama-server is llama.cpp's
own answer to many requests at once: N slots, continuous batching, one batch a step. The
server is built from source by bench/llamacpp/setup_server.sh (the llama.cpp that
llama-cpp-python vendors) into bench/.llama-server. Its life here:

    start: llama-server on 127.0.0.1 and a free port, the GGUF file as it is, N slots of
           the workload's longest context each, `--threads` compute threads
      │    wait for GET /health to answer 200
      ▼
    each run: every prompt POSTed to /completion at once, as token ids; greedy, EOS
      │       ignored, exactly its output length, no prompt cache; timed here from the
      │       first send to the last answer
      ▼
    close: terminate (kill after 10 s); the server never outlives the bench
"""

from __future__ import annotations

import argparse
import logging
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import torch

from pdserve.launch import free_port
from pdserve_bench.llamacpp_amx import REPACK_OFF_REASON, repack_allowed

logger = logging.getLogger(__name__)

_CHECKOUT = Path(__file__).resolve().parents[2]
LLAMA_SERVER_DIR = _CHECKOUT / "bench" / ".llama-server"
LLAMA_SERVER_SETUP = _CHECKOUT / "bench" / "llamacpp" / "setup_server.sh"
START_TIMEOUT_S = 120.0


def llama_server_binary() -> Path | None:
    """The built server, or None when setup_server.sh has not finished."""
    binary = LLAMA_SERVER_DIR / "bin" / "llama-server"
    built = any(LLAMA_SERVER_DIR.glob(".llama-server-*-built"))
    return binary if built and binary.exists() else None


class LlamaServerRunner:
    """`llama-server --parallel N` on the same GGUF file; N = the workload's prompts."""

    def __init__(
        self, binary: Path, model_path: Path, threads: int, slots: int, ctx_per_slot: int
    ) -> None:
        self.name = f"llama-server-np{slots}"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = [
            str(binary),
            *("-m", str(model_path), "--host", "127.0.0.1", "--port", str(self.port)),
            *("-t", str(threads), "-tb", str(threads), "--parallel", str(slots)),
            *("-c", str(slots * ctx_per_slot), "--cache-ram", "0", "--no-webui"),
            *("--log-verbosity", "2"),
            *(() if repack_allowed() else ("--no-repack",)),
        ]
        self.command = command
        self._proc = subprocess.Popen(command, stdout=subprocess.DEVNULL)
        self._client = httpx.Client(timeout=httpx.Timeout(600.0), limits=_limits(slots))
        self._pool = ThreadPoolExecutor(max_workers=slots)
        try:
            self.load_s = self._wait_ready()
        except BaseException:
            self.close()
            raise

    def _wait_ready(self) -> float:
        start = time.perf_counter()
        while time.perf_counter() - start < START_TIMEOUT_S:
            if self._proc.poll() is not None:
                raise SystemExit(f"llama-server exited ({self._proc.returncode}) while loading")
            try:
                if self._client.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    return time.perf_counter() - start
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise SystemExit(f"llama-server not ready after {START_TIMEOUT_S:.0f} s")

    def __call__(self, workload: Any) -> float:
        """Every prompt at once; the seconds until the last answer."""
        start = time.perf_counter()
        futures = [
            self._pool.submit(self._complete, prompt, n)
            for prompt, n in zip(workload.prompts, workload.output_lens, strict=True)
        ]
        produced = [f.result() for f in futures]
        seconds = time.perf_counter() - start
        if produced != list(workload.output_lens):
            raise RuntimeError(
                f"{self.name} produced {sum(produced)} tokens, not {workload.num_output_tokens}"
            )
        return seconds

    def _complete(self, prompt: list[int], num_tokens: int) -> int:
        body = {
            "prompt": prompt,
            "n_predict": num_tokens,
            "temperature": 0.0,  # greedy
            "ignore_eos": True,
            "cache_prompt": False,
            "return_tokens": True,
        }
        response = self._client.post(f"{self.url}/completion", json=body)
        response.raise_for_status()
        return len(response.json()["tokens"])

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._client.close()
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()


def _limits(slots: int) -> httpx.Limits:
    return httpx.Limits(max_connections=slots, max_keepalive_connections=slots)


def llama_server_runner(args: argparse.Namespace, planned: Any) -> LlamaServerRunner | None:
    """llama-server sized for `planned`, or None (logged) when it is not built."""
    from pdserve.model.files import resolve_model_path
    from pdserve_bench.offline import max_model_len

    binary = llama_server_binary()
    if binary is None:
        return None
    threads = args.threads or torch.get_num_threads()
    slots = len(planned.prompts)
    runner = LlamaServerRunner(
        binary, resolve_model_path(args.model), threads, slots, max_model_len(planned)
    )
    print(
        f"llama-server --parallel {slots} ({threads} threads, {slots} slots of "
        f"{max_model_len(planned)} tokens, greedy, no prompt cache), ready in "
        f"{runner.load_s:.1f} s: {' '.join(runner.command[1:])}"
    )
    if not repack_allowed():
        print(REPACK_OFF_REASON)
    return runner

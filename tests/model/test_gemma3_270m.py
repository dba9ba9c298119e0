"""The real model of a second family (issue 54): Gemma 3 270M (Q4_K_M, the `gemma3` extra)
through `pdserve up` (a proxy, a prefill and a decode node), against Hugging Face
transformers on the same file. System tier: three processes load 250 MB each, and
transformers' own GGUF loader takes ~55 s.

The reference is transformers twice over: its Gemma 3 on the weights pdserve's reader gives
(`pdserve_bench.hf_reference`), and its own GGUF loader (dequantizing, renaming and undoing
llama.cpp's norm offset itself), so the file is read independently of pdserve.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Any

import httpx
import pytest
import torch

from pdserve.launch import health_status
from tests.api.conftest import free_port

pytestmark = [pytest.mark.system, pytest.mark.timeout(600)]

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def gemma_file() -> Any:
    from pdserve.model.files import gemma3_270m_path

    return gemma3_270m_path()


def _wait_healthy(url: str, timeout_s: float, process: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + timeout_s
    while health_status(url) != 200:
        assert process.poll() is None, "pdserve up exited before it was ready"
        assert time.monotonic() < deadline, f"{url} not healthy within {timeout_s} s"
        time.sleep(0.5)


def _hf_greedy(model: Any, ids: list[int]) -> list[int]:
    out = model.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)
    return [int(t) for t in out[0, len(ids) :]]


def test_gemma3_270m_through_pdserve_up_answers_as_transformers(gemma_file: Any) -> None:
    import transformers

    from pdserve.model.gguf_file import open_gguf
    from pdserve_bench.hf_reference import hf_model_from_gguf

    ids = open_gguf(gemma_file).tokenizer().encode(PROMPT)
    ours_in_hf, _ = hf_model_from_gguf(gemma_file)
    expected = _hf_greedy(ours_in_hf, ids)
    native = transformers.AutoModelForCausalLM.from_pretrained(
        str(gemma_file.parent), gguf_file=gemma_file.name, dtype=torch.float32
    ).eval()
    assert _hf_greedy(native, ids) == expected  # the file read by transformers itself
    port = free_port()
    cmd = [sys.executable, "-m", "pdserve.cli", "up", "--model", "gemma3-270m", "--port",
           str(port), "--dtype", "float32", "--max-model-len", "2048"]  # fmt: skip
    env = {**os.environ, "PDSERVE_LOG_LEVEL": "WARNING"}
    up = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_healthy(url, 300, up)
        body = {"prompt": PROMPT, "max_tokens": 16, "temperature": 0, "return_token_ids": True}
        answer = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()
        assert answer["choices"][0]["token_ids"] == expected, answer
    finally:
        up.send_signal(signal.SIGTERM)
        output, _ = up.communicate(timeout=120)
    assert up.returncode == 0, output[-3000:]
    assert b"Gemma Terms of Use" in output  # said at load, on the console

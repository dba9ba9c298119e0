"""`pdserve bench accuracy`: the windows, the scores, and the command on the default model."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from pdserve.cli import main
from pdserve_bench import accuracy


@pytest.mark.parametrize("num_tokens", [2, 63, 64, 65, 200, 3879])
def test_every_target_is_scored_once_with_a_strides_context(num_tokens: int) -> None:
    window, stride = 64, 16
    windows = accuracy.plan_windows(num_tokens, window, stride)
    targets = [t for w in windows for t in range(w.first_target, w.end)]
    assert targets == list(range(1, num_tokens))
    for w in windows[1:]:
        assert w.end - w.start <= window
        assert w.first_target - w.start == window - stride  # context before the scored part


def test_scores_are_the_targets_nll_and_the_argmax() -> None:
    logits = torch.tensor([[0.0, 0.0, 0.0], [2.0, 0.0, 0.0], [0.0, 0.0, 1.0]])
    first = accuracy.score_logits(logits, [0, 1, 2], accuracy.Window(0, 3, first_target=1))
    assert first.top1.tolist() == [0, 0]  # rows 0 and 1 predict tokens 1 and 2
    assert first.nll.tolist() == pytest.approx([math.log(3), math.log(math.exp(2) + 2)])
    # a later window (tokens 10..12) scoring only token 12: row 1 predicts it
    later = accuracy.score_logits(logits, [0] * 12 + [0], accuracy.Window(10, 13, first_target=12))
    assert later.nll.tolist() == pytest.approx([math.log(math.exp(2) + 2) - 2])
    assert later.top1.tolist() == [0]


def test_chunked_window_logits_equal_one_forward_of_the_model(tiny_model_dir: Any) -> None:
    """The runner's every-token logits, the window run as chunks through the paged cache,
    are HF transformers' logits of the whole sequence."""
    import transformers

    from pdserve import LLM

    path = tiny_model_dir("llama")
    llm = LLM(str(path), dtype="float32", block_size=16, num_blocks=8, kernels="torch")
    ids = torch.randint(3, 320, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    ours = accuracy._window_logits(llm.engine, ids, stride=16)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), torch_dtype=torch.float32)
    with torch.no_grad():
        theirs = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(ours.float(), theirs, atol=1e-4, rtol=1e-4)
    assert llm.engine.kv.num_free_blocks == 8  # the window's blocks went back to the pool


def test_the_8bit_cache_scores_close_to_the_float_cache(tiny_model_dir: Any) -> None:
    """The same window through an int8 KV cache: logits near the float cache's (8-bit
    rounding of K and V), not equal to them (the option reached the engine)."""
    from pdserve import LLM

    path = tiny_model_dir("llama")
    ids = torch.randint(3, 320, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    logits = {}
    for kv in ("auto", "int8"):
        llm = LLM(
            str(path),
            dtype="float32",
            block_size=16,
            num_blocks=8,
            kernels="torch",
            **accuracy.kv_cache_options(kv),
        )
        logits[kv] = accuracy._window_logits(llm.engine, ids, stride=16).float()
    err = (logits["int8"] - logits["auto"]).abs().max().item()
    assert 0 < err < 0.05 * logits["auto"].abs().max().item()


def test_bench_accuracy_on_the_default_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(accuracy, "LLAMACPP_VENV", tmp_path / "missing")
    args = ["bench", "accuracy", "--max-tokens", "96", "--window", "64", "--stride", "32"]
    assert main([*args, "--formats", "f32-dense,f32-gguf", "--json"]) == 0
    out = capsys.readouterr().out
    assert f"llama.cpp: skipped ({tmp_path / 'missing'} not found: run " in out
    dense, gguf = json.loads(out.splitlines()[-1])
    assert (dense["system"], gguf["system"]) == ("f32-dense", "f32-gguf")
    for row in (dense, gguf):
        assert 1.0 < row["perplexity"] < 1000.0
        assert row["tokens_scored"] == 95 and row["ratio_to_llamacpp"] is None
    assert dense["top1_agreement"] == 1.0
    assert gguf["top1_agreement"] > 0.9
    assert "q4_1" in gguf["weights"]


@pytest.mark.system  # `make test-system` builds llama.cpp (bench/llamacpp/setup.sh) first
def test_llamacpp_reference_scores_the_same_tokens(capsys: pytest.CaptureFixture[str]) -> None:
    reason = accuracy.llamacpp_missing_reason("default")
    assert reason is None, f"llama.cpp reference: {reason}"
    args = ["bench", "accuracy", "--max-tokens", "200", "--window", "128", "--stride", "64"]
    assert main([*args, "--formats", "f32-gguf", "--json"]) == 0
    rows = {r["system"]: r for r in json.loads(capsys.readouterr().out.splitlines()[-1])}
    assert rows["llama.cpp"]["tokens_scored"] == rows["f32-gguf"]["tokens_scored"] == 199
    assert rows["f32-gguf"]["ratio_to_llamacpp"] == pytest.approx(1.0, abs=0.02)


def test_a_kv_cache_dtype_the_engine_lacks_is_refused_before_loading() -> None:
    with pytest.raises(SystemExit, match="not a KV format this bench scores"):
        main(["bench", "accuracy", "--kv-cache-dtypes", "auto,fp8_e4m3"])


def test_the_8bit_kv_cache_is_an_engine_option() -> None:
    assert accuracy.kv_cache_options("int8") == {"kv_cache_dtype": "int8"}
    assert accuracy.kv_cache_options("auto") == {"kv_cache_dtype": "auto"}


def test_the_text_ships_with_the_package_and_has_no_header() -> None:
    text = accuracy.load_text()
    assert text.startswith("The Declaration of Independence")
    assert "#" not in text.splitlines()[0]

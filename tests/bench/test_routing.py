"""`pdserve bench routing` end to end on the tiny chat model: every router row, the
short-prompt rows and the overload run come back with numbers, and the nodes' counters
move."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdserve.cli import main
from pdserve_bench import routing
from tests.proxy.conftest import chat_model_dir  # noqa: F401  (the session fixture)

pytestmark = pytest.mark.timeout(300)


@pytest.mark.system
def test_bench_routing_runs_every_row(
    chat_model_dir: Path,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setattr(routing, "VLLM_ROUTER", chat_model_dir / "no-vllm-router")
    argv = ["bench", "routing", "--model", str(chat_model_dir), "--dtype", "float32",
            "--conversations", "2", "--turns", "2", "--system-prompts", "1",
            "--system-words", "40", "--message-words", "6", "--max-tokens", "3",
            "--short-lens", "8,40", "--short-requests", "2", "--disagg-min-tokens", "16",
            "--capacity", "2", "--overload-s", "2", "--json"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "vllm-router: not installed" in out
    results = json.loads(out.strip().splitlines()[-1])
    chat = {r["system"]: r for r in results["chat"]}
    assert len(chat) == 3
    for row in chat.values():
        assert row["num_turns"] == 4 and row["num_failed"] == 0
        assert row["prompt_tokens_computed"] > 0 and row["ttft_p50_s"] > 0
    short = {r["system"]: r for r in results["short"]}
    assert set(short) == {"single node", "proxy, always P/D", "proxy, selective P/D (<16)"}
    assert all(r["ttft_p50_s@8"] > 0 and r["ttft_p50_s@40"] > 0 for r in short.values())
    overload = results["overload"]
    assert overload["num_5xx"] == overload["num_other"] == 0
    assert (
        overload["num_ok"] > 0
        and overload["num_ok"] + overload["num_429"] == (overload["num_requests"])
    )
    assert overload["idle_after_s"] < 30

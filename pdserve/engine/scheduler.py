"""Continuous batching with chunked prefill, prefix caching and preemption by recompute.

Each step, `schedule()` fills a token budget:
1. running requests first, in arrival order: one token each when decoding, the next
   chunk when still prefilling; if blocks run out, the newest running request is
   preempted (its blocks freed; it goes back to the front of the waiting queue and is
   recomputed later, mostly from the prefix cache);
2. then waiting requests, oldest first, while the budget, blocks and `max_num_seqs` allow;
   one whose next prompt block a running request is computing right now waits a step to
   find it cached instead of computing it twice (`_next_block_in_progress`).

After the model ran, `update_from_output()` appends the sampled tokens and finishes
requests that hit EOS, a stop token, `max_tokens` or the context limit. Requests can be
aborted in any state with `finish_requests()`.

A request whose prompt KV the connector loads from another node (P/D decode) is admitted
with blocks for those tokens but parked in `loading` (WAITING_FOR_REMOTE_KV, counted
against `max_num_seqs`, never preempted) until the connector reports the load ended; then
it runs from the loaded tokens, or recomputes them if the load failed.

The scheduler is role-agnostic: everything about KV transfer goes through the
`KVConnector` hooks.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence

from pdserve.batch import ScheduledRequest, SchedulerOutput
from pdserve.config import SchedulerConfig
from pdserve.engine.kv_connector import KVConnector, NoKVConnector
from pdserve.engine.kv_types import ConnectorEvents
from pdserve.engine.request import Request, RequestStatus
from pdserve.errors import ConfigError
from pdserve.kv_cache.kv_cache_manager import KVCacheManager

logger = logging.getLogger(__name__)


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVCacheManager,
        max_model_len: int,
        connector: KVConnector | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`clock` stamps each request's phases (`Request.times`); the same clock as the
        requests' `arrival_time`."""
        if not config.enable_chunked_prefill and config.max_num_batched_tokens < max_model_len:
            raise ConfigError(
                "without chunked prefill, max_num_batched_tokens "
                f"({config.max_num_batched_tokens}) must be >= max_model_len ({max_model_len}): "
                "longer prompts would never fit a step"
            )
        self.config = config
        self.kv = kv
        self.max_model_len = max_model_len
        self.connector = connector or NoKVConnector()
        self.clock = clock
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.loading: dict[str, tuple[Request, int]] = {}
        """Requests waiting for a remote load, with the token count they will have computed."""
        self.held: set[str] = set()
        """Finished requests whose blocks the connector keeps pinned."""
        self.num_preemptions = 0
        self.num_prompt_tokens_computed = 0

    # -- admission and abort ---------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests or request.request_id in self.held:
            raise ValueError(f"duplicate internal request id {request.request_id}")
        self.requests[request.request_id] = request
        self.waiting.append(request)
        self.connector.on_request_added(request)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> None:
        """Finish requests in any state (abort, stop string). Unknown ids are ignored."""
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None or request.is_finished:
                continue
            if request in self.running:
                self.running.remove(request)
            elif self.loading.pop(request_id, None) is None:
                self.waiting.remove(request)
            self._finish(request, status)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.loading)

    def has_runnable(self) -> bool:
        """Something to compute now (requests waiting for a remote load are not)."""
        return bool(self.waiting or self.running)

    # -- one step ------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput[Request]:
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest[Request]] = []
        preempted: list[str] = []
        budget = self._schedule_running(budget, scheduled, preempted)
        if not preempted:
            self._schedule_waiting(budget, scheduled)
        scheduled.sort(key=lambda s: s.num_new_tokens != 1)  # decodes first (stable)
        num_decodes = sum(1 for s in scheduled if s.num_new_tokens == 1)
        return SchedulerOutput(tuple(scheduled), num_decodes, tuple(preempted))

    def _schedule_running(
        self, budget: int, scheduled: list[ScheduledRequest[Request]], preempted: list[str]
    ) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            while not self.kv.allocate(request.request_id, request.num_computed_tokens + num_new):
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is request:
                    return budget
            scheduled.append(self._scheduled(request, num_new))
            budget -= num_new
            i += 1
        return budget

    def _schedule_waiting(self, budget: int, scheduled: list[ScheduledRequest[Request]]) -> None:
        i = 0
        while i < len(self.waiting) and budget > 0 and self._num_seqs < self.config.max_num_seqs:
            request = self.waiting[i]
            if request.grammar_pending is not None:
                i += 1  # its grammar is still being built; those behind it may go
                continue
            cached = self.kv.find_cached_prefix(request.token_ids)
            if request.params.prompt_logprobs is not None:
                cached = []  # its logprobs need every prompt position's logits
            num_computed = len(cached) * self.kv.block_size
            num_remote = self.connector.get_num_remote_tokens(request, num_computed)
            if not num_remote and self._next_block_in_progress(request, num_computed):
                i += 1  # it waits a step for that block; those behind it may go
                continue
            # A remote load needs blocks but no compute budget; the request runs later.
            num_new = 0 if num_remote else request.num_tokens - num_computed
            if num_new > budget and not self.config.enable_chunked_prefill:
                break
            num_new = min(num_new, budget)
            num_tokens = num_computed + num_remote + num_new
            # Admitted on its first chunk's blocks, a prompt the pool cannot hold whole
            # is preempted as soon as the running requests grow, and computed again from
            # its start at each readmission: 4 prompts of 4k tokens in a pool of 11k took
            # 7.8x longer (`bench offline --kv-cache-memory-mib`). So a prompt starts only
            # if all of it fits now, or if nothing runs (nothing else would preempt it).
            whole = max(request.num_tokens, num_tokens)
            if self.running and not self.kv.can_allocate(request.request_id, whole, cached):
                break
            if not self.kv.allocate(request.request_id, num_tokens, cached):
                break
            del self.waiting[i]
            if request.num_preemptions == 0 and request.status is RequestStatus.WAITING:
                request.num_cached_tokens = num_computed
                request.admitted_time = self.clock()
            request.num_computed_tokens = num_computed
            block_ids = self.kv.block_ids(request.request_id)
            if num_remote:
                request.status = RequestStatus.WAITING_FOR_REMOTE_KV
                self.loading[request.request_id] = (request, num_computed + num_remote)
                self.connector.on_admitted(request, block_ids, num_remote)
                continue
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            self.connector.on_admitted(request, block_ids, 0)
            scheduled.append(self._scheduled(request, num_new))
            budget -= num_new

    def _next_block_in_progress(self, request: Request, num_cached_tokens: int) -> bool:
        """A running request is computing the prompt block after `request`'s cached prefix,
        the same tokens: admitted now, `request` would compute that block a second time;
        a step later it is a prefix hit. So a burst of requests sharing a system prompt
        computes it once per node, not once per request admitted in the same step
        (`pdserve bench routing`'s chat turns). Never a wait on a request that is not
        computing: the one computing the block is running, so it is cached within the
        steps its prefill takes."""
        end = num_cached_tokens + self.kv.block_size
        if not self.kv.pool.enable_caching or end >= request.num_tokens:
            return False  # no cache, or the block holds the prompt's last token (no hit)
        head = request.token_ids[:end]
        return any(
            other.num_computed_tokens < end <= other.num_prompt_tokens
            and other.token_ids[:end] == head
            for other in self.running
        )

    @property
    def num_prompt_tokens_pending(self) -> int:
        """Prompt tokens waiting or admitted but not computed yet: the prefill work this
        node owes (what `ray up --autoscale` sizes prefill nodes by)."""
        waiting = sum(r.num_tokens - r.num_computed_tokens for r in self.waiting)
        running = sum(max(r.num_prompt_tokens - r.num_computed_tokens, 0) for r in self.running)
        return waiting + running

    @property
    def _num_seqs(self) -> int:
        return len(self.running) + len(self.loading)

    def _scheduled(self, request: Request, num_new: int) -> ScheduledRequest[Request]:
        block_ids = self.kv.block_ids(request.request_id)
        ctx = request.num_computed_tokens
        samples = ctx + num_new == request.num_tokens and request.params.max_tokens != 0
        return ScheduledRequest(request, num_new, ctx, tuple(block_ids), samples)

    def _preempt(self, request: Request) -> None:
        logger.info("preempting %s (KV blocks exhausted)", request.request_id)
        self.kv.free(request.request_id)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.status = RequestStatus.PREEMPTED
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    # -- after the model ran -------------------------------------------------------

    def update_from_output(
        self, output: SchedulerOutput[Request], sampled: Sequence[int | None]
    ) -> list[Request]:
        """Record the step: `sampled[i]` is the token for `output.scheduled[i]` (or None).

        Returns the requests that got a new token (finished ones included).
        """
        updated = []
        for entry, token in zip(output.scheduled, sampled, strict=True):
            request = entry.request
            if request.is_finished:  # finished during the step (abort): drop the result
                continue
            start = entry.num_context_tokens
            prompt_end = min(start + entry.num_new_tokens, request.num_prompt_tokens)
            self.num_prompt_tokens_computed += max(prompt_end - start, 0)
            request.num_computed_tokens += entry.num_new_tokens
            self.kv.cache_full_blocks(
                request.request_id, request.token_ids, request.num_computed_tokens
            )
            if token is not None:
                self._append_token(request, token)
                updated.append(request)
            elif (
                request.params.max_tokens == 0 and request.num_computed_tokens == request.num_tokens
            ):
                # It asked for its prompt's logprobs only: done once the prompt is computed.
                self.running.remove(request)
                self._finish(request, RequestStatus.FINISHED_LENGTH)
                updated.append(request)
        updated.extend(self._apply(self.connector.on_step_finished(output)))
        return updated

    def _append_token(self, request: Request, token: int) -> None:
        """A running request's next token (sampled here, or by the node its KV came from);
        finishes it on a stop condition."""
        request.token_ids.append(token)
        if request.grammar is not None:
            request.grammar.consume_token(token)  # sampled under its mask: always accepted
        if request.first_token_time is None:
            request.first_token_time = self.clock()
        status = self._stop_status(request, token)
        if status is not None:
            self.running.remove(request)
            self._finish(request, status)

    def _stop_status(self, request: Request, token: int) -> RequestStatus | None:
        params = request.params
        if request.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token in request.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if token in params.stop_token_ids:
                request.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if request.grammar is not None and request.grammar.is_stopped():
            return RequestStatus.FINISHED_STOPPED  # the grammar allows no further token
        if params.max_tokens is not None and request.num_output_tokens >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if request.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        request.finished_time = self.clock()
        del self.requests[request.request_id]
        block_ids = self.kv.block_ids(request.request_id)
        if self.connector.on_request_finished(request, block_ids):
            self.held.add(request.request_id)
            request.held_block_ids = tuple(block_ids)
        else:
            self.kv.free(request.request_id)

    def release_held(self, request_ids: Iterable[str]) -> list[str]:
        """Free the blocks of held requests; returns the ids actually freed."""
        freed = [r for r in request_ids if r in self.held]
        for request_id in freed:
            self.held.remove(request_id)
            self.kv.free(request_id)
        return freed

    def _apply(self, events: ConnectorEvents) -> list[Request]:
        """Apply the connector's news; returns the requests that need an output: failed
        ones, and loaded ones that got their next token from the remote node."""
        updated = []
        for result in events.loads_finished:
            request, num_loaded = self.loading.pop(result.request_id, (None, 0))
            if request is None:  # aborted meanwhile: its blocks are held until the read ended
                continue
            request.loaded_time = self.clock()
            if result.error is not None:
                request.error = result.error
                self._finish(request, RequestStatus.FINISHED_ERROR)
                updated.append(request)
                continue
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            if result.ok:
                request.num_computed_tokens = num_loaded
                self.kv.cache_full_blocks(request.request_id, request.token_ids, num_loaded)
            if result.ok and result.next_token is not None:
                request.accept_remote_token(result.next_token)
                self._append_token(request, result.next_token.token_id)
                updated.append(request)
        self.release_held(events.releasable)
        return updated

    def tick(self) -> list[Request]:
        """Between steps (idle, or after control messages): apply the connector's news.
        Returns the requests that need an output."""
        return self._apply(self.connector.on_step_finished(SchedulerOutput((), 0)))

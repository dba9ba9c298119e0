"""The engine: one model, one KV pool, one scheduler, stepped by its owner.

`step()` reads aloud: schedule → run the model → update request states → emit outputs.
The engine is synchronous and single-threaded; the offline `LLM` calls it in a loop, the
HTTP server runs it in its own process.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence
from dataclasses import replace

from pdserve import structured
from pdserve.config import EngineConfig
from pdserve.engine.kv_connector import KVConnectorFactory, NoKVConnector
from pdserve.engine.kv_types import KVTransferSpec
from pdserve.engine.output_processor import OutputProcessor
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.scheduler import Scheduler
from pdserve.errors import InvalidRequestError
from pdserve.kv_cache.kv_cache_manager import KVCacheManager
from pdserve.model import kv_format
from pdserve.model.loader import LoadedModel, load_model
from pdserve.model.runner import ModelRunner, kv_cache_bytes_per_block
from pdserve.outputs import RequestOutput
from pdserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        connector_factory: KVConnectorFactory | None = None,
        loaded: LoadedModel | None = None,
    ) -> None:
        """`connector_factory`: the node's KV connector, built once the KV pool exists
        (P/D nodes; the launcher chooses it). None: a single node (`NoKVConnector`)."""
        self.config = config
        self.loaded = loaded or load_model(config.model)
        self.tokenizer = self.loaded.tokenizer
        cache = config.cache
        cache_dtype = kv_format.resolve(cache.kv_cache_dtype, self.loaded.dtype)
        block_bytes = kv_cache_bytes_per_block(self.loaded, cache.block_size, cache_dtype)
        num_blocks = cache.num_blocks or max(1, cache.kv_cache_memory_bytes // block_bytes)
        self.max_model_len = min(self.loaded.max_model_len, num_blocks * cache.block_size)
        if self.max_model_len < self.loaded.max_model_len:
            logger.warning(
                "max_model_len lowered to %d: the KV pool holds only %d blocks",
                self.max_model_len,
                num_blocks,
            )
        self.kv = KVCacheManager(num_blocks, cache.block_size, cache.enable_prefix_caching)
        self.runner = ModelRunner(
            self.loaded,
            num_blocks,
            cache.block_size,
            config.model.seed,
            config.model.kernels,
            cache_dtype,
            config.model.batch_invariant,
        )
        self.connector = (
            connector_factory(self.loaded, self.runner.kv_cache, cache.block_size)
            if connector_factory is not None
            else NoKVConnector()
        )
        self.scheduler = Scheduler(config.scheduler, self.kv, self.max_model_len, self.connector)
        self.outputs = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()
        self.num_steps = 0
        self.step_timer = StepTimer()
        self._grammar_engine: structured.Grammars | None = None
        self._building: list[Request] = []
        """Requests whose grammar matcher is being built (`_grammars_built`)."""
        self._after_load: dict[str, tuple[Request, list[Request]]] = {}
        """Samples 2..n of a request that loads its KV, by the first's id: scheduled once
        its load has ended (`_start_after_load`)."""

    # -- requests ------------------------------------------------------------------

    def add_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams,
        request_id: str | None = None,
        kv_transfer: KVTransferSpec | None = None,
    ) -> str:
        """Queue a request; returns its id. `n > 1` becomes n engine requests.

        `kv_transfer` (from `pdserve.disagg.params`) tells the KV connector to hold the
        prompt's KV for a remote decode or to load it from a remote prefill."""
        request_id = request_id or f"req-{next(self._ids)}"
        if self.outputs.engine_ids(request_id):
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        if kv_transfer is not None and params.max_tokens == 0:
            raise InvalidRequestError(
                "max_tokens 0 computes the prompt only: it cannot be a P/D leg",
                param="max_tokens",
            )
        prompt_ids = self._tokenize(prompt)
        self._check_length(prompt_ids, params)
        self._check_logit_bias(params)
        eos = self.tokenizer.eos_token_ids if self.tokenizer else self.loaded.arch.eos_token_ids
        now = time.monotonic()
        requests = [
            Request(
                # Internal ids are minted here, unique for the engine's life, so a client
                # reusing an id can never reach another request's (or held) blocks.
                f"{request_id}#{i}.{next(self._ids)}",
                prompt_ids,
                _sample_params(params, i),
                eos_token_ids=tuple(eos),
                arrival_time=now,
                kv_transfer=kv_transfer if i == 0 else None,
            )
            for i in range(params.n)
        ]
        if params.grammar is not None:
            grammars = self._grammars()
            for r in requests:
                r.grammar_pending = grammars.matcher(params.grammar)
            self._building.extend(requests)
        self.outputs.add(request_id, requests)
        first, *others = requests
        if kv_transfer is not None and others:
            # One handoff, n samples: the first loads the prompt's KV; the others wait
            # for it, then find its full blocks in the prefix cache and compute only the
            # prompt's last partial block and their own first token.
            self._after_load[first.request_id] = (first, others)
            requests = [first]
        for r in requests:
            self.scheduler.add_request(r)
        return request_id

    def _grammars(self) -> structured.Grammars:
        """The engine's grammar matchers (built on first use: llguidance reads the
        tokenizer once, ~0.25 s on a 49k vocabulary)."""
        if self._grammar_engine is None:
            if self.tokenizer is None:
                raise InvalidRequestError(
                    "structured outputs need the model's tokenizer; this model has none",
                    param="structured_outputs",
                )
            vocab = self.loaded.arch.vocab_size
            self._grammar_engine = structured.Grammars(
                self.tokenizer.to_json(), vocab, tuple(self.tokenizer.eos_token_ids)
            )
        return self._grammar_engine

    def _grammars_built(self) -> list[Request]:
        """Requests whose matcher is now built become schedulable; one whose grammar does
        not fit this tokenizer (the API checked it without one) ends in an error."""
        failed, still = [], []
        for r in self._building:
            future = r.grammar_pending
            if r.is_finished or future is None:
                continue
            if not future.done():
                still.append(r)
                continue
            r.grammar_pending = None
            error: object = future.exception()
            if error is None and future.result().is_error():
                error = future.result().get_error()
            if error is not None:
                r.error = f"the grammar cannot be used: {error}"
                self.scheduler.finish_requests([r.request_id], RequestStatus.FINISHED_ERROR)
                failed.append(r)
            else:
                r.grammar = future.result()
        self._building = still
        return failed

    def abort(self, request_ids: Sequence[str]) -> list[RequestOutput]:
        """Abort unfinished requests in any state; returns their final outputs. Unknown or
        finished ids are ignored (blocks held for a finished request go by `free_held`)."""
        engine_ids = [e for rid in request_ids for e in self.outputs.engine_ids(rid)]
        requests = [self.scheduler.requests[e] for e in engine_ids if e in self.scheduler.requests]
        self.scheduler.finish_requests(engine_ids, RequestStatus.FINISHED_ABORTED)
        for first in engine_ids:
            requests += self._end_waiting(first, RequestStatus.FINISHED_ABORTED)
        outputs, _ = self.outputs.update(requests)
        return outputs

    def _start_after_load(self) -> list[RequestOutput]:
        """Schedule the samples waiting for their first sample's KV load once it has ended
        (its blocks are then in the prefix cache); end them with it if it failed."""
        ended = []
        for first, _ in list(self._after_load.values()):
            if first.status in (RequestStatus.WAITING, RequestStatus.WAITING_FOR_REMOTE_KV):
                continue  # still loading
            if first.status in (RequestStatus.FINISHED_ERROR, RequestStatus.FINISHED_ABORTED):
                ended += self._end_waiting(first.request_id, RequestStatus.FINISHED_ABORTED)
                continue
            for r in self._after_load.pop(first.request_id)[1]:
                self.scheduler.add_request(r)
        outputs, _ = self.outputs.update(ended)
        return outputs

    def _end_waiting(self, first_id: str, status: RequestStatus) -> list[Request]:
        _, waiting = self._after_load.pop(first_id, (None, []))
        for r in waiting:
            r.status = status
        return waiting

    def free_held(self, request_ids: Sequence[str]) -> list[str]:
        """Free the blocks held for these finished user requests (a prefill leg's handoff
        ended), as far as the connector allows. Returns the user ids freed; others are
        ignored. (The vLLM endpoint this project started from could not free finished
        requests at all.)"""
        wanted = set(request_ids)
        held = [h for h in self.scheduler.held if user_request_id(h) in wanted]
        if not held:
            return []
        freed = self.scheduler.release_held(self.connector.on_free_held(held))
        return [user_request_id(r) for r in freed]

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def close(self) -> None:
        """Stop the connector's threads and transfers (P/D nodes)."""
        self.connector.close()
        if self._grammar_engine is not None:
            self._grammar_engine.close()

    # -- the loop ------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        if self._building:
            failed, _ = self.outputs.update(self._grammars_built())
            if failed:
                return failed
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return self.tick()
        t1 = time.perf_counter()
        model_out = self.runner.execute(sched)
        t2 = time.perf_counter()
        for entry, logprob in zip(sched.scheduled, model_out.logprobs, strict=True):
            if logprob is not None:
                entry.request.logprobs.append(logprob)
        for entry, scored in zip(sched.scheduled, model_out.prompt_logprobs or (), strict=False):
            prompt = entry.request.prompt_logprobs
            if scored is not None and prompt is not None:
                at = entry.num_context_tokens + 1
                prompt[at : at + len(scored)] = scored
        updated = self.scheduler.update_from_output(sched, model_out.sampled)
        outputs, stopped = self.outputs.update(updated)
        self.scheduler.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        if self._after_load:
            outputs += self._start_after_load()
        self.num_steps += 1
        self.step_timer.record(t1 - t0, t2 - t1, time.perf_counter() - t2, sched.num_tokens)
        return outputs

    def tick(self) -> list[RequestOutput]:
        """No model step: apply the KV connector's news (loads ended, possibly with a remote
        first token; blocks releasable)."""
        outputs, stopped = self.outputs.update(self.scheduler.tick())
        self.scheduler.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        if self._after_load:
            outputs += self._start_after_load()
        return outputs

    # -- helpers -------------------------------------------------------------------

    def _tokenize(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError(
                    "this model has no tokenizer: pass token ids", param="prompt"
                )
            ids = self.tokenizer.encode(prompt)
        else:
            ids = list(prompt)
            vocab = self.loaded.arch.vocab_size
            if not all(isinstance(t, int) and 0 <= t < vocab for t in ids):
                raise InvalidRequestError(
                    f"token ids must be integers in [0, {vocab})", param="prompt"
                )
        if not ids:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        return ids

    def _check_logit_bias(self, params: SamplingParams) -> None:
        vocab = self.loaded.arch.vocab_size
        outside = [t for t, _ in params.logit_bias if t >= vocab]
        if outside:
            raise InvalidRequestError(
                f"logit_bias names token ids outside the vocabulary [0, {vocab}): {outside[:5]}",
                param="logit_bias",
            )

    def _check_length(self, prompt_ids: list[int], params: SamplingParams) -> None:
        if len(prompt_ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"the prompt has {len(prompt_ids)} tokens; this model's context is "
                f"{self.max_model_len} tokens (prompt + output)",
                param="prompt",
            )
        if (
            params.max_tokens is not None
            and len(prompt_ids) + params.max_tokens > self.max_model_len
        ):
            raise InvalidRequestError(
                f"max_tokens ({params.max_tokens}) + prompt ({len(prompt_ids)} tokens) exceeds "
                f"the context of {self.max_model_len} tokens",
                param="max_tokens",
            )


class StepTimer:
    """Where a step's time goes, logged every `interval_s`: scheduling and output handling
    (the engine's own overhead) against the model step (input preparation, forward,
    sampling). On the default model the overhead is well under 1 ms of a 20-100 ms step."""

    def __init__(self, interval_s: float = 30.0) -> None:
        self.interval_s = interval_s
        self._reset(time.monotonic())

    def _reset(self, now: float) -> None:
        self.since = now
        self.steps = self.tokens = 0
        self.schedule_s = self.model_s = self.output_s = 0.0

    def record(self, schedule_s: float, model_s: float, output_s: float, tokens: int) -> None:
        self.steps += 1
        self.tokens += tokens
        self.schedule_s += schedule_s
        self.model_s += model_s
        self.output_s += output_s
        now = time.monotonic()
        if now - self.since >= self.interval_s:
            n = self.steps
            logger.info(
                "%d steps (%d tokens) in %.0f s; per step: schedule %.2f ms, model %.1f ms, "
                "outputs %.2f ms",
                n,
                self.tokens,
                now - self.since,
                1e3 * self.schedule_s / n,
                1e3 * self.model_s / n,
                1e3 * self.output_s / n,
            )
            self._reset(now)


def user_request_id(engine_request_id: str) -> str:
    """The caller's request id inside an internal id `{request_id}#{sample}.{counter}`."""
    return engine_request_id.rsplit("#", 1)[0]


def _sample_params(params: SamplingParams, index: int) -> SamplingParams:
    """The i-th of n samples: its own seed (seed + i), so samples differ but reproduce."""
    if params.n == 1:
        return params
    seed = None if params.seed is None else params.seed + index
    return replace(params, n=1, seed=seed)

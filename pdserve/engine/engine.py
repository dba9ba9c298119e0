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

from pdserve.config import EngineConfig
from pdserve.engine.kv_connector import KVConnector
from pdserve.engine.output_processor import OutputProcessor
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.scheduler import Scheduler
from pdserve.errors import InvalidRequestError
from pdserve.kv_cache.kv_cache_manager import KVCacheManager
from pdserve.model.loader import LoadedModel, load_model
from pdserve.model.runner import ModelRunner, kv_cache_bytes_per_block
from pdserve.outputs import RequestOutput
from pdserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        connector: KVConnector | None = None,
        loaded: LoadedModel | None = None,
    ) -> None:
        self.config = config
        self.loaded = loaded or load_model(config.model)
        self.tokenizer = self.loaded.tokenizer
        cache = config.cache
        num_blocks = cache.num_blocks or max(
            1,
            cache.kv_cache_memory_bytes // kv_cache_bytes_per_block(self.loaded, cache.block_size),
        )
        self.max_model_len = min(self.loaded.max_model_len, num_blocks * cache.block_size)
        if self.max_model_len < self.loaded.max_model_len:
            logger.warning(
                "max_model_len lowered to %d: the KV pool holds only %d blocks",
                self.max_model_len,
                num_blocks,
            )
        self.kv = KVCacheManager(num_blocks, cache.block_size, cache.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler, self.kv, self.max_model_len, connector)
        self.runner = ModelRunner(self.loaded, num_blocks, cache.block_size, config.model.seed)
        self.outputs = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()
        self.num_steps = 0

    # -- requests ------------------------------------------------------------------

    def add_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams,
        request_id: str | None = None,
    ) -> str:
        """Queue a request; returns its id. `n > 1` becomes n engine requests."""
        request_id = request_id or f"req-{next(self._ids)}"
        if self.outputs.engine_ids(request_id):
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        prompt_ids = self._tokenize(prompt)
        self._check_length(prompt_ids, params)
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
            )
            for i in range(params.n)
        ]
        self.outputs.add(request_id, requests)
        for r in requests:
            self.scheduler.add_request(r)
        return request_id

    def abort(self, request_ids: Sequence[str]) -> list[RequestOutput]:
        """Abort requests in any state; returns their final outputs. Unknown ids: ignored."""
        engine_ids = [e for rid in request_ids for e in self.outputs.engine_ids(rid)]
        requests = [self.scheduler.requests[e] for e in engine_ids if e in self.scheduler.requests]
        self.scheduler.finish_requests(engine_ids, RequestStatus.FINISHED_ABORTED)
        outputs, _ = self.outputs.update(requests)
        return outputs

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- the loop ------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        sched = self.scheduler.schedule()
        if sched.is_empty:
            self.scheduler.tick()
            return []
        model_out = self.runner.execute(sched)
        for entry, logprob in zip(sched.scheduled, model_out.logprobs, strict=True):
            if logprob is not None:
                entry.request.logprobs.append(logprob)
        updated = self.scheduler.update_from_output(sched, model_out.sampled)
        outputs, stopped = self.outputs.update(updated)
        self.scheduler.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        self.num_steps += 1
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


def _sample_params(params: SamplingParams, index: int) -> SamplingParams:
    """The i-th of n samples: its own seed (seed + i), so samples differ but reproduce."""
    if params.n == 1:
        return params
    seed = None if params.seed is None else params.seed + index
    return replace(params, n=1, seed=seed)

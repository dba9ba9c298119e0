"""Turns scheduler updates into `RequestOutput`s: detokenizes, applies stop strings,
and gathers the `n` samples of one user request (each an engine request of its own).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from pdserve.engine.detokenizer import IncrementalDetokenizer
from pdserve.engine.request import Request
from pdserve.model.tokenizer import Tokenizer
from pdserve.outputs import CompletionOutput, RequestOutput, RequestTimes, TokenLogprob


@dataclass
class _Sample:
    output: CompletionOutput
    detokenizer: IncrementalDetokenizer | None
    num_tokens_seen: int = 0


@dataclass
class _Group:
    """One user request: its `n` samples, keyed by engine request id."""

    request_id: str
    prompt_token_ids: list[int]
    samples: dict[str, _Sample] = field(default_factory=dict)
    num_cached_tokens: int = 0
    held_block_ids: tuple[int, ...] = ()
    error: str | None = None
    times: RequestTimes | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    prompt_logprobs_sent: bool = False
    """They go out twice, not with every token: in the first output after the prompt is
    computed (a stream echoes the prompt) and in the last (a whole answer)."""

    @property
    def finished(self) -> bool:
        return all(s.output.finished for s in self.samples.values())


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self._tok = tokenizer
        self._groups: dict[str, _Group] = {}
        self._group_of: dict[str, _Group] = {}

    def add(self, request_id: str, requests: list[Request]) -> None:
        group = _Group(request_id, list(requests[0].token_ids))
        for i, r in enumerate(requests):
            detok = None
            if self._tok is not None:
                detok = IncrementalDetokenizer(self._tok, group.prompt_token_ids, r.params)
            logprobs: list[TokenLogprob] | None = [] if r.params.logprobs is not None else None
            group.samples[r.request_id] = _Sample(CompletionOutput(i, logprobs=logprobs), detok)
            self._group_of[r.request_id] = group
        self._groups[request_id] = group

    def request_ids(self) -> list[str]:
        """Ids of the user requests still in flight."""
        return list(self._groups)

    def engine_ids(self, request_id: str) -> list[str]:
        group = self._groups.get(request_id)
        return list(group.samples) if group else []

    def update(self, requests: list[Request]) -> tuple[list[RequestOutput], list[str]]:
        """Record new tokens; return outputs for touched groups and ids stopped by a
        stop string (the caller must finish those in the scheduler)."""
        touched: dict[str, _Group] = {}
        stopped: list[str] = []
        for r in requests:
            group = self._group_of.get(r.request_id)
            if group is None:
                continue
            sample = group.samples[r.request_id]
            group.num_cached_tokens = max(group.num_cached_tokens, r.num_cached_tokens)
            group.held_block_ids += r.held_block_ids
            group.error = group.error or r.error
            group.times = r.times() or group.times
            prompt = r.prompt_logprobs
            if (
                group.prompt_logprobs is None
                and prompt is not None
                and r.num_computed_tokens >= r.num_prompt_tokens
            ):
                self._decode(prompt)
                group.prompt_logprobs = prompt
            if self._absorb(r, sample):
                stopped.append(r.request_id)
            touched[group.request_id] = group
        return [self._emit(g) for g in touched.values()], stopped

    def _absorb(self, r: Request, sample: _Sample) -> bool:
        out = sample.output
        new_ids = r.output_token_ids[sample.num_tokens_seen :]
        sample.num_tokens_seen += len(new_ids)
        out.token_ids.extend(new_ids)
        out.delta_token_ids.extend(new_ids)
        if out.logprobs is not None:
            new_entries = r.logprobs[len(out.logprobs) :]
            self._decode(new_entries)
            out.logprobs.extend(new_entries)
        stopped = False
        if sample.detokenizer is not None:
            for t in new_ids:
                sample.detokenizer.push(t)
            if sample.detokenizer.stop_string is not None and not r.is_finished:
                stopped = True
                out.stop_reason = sample.detokenizer.stop_string
        if r.is_finished or stopped:
            out.finish_reason = "stop" if stopped else r.status.finish_reason
            if r.stop_reason is not None:
                out.stop_reason = r.stop_reason
        if sample.detokenizer is not None:
            out.delta_text += sample.detokenizer.take_delta(out.finished)
            out.text = sample.detokenizer.text
        return stopped

    def _decode(self, entries: Sequence[TokenLogprob | None]) -> None:
        """Fill in the text of each entry's chosen and top tokens."""
        if self._tok is None:
            return
        for entry in entries:
            if entry is not None:
                for token_id in (entry.token_id, *(t for t, _ in entry.top)):
                    entry.decoded[token_id] = self._tok.token_text(token_id)

    def _emit(self, group: _Group) -> RequestOutput:
        outputs = []
        for sample in group.samples.values():
            out = sample.output
            outputs.append(
                CompletionOutput(
                    index=out.index,
                    text=out.text,
                    token_ids=list(out.token_ids),
                    logprobs=list(out.logprobs) if out.logprobs is not None else None,
                    finish_reason=out.finish_reason,
                    stop_reason=out.stop_reason,
                    delta_text=out.delta_text,
                    delta_token_ids=out.delta_token_ids,
                )
            )
            out.delta_text, out.delta_token_ids = "", []
        finished = group.finished
        prompt_logprobs = None
        if finished or not group.prompt_logprobs_sent:
            prompt_logprobs = group.prompt_logprobs
            group.prompt_logprobs_sent = prompt_logprobs is not None
        if finished:
            del self._groups[group.request_id]
            for engine_id in group.samples:
                self._group_of.pop(engine_id, None)
        return RequestOutput(
            group.request_id,
            group.prompt_token_ids,
            outputs,
            group.num_cached_tokens,
            finished,
            held_block_ids=group.held_block_ids if finished else (),
            error=group.error,
            prompt_logprobs=prompt_logprobs,
            times=group.times if finished else None,
        )

"""Prompt logprobs (`SamplingParams.prompt_logprobs`) and `max_tokens=0`, on the engine with
a tiny model in float32: each prompt token's entry is what a sampled token's would be at
that position, whatever the chunking, a prefix-cache hit or a preemption."""

from __future__ import annotations

from typing import Any

import pytest

from pdserve.errors import InvalidRequestError
from pdserve.llm import LLM
from pdserve.outputs import TokenLogprob
from pdserve.sampling_params import SamplingParams

PROMPT = [(7 * i + 3) % 200 + 5 for i in range(70)]  # 70 tokens: chunks of 16 cut it 5 times


def _llm(tiny_model_dir: Any, **options: Any) -> LLM:
    options = {"num_blocks": 64, **options}
    return LLM(str(tiny_model_dir("llama")), dtype="float32", block_size=16, max_model_len=256,
               **options)  # fmt: skip


def _close(a: list[TokenLogprob | None], b: list[TokenLogprob | None]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert (x is None) == (y is None)
        if x is not None and y is not None:
            assert x.token_id == y.token_id
            assert x.logprob == pytest.approx(y.logprob, abs=1e-4)
            assert [t for t, _ in x.top] == [t for t, _ in y.top]


def test_prompt_entries_are_the_sampled_tokens_entries(tiny_model_dir: Any) -> None:
    llm = _llm(tiny_model_dir)
    greedy = SamplingParams(max_tokens=6, temperature=0, logprobs=3)
    [done] = llm.generate(PROMPT, greedy)
    whole = PROMPT + done.outputs[0].token_ids
    [scored] = llm.generate(whole, SamplingParams(max_tokens=0, prompt_logprobs=3))
    assert scored.outputs[0].token_ids == [] and scored.outputs[0].finish_reason == "length"
    prompt = scored.prompt_logprobs
    assert prompt is not None and len(prompt) == len(whole) and prompt[0] is None
    assert [e.token_id for e in prompt[1:] if e is not None] == whole[1:]
    _close(prompt[-6:], list(done.outputs[0].logprobs or []))
    assert all(len(e.top) == 3 for e in prompt[1:] if e is not None)


def test_chunks_cache_hits_and_preemption_change_nothing(tiny_model_dir: Any) -> None:
    params = SamplingParams(max_tokens=4, temperature=0, prompt_logprobs=2)
    [whole] = _llm(tiny_model_dir, max_num_batched_tokens=256).generate(PROMPT, params)
    chunked = _llm(tiny_model_dir, max_num_batched_tokens=16)
    [first] = chunked.generate(PROMPT, params)
    [again] = chunked.generate(PROMPT, params)  # its blocks are cached now: not read
    assert again.num_cached_tokens == 0
    assert whole.prompt_logprobs is not None
    for out in (first, again):
        assert out.prompt_logprobs is not None
        _close(out.prompt_logprobs, whole.prompt_logprobs)
        assert out.outputs[0].token_ids == whole.outputs[0].token_ids
    # Too few blocks for four at once: requests are preempted and recomputed.
    tight = _llm(tiny_model_dir, max_num_batched_tokens=16, num_blocks=12)
    long = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, prompt_logprobs=2)
    outs = tight.generate([PROMPT] * 4, long)
    assert tight.engine.scheduler.num_preemptions > 0
    for out in outs:
        assert out.prompt_logprobs is not None
        _close(out.prompt_logprobs, whole.prompt_logprobs)


def test_max_tokens_zero_cannot_be_a_p_d_leg(tiny_model_dir: Any) -> None:
    from pdserve.disagg.params import RemoteDecode

    llm = _llm(tiny_model_dir)
    with pytest.raises(InvalidRequestError) as refused:
        llm.engine.add_request(PROMPT, SamplingParams(max_tokens=0), kv_transfer=RemoteDecode())
    assert refused.value.param == "max_tokens"
    with pytest.raises(InvalidRequestError):
        SamplingParams(prompt_logprobs=21)

"""pdserve's model and engine against HF transformers on tiny random models of each family."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from pdserve import LLM, SamplingParams
from tests.conftest import TINY_ARCHS, hf_greedy


def hf_model(path: Any, dtype: torch.dtype = torch.float32) -> Any:
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).eval()


def prompts(n: int, seed: int = 0, low: int = 5, high: int = 300) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 320) for _ in range(rng.randint(low, high))] for _ in range(n)]


GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=5)


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_logprobs_match_hf_fp32(arch: str, tiny_model_dir: Any) -> None:
    path = tiny_model_dir(arch)
    ref = hf_model(path)
    llm = LLM(str(path), dtype="float32", num_blocks=64)
    for prompt in prompts(3, seed=1):
        tokens, logits = hf_greedy(ref, prompt, 12)
        out = llm.generate([prompt], GREEDY)[0].outputs[0]
        assert out.token_ids == tokens
        ref_logprobs = torch.log_softmax(logits, dim=-1)
        for step, entry in enumerate(out.logprobs or []):
            ids = [t for t, _ in entry.top]
            ours = torch.tensor([v for _, v in entry.top])
            torch.testing.assert_close(ours, ref_logprobs[step, ids], atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3", "phi3"])
def test_logprobs_close_to_hf_bf16(arch: str, tiny_model_dir: Any) -> None:
    path = tiny_model_dir(arch)
    ref = hf_model(path)  # fp32 reference: bf16 error is measured against the truth
    llm = LLM(str(path), dtype="bfloat16", num_blocks=64)
    prompt = prompts(1, seed=2)[0]
    _, logits = hf_greedy(ref, prompt, 1)
    entry = (llm.generate([prompt], GREEDY)[0].outputs[0].logprobs or [])[0]
    ids = [t for t, _ in entry.top]
    ours = torch.tensor([v for _, v in entry.top])
    torch.testing.assert_close(ours, torch.log_softmax(logits, -1)[0, ids], atol=0.08, rtol=0.02)


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_mixed_batch_greedy_matches_hf(arch: str, tiny_model_dir: Any) -> None:
    path = tiny_model_dir(arch)
    ref = hf_model(path)
    batch = prompts(6, seed=3)
    expected = [hf_greedy(ref, p, 10)[0] for p in batch]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    llm = LLM(str(path), dtype="float32", num_blocks=128)
    outs = llm.generate(batch, params)
    assert [o.outputs[0].token_ids for o in outs] == expected


@pytest.fixture(scope="module")
def llama_reference(tiny_model_dir: Any) -> tuple[Any, list[list[int]], list[list[int]]]:
    path = tiny_model_dir("llama")
    ref = hf_model(path)
    shared = prompts(1, seed=4, low=40, high=40)[0]
    batch = [shared + p for p in prompts(4, seed=5, low=3, high=60)] + prompts(3, seed=6)
    return path, batch, [hf_greedy(ref, p, 16)[0] for p in batch]


def _run(path: Any, batch: list[list[int]], **options: Any) -> tuple[LLM, list[list[int]]]:
    llm = LLM(str(path), dtype="float32", **options)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    outs = llm.generate(batch, params)
    return llm, [o.outputs[0].token_ids for o in outs]


def test_prefix_cache_hits_do_not_change_output(llama_reference: Any) -> None:
    path, batch, expected = llama_reference
    llm, first = _run(path, batch, num_blocks=256, block_size=4)
    assert first == expected
    again = llm.generate(batch, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in again] == expected
    assert all(o.num_cached_tokens > 0 for o in again)
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks


def test_chunked_prefill_does_not_change_output(llama_reference: Any) -> None:
    path, batch, expected = llama_reference
    llm, got = _run(path, batch, num_blocks=256, max_num_batched_tokens=16, block_size=4)
    assert got == expected
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks


def test_preemption_does_not_change_output(llama_reference: Any) -> None:
    path, batch, expected = llama_reference
    # 7 requests of up to ~320 tokens (~560 blocks in all) in a 100-block pool: must preempt.
    llm, got = _run(path, batch, num_blocks=100, block_size=4)
    assert llm.engine.scheduler.num_preemptions > 0
    assert got == expected
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks


def test_abort_mix_frees_every_block(tiny_model_dir: Any) -> None:
    llm = LLM(str(tiny_model_dir("llama")), dtype="float32", num_blocks=64, block_size=4)
    engine = llm.engine
    params = SamplingParams(temperature=0.8, max_tokens=30, ignore_eos=True, seed=3)
    ids = [engine.add_request(p, params) for p in prompts(8, seed=7, high=80)]
    for step in range(40):
        if step in (1, 4, 9):
            engine.abort(ids[step % 8 : step % 8 + 2])
        engine.step()
        if not engine.has_unfinished():
            break
    engine.abort(ids)
    while engine.has_unfinished():
        engine.step()
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    assert not engine.scheduler.requests

"""`DecodeGraphRunner`'s static buffers, packing and padding, run eagerly on the CPU.

Capture and replay themselves need a GPU (bench/gpu/bench_gpu.py checks them there); here
the same step function must give the runner's logits and KV writes for a padded batch.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

from pdserve.batch import ScheduledRequest, SchedulerOutput
from pdserve.engine.request import Request
from pdserve.model.arch import ModelArch
from pdserve.model.cuda_graphs import DecodeGraphRunner, default_batch_sizes
from pdserve.model.loader import LoadedModel, build_model
from pdserve.model.ops import TorchOps
from pdserve.model.runner import ModelRunner
from pdserve.sampling_params import SamplingParams

BLOCK_SIZE = 4
NUM_BLOCKS = 40
PAD_BLOCK = NUM_BLOCKS - 1


def tiny_runner() -> ModelRunner:
    arch = ModelArch(
        architecture="qwen2",
        vocab_size=96,
        hidden_size=64,
        intermediate_size=96,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=128,
        tie_word_embeddings=True,
        attention_bias=True,
    )
    model = build_model(arch, 128, torch.float32, torch.device("cpu"), None, seed=1)
    loaded = LoadedModel(model, arch, None, torch.float32, torch.device("cpu"), 128)
    runner = ModelRunner(loaded, NUM_BLOCKS, BLOCK_SIZE, kernels="torch")
    runner.kv_cache.normal_(generator=torch.Generator().manual_seed(2))  # "earlier" context
    return runner


def decode_step(context_lens: list[int]) -> tuple[SchedulerOutput, list[list[int]]]:
    rng = random.Random(3)
    free = list(range(PAD_BLOCK))
    rng.shuffle(free)
    entries, tables = [], []
    for i, ctx in enumerate(context_lens):
        table = [free.pop() for _ in range(ctx // BLOCK_SIZE + 1)]
        tokens = [rng.randrange(96) for _ in range(ctx + 1)]
        request = Request(f"r{i}", tokens, SamplingParams(max_tokens=4))
        entries.append(ScheduledRequest(request, 1, ctx, tuple(table), True))
        tables.append(table)
    return SchedulerOutput(tuple(entries), num_decodes=len(entries)), tables


def ops_under_test() -> list[TorchOps]:
    backends = [TorchOps()]
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    try:
        import triton  # noqa: F401
    except ImportError:
        return backends
    from pdserve.model.triton_attention import TritonOps

    return [*backends, TritonOps()]


def test_default_batch_sizes() -> None:
    assert default_batch_sizes(1) == [1]
    assert default_batch_sizes(8) == [1, 2, 4, 8]
    assert default_batch_sizes(40) == [1, 2, 4, 8, 16, 32, 40]


@pytest.mark.parametrize("ops", ops_under_test(), ids=lambda o: o.name)
def test_padded_static_step_matches_runner(ops: TorchOps) -> None:
    runner = tiny_runner()
    runner.ops = ops
    step, tables = decode_step([5, 0, 13])
    cache_before = runner.kv_cache.clone()
    want = runner.forward(step)
    cache_runner = runner.kv_cache.clone()

    runner.kv_cache.copy_(cache_before)
    graphs = DecodeGraphRunner(
        runner.model, runner.kv_cache, ops, BLOCK_SIZE, max_batch=8,
        max_blocks_per_seq=6, pad_block=PAD_BLOCK, batch_sizes=[2, 4, 8],
    )  # fmt: skip
    graphs.capture()
    assert not graphs.use_graphs and graphs.padded_size(3) == 4
    tokens = [s.request.token_ids[-1] for s in step.scheduled]
    positions = [s.num_context_tokens for s in step.scheduled]
    got = graphs.run(tokens, positions, tables)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    # Same KV writes; the padded row wrote only into the pad block.
    torch.testing.assert_close(runner.kv_cache[:PAD_BLOCK], cache_runner[:PAD_BLOCK])

    # A second, smaller step reuses the buffers: stale rows from the first must not leak.
    got1 = graphs.run(tokens[:1], positions[:1], tables[:1])
    runner.kv_cache.copy_(cache_runner)
    step1 = SchedulerOutput(step.scheduled[:1], num_decodes=1)
    torch.testing.assert_close(got1, runner.forward(step1), atol=1e-4, rtol=1e-4)


def test_rejects_bad_inputs() -> None:
    runner = tiny_runner()
    graphs = DecodeGraphRunner(
        runner.model, runner.kv_cache, TorchOps(), BLOCK_SIZE, max_batch=2,
        max_blocks_per_seq=2, pad_block=PAD_BLOCK,
    )  # fmt: skip
    with pytest.raises(ValueError, match="exceeds"):
        graphs.run([1, 2, 3], [0, 0, 0], [[0], [1], [2]])
    with pytest.raises(ValueError, match="block table"):
        graphs.run([1], [4], [[0]])  # position 4 needs a second block

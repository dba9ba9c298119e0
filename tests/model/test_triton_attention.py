"""The Triton paged decode kernel against gather + SDPA: compiled on a CUDA machine, run
by Triton's interpreter (TRITON_INTERPRET=1, set here) on a CPU.

Triton is a test requirement (not a pdserve dependency): its interpreter needs no GPU, so CI
runs these. Shapes are small: the interpreter runs each program in Python.
"""

from __future__ import annotations

import dataclasses
import os
import random

import pytest
import torch

if not torch.cuda.is_available():  # the CPU interpreter; set before the kernels are imported
    os.environ.setdefault("TRITON_INTERPRET", "1")
import triton  # noqa: F401  (requirements-dev.txt: its interpreter needs no GPU)

from pdserve.model import triton_attention as ta
from pdserve.model.attention import (
    AttentionMetadata,
    DecodeGroup,
    PrefillChunk,
)
from pdserve.model.ops import TORCH_OPS

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
if DEVICE.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("Triton on CPU needs TRITON_INTERPRET=1", allow_module_level=True)


def make_case(
    seq_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    block_size: int = 16,
    num_layers: int = 2,
    table_dtype: torch.dtype = torch.int32,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, one layer's view of a shuffled block-major cache, block tables, seq lens."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-n // block_size) for n in seq_lens]
    max_blocks = max(max(need), 1)
    num_blocks = sum(need) + 3
    cache = torch.randn(
        (num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim), generator=gen
    ).to(dtype)
    ids = list(range(num_blocks))
    random.Random(seed).shuffle(ids)
    tables = torch.zeros((len(seq_lens), max_blocks), dtype=table_dtype)
    for row, n in enumerate(need):
        tables[row, :n] = torch.tensor([ids.pop() for _ in range(n)], dtype=table_dtype)
    q = torch.randn((len(seq_lens), num_heads, head_dim), generator=gen).to(dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    kv_layer = cache.to(DEVICE)[:, num_layers - 1]  # a strided view, as the model passes it
    return q.to(DEVICE), kv_layer, tables.to(DEVICE), lens.to(DEVICE)


CASES = [
    # seq_lens, heads, kv heads, head dim, dtype
    ([1, 17, 40, 5], 9, 3, 64, torch.float16),
    ([33, 16, 7], 8, 8, 128, torch.bfloat16),
    ([70], 9, 3, 128, torch.bfloat16),
    ([64, 1, 31], 8, 8, 64, torch.float16),
]


@pytest.mark.parametrize(("seq_lens", "heads", "kv_heads", "dim", "dtype"), CASES)
def test_matches_reference(
    seq_lens: list[int], heads: int, kv_heads: int, dim: int, dtype: torch.dtype
) -> None:
    q, kv_layer, tables, lens = make_case(seq_lens, heads, kv_heads, dim, dtype)
    scale = dim**-0.5
    got = ta.paged_decode_attention(q, kv_layer, tables, lens, scale)
    want = ta.reference_paged_decode(q, kv_layer, tables, lens, scale)
    assert got.shape == q.shape and got.dtype == dtype
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("num_splits", [2, 3])
def test_split_sequences_merge_exactly(num_splits: int) -> None:
    """Flash-decoding: slices of one sequence merged by log-sum-exp; a slice can be empty
    (the short sequence) and a row can have no keys at all (a padded batch row)."""
    q, kv_layer, tables, lens = make_case([90, 3, 0], 9, 3, 64, torch.float16, seed=1)
    scale = 0.125
    got = ta.paged_decode_attention(q, kv_layer, tables, lens, scale, num_splits=num_splits)
    want = ta.reference_paged_decode(q, kv_layer, tables, lens, scale)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
    assert not got[2].any()


def test_int64_tables_and_tile_straddling_blocks() -> None:
    q, kv_layer, tables, lens = make_case(
        [45, 20], 8, 8, 64, torch.float16, block_size=8, table_dtype=torch.int64, seed=2
    )
    got = ta.paged_decode_attention(q, kv_layer, tables, lens, 0.125, tile_n=32)
    want = ta.reference_paged_decode(q, kv_layer, tables, lens, 0.125)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


def test_triton_ops_match_torch_ops() -> None:
    """`TritonOps.attention` (block tables + lengths) gives what `TorchOps.attention` (the
    runner's gathered decode groups) gives on a mixed step: three decodes and a prefill
    chunk with earlier context; the step's K/V land in the same slots."""
    heads, kv_heads, dim, bs = 9, 3, 64, 16
    seq_lens = [40, 9, 35]
    chunk_ctx, chunk_len = 20, 5
    q, kv_layer, tables, lens = make_case(
        [*seq_lens, chunk_ctx + chunk_len], heads, kv_heads, dim, torch.float16
    )
    cache_a, cache_b = kv_layer.clone(), kv_layer.clone()
    dev = q.device
    total = len(seq_lens) + chunk_len
    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn((total, heads + 2 * kv_heads, dim), generator=gen).to(q)
    positions = torch.tensor([n - 1 for n in seq_lens] + [chunk_ctx + i for i in range(5)])
    rows = [0, 1, 2] + [3] * chunk_len
    slot_blocks = torch.stack(
        [tables[r, p // bs] for r, p in zip(rows, positions.tolist(), strict=True)]
    )
    angles = positions[:, None].float() * torch.linspace(0.01, 1.0, dim // 2)[None, :]
    emb = torch.cat((angles, angles), dim=-1)
    rope = (emb.cos()[:, None, :].to(q), emb.sin()[:, None, :].to(q))

    def group(members: list[int]) -> DecodeGroup:
        width = max(-(-seq_lens[r] // bs) for r in members)
        keys = torch.arange(width * bs, device=dev)
        mask = torch.where(keys[None, :] < lens[members].long()[:, None], 0.0, float("-inf")).to(
            q.dtype
        )
        return DecodeGroup(
            indices=torch.tensor(members, device=dev),
            block_tables=tables[members, :width].long(),
            mask=mask[:, None, None, :],
            seq_lens=lens[members].long(),
        )

    n_chunk_blocks = -(-(chunk_ctx + chunk_len) // bs)
    meta = AttentionMetadata(
        num_decode_tokens=3,
        slot_block_ids=slot_blocks.long(),
        slot_offsets=(positions % bs).to(dev),
        decode_groups=(group([0, 2]), group([1])),
        decode_block_tables=tables[:3].long(),
        decode_seq_lens=lens[:3].long(),
        decode_kv_buffer=None,
        prefills=(
            PrefillChunk(
                token_start=3,
                num_tokens=chunk_len,
                num_context_tokens=chunk_ctx,
                block_table=tables[3, :n_chunk_blocks].long(),
            ),
        ),
    )
    scale = dim**-0.5
    got = ta.TritonOps().attention(qkv, heads, kv_heads, rope, cache_a, meta, scale)
    want = TORCH_OPS.attention(qkv, heads, kv_heads, rope, cache_b, meta, scale)
    torch.testing.assert_close(cache_a, cache_b)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)

    decode_only = dataclasses.replace(meta, prefills=(), slot_block_ids=meta.slot_block_ids[:3])
    decode_only = dataclasses.replace(decode_only, slot_offsets=meta.slot_offsets[:3])
    rope_d = (rope[0][:3], rope[1][:3])
    got = ta.TritonOps().attention(qkv[:3], heads, kv_heads, rope_d, cache_a, decode_only, scale)
    torch.testing.assert_close(got.float(), want[:3].float(), atol=2e-2, rtol=2e-2)

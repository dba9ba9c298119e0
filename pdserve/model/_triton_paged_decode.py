"""Triton kernels behind `pdserve.model.triton_attention` (imported only when first used).

Kept apart from the public module so that importing pdserve never imports Triton, and so
that `TRITON_INTERPRET=1` (read when the kernels are decorated) can still be set first.

Stage 1, grid (batch, kv_heads, splits): one program attends the G = H / Hkv query heads
of one KV head over one slice of one sequence, reading each key and value once. Keys are
fetched a tile of TILE_N tokens at a time straight from the block-major cache: token n of
the sequence lives in block `block_tables[b, n // BLOCK_SIZE]` at offset
`n % BLOCK_SIZE`, so a tile may straddle blocks and the block size is free. Online
softmax in fp32; the G heads are padded to 16 rows so both products are `tl.dot`s.

Stage 2 (only when a sequence is split): merge the slices' partial outputs with their
log-sum-exps, flash-decoding style.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")
"""Whether these kernels run in Triton's CPU interpreter (decided when they are decorated).
Its `tl.dot` multiplies bfloat16 operands as their raw uint16 bits (Triton 3.9), so there
both products are done in fp32 instead (UPCAST_DOT); compiled kernels never take that path."""


@triton.jit
def paged_decode_stage1(
    q_ptr,
    kv_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    scale,
    tokens_per_split,
    stride_q_b,
    stride_q_h,
    stride_kv_block,
    stride_kv_kv,
    stride_kv_tok,
    stride_kv_head,
    stride_bt_b,
    stride_o_b,
    stride_o_h,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)
    start = split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, seq_len)

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, D_PAD)
    head = kv_head * GROUP + g
    g_mask = g < GROUP
    d_mask = d < HEAD_DIM
    q = tl.load(
        q_ptr + b * stride_q_b + head[:, None] * stride_q_h + d[None, :],
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    )

    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, D_PAD], dtype=tl.float32)
    table = block_tables_ptr + b.to(tl.int64) * stride_bt_b
    head_offset = kv_head * stride_kv_head
    for tile_start in range(start, end, TILE_N):
        n = tile_start + tl.arange(0, TILE_N)
        n_mask = n < end
        block = tl.load(table + n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        token = block * stride_kv_block + (n % BLOCK_SIZE) * stride_kv_tok + head_offset
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(kv_ptr + token[:, None] + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(kv_ptr + stride_kv_kv + token[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if UPCAST_DOT:
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * scale  # [GROUP_PAD, TILE_N], fp32
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: every tile has a valid token
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if UPCAST_DOT:
            pv = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    # An empty slice (past the end of a short sequence, or a padded row) has l_i == 0.
    has_keys = l_i > 0.0
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    if NUM_SPLITS == 1:
        tl.store(
            out_ptr + b * stride_o_b + head[:, None] * stride_o_h + d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=g_mask[:, None] & d_mask[None, :],
        )
    else:
        # part_out [B, H, NUM_SPLITS, HEAD_DIM] fp32, part_lse [B, H, NUM_SPLITS] fp32
        row = (b * (tl.num_programs(1) * GROUP) + head) * NUM_SPLITS + split
        tl.store(
            part_out_ptr + row[:, None] * HEAD_DIM + d[None, :],
            out,
            mask=g_mask[:, None] & d_mask[None, :],
        )
        lse = tl.where(has_keys, m_i + tl.log(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + row, lse, mask=g_mask)


@triton.jit
def paged_decode_stage2(
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    stride_o_b,
    stride_o_h,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, D_PAD)
    s_mask = s < NUM_SPLITS
    d_mask = d < HEAD_DIM
    row = (b * NUM_HEADS + h) * NUM_SPLITS + s
    lse = tl.load(part_lse_ptr + row, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)  # a row with no keys at all: output zeros
    w = tl.exp(lse - m)
    part = tl.load(
        part_out_ptr + row[:, None] * HEAD_DIM + d[None, :],
        mask=s_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    total = tl.sum(w, 0)
    out = tl.sum(part * w[:, None], 0) / tl.where(total > 0.0, total, 1.0)
    tl.store(
        out_ptr + b * stride_o_b + h * stride_o_h + d,
        out.to(out_ptr.dtype.element_ty),
        mask=d_mask,
    )

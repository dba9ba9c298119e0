"""Paged attention in plain PyTorch (CPU and CUDA).

The KV cache is one tensor per engine, block-major so that one block of one request is one
contiguous byte range across all layers (a single descriptor for a KV transfer):

    kv_cache[num_blocks, num_layers, 2 (K, V), block_size, num_kv_heads, head_dim]

(head_dim + 4 int8 per row in the 8-bit format: values and their scale; kv_format.py.)

A step's tokens are flattened into one batch, decoding requests first, then prefill chunks:

    tokens:  | d0 d1 ... d(B-1) | chunk 0 (n0 tokens) | chunk 1 (n1 tokens) | ...
              one token each      context c0 before it  context c1 before it

Each layer first writes the new K/V at the token's slot (block id, offset), then attends:
- decode tokens either straight from the paged cache (a backend's kernel, given padded
  block tables and sequence lengths; see ops.py), or here in a few batched SDPA calls (one
  per group of similar context length) over K/V gathered through padded block tables;
- each prefill chunk with its own call: plain causal attention when it has no earlier
  context, else over the gathered context with a bottom-right causal mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pdserve.model import kv_format


@dataclass(frozen=True)
class PrefillChunk:
    token_start: int
    """Index of the chunk's first token in the flattened batch."""
    num_tokens: int
    num_context_tokens: int
    """Tokens of this request already in the cache before this chunk."""
    block_table: torch.Tensor
    """Block ids covering context + chunk, [num_blocks] int64."""


@dataclass(frozen=True)
class DecodeGroup:
    """Decode tokens of similar context length, attended in one padded SDPA call.

    Grouping by length bounds the padding: one group for 10- and 1000-token contexts
    would gather and attend 1000 keys for both.
    """

    indices: torch.Tensor | None
    """Positions among the step's decode tokens; None means all of them, in order."""
    block_tables: torch.Tensor
    """[n, max_blocks] int64, padded with block 0 (masked out)."""
    mask: torch.Tensor
    """[n, 1, 1, max_blocks * block_size] additive mask (0 or -inf) in the model dtype."""
    seq_lens: torch.Tensor
    """[n] int64 tokens each decode attends to (its new one included)."""


@dataclass(frozen=True)
class AttentionMetadata:
    num_decode_tokens: int
    slot_block_ids: torch.Tensor
    """[num_tokens] block id of each new token's KV slot."""
    slot_offsets: torch.Tensor
    """[num_tokens] offset of that slot inside its block."""
    decode_groups: tuple[DecodeGroup, ...]
    """For gathered decode attention; empty when the backend reads the cache in place."""
    decode_block_tables: torch.Tensor | None
    """[num_decode_tokens, max_blocks] int64 padded block tables, for in-place decode."""
    decode_seq_lens: torch.Tensor | None
    """[num_decode_tokens] int64 tokens each decode attends to (its new one included)."""
    decode_kv_buffer: torch.Tensor | None
    """[2, blocks, block_size, Hkv, D] scratch for one group's gathered K and V, shared by
    all groups and layers: allocating tens of MB per layer per step costs more than the
    copy itself on CPU (fresh pages fault in)."""
    prefills: tuple[PrefillChunk, ...]


def write_kv(
    kv_layer: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
) -> None:
    """Store the step's new keys and values ([T, Hkv, D]) in their cache slots."""
    index = (meta.slot_block_ids, meta.slot_offsets)
    kv_layer[:, 0].index_put_(index, kv_format.storable(k, kv_layer.dtype))
    kv_layer[:, 1].index_put_(index, kv_format.storable(v, kv_layer.dtype))


def _gather(
    cache: torch.Tensor,
    block_table: torch.Tensor,
    dtype: torch.dtype,
    buffer: torch.Tensor | None = None,
    index: int = 0,
) -> torch.Tensor:
    """[..., nblocks] block ids -> [..., Hkv, nblocks * block_size, D] keys or values in
    `dtype` (dequantized from an 8-bit cache).

    Gathers into `buffer[index]` when given. index_select on the flattened table is several
    times faster than advanced indexing on this strided (block-major) view.
    """
    flat_table = block_table.reshape(-1)
    if buffer is None:
        blocks = cache.index_select(0, flat_table)  # [n, block_size, Hkv, D]
    else:
        out = buffer[index, : flat_table.numel()]
        blocks = torch.index_select(cache, 0, flat_table, out=out)
    bs, hkv, d = cache.shape[1:]
    flat = blocks.reshape(*block_table.shape[:-1], block_table.shape[-1] * bs, hkv, d)
    return kv_format.readable(flat, dtype).transpose(-3, -2)


def decode_attention_gathered(
    q: torch.Tensor,
    kv_layer: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    out: torch.Tensor,
    window: int = 0,
) -> None:
    """Decode tokens' attention into `out[:num_decode_tokens]`, one SDPA call per group;
    with a `window`, over each token's last `window` keys only.

    q [T, H, D]; `kv_layer` is this layer's [num_blocks, 2, block_size, Hkv, D] view.
    """
    k_cache, v_cache = kv_layer[:, 0], kv_layer[:, 1]
    nd = meta.num_decode_tokens
    for group in meta.decode_groups:
        qd = q[:nd] if group.indices is None else q.index_select(0, group.indices)
        kd = _gather(k_cache, group.block_tables, q.dtype, meta.decode_kv_buffer, 0)
        vd = _gather(v_cache, group.block_tables, q.dtype, meta.decode_kv_buffer, 1)
        mask = group.mask
        if window:
            keys = torch.arange(mask.shape[-1], device=mask.device)
            early = keys[None, :] < (group.seq_lens - window)[:, None]
            mask = mask.masked_fill(early[:, None, None, :], float("-inf"))
        od = F.scaled_dot_product_attention(
            qd.unsqueeze(2), kd, vd, attn_mask=mask, scale=scale, enable_gqa=True
        ).squeeze(2)
        if group.indices is None:
            out[:nd] = od
        else:
            out.index_copy_(0, group.indices, od)


def prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_layer: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    out: torch.Tensor,
    window: int = 0,
) -> None:
    """Each prefill chunk's attention into its rows of `out`; the step's K/V are stored.
    With a `window`, each token attends to its last `window` keys (itself included).

    q [T, H, D], k/v [T, Hkv, D] for the step's tokens (the chunks' rows are used).
    """
    k_cache, v_cache = kv_layer[:, 0], kv_layer[:, 1]
    for chunk in meta.prefills:
        s, n, ctx = chunk.token_start, chunk.num_tokens, chunk.num_context_tokens
        # 4-D [1, H, n, D] inputs: PyTorch's CPU flash kernel only takes batched ones and
        # falls back to the ~10x slower math path for 3-D.
        qc = q[s : s + n].transpose(0, 1).unsqueeze(0)
        if window and ctx + n > window:  # the window cuts: an explicit mask either way
            kc = _gather(k_cache, chunk.block_table, q.dtype)[:, : ctx + n].unsqueeze(0)
            vc = _gather(v_cache, chunk.block_table, q.dtype)[:, : ctx + n].unsqueeze(0)
            mask = causal_mask_with_context(n, ctx, q.device, window)
            oc = F.scaled_dot_product_attention(
                qc, kc, vc, attn_mask=mask, scale=scale, enable_gqa=True
            )
        elif not ctx:
            kc = k[s : s + n].transpose(0, 1).unsqueeze(0)
            vc = v[s : s + n].transpose(0, 1).unsqueeze(0)
            oc = F.scaled_dot_product_attention(
                qc, kc, vc, is_causal=True, scale=scale, enable_gqa=True
            )
        else:
            kc = _gather(k_cache, chunk.block_table, q.dtype)[:, : ctx + n].unsqueeze(0)
            vc = _gather(v_cache, chunk.block_table, q.dtype)[:, : ctx + n].unsqueeze(0)
            mask = causal_mask_with_context(n, ctx, q.device)
            oc = F.scaled_dot_product_attention(
                qc, kc, vc, attn_mask=mask, scale=scale, enable_gqa=True
            )
        out[s : s + n] = oc[0].transpose(0, 1)


def causal_mask_with_context(
    num_tokens: int, num_context: int, device: torch.device, window: int = 0
) -> torch.Tensor:
    """Bottom-right causal mask: query i (at position context + i) sees keys 0..context+i,
    or with a `window` only the last `window` of them."""
    q_pos = torch.arange(num_tokens, device=device).unsqueeze(1) + num_context
    k_pos = torch.arange(num_context + num_tokens, device=device).unsqueeze(0)
    if window:
        return (k_pos <= q_pos) & (k_pos > q_pos - window)
    return k_pos <= q_pos

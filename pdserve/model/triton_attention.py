"""Decode attention over the paged KV cache with a Triton kernel (CUDA; CPU via the
Triton interpreter, `TRITON_INTERPRET=1`, for tests).

One new token per sequence attends to its whole context read straight from the
block-major cache through the block table: no gather into a padded copy, no mask, and each
sequence reads only its own `seq_len` keys (the SDPA path reads the group's longest).

Triton is optional: this module imports without it, and `triton_available()` says whether
the kernel can run. The kernels live in `_triton_paged_decode`, imported on first use.

`TritonOps` is an `ops.py` backend built on it (`runner.ops = TritonOps()`): decode
attention through the kernel, everything else as `TorchOps` does it.
"""

from __future__ import annotations

import functools
import importlib.util
from types import ModuleType

import torch
import torch.nn.functional as F

from pdserve.model.attention import AttentionMetadata
from pdserve.model.ops import TorchOps, paged_decode_inputs

DEFAULT_TILE_N = 64
"""Keys per inner-loop iteration (K and V tiles of TILE_N x head_dim)."""
_CPU_PROGRAM_TARGET = 8
"""Programs to aim for without a GPU to size (only the interpreter runs there)."""


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


@functools.cache
def _kernels() -> ModuleType:
    from pdserve.model import _triton_paged_decode

    return _triton_paged_decode


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return _CPU_PROGRAM_TARGET


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def default_num_splits(
    batch: int, num_kv_heads: int, max_tokens: int, device: torch.device, tile_n: int
) -> int:
    """Split each sequence into slices when batch x kv_heads programs would leave SMs idle
    (batch 1: 2-8 programs on 132 SMs). Depends on shapes only, never on the sequence
    lengths' values, so the choice is fixed for a CUDA graph and needs no host sync."""
    programs = batch * num_kv_heads
    sms = _num_sms(device)
    if programs >= sms:
        return 1
    return max(1, min(_cdiv(2 * sms, programs), _cdiv(max_tokens, tile_n)))


def paged_decode_attention(
    q: torch.Tensor,
    kv_layer: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    num_splits: int | None = None,
    tile_n: int = DEFAULT_TILE_N,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one query token per sequence over its cached keys and values.

    q [B, H, D] (fp16/bf16; head dim contiguous), kv_layer [num_blocks, 2, block_size,
    Hkv, D] (one layer's view of the block-major cache), block_tables [B, max_blocks]
    int32/int64, seq_lens [B] (keys 0..seq_len-1 are attended; 0 gives a zero row) ->
    out [B, H, D] in q's dtype. Accumulates in fp32. H must be a multiple of Hkv; query
    head h reads KV head h // (H / Hkv), as SDPA's `enable_gqa` does.
    """
    batch, num_heads, head_dim = q.shape
    _, two, block_size, num_kv_heads, kv_dim = kv_layer.shape
    if two != 2 or kv_dim != head_dim or num_heads % num_kv_heads:
        raise ValueError(f"bad shapes: q {tuple(q.shape)}, kv_layer {tuple(kv_layer.shape)}")
    if block_tables.dim() != 2 or block_tables.shape[0] != batch or seq_lens.shape != (batch,):
        raise ValueError(
            f"bad shapes: block_tables {tuple(block_tables.shape)}, "
            f"seq_lens {tuple(seq_lens.shape)} for batch {batch}"
        )
    if q.stride(-1) != 1 or kv_layer.stride(-1) != 1:
        raise ValueError("q and kv_layer need a contiguous head dim")
    if block_tables.stride(-1) != 1:
        block_tables = block_tables.contiguous()
    if out is None:
        out = torch.empty((batch, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if batch == 0:
        return out
    group = num_heads // num_kv_heads
    max_tokens = max(1, block_tables.shape[1] * block_size)
    splits = num_splits or default_num_splits(batch, num_kv_heads, max_tokens, q.device, tile_n)
    tokens_per_split = _cdiv(_cdiv(max_tokens, splits), tile_n) * tile_n
    splits = _cdiv(max_tokens, tokens_per_split)
    d_pad = max(16, _next_pow2(head_dim))
    k = _kernels()
    if splits > 1:
        part_out = torch.empty(
            (batch, num_heads, splits, head_dim), dtype=torch.float32, device=q.device
        )
        part_lse = torch.empty((batch, num_heads, splits), dtype=torch.float32, device=q.device)
    else:
        part_out = part_lse = out  # unused by the kernel
    k.paged_decode_stage1[(batch, num_kv_heads, splits)](
        q,
        kv_layer,
        block_tables,
        seq_lens,
        out,
        part_out,
        part_lse,
        scale,
        tokens_per_split,
        q.stride(0),
        q.stride(1),
        kv_layer.stride(0),
        kv_layer.stride(1),
        kv_layer.stride(2),
        kv_layer.stride(3),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        GROUP=group,
        GROUP_PAD=max(16, _next_pow2(group)),
        HEAD_DIM=head_dim,
        D_PAD=d_pad,
        BLOCK_SIZE=block_size,
        TILE_N=tile_n,
        NUM_SPLITS=splits,
        UPCAST_DOT=k.INTERPRETED,
        num_warps=4,
    )
    if splits > 1:
        k.paged_decode_stage2[(batch, num_heads)](
            part_out,
            part_lse,
            out,
            out.stride(0),
            out.stride(1),
            NUM_HEADS=num_heads,
            HEAD_DIM=head_dim,
            D_PAD=d_pad,
            NUM_SPLITS=splits,
            SPLITS_PAD=max(2, _next_pow2(splits)),
            num_warps=4,
        )
    return out


def reference_paged_decode(
    q: torch.Tensor,
    kv_layer: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """The same computation in plain PyTorch (gather through the table + masked SDPA, in
    fp32): the kernel's reference in tests and in the GPU benchmark."""
    batch, _, head_dim = q.shape
    block_size, num_kv_heads = kv_layer.shape[2], kv_layer.shape[3]
    blocks = kv_layer.index_select(0, block_tables.reshape(-1).long()).float()
    kv = blocks.view(batch, -1, 2, block_size, num_kv_heads, head_dim)
    kv = kv.permute(2, 0, 4, 1, 3, 5).reshape(2, batch, num_kv_heads, -1, head_dim)
    keys = torch.arange(kv.shape[3], device=q.device)
    mask = keys[None, :] < seq_lens.to(q.device).long()[:, None]  # [B, L]
    out = F.scaled_dot_product_attention(
        q.float().unsqueeze(2),
        kv[0],
        kv[1],
        attn_mask=mask[:, None, None, :],
        scale=scale,
        enable_gqa=True,
    ).squeeze(2)
    empty = (seq_lens.to(q.device) == 0)[:, None, None]
    return torch.where(empty, torch.zeros_like(out), out).to(q.dtype)


class TritonOps(TorchOps):
    """The PyTorch backend with decode attention through the Triton kernel: the runner
    then hands over padded block tables and sequence lengths (`paged_decode`) instead of
    gathered decode groups. Rotary, the KV write and prefill attention stay on PyTorch."""

    name = "triton"
    paged_decode = True

    def decode_attention(
        self,
        q: torch.Tensor,
        kv_layer: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int = 0,
    ) -> torch.Tensor:
        """`window` is always 0 here: `select_ops` refuses sliding models on Triton."""
        tables, seq_lens = paged_decode_inputs(meta)
        return paged_decode_attention(q, kv_layer, tables, seq_lens, scale)

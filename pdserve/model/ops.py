"""The model's hot operations: the `Ops` interface the decoder is written against, and
`TorchOps`, plain PyTorch (any device, any dtype), the reference every other backend is
tested against. Decode attention gathers each group's K/V blocks and calls SDPA (see
attention.py).

The other backends implement `Ops` over the same contract: `CpuKernelOps` (`cpu_ops.py`,
the fused CPU kernels) and `TritonOps` (`triton_attention.py`, decode attention on CUDA);
each subclasses `TorchOps` and overrides what it runs itself. `backends.select_ops` picks
one from the config and the machine.

The residual stream is carried as (x, delta): each layer's two norms first add the
pending delta into x in place, which is what lets the kernel fuse add and norm.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.model.attention import (
    AttentionMetadata,
    decode_attention_gathered,
    prefill_attention,
    write_kv,
)


class Ops(Protocol):
    """What the decoder asks of a backend, per step (`decoder.py`)."""

    name: str
    paged_decode: bool
    """True when decode attention reads the paged cache directly (no decode groups)."""

    @property
    def label(self) -> str: ...
    def linear(self, x: torch.Tensor, layer: nn.Linear) -> torch.Tensor: ...
    def logits(self, h: torch.Tensor, head: nn.Linear) -> torch.Tensor: ...
    def embed(self, table: nn.Module, ids: torch.Tensor) -> torch.Tensor: ...
    def add_rms_norm(
        self, x: torch.Tensor, delta: torch.Tensor | None, norm: Any
    ) -> torch.Tensor: ...
    def rms_norm(self, x: torch.Tensor, norm: Any) -> torch.Tensor: ...
    def head_norms(
        self, qkv: torch.Tensor, num_heads: int, num_kv_heads: int, q_norm: Any, k_norm: Any
    ) -> None: ...
    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor: ...
    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor: ...
    def rope(self, rotary: Any, positions: torch.Tensor, dtype: torch.dtype) -> Any: ...
    def run_layers(
        self, model: Any, x: torch.Tensor, ropes: tuple[Any, ...], kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor | None: ...  # fmt: skip
    def attention(
        self,
        qkv: torch.Tensor,
        num_heads: int,
        num_kv_heads: int,
        rope: Any,
        kv_layer: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int = 0,
    ) -> torch.Tensor: ...


class TorchOps:
    """Plain PyTorch operations; the reference every other backend is tested against."""

    name = "torch"
    paged_decode = False
    """True when decode attention reads the paged cache directly (no decode groups)."""

    @property
    def label(self) -> str:
        """What ran, for logs and benchmark reports (the kernels' CPU level included)."""
        return self.name

    def linear(self, x: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
        return F.linear(x, layer.weight, layer.bias)

    def logits(self, h: torch.Tensor, head: nn.Linear) -> torch.Tensor:
        """The LM head's output; here in the model's dtype (the sampler widens it)."""
        return self.linear(h, head)

    def embed(self, table: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        return table(ids)

    def add_rms_norm(self, x: torch.Tensor, delta: torch.Tensor | None, norm: Any) -> torch.Tensor:
        """x += delta in place (when given), then RMSNorm(x)."""
        if delta is not None:
            x.add_(delta)
        # One fused kernel; it accumulates in fp32 like Hugging Face's hand-written version.
        return F.rms_norm(x, norm.weight.shape, norm.weight, norm.eps)

    def rms_norm(self, x: torch.Tensor, norm: Any) -> torch.Tensor:
        """RMSNorm(x) into a new tensor (a sublayer's output norm)."""
        return self.add_rms_norm(x, None, norm)

    def head_norms(
        self, qkv: torch.Tensor, num_heads: int, num_kv_heads: int, q_norm: Any, k_norm: Any
    ) -> None:
        """RMSNorm over each q head and each k head of qkv [T, H + 2Hkv, D], in place."""
        q, k = qkv[:, :num_heads], qkv[:, num_heads : num_heads + num_kv_heads]
        d = qkv.shape[-1]
        q.copy_(F.rms_norm(q, (d,), q_norm.weight, q_norm.eps))
        k.copy_(F.rms_norm(k, (d,), k_norm.weight, k_norm.eps))

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """GeGLU (Gemma): gelu(gate), GeLU's tanh approximation, times up."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up

    def rope(self, rotary: Any, positions: torch.Tensor, dtype: torch.dtype) -> Any:
        """Per-step rotary state, computed once and handed to every layer's attention."""
        return rotary.tables(positions, dtype)

    def rotary_write_kv(
        self,
        qkv: torch.Tensor,
        num_heads: int,
        num_kv_heads: int,
        rope: Any,
        kv_layer: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rotate q and k, store k and v in their cache slots; return (q, k, v)."""
        cos, sin = rope
        qk = qkv[:, : num_heads + num_kv_heads]
        qk = qk * cos + _rotate_half(qk) * sin
        q, k = qk.split([num_heads, num_kv_heads], dim=1)
        v = qkv[:, num_heads + num_kv_heads :]
        write_kv(kv_layer, k, v, meta)
        return q, k, v

    def decode_attention(
        self,
        q: torch.Tensor,
        kv_layer: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int = 0,
    ) -> torch.Tensor:
        """The step's decode tokens (q [num_decode_tokens, H, D]) over their cached context
        (its last `window` tokens, when given)."""
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        decode_attention_gathered(q, kv_layer, meta, scale, out, window)
        return out

    def run_layers(
        self, model: Any, x: torch.Tensor, ropes: tuple[Any, ...], kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor | None:  # fmt: skip
        """Every decoder layer of `model`: x, the residual stream, is updated in place; the
        last layer's delta (not yet added) is returned. `ropes`: the step's rotary state
        per table (`DecoderModel.rotaries`)."""
        delta = None
        for i, layer in enumerate(model.layers):
            delta = layer(x, delta, ropes, kv_cache[:, i], meta, self)
        return delta

    def attention(
        self,
        qkv: torch.Tensor,
        num_heads: int,
        num_kv_heads: int,
        rope: Any,
        kv_layer: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int = 0,
    ) -> torch.Tensor:
        """qkv [T, H + 2Hkv, D] -> attention output [T, H, D]; stores the step's K/V.
        `window`: a sliding layer's keys per token (itself included), 0 for all.

        Backends differ in `rotary_write_kv`, `decode_attention` and `prefill_attention`."""
        q, k, v = self.rotary_write_kv(qkv, num_heads, num_kv_heads, rope, kv_layer, meta)
        if not meta.prefills:
            return self.decode_attention(q, kv_layer, meta, scale, window)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        nd = meta.num_decode_tokens
        if nd:
            out[:nd] = self.decode_attention(q[:nd], kv_layer, meta, scale, window)
        self.prefill_attention(q, k, v, kv_layer, meta, scale, out, window)
        return out

    def prefill_attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_layer: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        out: torch.Tensor,
        window: int = 0,
    ) -> None:
        """Each prefill chunk's rows of `out` (SDPA; see attention.py)."""
        prefill_attention(q, k, v, kv_layer, meta, scale, out, window)


def paged_decode_inputs(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """(block tables, sequence lengths) for a backend whose decode attention reads the
    paged cache in place (`paged_decode = True` makes the runner provide them)."""
    if meta.decode_block_tables is None or meta.decode_seq_lens is None:
        raise ValueError("paged decode attention needs decode_block_tables and decode_seq_lens")
    return meta.decode_block_tables, meta.decode_seq_lens


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


TORCH_OPS = TorchOps()

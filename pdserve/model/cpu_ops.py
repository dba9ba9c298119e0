"""`CpuKernelOps`: the model's hot operations on x86-64 CPUs through the fused kernels
(`cpu_kernels.py` picks the library from the dtype and the CPU's level): residual add +
RMSNorm in one pass, rotary + KV-cache write in one pass, SiLU·mul and GeLU·mul in one
pass, per-head q/k norms, decode attention read straight from the paged cache (a sliding
layer's window included), and linears for decode-sized batches that read each weight once
per step. In bf16 (`csrc/cpu_kernels.cpp`, AVX512-BF16): a weight-streaming loop for a few
rows, AMX tiles on pre-packed weights up to 128 (oneDNN repacks per call and reads weights
at half the speed), and a flash prefill attention (AMX tiles, or AVX512-BF16 dot products).
In float32 (`csrc/cpu_kernels_fp32.cpp`, AVX2 or AVX-512): the weight-streaming loop up to
FP32_MAX_M rows (from 16 or 32 rows on panels of x), prefill attention on SDPA.
Prefill-sized GEMMs stay on oneDNN/MKL. A decode-only step runs every layer in one kernel
call (`pd_decode_layers`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.model import cpu_kernels, huge_pages
from pdserve.model.attention import AttentionMetadata
from pdserve.model.ops import TorchOps, paged_decode_inputs
from pdserve.model.quant import QuantEmbedding, QuantLinear


class CpuKernelOps(TorchOps):
    """bf16 on the CPU through the fused kernels; falls back per call where a shape
    does not fit a kernel (a prefill-sized linear goes to oneDNN)."""

    name = "cpu-kernels"
    paged_decode = True

    def __init__(self, kernels: cpu_kernels.CpuKernels, batch_invariant: bool = False) -> None:
        self.k = kernels
        self.dtype = kernels.dtype
        self.batch_invariant = batch_invariant
        """ModelConfig.batch_invariant: every linear on one kernel (`CpuKernels.route`)."""
        self.one_call = True
        """False runs every step per op (what `pdserve bench kernels` compares against)."""
        self._layer_tables: dict[tuple[int, int, bool], Any] = {}

    @property
    def label(self) -> str:
        invariant = ", batch-invariant" if self.batch_invariant else ""
        return f"{self.name} ({self.k.isa.label}{invariant})"

    def run_layers(
        self, model: Any, x: torch.Tensor, ropes: tuple[Any, ...], kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor | None:  # fmt: skip
        """A decode-only step runs all layers in one kernel call (`pd_decode_layers`: the
        same kernels on the same values as the per-op path, so bit-identical) when its rows
        fit the small-M linear, or the AMX linear where the CPU has it; anything else (a
        prefill chunk in the step, more rows, a family whose layers are not Llama's) runs
        per op. Batch-invariant: the AMX table at every row count (the kernel `route` gives
        every linear), and without AMX the loop `CpuKernels.linear` takes in that mode, as
        one call too."""
        t = x.shape[0]
        amx = (self.k.amx if self.batch_invariant else t > self.k.small_m) and not model.quantized
        limit = self.k.quant_max_m if model.quantized else self.k.max_one_call_m
        table = None
        if self.one_call and not meta.prefills and t <= limit:
            table = self._layer_table(model, kv_cache, amx)
        if table is None:
            return super().run_layers(model, x, ropes, kv_cache, meta)
        positions = ropes[0][2]  # every table's rope state carries the step's positions
        block_tables, seq_lens = paged_decode_inputs(meta)
        attn, mlp = model.layers[0].self_attn, model.layers[0].mlp
        shape = (attn.num_heads, attn.num_kv_heads, attn.head_dim, mlp.intermediate_size)
        return self.k.decode_layers(
            table, x, shape, model.arch.rms_norm_eps, attn.scale, positions,
            kv_cache, meta.slot_block_ids, meta.slot_offsets, block_tables, seq_lens,
            self.batch_invariant,
        )  # fmt: skip

    def _layer_table(self, model: Any, kv_cache: torch.Tensor, amx: bool) -> Any:
        """The layers' weight and cache pointers for `pd_decode_layers`, built once per
        model, cache and linear kernel; None when a layer does not fit (a bias other than
        qkv's, an inner size not a multiple of `k_multiple`, or for AMX an outer one not
        of 16)."""
        key = (id(model), kv_cache.data_ptr(), amx)
        if key not in self._layer_tables:
            self._layer_tables[key] = _layer_table(self.k, model, kv_cache, amx)
        return self._layer_tables[key]

    def linear(self, x: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
        if isinstance(layer, QuantLinear):
            if x.shape[0] <= self.k.quant_max_m:
                return self.k.linear_quant(x, layer)
            dense = self.k.dequantize(layer.qweight, layer.qtype, layer.in_features)
            return F.linear(x, dense, layer.bias)
        route = self.k.route(x, layer.weight, self.batch_invariant)
        if route == "small":
            return self.k.linear(x, layer.weight, layer.bias, self.batch_invariant)
        if route == "amx":
            return self.k.linear_amx(x, _amx_weight(self.k, layer), layer.bias)
        return F.linear(x, layer.weight, layer.bias)

    def logits(self, h: torch.Tensor, head: nn.Linear) -> torch.Tensor:
        """bf16: float32 logits from the bf16 activations and the weight as kept
        (`pd_logits`), so greedy picks and logprobs are not decided by rounding the logits
        to bf16. float32: the linear."""
        if self.k.dtype != torch.bfloat16:
            return self.linear(h, head)
        return self.k.logits(h, head)

    def embed(self, table: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        if isinstance(table, QuantEmbedding):
            return self.k.dequantize(table.qweight[ids], table.qtype, table.embedding_dim)
        return table(ids)

    def add_rms_norm(self, x: torch.Tensor, delta: torch.Tensor | None, norm: Any) -> torch.Tensor:
        return self.k.add_rms_norm(x, delta, norm.weight, norm.eps)

    def rms_norm(self, x: torch.Tensor, norm: Any) -> torch.Tensor:
        return self.k.add_rms_norm(x.contiguous(), None, norm.weight, norm.eps)

    def head_norms(
        self, qkv: torch.Tensor, num_heads: int, num_kv_heads: int, q_norm: Any, k_norm: Any
    ) -> None:
        """The kernel the one-call step runs too: both paths give the same bits."""
        self.k.head_norms(qkv, num_heads, num_kv_heads, q_norm, k_norm)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self.k.silu_mul(gate_up)

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self.k.gelu_tanh_mul(gate_up)

    def rope(self, rotary: Any, positions: torch.Tensor, dtype: torch.dtype) -> Any:
        return rotary.cos, rotary.sin, positions  # fp32 tables, indexed inside the kernel

    def rotary_write_kv(
        self,
        qkv: torch.Tensor,
        num_heads: int,
        num_kv_heads: int,
        rope: Any,
        kv_layer: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """In place in qkv: q, k and v come back as views of it."""
        cos, sin, positions = rope
        self.k.rotary_write_kv(
            qkv, num_heads, num_kv_heads, cos, sin, positions, kv_layer,
            meta.slot_block_ids, meta.slot_offsets,
        )  # fmt: skip
        q, k, v = qkv.split([num_heads, num_kv_heads, num_kv_heads], dim=1)
        return q, k, v

    def decode_attention(
        self,
        q: torch.Tensor,
        kv_layer: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int = 0,
    ) -> torch.Tensor:
        tables, seq_lens = paged_decode_inputs(meta)
        return self.k.decode_attention(q, kv_layer, tables, seq_lens, scale, window)

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
        """With the bf16 library, every chunk reads its keys from the cache (the step's
        K/V are already there; an 8-bit cache's dequantized as they are read) in the flash
        kernel (AMX tiles, or AVX512-BF16 dot products: 1.8-3.5x SDPA a 2k chunk at 0-6k of
        context, a whole 8k prompt 1.8x faster; docs/benchmarks.md); otherwise SDPA, and
        so for a sliding layer whose chunk reaches past its window (the flash kernel reads
        every key)."""
        slides = window and any(c.num_context_tokens + c.num_tokens > window for c in meta.prefills)
        if (
            slides
            or not self.k.has_prefill_attention
            or q.shape[-1] not in cpu_kernels.PREFILL_HEAD_SIZES
        ):
            return super().prefill_attention(q, k, v, kv_layer, meta, scale, out, window)
        for chunk in meta.prefills:
            s, n = chunk.token_start, chunk.num_tokens
            self.k.prefill_attention(
                q[s : s + n], kv_layer, chunk.block_table, chunk.num_context_tokens, scale,
                out[s : s + n],
            )  # fmt: skip


def _layer_table(
    kernels: cpu_kernels.CpuKernels, model: Any, kv_cache: torch.Tensor, amx: bool
) -> Any:
    layers = []
    for i, layer in enumerate(model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        dense = [lin for lin in linears if not isinstance(lin, QuantLinear)]
        if any(lin.bias is not None for lin in linears[1:]) or any(
            lin.weight.shape[1] % kernels.k_multiple or (amx and lin.weight.shape[0] % 16)
            for lin in dense
        ):
            return None
        weights = [_weight_ptr(lin) for lin in linears]
        packed = [_amx_weight(kernels, lin).data_ptr() if amx else None for lin in linears]
        types = [
            kernels.quant_type(lin.qtype) if isinstance(lin, QuantLinear) else 0 for lin in linears
        ]
        rotary = model.rotaries[layer.rope_variant]
        norms = (attn.q_norm, attn.k_norm, layer.attn_out_norm, layer.mlp_out_norm)
        layers.append(cpu_kernels.PdLayer(
            layer.input_layernorm.weight.data_ptr(), weights[0],
            None if attn.qkv_proj.bias is None else attn.qkv_proj.bias.data_ptr(),
            weights[1], layer.post_attention_layernorm.weight.data_ptr(), weights[2], weights[3],
            kv_cache[:, i].data_ptr(), *packed, *types,
            *(None if n is None else n.weight.data_ptr() for n in norms),
            rotary.cos.data_ptr(), rotary.sin.data_ptr(), attn.window,
            cpu_kernels.ACTIVATIONS[mlp.activation.value],
        ))  # fmt: skip
    return (cpu_kernels.PdLayer * len(layers))(*layers)


def _weight_ptr(layer: nn.Linear | QuantLinear) -> int:
    """The weight the kernels read: the blocks of a quantized linear."""
    if isinstance(layer, QuantLinear):
        return layer.qweight.data_ptr()
    return layer.weight.data_ptr()


def _amx_weight(kernels: cpu_kernels.CpuKernels, layer: nn.Linear) -> torch.Tensor:
    """The layer's weight packed for the AMX linear: packed on first use, kept beside it
    (twice the weight memory, only on machines and batch sizes that use AMX)."""
    packed: torch.Tensor | None = getattr(layer, "amx_weight", None)
    if packed is None:
        packed = layer.amx_weight = _PACKED.copy_of(kernels.pack_amx(layer.weight.detach()))
    return packed


_PACKED = huge_pages.Arena()
"""AMX-packed weights, streamed every step like the weights themselves."""

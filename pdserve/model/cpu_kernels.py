"""Load and call the fused CPU kernels: bf16 (`csrc/cpu_kernels.cpp`) and float32
(`csrc/cpu_kernels_fp32.cpp`); `kernel_build.py` compiles them.

Which library runs follows the model's dtype and the CPU's level (cpu_isa.py):

| dtype    | level                 | library                                          |
|----------|-----------------------|--------------------------------------------------|
| bfloat16 | avx512_bf16, amx      | `bf16`: AVX512-BF16 dot products, AMX tiles on amx |
| float32  | avx512 and above      | `fp32-avx512`: the float32 kernels on 16 lanes    |
| float32  | avx2                  | `fp32-avx2`: the same source on 8 lanes           |
| other    | any                   | none: plain PyTorch ops                           |

A library is compiled on first use with the system's g++ (about a second) into a cache
directory keyed by its source, its flags and the CPU's flags, then loaded with ctypes. No
PyTorch headers are involved, so a build costs nothing noticeable and no ABI ties the
library to one torch version. The kernels run on the libgomp that PyTorch has already
loaded (same soname), so they share its threads. The float32 builds name their ISA
(`-march=x86-64-v3` for AVX2) instead of `-march=native`: forced onto a bigger CPU with
PDSERVE_CPU_ISA, the AVX2 path runs AVX2 code, not whatever the compiler found there.

`load()` returns None, with the reason logged once, where no kernels can be used: no
library for the dtype at this level, no g++, or a failed build. The model then runs its
plain PyTorch ops; the kernels are a speed-up, never a requirement.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import subprocess
from typing import Any

import torch
from torch import nn

from pdserve.model import cpu_isa, kv_format
from pdserve.model.cpu_isa import CpuIsa
from pdserve.model.kernel_build import (
    Build,
    build_for,
    build_library,
    library_path,
    unavailable_reason,
)
from pdserve.model.quant import QuantLinear, QuantType

__all__ = ["CpuKernels", "PdLayer", "build_for", "load", "unavailable_reason"]

logger = logging.getLogger(__name__)

HEAD_SIZES = (32, 64, 128, 256)
"""Head sizes the decode-attention kernels are specialised for."""
PREFILL_HEAD_SIZES = (64, 128, 256)
"""Head sizes the AMX prefill-attention kernel takes (whole 64-dim groups)."""
SMALL_M = 6
"""bf16 without AMX: the most rows the small-M kernel takes; above it oneDNN is as fast.
From `pdserve bench kernels` (2 threads, one decode step's weights, 2026-11-30):
small-M 10-16 ms vs oneDNN 22 ms for 1-6 rows; with AMX: AMX 10-11 ms for 3-16 rows,
15 ms at 32 (oneDNN 31 ms), 32 ms at 64 (oneDNN 41 ms)."""
FP32_MAX_M = 128
"""float32: the most rows the small-M kernel takes (it reads each weight once a call;
MKL repacks the weights every call)."""

_P = ctypes.c_void_p
_I = ctypes.c_int64
_F = ctypes.c_float
_SIGNATURES = {
    "pd_linear_small": [_P, _P, _P, _P, _I, _I, _I],
    "pd_linear_rows": [_P, _P, _P, _P, _I, _I, _I],
    "pd_add_rms_norm": [_P, _P, _P, _P, _I, _I, _F],
    "pd_silu_mul": [_P, _P, _I, _I],
    "pd_gelu_tanh_mul": [_P, _P, _I, _I],
    "pd_head_norms": [_P, _I, _I, _I, _I, _P, _P, _F],
    "pd_rotary_write_kv": [_P, _I, _I, _I, _I, _P, _P, _P, _P, _I, _I, _I, _I, _P, _P],
    "pd_decode_attention": [_P, _I, _P, _I, _I, _I, _I, _P, _I, _P, _P, _I, _I, _I, _I, _I, _F, _I],
    "pd_linear_amx": [_P, _P, _P, _P, _I, _I, _I],
    "pd_prefill_attention": [_P, _I, _P, _I, _I, _I, _I, _P, _I, _I, _I, _P, _I, _I, _I, _F, _I],
    "pd_amx_init": [],
    "pd_amx_available": [],
    "pd_linear_quant": [_P, _P, _I, _P, _P, _I, _I, _I],
    "pd_dequantize": [_P, _I, _P, _I, _I],
    "pd_logits": [_P, _P, _I, _P, _P, _I, _I, _I],
}
_RETURNS_INT = (
    "pd_decode_attention",
    "pd_prefill_attention",
    "pd_amx_init",
    "pd_amx_available",
    "pd_decode_layers",
    "pd_linear_quant",
    "pd_dequantize",
    "pd_logits",
)


class PdLayer(ctypes.Structure):
    """One decoder layer's weights and KV cache for `pd_decode_layers` (raw pointers)."""

    _fields_ = [
        *((name, _P) for name in ("input_norm", "qkv", "qkv_bias", "o", "post_norm")),
        *((name, _P) for name in ("gate_up", "down", "kv")),
        *((name, _P) for name in ("qkv_amx", "o_amx", "gate_up_amx", "down_amx")),
        # The four weights' formats: 0 dense, else a quant.QuantType (blocks in qkv, ...).
        *((name, _I) for name in ("qkv_type", "o_type", "gate_up_type", "down_type")),
        # The family's (null, 0 for Llama's layer): per-head q/k norms, sublayer-output
        # norms, the layer's rotary tables, its window, its activation (ACTIVATIONS).
        *((name, _P) for name in ("q_norm", "k_norm", "attn_out_norm", "mlp_out_norm")),
        *((name, _P) for name in ("cos", "sin")),
        *((name, _I) for name in ("window", "activation")),
    ]


ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}
"""`PdLayer.activation`'s codes (paged_decode.h's Activation), by family.Activation value."""


# layers, num_layers, x, delta, T, hidden, H, Hkv, D, inter, eps, scale, positions,
# kv_format, s_block, s_kv, s_tok, slot blocks and offsets, block tables, max_blocks,
# seq_lens, block_size, batch_invariant.
_SIGNATURES["pd_decode_layers"] = [ctypes.POINTER(PdLayer), *[_I, _P, _P], *[_I] * 6, _F, _F,
                                   _P, *[_I] * 4, _P, _P, _P, _I, _P, _I, _I]  # fmt: skip
AMX_MAX_M = 128
"""Most rows the AMX linear takes. Against oneDNN on a decode step's weights (`pdserve
bench kernels`, 2 cores): 1.2-1.4x at 128 rows in every run; at 160-256 rows anywhere
from 0.67x to 1.3x from run to run; 0.5-0.9x at 512 and above, where oneDNN's blocking
reaches ~2.3 TFLOP/s on a quiet machine and this kernel ~1.5."""
QUANT_MAX_M = 128
"""Most rows a linear on quantized weights computes from the blocks; larger ones (prefill)
dequantize the layer and run oneDNN/MKL. [measured in docs/benchmarks.md]"""
AMX_QUANT_MAX_M = 512
"""The same where the blocks' linear runs on AMX tiles: against dequantizing the layer for
oneDNN (Q4_K 8192 x 2048, AMX class, 2026-12-05) 3.2x at 128 rows, 1.4x at 512, 0.95x at
1024, 0.75x at 2048."""
AMX_TILES_FLAG = 1 << 8
"""Set in a block format's type (`CpuKernels.quant_type`): rows of x past the fused loop's
take AMX tiles on the dequantized blocks (cpu_kernels.cpp's kAmxTiles)."""
AMX_SMALL_M = 2
"""With AMX, rows up to which the small-M kernel is still (slightly) faster."""


def load(dtype: torch.dtype = torch.bfloat16, isa: CpuIsa | None = None) -> CpuKernels | None:
    """The kernels for `dtype` at CPU level `isa` (default: this machine's, as capped by
    PDSERVE_CPU_ISA), built if needed; None (reason logged) if none can run."""
    return _load(dtype, cpu_isa.effective() if isa is None else isa)


@functools.cache
def _load(dtype: torch.dtype, isa: CpuIsa) -> CpuKernels | None:
    reason = unavailable_reason(dtype, isa)
    build = build_for(dtype, isa)
    if reason is None and build is not None:
        path = library_path(build)
        try:
            if not path.exists():
                logger.info("building the %s CPU kernels into %s", build.name, path)
                build_library(build, path)
            return CpuKernels(ctypes.CDLL(str(path)), build, isa)
        except (OSError, RuntimeError, subprocess.TimeoutExpired) as e:
            reason = f"build or load failed: {e}"
    logger.warning("fused CPU kernels disabled (%s); using PyTorch ops", reason)
    return None


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class CpuKernels:
    """Typed wrappers around one library (`build`). Callers guarantee tensors in the
    library's dtype, contiguous rows and the shape rules below."""

    def __init__(self, lib: ctypes.CDLL, build: Build, isa: CpuIsa) -> None:
        for name, argtypes in _SIGNATURES.items():
            fn = getattr(lib, name, None)  # the float32 library has no AMX entry points
            if fn is not None:
                fn.argtypes = argtypes
                fn.restype = ctypes.c_int if name in _RETURNS_INT else None
        self._lib = lib
        self.build, self.dtype = build, build.dtype
        # AMX needs the level (PDSERVE_CPU_ISA may cap it), a build with AMX enabled and
        # the kernel's permission.
        self.amx = (
            isa >= CpuIsa.AMX
            and hasattr(lib, "pd_amx_available")
            and bool(lib.pd_amx_available())
            and lib.pd_amx_init() == 0
        )
        self.isa = CpuIsa.AMX if self.amx else build.isa
        """The level of the code that runs: what reports and benchmarks name."""
        self.has_prefill_attention = hasattr(lib, "pd_prefill_attention")
        """The bf16 library's flash prefill attention (AMX or AVX512-BF16); the float32
        library leaves prefill attention to SDPA."""
        self.k_multiple = 32 if self.dtype == torch.bfloat16 else 16
        """Inner (K) sizes the linear and the one-call path take are multiples of this."""

    def route(
        self, x: torch.Tensor, weight: torch.Tensor, batch_invariant: bool = False
    ) -> str | None:
        """Which kernel computes x @ weight^T: "small" (weight-streaming, up to `small_m`
        rows), "amx" (up to AMX_MAX_M rows, weight packed by `pack_amx`), or None
        (oneDNN/MKL: prefill sizes, or a shape neither kernel takes).

        `batch_invariant`: one kernel for the weight whatever the rows. Each kernel sums a
        row's products in an order fixed by K alone (AMX: tile by tile along K; the
        streaming loop: 16 fp32 lanes along K, then one reduction), so a row's result does
        not depend on the other rows; the kernels differ from each other, and so does
        oneDNN from both, which is why the default routes by M are not invariant."""
        m, (n, k) = x.shape[0], weight.shape
        if k % self.k_multiple:
            return None
        amx_fits = self.amx and n % 16 == 0
        if batch_invariant:
            return "amx" if amx_fits else "small"
        if m <= self.small_m:
            return "small"
        return "amx" if amx_fits and m <= AMX_MAX_M else None

    @property
    def small_m(self) -> int:
        """Most rows the small-M linear takes (what `route` sends to "small")."""
        if self.dtype == torch.float32:
            return FP32_MAX_M
        return AMX_SMALL_M if self.amx else SMALL_M

    @property
    def quant_max_m(self) -> int:
        """Most rows a linear on blocks takes from the blocks (`linear_quant`)."""
        return AMX_QUANT_MAX_M if self.amx else QUANT_MAX_M

    @property
    def max_one_call_m(self) -> int:
        """Most rows a decode-only step may have to run in one `decode_layers` call."""
        return AMX_MAX_M if self.amx else self.small_m

    def linear(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        batch_invariant: bool = False,
    ) -> torch.Tensor:
        """x [M, K] @ weight[N, K]^T (+ bias) for few rows (`route` says "small").
        `batch_invariant`: the float32 library's `pd_linear_rows`, one loop at every row
        count, never its one-row loop (four FMA chains along K, 15% faster at batch 1) or
        its panels from 2 vectors' rows (each summed in another order than the tile's)."""
        m, k = x.shape
        n = weight.shape[0]
        y = torch.empty((m, n), dtype=x.dtype)
        x = x.contiguous()
        fn = self._lib.pd_linear_rows if batch_invariant else self._lib.pd_linear_small
        fn(x.data_ptr(), weight.data_ptr(), _ptr(bias), y.data_ptr(), m, n, k)
        return y

    def quant_type(self, qtype: QuantType) -> int:
        """A block format as the kernels take it: with AMX, flagged so that rows past the
        fused loop's run on AMX tiles (`linear_quant_amx`) instead of the dense loop."""
        return int(qtype) | (AMX_TILES_FLAG if self.amx else 0)

    def linear_quant(self, x: torch.Tensor, layer: QuantLinear) -> torch.Tensor:
        """x [M, K] times a weight kept in blocks (+ bias) -> [M, N] in x's dtype: the
        product with the dequantized weight (quant_linear.h)."""
        m, k = x.shape
        y = torch.empty((m, layer.out_features), dtype=x.dtype)
        x = x.contiguous()
        qtype = self.quant_type(layer.qtype)
        args = (layer.qweight.data_ptr(), qtype, _ptr(layer.bias), y.data_ptr())
        if self._lib.pd_linear_quant(x.data_ptr(), *args, m, layer.out_features, k) != 0:
            raise ValueError(f"no kernel for {layer.qtype.label} weights")
        return y

    def logits(self, x: torch.Tensor, head: nn.Linear | QuantLinear) -> torch.Tensor:
        """bf16 library: x [M, K] times the LM head's weight (dense bf16, or blocks) ->
        float32 [M, N], any M (`pd_logits`). A dense K the kernel does not take: the
        linear's bf16 output, widened."""
        m, k = x.shape
        if isinstance(head, QuantLinear):
            weight, qtype = head.qweight, self.quant_type(head.qtype)
        elif k % self.k_multiple == 0:
            weight, qtype = head.weight, 0
        else:
            return nn.functional.linear(x, head.weight, head.bias).float()
        y = torch.empty((m, weight.shape[0]), dtype=torch.float32)
        x = x.contiguous()
        args = (weight.data_ptr(), qtype, _ptr(head.bias), y.data_ptr(), m, weight.shape[0], k)
        if self._lib.pd_logits(x.data_ptr(), *args) != 0:
            raise ValueError(f"no kernel for weights of type {qtype}")
        return y

    def dequantize(self, data: torch.Tensor, qtype: QuantType, k: int) -> torch.Tensor:
        """uint8 [N, row_bytes] of `qtype` blocks -> [N, k] in the library's dtype."""
        data = data.contiguous()
        n = data.shape[0]
        out = torch.empty((n, k), dtype=self.dtype)
        if self._lib.pd_dequantize(data.data_ptr(), int(qtype), out.data_ptr(), n, k) != 0:
            raise ValueError(f"no kernel for {qtype.label} weights")
        return out

    @staticmethod
    def pack_amx(weight: torch.Tensor) -> torch.Tensor:
        """[N, K] -> 16x32 VNNI tiles: tile[j][kb][r][2c + e] = W[16j + c][32kb + 2r + e]."""
        n, k = weight.shape
        tiles = weight.view(n // 16, 16, k // 32, 16, 2).permute(0, 2, 3, 1, 4)
        return tiles.contiguous()

    def linear_amx(
        self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """x [M, K] times the weight `pack_amx` packed (+ bias)."""
        m, k = x.shape
        n = packed.numel() // k
        y = torch.empty((m, n), dtype=x.dtype)
        x = x.contiguous()
        self._lib.pd_linear_amx(x.data_ptr(), packed.data_ptr(), _ptr(bias), y.data_ptr(),
                                m, n, k)  # fmt: skip
        return y

    def add_rms_norm(
        self, x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """x += delta in place (when given); return rms_norm(x) * weight. Hidden % 16 == 0."""
        out = torch.empty_like(x)
        t, h = x.shape
        self._lib.pd_add_rms_norm(x.data_ptr(), _ptr(delta), weight.data_ptr(), out.data_ptr(),
                                  t, h, eps)  # fmt: skip
        return out

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        t, two_i = gate_up.shape
        out = torch.empty((t, two_i // 2), dtype=gate_up.dtype)
        self._lib.pd_silu_mul(gate_up.data_ptr(), out.data_ptr(), t, two_i // 2)
        return out

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        t, two_i = gate_up.shape
        out = torch.empty((t, two_i // 2), dtype=gate_up.dtype)
        self._lib.pd_gelu_tanh_mul(gate_up.data_ptr(), out.data_ptr(), t, two_i // 2)
        return out

    def head_norms(
        self, qkv: torch.Tensor, num_heads: int, num_kv_heads: int, q_norm: Any, k_norm: Any
    ) -> None:
        """Each q and k head of qkv [T, H + 2Hkv, D] (contiguous) normalized in place."""
        t, _, d = qkv.shape
        self._lib.pd_head_norms(qkv.data_ptr(), t, num_heads, num_kv_heads, d,
                                q_norm.weight.data_ptr(), k_norm.weight.data_ptr(),
                                q_norm.eps)  # fmt: skip

    def rotary_write_kv(
        self,
        qkv: torch.Tensor,
        num_heads: int,
        num_kv_heads: int,
        cos: torch.Tensor,
        sin: torch.Tensor,
        positions: torch.Tensor,
        kv_layer: torch.Tensor,
        slot_blocks: torch.Tensor,
        slot_offsets: torch.Tensor,
    ) -> None:
        """Rotate q and k of qkv [T, H + 2Hkv, D] in place; store k and v in their slots."""
        t, _, d = qkv.shape
        s_block, s_kv, s_tok = kv_layer.stride()[:3]
        fmt = kv_format.kernel_code(kv_layer.dtype)
        self._lib.pd_rotary_write_kv(
            qkv.data_ptr(), t, num_heads, num_kv_heads, d, cos.data_ptr(), sin.data_ptr(),
            positions.data_ptr(), kv_layer.data_ptr(), fmt, s_block, s_kv, s_tok,
            slot_blocks.data_ptr(), slot_offsets.data_ptr(),
        )  # fmt: skip

    def decode_attention(
        self,
        q: torch.Tensor,
        kv_layer: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
        window: int = 0,
    ) -> torch.Tensor:
        """q [B, H, D] (rows may be strided) attending over the paged cache -> [B, H, D];
        with a `window`, over each sequence's last `window` keys only."""
        b, h, d = q.shape
        hkv = kv_layer.shape[3]
        out = torch.empty((b, h, d), dtype=q.dtype)
        s_block, s_kv, s_tok = kv_layer.stride()[:3]
        fmt = kv_format.kernel_code(kv_layer.dtype)
        status = self._lib.pd_decode_attention(
            q.data_ptr(), q.stride(0), kv_layer.data_ptr(), fmt, s_block, s_kv, s_tok,
            block_tables.data_ptr(), block_tables.shape[1], seq_lens.data_ptr(),
            out.data_ptr(), b, h, hkv, d, kv_layer.shape[2], scale, window,
        )  # fmt: skip
        if status != 0:
            raise ValueError(f"no decode-attention kernel for head size {d}")
        return out

    def prefill_attention(
        self,
        q: torch.Tensor,
        kv_layer: torch.Tensor,
        block_table: torch.Tensor,
        num_context: int,
        scale: float,
        out: torch.Tensor,
    ) -> None:
        """One prefill chunk's causal attention (the bf16 library: `has_prefill_attention`),
        on AMX tiles where `amx`, else AVX512-BF16 dot products: q [n, H, D] (rows may be
        strided) at positions num_context.., over keys 0..num_context+n-1, all in the paged
        cache, bf16 or 8-bit (block_table [blocks] int64); writes out [n, H, D]
        (contiguous). Head sizes in PREFILL_HEAD_SIZES."""
        n, h, d = q.shape
        if q.stride(1) != d or q.stride(2) != 1 or not out.is_contiguous():
            raise ValueError("prefill attention needs dense heads in q and a contiguous out")
        if block_table.dtype != torch.int64 or not block_table.is_contiguous():
            raise ValueError("prefill attention needs a contiguous int64 block table")
        s_block, s_kv, s_tok = kv_layer.stride()[:3]
        status = self._lib.pd_prefill_attention(
            q.data_ptr(), q.stride(0), kv_layer.data_ptr(), kv_format.kernel_code(kv_layer.dtype),
            s_block, s_kv, s_tok, block_table.data_ptr(), kv_layer.shape[2], n, num_context,
            out.data_ptr(), h, kv_layer.shape[3], d, scale, int(self.amx),
        )  # fmt: skip
        if status != 0:
            raise ValueError(f"no prefill-attention kernel for head size {d}")

    def decode_layers(
        self,
        layers: ctypes.Array[PdLayer],
        x: torch.Tensor,
        shape: tuple[int, int, int, int],
        eps: float,
        scale: float,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_blocks: torch.Tensor,
        slot_offsets: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        batch_invariant: bool = False,
    ) -> torch.Tensor:
        """Every layer of a decode-only step in one call: x [T, hidden] is the residual
        stream, updated in place; returns the last layer's delta. `layers` points into
        `kv_cache`, the whole cache. `layers` holds AMX-packed
        weights for T > `small_m` (up to AMX_MAX_M), none for T <= `small_m`. `shape` is
        (heads, kv heads, head size, intermediate size). `batch_invariant`: the dense
        linears on the loop `linear` takes in that mode."""
        t, hidden = x.shape
        h, hkv, d, inter = shape
        delta = torch.empty_like(x)
        status = self._lib.pd_decode_layers(
            layers, len(layers), x.data_ptr(), delta.data_ptr(), t, hidden, h, hkv, d, inter,
            eps, scale, positions.data_ptr(),
            kv_format.kernel_code(kv_cache.dtype), *kv_cache[:, 0].stride()[:3],
            slot_blocks.data_ptr(), slot_offsets.data_ptr(), block_tables.data_ptr(),
            block_tables.shape[1], seq_lens.data_ptr(), kv_cache.shape[3], batch_invariant,
        )  # fmt: skip
        if status != 0:
            raise ValueError(f"no decode-attention kernel for head size {d}")
        return delta

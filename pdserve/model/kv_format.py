"""The KV cache's formats: the model's own dtype, or 8 bits with a scale per token and head.

`--kv-cache-dtype auto|bfloat16|float32|int8` (`CacheConfig.kv_cache_dtype`):
- `auto` stores K and V in the model's dtype; `bfloat16`/`float32` (or `bf16`/`fp32`) name
  it explicitly and must equal it (a float cache in another dtype is not built).
- `int8` stores each (token, kv head) of K and of V as `head_dim` int8 values followed by
  their float32 scale, four more bytes: round(x / scale) with scale = max|x| / 127.

      kv_cache[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim + 4] int8
                                                                 └ values ┘└ scale ┘

  The scales live inside the block's bytes, so everything that moves or frees whole blocks
  (the P/D transfer, prefix caching, the handoff protocol) handles them unchanged, and a
  P/D handoff moves 68 bytes per head row instead of bf16's 128 (53%) or float32's 256.
  Per (token, head) scales never need requantizing: a token's K/V are final when written.
  Both nodes of a P/D pair must use the same format; the handshake's KV layout compares it.
- `fp8_e4m3` is named but not built: x86 CPUs have no fp8 conversion instructions (before
  AVX10.2), so it would cost table lookups for what int8 stores in the same bytes.

Attention reads the 8-bit cache in float math: the CPU kernels (csrc/attention_f32.h)
widen the bytes in registers; PyTorch ops dequantize what they gather. Both quantize with
the arithmetic below, so both paths store identical bytes.
"""

from __future__ import annotations

import torch

from pdserve.config import FP8_NOT_BUILT, KV_CACHE_DTYPES
from pdserve.errors import ConfigError

_FLOAT_NAMES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
_FLOAT_NAMES.update({"float32": torch.float32, "fp32": torch.float32})

SCALE_BYTES = 4
"""An int8 head row's float32 scale, after its values."""


def resolve(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache tensor's dtype for `--kv-cache-dtype name` with a model in `model_dtype`."""
    if name == "auto":
        return model_dtype
    if name == "int8":
        return torch.int8
    if name == "fp8_e4m3":
        raise ConfigError(FP8_NOT_BUILT)
    dtype = _FLOAT_NAMES.get(name)
    if dtype is None:
        raise ConfigError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {name!r}")
    if dtype != model_dtype:
        model = str(model_dtype).removeprefix("torch.")
        raise ConfigError(
            f"kv_cache_dtype {name} with a {model} model: a float KV cache is kept in the "
            f"model's dtype; use auto ({model}) or int8"
        )
    return dtype


def is_quantized(cache_dtype: torch.dtype) -> bool:
    return cache_dtype == torch.int8


def kernel_code(cache_dtype: torch.dtype) -> int:
    """The CPU kernels' paged::KVFormat: 0 for the library's own dtype, 1 for int8."""
    return 1 if is_quantized(cache_dtype) else 0


def head_width(cache_dtype: torch.dtype, head_dim: int) -> int:
    """Elements of one (token, kv head) row in the cache."""
    return head_dim + SCALE_BYTES if is_quantized(cache_dtype) else head_dim


def name(cache_dtype: torch.dtype) -> str:
    return str(cache_dtype).removeprefix("torch.")


def quantize(x: torch.Tensor) -> torch.Tensor:
    """[..., D] float -> [..., D + 4] int8: the values, then the float32 scale's bytes."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1, keepdim=True) / 127.0
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    values = torch.where(scale > 0, (xf / safe).round(), torch.zeros_like(xf))
    values = values.clamp_(-127, 127).to(torch.int8)
    return torch.cat((values, scale.contiguous().view(torch.int8)), dim=-1)


def dequantize(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[..., D + 4] int8 rows (any strides with a dense last dimension) -> [..., D]."""
    head_dim = rows.shape[-1] - SCALE_BYTES
    scale = rows[..., head_dim:].contiguous().view(torch.float32)
    return (rows[..., :head_dim].float() * scale).to(dtype)


def readable(cache_rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows read from the cache, as attention computes on them."""
    return dequantize(cache_rows, dtype) if is_quantized(cache_rows.dtype) else cache_rows


def storable(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """New K or V rows [..., D], as the cache stores them."""
    return quantize(x) if is_quantized(cache_dtype) else x

"""Weights kept in GGUF's block formats (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 and the K-quants
Q4_K, Q5_K, Q6_K): the formats, a PyTorch reference for them, and the modules that hold
them.

A decode step on a CPU is bound by reading the weights. Dequantized to float32, the default
model's Q4_1 file becomes 538 MB a step; kept as it is, 96 MB (4.5-8.5 bits a weight). The
kernels in `csrc/quant_linear.h` compute straight from the blocks; this module is what the
loader and the tests use around them:
- `QuantType` and the block layouts, as ggml defines them;
- `dequantize` in PyTorch for every format, `quantize` (ggml's reference rounding) for the
  32-weight ones: for loading a dense checkpoint into a format, converting between formats,
  and testing the kernels (a K-quant file is read as it is; nothing here writes one);
- `QuantLinear` and `QuantEmbedding`, the model's linears and embedding table on blocks.

Which layers are kept quantized, and in which format, is the loader's `--quantization`
choice (loader.plan_quantization).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch
from torch import nn

from pdserve.errors import ModelLoadError

BLOCK = 32
"""Weights per block of the 32-weight formats, and per step of the kernels (a K-quant's
sub-block): a model's inner sizes must be multiples of it."""
SUPER_BLOCK = 256
"""Weights per K-quant super-block."""

_BLOCK_BYTES = {2: 18, 3: 20, 6: 22, 7: 24, 8: 34, 12: 144, 13: 176, 14: 210}


class QuantType(enum.IntEnum):
    """The formats with kernels; values are ggml's type numbers (gguf.GGMLQuantizationType)."""

    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14

    @property
    def label(self) -> str:
        return self.name.lower()

    @property
    def block_bytes(self) -> int:
        return _BLOCK_BYTES[self]

    @property
    def block_weights(self) -> int:
        return SUPER_BLOCK if self.is_k_quant else BLOCK

    @property
    def is_k_quant(self) -> bool:
        return self >= QuantType.Q4_K

    def row_bytes(self, k: int) -> int:
        return k // self.block_weights * self.block_bytes

    @classmethod
    def parse(cls, name: str) -> QuantType:
        return cls[name.upper()]


@dataclass(frozen=True)
class QuantizedTensor:
    """A weight as a GGUF file stores it: `data` uint8 [rows, row_bytes] of `qtype` blocks,
    `shape` the dense (rows, cols)."""

    data: torch.Tensor
    qtype: QuantType
    shape: tuple[int, int]


def _f16(raw: torch.Tensor) -> torch.Tensor:
    """[..., 2] uint8 -> float32 [...] (little-endian fp16)."""
    return raw.contiguous().view(torch.float16).squeeze(-1).float()


def dequantize(data: torch.Tensor, qtype: QuantType, k: int) -> torch.Tensor:
    """uint8 [N, row_bytes] -> float32 [N, k]; the reference for the kernels' dequantize
    (the same float32 operations, so the same values)."""
    n = data.shape[0]
    blocks = data.reshape(n, k // qtype.block_weights, qtype.block_bytes)
    if qtype.is_k_quant:
        return _dequantize_k(blocks, qtype).reshape(n, k)
    d = _f16(blocks[..., 0:2]).unsqueeze(-1)
    if qtype == QuantType.Q8_0:
        q = blocks[..., 2:].contiguous().view(torch.int8).float()
        return (d * q).reshape(n, k)
    with_min = qtype in (QuantType.Q4_1, QuantType.Q5_1)
    at = 4 if with_min else 2
    if qtype in (QuantType.Q5_0, QuantType.Q5_1):  # a fifth bit per weight in qh[4]
        qh = blocks[..., at : at + 4].contiguous().view(torch.int32)
        fifth = ((qh >> torch.arange(32, dtype=torch.int32)) & 1).to(torch.uint8) << 4
        at += 4
    qs = blocks[..., at:]
    q = torch.cat([qs & 15, qs >> 4], dim=-1)
    if qtype in (QuantType.Q5_0, QuantType.Q5_1):
        q = q | fifth
    if with_min:
        m = _f16(blocks[..., 2:4]).unsqueeze(-1)
    else:
        m = (-16.0 if qtype == QuantType.Q5_0 else -8.0) * d
    return (d * q.float() + m).reshape(n, k)


def _scale_min_k4(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K: the 8 sub-blocks' 6-bit scales and mins from their 12 bytes [..., 12]
    -> two [..., 8] int tensors (ggml's get_scale_min_k4)."""
    q = packed.to(torch.int32)
    sc = torch.cat([q[..., 0:4] & 63, (q[..., 8:12] & 0xF) | ((q[..., 0:4] >> 6) << 4)], dim=-1)
    m = torch.cat([q[..., 4:8] & 63, (q[..., 8:12] >> 4) | ((q[..., 4:8] >> 6) << 4)], dim=-1)
    return sc, m


def _dequantize_k(blocks: torch.Tensor, qtype: QuantType) -> torch.Tensor:
    """[..., super-blocks, bytes] of Q4_K/Q5_K/Q6_K -> float32 [..., super-blocks, 256]."""
    lead = blocks.shape[:-1]
    if qtype == QuantType.Q6_K:  # {ql[128]; qh[64]; int8 scales[16]; d}
        ql = blocks[..., 0:128].reshape(*lead, 2, 2, 32)  # [half n][r % 2][l]
        qh = blocks[..., 128:192].reshape(*lead, 2, 1, 32)
        low = torch.stack([ql[..., 0, :] & 15, ql[..., 1, :] & 15, ql[..., 0, :] >> 4,
                           ql[..., 1, :] >> 4], dim=-2)  # [n][r][l]  # fmt: skip
        high = (qh >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(4, 1)) & 3
        q = (low | (high << 4)).float()
        scales = (
            blocks[..., 192:208].contiguous().view(torch.int8).float().reshape(*lead, 2, 4, 2, 1)
        )
        d = _f16(blocks[..., 208:210]).reshape(*lead, 1, 1, 1, 1)
        a = (d * scales).expand(*lead, 2, 4, 2, 16).reshape(*lead, 2, 4, 32)
        return (a * q + -32.0 * a).reshape(*lead, 256)
    d = _f16(blocks[..., 0:2]).unsqueeze(-1)
    dmin = _f16(blocks[..., 2:4]).unsqueeze(-1)
    sc, m = _scale_min_k4(blocks[..., 4:16])
    a = (d * sc.float()).unsqueeze(-1)  # [..., 8, 1]
    c = -(dmin * m.float()).unsqueeze(-1)
    qs = blocks[..., (48 if qtype == QuantType.Q5_K else 16) :].reshape(*lead, 4, 32)
    q = torch.stack([qs & 15, qs >> 4], dim=-2).reshape(*lead, 8, 32)  # sub-block 2p, 2p+1
    if qtype == QuantType.Q5_K:  # bit j of qh[l]: weight l of sub-block j
        qh = blocks[..., 16:48].unsqueeze(-2)
        q = q | (((qh >> torch.arange(8, dtype=torch.uint8).view(8, 1)) & 1) << 4)
    return (a * q.float() + c).reshape(*lead, 256)


def quantize(w: torch.Tensor, qtype: QuantType) -> torch.Tensor:
    """float [N, K] (K % 32 == 0) -> uint8 [N, row_bytes], rounded as ggml's reference
    quantizers (quantize_row_*_ref) round."""
    if qtype not in (QuantType.Q8_0, QuantType.Q4_0, QuantType.Q4_1):
        raise ValueError(f"pdserve does not quantize to {qtype.label} (it reads such files)")
    n, k = w.shape
    x = w.detach().float().reshape(n, k // BLOCK, BLOCK)
    if qtype == QuantType.Q8_0:
        d = x.abs().amax(-1, keepdim=True) / 127
        inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
        q = _round_half_away(x * inv).to(torch.int8)
        parts = [_f16_bytes(d), q.view(torch.uint8)]
    elif qtype == QuantType.Q4_0:
        idx = x.abs().argmax(-1, keepdim=True)
        d = x.gather(-1, idx) / -8
        inv = torch.where(d != 0, 1 / d, torch.zeros_like(d))
        q = (x * inv + 8.5).to(torch.int8).clamp(max=15).to(torch.uint8)  # truncation, as C
        parts = [_f16_bytes(d), q[..., :16] | (q[..., 16:] << 4)]
    else:
        lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
        d = (hi - lo) / 15
        inv = torch.where(d != 0, 1 / d, torch.zeros_like(d))
        q = ((x - lo) * inv + 0.5).to(torch.int8).clamp(max=15).to(torch.uint8)
        parts = [_f16_bytes(d), _f16_bytes(lo), q[..., :16] | (q[..., 16:] << 4)]
    return torch.cat(parts, dim=-1).reshape(n, qtype.row_bytes(k))


def _round_half_away(x: torch.Tensor) -> torch.Tensor:
    return torch.sign(x) * torch.floor(x.abs() + 0.5)


def _f16_bytes(v: torch.Tensor) -> torch.Tensor:
    return v.to(torch.float16).contiguous().view(torch.uint8)


def convert(weight: torch.Tensor | QuantizedTensor, qtype: QuantType) -> torch.Tensor:
    """A checkpoint's weight (dense, or blocks of any format) as `qtype` blocks: kept as
    they are when already in it, else dequantized and quantized again."""
    if isinstance(weight, QuantizedTensor):
        if weight.qtype == qtype:
            return weight.data
        weight = dequantize(weight.data, weight.qtype, weight.shape[1])
    return quantize(weight, qtype)


def scale_offsets(qtype: QuantType) -> tuple[int, ...]:
    """Byte offsets of a block's fp16 fields: its scale, and its offset (Q4_1, Q5_1) or
    min scale (Q4_K, Q5_K)."""
    single = (QuantType.Q8_0, QuantType.Q4_0, QuantType.Q5_0)
    return (208,) if qtype == QuantType.Q6_K else (0,) if qtype in single else (0, 2)


def check_scales(data: torch.Tensor, qtype: QuantType, name: str) -> None:
    """Refuse blocks whose fp16 scales (and offsets, mins) are not finite numbers: a
    corrupt file would otherwise load and answer with NaNs."""
    blocks = data.reshape(-1, qtype.block_bytes)
    scales = [_f16(blocks[:, i : i + 2]) for i in scale_offsets(qtype)]
    bad = sum(int((~torch.isfinite(s)).sum()) for s in scales)
    if bad:
        raise ModelLoadError(
            f"weight {name!r}: {bad} of its {blocks.shape[0]} {qtype.label} blocks have a "
            "scale that is not a finite number (a corrupt file?)"
        )


class QuantModule(nn.Module):
    """A module whose weight stays in `qtype` blocks: `qweight`, uint8 [rows, row_bytes]."""

    qweight: torch.Tensor

    def __init__(self, rows: int, cols: int, qtype: QuantType) -> None:
        super().__init__()
        self.qtype, self.cols = qtype, cols
        self.register_buffer("qweight", torch.empty(rows, qtype.row_bytes(cols), dtype=torch.uint8))
        self.compute_dtype = torch.float32
        """The activations' dtype (the model's), what the weight is dequantized to."""

    @property
    def dense_shape(self) -> tuple[int, int]:
        return self.qweight.shape[0], self.cols

    def extra_repr(self) -> str:
        return f"{self.dense_shape}, {self.qtype.label}"


class QuantLinear(QuantModule):
    """A linear layer on blocks. `weight` dequantizes on every read: what plain PyTorch
    ops use. The CPU kernels read `qweight` directly."""

    def __init__(
        self, in_features: int, out_features: int, qtype: QuantType, bias: nn.Parameter | None
    ) -> None:
        super().__init__(out_features, in_features, qtype)
        self.in_features, self.out_features = in_features, out_features
        self.bias = bias

    @property
    def weight(self) -> torch.Tensor:
        return dequantize(self.qweight, self.qtype, self.in_features).to(self.compute_dtype)


class QuantEmbedding(QuantModule):
    """An embedding table on blocks: a lookup dequantizes only the rows it reads. A tied
    LM head (a QuantLinear) shares `qweight`."""

    def __init__(self, num_embeddings: int, dim: int, qtype: QuantType) -> None:
        super().__init__(num_embeddings, dim, qtype)
        self.embedding_dim = dim

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = dequantize(self.qweight[ids], self.qtype, self.embedding_dim)
        return rows.to(self.compute_dtype)


def quant_modules(model: nn.Module) -> list[QuantModule]:
    """The model's quantized modules, one per weight (a tied LM head is its embedding's)."""
    unique = {id(m.qweight): m for m in model.modules() if isinstance(m, QuantModule)}
    return list(unique.values())

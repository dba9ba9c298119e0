"""Llama-family decoder (Llama, Mistral, Qwen2, SmolLM2) over a paged KV cache.

Weights use Hugging Face's layout with two fusions the loader performs: q/k/v projections
are one `qkv_proj` and gate/up are one `gate_up_proj`, so each layer runs four GEMMs over
the whole flattened batch. How each hot operation runs (PyTorch, or fused CPU kernels) is
the `Ops` backend's business (ops.py); this file only says what is computed.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn

from pdserve.errors import ModelLoadError
from pdserve.model.arch import ModelArch
from pdserve.model.attention import AttentionMetadata
from pdserve.model.ops import TORCH_OPS, TorchOps
from pdserve.model.quant import QuantEmbedding, QuantLinear, QuantModule, QuantType


class RMSNorm(nn.Module):
    """Weights only: the norm runs fused with the residual add (`Ops.add_rms_norm`)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps


def rope_inv_freq(arch: ModelArch) -> torch.Tensor:
    """Inverse rotary frequencies, with Llama 3 or linear scaling when the config asks."""
    dim = arch.head_dim
    inv_freq = 1.0 / (arch.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = arch.rope_scaling_dict
    if scaling is None:
        return inv_freq.float()
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        return (inv_freq / float(scaling["factor"])).float()
    if kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_ctx = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_ctx / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
        mid = (wavelen <= old_ctx / low) & (wavelen >= old_ctx / high)
        blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        return torch.where(mid, blended, scaled).float()
    raise ModelLoadError(f"unsupported rope_scaling type {kind!r} (supported: linear, llama3)")


class Rotary(nn.Module):
    """Rotate-half rotary embedding with a precomputed cos/sin table."""

    cos: torch.Tensor
    sin: torch.Tensor

    def __init__(self, arch: ModelArch, max_positions: int) -> None:
        super().__init__()
        self.arch, self.max_positions = arch, max_positions
        self.register_buffer("cos", torch.empty(max_positions, arch.head_dim), persistent=False)
        self.register_buffer("sin", torch.empty(max_positions, arch.head_dim), persistent=False)
        if self.cos.device.type != "meta":
            self.compute_tables()

    def compute_tables(self) -> None:
        """Fill the float32 cos/sin tables on the buffers' device (after a meta build).

        The angles are float32 products, as Hugging Face computes them; their cos and sin
        are taken in float64 by NumPy and rounded once, not by torch's float32 kernels. A
        node computed this table at start-up with every cos from row 256 on off by up to
        1.5e-4 (the half of the table torch's second thread takes, rarely, under load; the
        other nodes and the same process later computed it right): every prompt longer than
        256 tokens then differed on that node alone, which broke P/D's equality with one
        node (docs/benchmarks.md). NumPy's float64 functions run on the calling thread."""
        positions = torch.arange(self.max_positions, dtype=torch.float32)
        angles = torch.outer(positions, rope_inv_freq(self.arch)).numpy().astype(np.float64)
        device = self.cos.device
        cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
        # A row's two halves are the same angles: taken once, then repeated.
        self.cos = torch.from_numpy(np.concatenate((cos, cos), axis=1)).to(device)
        self.sin = torch.from_numpy(np.concatenate((sin, sin), axis=1)).to(device)

    def tables(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin rows for the step's positions, [T, 1, D]; gathered once per step."""
        return (
            self.cos[positions].unsqueeze(1).to(dtype),
            self.sin[positions].unsqueeze(1).to(dtype),
        )


class Attention(nn.Module):
    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = arch.num_heads, arch.num_kv_heads
        self.head_dim = arch.head_dim
        self.q_size = arch.num_heads * arch.head_dim
        self.kv_size = arch.num_kv_heads * arch.head_dim
        self.qkv_proj = nn.Linear(
            arch.hidden_size, self.q_size + 2 * self.kv_size, bias=arch.attention_bias
        )
        self.o_proj = nn.Linear(self.q_size, arch.hidden_size, bias=False)
        self.scale = arch.head_dim**-0.5

    def forward(
        self,
        x: torch.Tensor,
        rope: object,
        kv_layer: torch.Tensor,
        meta: AttentionMetadata,
        ops: TorchOps,
    ) -> torch.Tensor:
        t = x.shape[0]
        qkv = ops.linear(x, self.qkv_proj)
        qkv = qkv.view(t, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        out = ops.attention(
            qkv, self.num_heads, self.num_kv_heads, rope, kv_layer, meta, self.scale
        )
        return ops.linear(out.reshape(t, self.q_size), self.o_proj)


class MLP(nn.Module):
    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        self.intermediate_size = arch.intermediate_size
        self.gate_up_proj = nn.Linear(arch.hidden_size, 2 * arch.intermediate_size, bias=False)
        self.down_proj = nn.Linear(arch.intermediate_size, arch.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, ops: TorchOps) -> torch.Tensor:
        return ops.linear(ops.silu_mul(ops.linear(x, self.gate_up_proj)), self.down_proj)


class DecoderLayer(nn.Module):
    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.self_attn = Attention(arch)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.mlp = MLP(arch)

    def forward(
        self,
        x: torch.Tensor,
        delta: torch.Tensor | None,
        rope: object,
        kv_layer: torch.Tensor,
        meta: AttentionMetadata,
        ops: TorchOps,
    ) -> torch.Tensor:
        """Add the previous layer's `delta` into the residual stream `x` (in place), run
        the layer, and return this layer's delta (its MLP output, not yet added)."""
        h = ops.add_rms_norm(x, delta, self.input_layernorm)
        attn = self.self_attn(h, rope, kv_layer, meta, ops)
        h = ops.add_rms_norm(x, attn, self.post_attention_layernorm)
        return self.mlp(h, ops)


class LlamaModel(nn.Module):
    def __init__(self, arch: ModelArch, max_positions: int) -> None:
        super().__init__()
        self.arch = arch
        # An empty table, not nn.Embedding's random one: its normal_() on the meta device
        # (`build_model`) runs a Python reference that imports torch._dynamo, 1-2 s of
        # every engine start. The weights are loaded over it anyway.
        self.embed_tokens = nn.Embedding.from_pretrained(
            torch.empty(arch.vocab_size, arch.hidden_size), freeze=False
        )
        self.layers = nn.ModuleList(DecoderLayer(arch) for _ in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.rotary = Rotary(arch, max_positions)
        self.lm_head = nn.Linear(arch.hidden_size, arch.vocab_size, bias=False)
        self.quantized = False
        """Whether the layers' linears hold their weights in blocks (`keep_quantized`)."""
        self.tie_weights()

    def tie_weights(self) -> None:
        if not self.arch.tie_word_embeddings:
            return
        if isinstance(self.embed_tokens, QuantEmbedding):
            self.lm_head.qweight = self.embed_tokens.qweight
        else:
            self.lm_head.weight = self.embed_tokens.weight

    def keep_quantized(self, plan: dict[str, QuantType]) -> None:
        """Replace the linears and the embedding named in `plan` (module name -> format)
        by ones that hold their weight in that format's blocks. Before the weights are
        allocated (on the meta device), so no dense copy ever exists."""
        for name, qtype in plan.items():
            parent_name, _, attr = name.rpartition(".")
            parent = self.get_submodule(parent_name) if parent_name else self
            old = getattr(parent, attr)
            new: nn.Module
            if isinstance(old, nn.Embedding):
                new = QuantEmbedding(old.num_embeddings, old.embedding_dim, qtype)
            else:
                new = QuantLinear(old.in_features, old.out_features, qtype, old.bias)
            setattr(parent, attr, new)
        self.quantized = any(isinstance(m, QuantLinear) for m in self.layers.modules())
        self.tie_weights()

    def set_compute_dtype(self, dtype: torch.dtype) -> None:
        """The activations' dtype, which quantized modules dequantize to."""
        for module in self.modules():
            if isinstance(module, QuantModule):
                module.compute_dtype = dtype

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,
        ops: TorchOps = TORCH_OPS,
    ) -> torch.Tensor:
        """Run one step; return logits for the tokens at `logits_indices` only, as
        `ops.logits` computes them (float32 on the bf16 CPU kernels, else the model's
        dtype: the sampler widens to float32 only what it computes with)."""
        x = ops.embed(self.embed_tokens, input_ids)
        rope = ops.rope(self.rotary, positions, x.dtype)
        delta = ops.run_layers(self, x, rope, kv_cache, meta)
        x = x[logits_indices]
        h = ops.add_rms_norm(x, None if delta is None else delta[logits_indices], self.norm)
        return ops.logits(h, self.lm_head)

"""The decoder every family runs (Llama, Mistral, Qwen2/3, Gemma 3, Phi-3) over a paged KV
cache. What differs between families is data (`family.py`, `ModelArch`) read here in a few
places: optional per-head q/k norms, norms on the sublayers' outputs, the MLP's activation,
scaled embeddings, each layer's sliding window and rotary table.

Weights use Hugging Face's layout with two fusions the loader performs: q/k/v projections
are one `qkv_proj` and gate/up are one `gate_up_proj`, so each layer runs four GEMMs over
the whole flattened batch. How each hot operation runs (PyTorch, or fused CPU kernels) is
the `Ops` backend's business (ops.py); this file only says what is computed.

A layer, with the residual stream x carried as (x, pending delta) so each norm can fuse
the add (`Ops.add_rms_norm`):

    h = norm(x += delta)             input_layernorm
    a = attention(h)                 q/k norms, rotary, window: per family and layer
    a = norm(a)                      attn_out_norm (Gemma)
    h = norm(x += a)                 post_attention_layernorm (before the MLP)
    delta = mlp(h), then norm(delta) mlp_out_norm (Gemma)
"""

from __future__ import annotations

import math
from typing import cast

import numpy as np
import torch
from torch import nn

from pdserve.errors import ModelLoadError
from pdserve.model.arch import ModelArch, longrope_attention_factor
from pdserve.model.attention import AttentionMetadata
from pdserve.model.family import Activation
from pdserve.model.ops import TORCH_OPS, Ops
from pdserve.model.quant import QuantEmbedding, QuantLinear, QuantModule, QuantType


class RMSNorm(nn.Module):
    """Weights only: the norm runs fused with the residual add (`Ops.add_rms_norm`)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps


def rope_inv_freq(arch: ModelArch, sliding: bool = False, max_positions: int = 0) -> torch.Tensor:
    """Inverse rotary frequencies of the rotated dimensions: the sliding layers' own base
    unscaled (`sliding`, Gemma 3), else the global base with Llama 3, linear or LongRoPE
    scaling when the config asks. LongRoPE takes its long factors when the context served
    (`max_positions`) exceeds the original one, as llama.cpp decides (per context, not per
    step as Hugging Face does, so a sequence's cached keys keep one rotation)."""
    dim = arch.num_rotary_dims
    theta = arch.rope_theta
    if sliding and arch.sliding_rope_theta is not None:
        theta = arch.sliding_rope_theta
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = None if sliding else arch.rope_scaling_dict
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
    if kind == "longrope":
        long = max_positions > int(scaling["original_max_position_embeddings"])
        factors = torch.tensor(
            scaling["long_factor" if long else "short_factor"], dtype=torch.float64
        )
        return (inv_freq / factors).float()
    raise ModelLoadError(
        f"unsupported rope_scaling type {kind!r} (supported: linear, llama3, longrope)"
    )


def head_permutation(arch: ModelArch) -> list[int] | None:
    """Where each dimension of a q/k head goes so that a partial rotary (Phi) runs as a
    whole-head one: pdserve's kernels turn pairs (j, j + D/2), Hugging Face pairs
    (i, i + R/2) of the first R dimensions and passes the rest. With q and k rows laid out
    as below and the tables' extra columns cos 1, sin 0, the kernels compute the same
    scores (a dot product does not care how both sides order their dimensions); v is not
    touched. None when the rotary turns whole heads.

        position  0 .. R/2-1 | R/2 .. D/2-1       | D/2 .. D/2+R/2-1 | D/2+R/2 .. D-1
        HF dim    0 .. R/2-1 | R .. R+(D-R)/2-1   | R/2 .. R-1       | the rest
    """
    d, r = arch.head_dim, arch.num_rotary_dims
    if r == d:
        return None
    half, rest = r // 2, (d - r) // 2
    rotated = list(range(half))
    passed = list(range(r, d))
    return rotated + passed[:rest] + [i + half for i in rotated] + passed[rest:]


class Rotary(nn.Module):
    """Rotate-half rotary embedding with a precomputed cos/sin table."""

    cos: torch.Tensor
    sin: torch.Tensor

    def __init__(self, arch: ModelArch, max_positions: int, sliding: bool = False) -> None:
        super().__init__()
        self.arch, self.max_positions, self.sliding = arch, max_positions, sliding
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
        node (docs/benchmarks.md). NumPy's float64 functions run on the calling thread.

        A partial rotary's columns past its dimensions are cos 1 and sin 0 (see
        `head_permutation`); LongRoPE scales the turned columns by its attention factor."""
        inv_freq = rope_inv_freq(self.arch, self.sliding, self.max_positions)
        positions = torch.arange(self.max_positions, dtype=torch.float32)
        angles = torch.outer(positions, inv_freq).numpy().astype(np.float64)
        cos, sin = np.cos(angles), np.sin(angles)
        scaling = self.arch.rope_scaling_dict
        if not self.sliding and scaling and scaling.get("rope_type") == "longrope":
            factor = longrope_attention_factor(scaling)
            cos, sin = cos * factor, sin * factor
        still = (self.arch.head_dim - self.arch.num_rotary_dims) // 2
        if still:
            cos = np.concatenate((cos, np.ones((len(cos), still))), axis=1)
            sin = np.concatenate((sin, np.zeros((len(sin), still))), axis=1)
        cos, sin = cos.astype(np.float32), sin.astype(np.float32)
        device = self.cos.device
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
    def __init__(self, arch: ModelArch, layer: int) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = arch.num_heads, arch.num_kv_heads
        self.head_dim = arch.head_dim
        self.q_size = arch.num_heads * arch.head_dim
        self.kv_size = arch.num_kv_heads * arch.head_dim
        self.qkv_proj = nn.Linear(
            arch.hidden_size, self.q_size + 2 * self.kv_size, bias=arch.attention_bias
        )
        self.o_proj = nn.Linear(self.q_size, arch.hidden_size, bias=False)
        self.q_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps) if arch.family.qk_norm else None
        self.k_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps) if arch.family.qk_norm else None
        self.scale = arch.scale
        self.window = arch.window(layer)
        """Keys each token attends to (itself included); 0: all of them."""

    def forward(
        self,
        x: torch.Tensor,
        rope: object,
        kv_layer: torch.Tensor,
        meta: AttentionMetadata,
        ops: Ops,
    ) -> torch.Tensor:
        t = x.shape[0]
        qkv = ops.linear(x, self.qkv_proj)
        qkv = qkv.view(t, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            ops.head_norms(qkv, self.num_heads, self.num_kv_heads, self.q_norm, self.k_norm)
        out = ops.attention(
            qkv, self.num_heads, self.num_kv_heads, rope, kv_layer, meta, self.scale, self.window
        )
        return ops.linear(out.reshape(t, self.q_size), self.o_proj)


class MLP(nn.Module):
    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        self.intermediate_size = arch.intermediate_size
        self.activation = arch.family.activation
        self.gate_up_proj = nn.Linear(arch.hidden_size, 2 * arch.intermediate_size, bias=False)
        self.down_proj = nn.Linear(arch.intermediate_size, arch.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, ops: Ops) -> torch.Tensor:
        gate_up = ops.linear(x, self.gate_up_proj)
        if self.activation is Activation.GELU_TANH:
            act = ops.gelu_tanh_mul(gate_up)
        else:
            act = ops.silu_mul(gate_up)
        return ops.linear(act, self.down_proj)


class DecoderLayer(nn.Module):
    def __init__(self, arch: ModelArch, layer: int) -> None:
        super().__init__()
        eps = arch.rms_norm_eps
        self.input_layernorm = RMSNorm(arch.hidden_size, eps)
        self.self_attn = Attention(arch, layer)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, eps)
        self.mlp = MLP(arch)
        out_norms = arch.family.sublayer_out_norms
        self.attn_out_norm = RMSNorm(arch.hidden_size, eps) if out_norms else None
        self.mlp_out_norm = RMSNorm(arch.hidden_size, eps) if out_norms else None
        self.rope_variant = arch.rope_variant(layer)
        """Index of this layer's rotary table in `DecoderModel.rotaries`."""

    def forward(
        self,
        x: torch.Tensor,
        delta: torch.Tensor | None,
        ropes: tuple[object, ...],
        kv_layer: torch.Tensor,
        meta: AttentionMetadata,
        ops: Ops,
    ) -> torch.Tensor:
        """Add the previous layer's `delta` into the residual stream `x` (in place), run
        the layer, and return this layer's delta (its MLP output, not yet added)."""
        h = ops.add_rms_norm(x, delta, self.input_layernorm)
        attn = self.self_attn(h, ropes[self.rope_variant], kv_layer, meta, ops)
        if self.attn_out_norm is not None:
            attn = ops.rms_norm(attn, self.attn_out_norm)
        h = ops.add_rms_norm(x, attn, self.post_attention_layernorm)
        out = self.mlp(h, ops)
        return out if self.mlp_out_norm is None else ops.rms_norm(out, self.mlp_out_norm)


class DecoderModel(nn.Module):
    def __init__(self, arch: ModelArch, max_positions: int) -> None:
        super().__init__()
        self.arch = arch
        # An empty table, not nn.Embedding's random one: its normal_() on the meta device
        # (`build_model`) runs a Python reference that imports torch._dynamo, 1-2 s of
        # every engine start. The weights are loaded over it anyway.
        self.embed_tokens = nn.Embedding.from_pretrained(
            torch.empty(arch.vocab_size, arch.hidden_size), freeze=False
        )
        self.embed_scale = math.sqrt(arch.hidden_size) if arch.family.scales_embeddings else None
        self.layers = nn.ModuleList(DecoderLayer(arch, i) for i in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.rotary = Rotary(arch, max_positions)
        self.sliding_rotary = (
            Rotary(arch, max_positions, sliding=True) if arch.sliding_rope_theta else None
        )
        self.lm_head = nn.Linear(arch.hidden_size, arch.vocab_size, bias=False)
        self.quantized = False
        """Whether the layers' linears hold their weights in blocks (`keep_quantized`)."""
        self.tie_weights()

    @property
    def rotaries(self) -> tuple[Rotary, ...]:
        """The rotary tables, by `DecoderLayer.rope_variant`."""
        return (self.rotary,) if self.sliding_rotary is None else (self.rotary, self.sliding_rotary)

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

    @torch.no_grad()
    def permute_heads(self) -> None:
        """Lay out each q and k head as `head_permutation` says (once, after loading)."""
        perm = head_permutation(self.arch)
        if perm is None:
            return
        d = self.arch.head_dim
        q_heads, k_heads = self.arch.num_heads, self.arch.num_kv_heads
        index = torch.tensor(
            [h * d + p for h in range(q_heads + k_heads) for p in perm], dtype=torch.long
        )
        for layer in cast(list[DecoderLayer], self.layers):
            attn = layer.self_attn
            qkv = attn.qkv_proj
            rows = qkv.qweight if isinstance(qkv, QuantLinear) else qkv.weight
            for tensor in (rows, qkv.bias):  # whole rows: a quantized one's blocks too
                if tensor is not None:
                    tensor[: len(index)] = tensor[index.to(tensor.device)].clone()
            for norm in (attn.q_norm, attn.k_norm):
                if norm is not None:
                    norm.weight.copy_(norm.weight[torch.tensor(perm)].clone())

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,
        ops: Ops = TORCH_OPS,
    ) -> torch.Tensor:
        """Run one step; return logits for the tokens at `logits_indices` only, as
        `ops.logits` computes them (float32 on the bf16 CPU kernels, else the model's
        dtype: the sampler widens to float32 only what it computes with)."""
        x = ops.embed(self.embed_tokens, input_ids)
        if self.embed_scale is not None:  # in the compute dtype, as Hugging Face scales
            x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        ropes = tuple(ops.rope(r, positions, x.dtype) for r in self.rotaries)
        delta = ops.run_layers(self, x, ropes, kv_cache, meta)
        x = x[logits_indices]
        h = ops.add_rms_norm(x, None if delta is None else delta[logits_indices], self.norm)
        return ops.logits(h, self.lm_head)

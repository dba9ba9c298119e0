"""The shape of one decoder model, independent of where the weights come from: its family
(`family.py`) and its numbers, read from a Hugging Face `config.json` here or from GGUF
metadata (`gguf_file.py`)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from pdserve.errors import ModelLoadError
from pdserve.model.family import FAMILIES, Family, family_for_hf

SUPPORTED_ARCHITECTURES = sorted(
    a for f in FAMILIES.values() for a in f.hf_architectures
)  # fmt: skip
"""Hugging Face `architectures` names pdserve loads."""


@dataclass(frozen=True)
class ModelArch:
    architecture: str
    """The family's name (`family.FAMILIES`)."""
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    rope_scaling: tuple[tuple[str, Any], ...] | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    rotary_dim: int | None = None
    """Dimensions of each head the rotary embedding turns (Phi's partial rotary); None:
    all of them."""
    attention_scale: float | None = None
    """Scores' scale (Gemma's query_pre_attn_scalar ** -0.5); None: head_dim ** -0.5."""
    layer_windows: tuple[int, ...] = ()
    """Per layer, the keys a token attends to when that layer slides a window (itself
    included, as Hugging Face and llama.cpp count), or 0 for full attention; empty: every
    layer attends to everything."""
    sliding_rope_theta: float | None = None
    """The sliding layers' own rotary base, unscaled (Gemma 3's local layers); None: the
    global base and scaling for every layer."""

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads != 0:
            raise ModelLoadError(
                f"num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if self.architecture not in FAMILIES:
            raise ModelLoadError(f"unknown model family {self.architecture!r}")
        if self.layer_windows and len(self.layer_windows) != self.num_layers:
            raise ModelLoadError(
                f"{len(self.layer_windows)} layer windows for {self.num_layers} layers"
            )
        if self.rotary_dim is not None and (
            self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim
        ):
            raise ModelLoadError(
                f"rotary dimensions {self.rotary_dim} for heads of {self.head_dim}"
            )

    @property
    def family(self) -> Family:
        return FAMILIES[self.architecture]

    @property
    def rope_scaling_dict(self) -> dict[str, Any] | None:
        return dict(self.rope_scaling) if self.rope_scaling else None

    @property
    def num_rotary_dims(self) -> int:
        return self.rotary_dim or self.head_dim

    @property
    def scale(self) -> float:
        return self.attention_scale if self.attention_scale is not None else self.head_dim**-0.5

    def window(self, layer: int) -> int:
        """Layer `layer`'s sliding window, 0 for full attention."""
        return self.layer_windows[layer] if self.layer_windows else 0

    def rope_variant(self, layer: int) -> int:
        """Which rotary table layer `layer` takes: 0 the global one, 1 the sliding layers'."""
        return int(bool(self.window(layer)) and self.sliding_rope_theta is not None)

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> ModelArch:
        """Build from a Hugging Face `config.json` dict; unsupported models fail clearly."""
        family = family_for_hf(cfg.get("architectures") or [], cfg.get("model_type"))
        for cap in ("attn_logit_softcapping", "final_logit_softcapping"):
            if cfg.get(cap):
                raise ModelLoadError(f"{cap} (Gemma 2's soft caps) is not supported")
        try:
            num_heads = int(cfg["num_attention_heads"])
            hidden = int(cfg["hidden_size"])
            head_dim = int(cfg.get("head_dim") or hidden // num_heads)
            eos = cfg.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
            num_layers = int(cfg["num_hidden_layers"])
            rope_theta, rope_scaling, sliding_theta = _hf_rope(cfg)
            params = cfg.get("rope_parameters") or {}
            partial = float(
                cfg.get("partial_rotary_factor") or params.get("partial_rotary_factor") or 1.0
            )
            pre_attn = cfg.get("query_pre_attn_scalar")
            return cls(
                architecture=family.name,
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_layers=num_layers,
                num_heads=num_heads,
                num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
                head_dim=head_dim,
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=rope_theta,
                max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                attention_bias=family.qkv_bias or bool(cfg.get("attention_bias", False)),
                rope_scaling=tuple(sorted(rope_scaling.items())) if rope_scaling else None,
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_ids=tuple(int(e) for e in eos_ids),
                rotary_dim=int(head_dim * partial) if partial < 1.0 else None,
                attention_scale=float(pre_attn) ** -0.5 if pre_attn else None,
                layer_windows=_hf_layer_windows(cfg, num_layers),
                sliding_rope_theta=sliding_theta,
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ModelLoadError(f"config.json is missing or has a bad field: {e!r}") from e


def _hf_rope(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None, float | None]:
    """(global base, global scaling or None, the sliding layers' base or None) from either
    config form: transformers 5's `rope_parameters` (per layer type for Gemma 3) or the
    older `rope_theta` / `rope_scaling` / `rope_local_base_freq`."""
    params = cfg.get("rope_parameters") or {}
    sliding = params.get("sliding_attention") if "full_attention" in params else None
    full = params.get("full_attention", params) or cfg.get("rope_scaling") or {}
    theta = full.get("rope_theta", cfg.get("rope_theta", 10000.0))
    scaling = (
        dict(full) if full.get("rope_type", full.get("type")) not in (None, "default") else None
    )
    if scaling is not None:
        scaling.pop("rope_theta", None)
        scaling.setdefault("rope_type", scaling.pop("type", None))
        for key in ("original_max_position_embeddings", "max_position_embeddings"):
            if key in cfg:
                scaling.setdefault(key, cfg[key])
    sliding_theta = (sliding or {}).get("rope_theta", cfg.get("rope_local_base_freq"))
    if sliding and sliding.get("rope_type", "default") != "default":
        raise ModelLoadError("rotary scaling on sliding-window layers is not supported")
    return float(theta), scaling, None if sliding_theta is None else float(sliding_theta)


def _hf_layer_windows(cfg: dict[str, Any], num_layers: int) -> tuple[int, ...]:
    """Each layer's sliding window (0: full attention). transformers 5 lists the layers'
    kinds in `layer_types`; older configs give Gemma's `sliding_window_pattern` (every
    n-th layer full), or a window for every layer (Mistral, Phi-3) unless
    `use_sliding_window` is false (Qwen2's)."""
    window = int(cfg.get("sliding_window") or 0)
    types = cfg.get("layer_types")
    if not window or (types is None and cfg.get("use_sliding_window") is False):
        return ()
    if types is None:
        pattern = cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern")
        sliding = [bool((i + 1) % int(pattern)) if pattern else True for i in range(num_layers)]
    else:
        if len(types) != num_layers:
            raise ModelLoadError(f"layer_types has {len(types)} entries for {num_layers} layers")
        unknown = set(types) - {"sliding_attention", "full_attention"}
        if unknown:
            raise ModelLoadError(f"unsupported layer types {sorted(unknown)}")
        sliding = [t == "sliding_attention" for t in types]
    windows = tuple(window if s else 0 for s in sliding)
    return windows if any(windows) else ()


def longrope_attention_factor(scaling: dict[str, Any]) -> float:
    """LongRoPE's scale on cos and sin (Phi-3): the config's, or sqrt(1 + ln(s) / ln(L0))
    for a context s times the original L0, as Hugging Face computes it."""
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    original = float(scaling["original_max_position_embeddings"])
    factor = scaling.get("factor")
    if factor is None:
        factor = float(scaling.get("max_position_embeddings", original)) / original
    return math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1 else 1.0

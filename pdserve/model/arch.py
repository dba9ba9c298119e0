"""The shape of a Llama-family decoder, independent of where the weights come from."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pdserve.errors import ModelLoadError

# Hugging Face `architectures` names this model implementation covers. Qwen2 adds
# q/k/v biases; Mistral and SmolLM2 are plain Llama.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}


@dataclass(frozen=True)
class ModelArch:
    architecture: str
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

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads != 0:
            raise ModelLoadError(
                f"num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )

    @property
    def rope_scaling_dict(self) -> dict[str, Any] | None:
        return dict(self.rope_scaling) if self.rope_scaling else None

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> ModelArch:
        """Build from a Hugging Face `config.json` dict; unsupported models fail clearly."""
        names = cfg.get("architectures") or []
        arch = next(
            (SUPPORTED_ARCHITECTURES[n] for n in names if n in SUPPORTED_ARCHITECTURES), None
        )
        if arch is None:
            raise ModelLoadError(
                f"unsupported architecture {names or cfg.get('model_type')!r}; "
                f"pdserve supports {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        try:
            num_heads = int(cfg["num_attention_heads"])
            hidden = int(cfg["hidden_size"])
            eos = cfg.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
            rope_scaling = cfg.get("rope_scaling") or (cfg.get("rope_parameters") or None)
            if rope_scaling is not None:
                kind = rope_scaling.get("rope_type", rope_scaling.get("type"))
                rope_scaling = None if kind in (None, "default") else rope_scaling
            rope_theta = cfg.get("rope_theta")
            if rope_theta is None:
                rope_theta = (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)
            return cls(
                architecture=arch,
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_layers=int(cfg["num_hidden_layers"]),
                num_heads=num_heads,
                num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
                head_dim=int(cfg.get("head_dim") or hidden // num_heads),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=float(rope_theta),
                max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                attention_bias=arch == "qwen2" or bool(cfg.get("attention_bias", False)),
                rope_scaling=tuple(sorted(rope_scaling.items())) if rope_scaling else None,
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_ids=tuple(int(e) for e in eos_ids),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ModelLoadError(f"config.json is missing or has a bad field: {e!r}") from e

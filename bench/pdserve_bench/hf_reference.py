"""Hugging Face transformers models built from the same weights pdserve loads.

The reference implementation for correctness tests and the baseline for benchmarks.
transformers is a dev dependency only; pdserve itself never imports it.

A GGUF file's tensors come from pdserve's reader (its names, dequantized, llama.cpp's q/k
interleaving undone), so this checks pdserve's model code against transformers' on the
same numbers. That the reader reads llama.cpp's files right is checked separately: tiny
models converted by llama.cpp's own converter against their directories
(tests/model/test_families.py), and transformers' own GGUF loader on the real Gemma file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from pdserve.model.arch import ModelArch
from pdserve.model.gguf_file import open_gguf

_HF_CLASSES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM"),
}


def hf_config(arch: ModelArch) -> Any:
    """The transformers config of `arch`'s model (its family's class)."""
    import transformers

    cfg: dict[str, Any] = dict(
        vocab_size=arch.vocab_size,
        hidden_size=arch.hidden_size,
        intermediate_size=arch.intermediate_size,
        num_hidden_layers=arch.num_layers,
        num_attention_heads=arch.num_heads,
        num_key_value_heads=arch.num_kv_heads,
        head_dim=arch.head_dim,
        rms_norm_eps=arch.rms_norm_eps,
        max_position_embeddings=arch.max_position_embeddings,
        tie_word_embeddings=arch.tie_word_embeddings,
        bos_token_id=arch.bos_token_id,
        eos_token_id=list(arch.eos_token_ids) or None,
    )
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": arch.rope_theta}
    rope.update(arch.rope_scaling_dict or {})
    if arch.rotary_dim:
        cfg["partial_rotary_factor"] = rope["partial_rotary_factor"] = (
            arch.rotary_dim / arch.head_dim
        )
    if "original_max_position_embeddings" in rope:
        cfg["original_max_position_embeddings"] = rope["original_max_position_embeddings"]
    for key in ("max_position_embeddings", "attention_factor"):
        rope.pop(key, None)  # the config's, or derived from it as pdserve derives it
    if arch.layer_windows:
        cfg["sliding_window"] = max(arch.layer_windows)
        cfg["layer_types"] = [
            "sliding_attention" if w else "full_attention" for w in arch.layer_windows
        ]
    if arch.sliding_rope_theta is not None:
        sliding = {"rope_type": "default", "rope_theta": arch.sliding_rope_theta}
        rope = {"full_attention": rope, "sliding_attention": sliding}
    cfg["rope_parameters"] = rope
    if arch.architecture == "gemma3":
        cfg["query_pre_attn_scalar"] = round(arch.scale**-2)
    config_cls, _ = _HF_CLASSES[arch.architecture]
    return getattr(transformers, config_cls)(**cfg)


def hf_state_dict(arch: ModelArch, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """pdserve-named tensors in the family's Hugging Face names (norm offsets taken out)."""
    family = arch.family
    state = {}
    for name, tensor in weights.items():
        for hf, ours in family.hf_names:  # pdserve -> HF: the renames undone, in one pass
            if f".{ours}." in name:
                name = name.replace(f".{ours}.", f".{hf}.")
                break
        if family.hf_norm_offset and name.endswith("norm.weight"):
            tensor = tensor - family.hf_norm_offset
        state[name] = tensor
    if arch.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    return state


def hf_model_from_gguf(path: Path, dtype: torch.dtype = torch.float32) -> tuple[Any, ModelArch]:
    """A transformers CausalLM with the GGUF file's (dequantized, un-permuted) weights."""
    import transformers

    gguf_file = open_gguf(path)
    arch = gguf_file.arch()
    _, model_cls = _HF_CLASSES[arch.architecture]
    model: Any = getattr(transformers, model_cls)(hf_config(arch))
    state = hf_state_dict(arch, dict(gguf_file.weights(arch)))  # type: ignore[arg-type]
    model.load_state_dict(state, strict=True)
    return model.to(dtype).eval(), arch


def save_hf_dir(path: Path, gguf_path: Path, dtype: torch.dtype = torch.float32) -> None:
    """Export a GGUF model as a Hugging Face directory (config, safetensors, tokenizer)."""
    model, _ = hf_model_from_gguf(gguf_path, dtype)
    model.save_pretrained(str(path))
    open_gguf(gguf_path).tokenizer().save_hf(path)

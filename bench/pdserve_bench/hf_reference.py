"""Hugging Face transformers models built from the same weights pdserve loads.

The reference implementation for correctness tests and the baseline for benchmarks.
transformers is a dev dependency only; pdserve itself never imports it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from pdserve.model.arch import ModelArch
from pdserve.model.gguf_file import open_gguf


def hf_config(arch: ModelArch) -> Any:
    import transformers

    common: dict[str, Any] = dict(
        vocab_size=arch.vocab_size,
        hidden_size=arch.hidden_size,
        intermediate_size=arch.intermediate_size,
        num_hidden_layers=arch.num_layers,
        num_attention_heads=arch.num_heads,
        num_key_value_heads=arch.num_kv_heads,
        rms_norm_eps=arch.rms_norm_eps,
        rope_theta=arch.rope_theta,
        max_position_embeddings=arch.max_position_embeddings,
        tie_word_embeddings=arch.tie_word_embeddings,
        bos_token_id=arch.bos_token_id,
        eos_token_id=list(arch.eos_token_ids) or None,
    )
    if arch.architecture == "qwen2":
        return transformers.Qwen2Config(**common)
    return transformers.LlamaConfig(head_dim=arch.head_dim, **common)


def hf_model_from_gguf(path: Path, dtype: torch.dtype = torch.float32) -> tuple[Any, ModelArch]:
    """A transformers CausalLM with the GGUF file's (dequantized, un-permuted) weights."""
    import transformers

    gguf_file = open_gguf(path)
    arch = gguf_file.arch()
    config = hf_config(arch)
    cls = (
        transformers.Qwen2ForCausalLM
        if arch.architecture == "qwen2"
        else transformers.LlamaForCausalLM
    )
    model: Any = cls(config)
    state = dict(gguf_file.weights(arch))
    if arch.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict(state, strict=True)
    return model.to(dtype).eval(), arch


def save_hf_dir(path: Path, gguf_path: Path, dtype: torch.dtype = torch.float32) -> None:
    """Export a GGUF model as a Hugging Face directory (config, safetensors, tokenizer)."""
    model, _ = hf_model_from_gguf(gguf_path, dtype)
    model.save_pretrained(str(path))
    open_gguf(gguf_path).tokenizer().save_hf(path)

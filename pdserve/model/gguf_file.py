"""Read a GGUF file: architecture, tokenizer and dequantized weights in Hugging Face names.

llama.cpp's converter permutes the Q and K projections of `llama`-architecture models so
its rotary kernel can rotate interleaved pairs (x0,x1),(x2,x3)...; pdserve (like Hugging
Face) rotates halves (x0,x_{d/2}),..., so those two weights are permuted back here.
Without that step the model runs but its output is garbage.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from pdserve.engine.tokenizer import Tokenizer
from pdserve.errors import ModelLoadError
from pdserve.model.arch import ModelArch

_GGUF_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2"}

# GGUF per-layer tensor names -> Hugging Face names (prefix model.layers.N.).
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


class GGUFModelFile:
    """An opened GGUF file. Tensor data is memory-mapped and dequantized on iteration."""

    def __init__(self, path: Path) -> None:
        import gguf  # imported here: only GGUF loads pay for it

        try:
            self._reader = gguf.GGUFReader(str(path))
            self.fields = {name: f.contents() for name, f in self._reader.fields.items()}
        except Exception as e:  # the reader raises assorted errors on truncated files
            raise ModelLoadError(f"{path} is not a readable GGUF file: {e}") from e
        self.path = path
        self._gguf = gguf

    @property
    def num_tensors(self) -> int:
        return len(self._reader.tensors)

    def arch(self) -> ModelArch:
        kind = self.fields.get("general.architecture")
        if kind not in _GGUF_ARCHITECTURES:
            raise ModelLoadError(
                f"unsupported GGUF architecture {kind!r}; supported: {sorted(_GGUF_ARCHITECTURES)}"
            )
        if any(t.name == "rope_freqs.weight" for t in self._reader.tensors):
            raise ModelLoadError("GGUF rope frequency tables (Llama 3.1) are not supported yet")
        f = self.fields
        try:
            num_heads = int(f[f"{kind}.attention.head_count"])
            hidden = int(f[f"{kind}.embedding_length"])
            head_dim = int(f.get(f"{kind}.rope.dimension_count", hidden // num_heads))
            tokens = f.get("tokenizer.ggml.tokens") or []
            return ModelArch(
                architecture=_GGUF_ARCHITECTURES[kind],
                vocab_size=int(f.get(f"{kind}.vocab_size", len(tokens))),
                hidden_size=hidden,
                intermediate_size=int(f[f"{kind}.feed_forward_length"]),
                num_layers=int(f[f"{kind}.block_count"]),
                num_heads=num_heads,
                num_kv_heads=int(f.get(f"{kind}.attention.head_count_kv", num_heads)),
                head_dim=head_dim,
                rms_norm_eps=float(f[f"{kind}.attention.layer_norm_rms_epsilon"]),
                rope_theta=float(f.get(f"{kind}.rope.freq_base", 10000.0)),
                max_position_embeddings=int(f.get(f"{kind}.context_length", 4096)),
                tie_word_embeddings=not any(
                    t.name == "output.weight" for t in self._reader.tensors
                ),
                attention_bias=kind == "qwen2",
                bos_token_id=f.get("tokenizer.ggml.bos_token_id"),
                eos_token_ids=tuple(
                    int(f[k])
                    for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")
                    if k in f
                ),
            )
        except KeyError as e:
            raise ModelLoadError(f"GGUF metadata lacks {e}") from e

    def tokenizer(self) -> Tokenizer:
        return Tokenizer.from_gguf_fields(self.fields)

    def weights(self, arch: ModelArch) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (Hugging Face name, float32 tensor) for every tensor in the file."""
        permute = self.fields.get("general.architecture") == "llama"
        for t in self._reader.tensors:
            name = _hf_name(t.name)
            if name is None:
                raise ModelLoadError(f"unexpected tensor {t.name!r} in {self.path}")
            try:
                array = self._gguf.quants.dequantize(t.data, t.tensor_type)
            except Exception as e:
                raise ModelLoadError(
                    f"cannot dequantize {t.name} ({t.tensor_type.name}): {e}"
                ) from e
            shape = tuple(int(d) for d in reversed(t.shape))
            tensor = torch.from_numpy(np.array(array, copy=True).reshape(shape))
            if permute and name.endswith("q_proj.weight"):
                tensor = _unpermute(tensor, arch.num_heads)
            elif permute and name.endswith("k_proj.weight"):
                tensor = _unpermute(tensor, arch.num_kv_heads)
            yield name, tensor


def _hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}"
    return None


def _unpermute(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's interleaving permutation of a Q or K projection's rows.

    Converter: rows of each head reordered from [half0 | half1] to pairs (h0[i], h1[i]),
    i.e. reshape(heads, 2, d/2) -> swap -> (heads, d/2, 2). This is the inverse.
    """
    out_dim = w.shape[0]
    head_dim = out_dim // num_heads
    return (
        w.reshape(num_heads, head_dim // 2, 2, *w.shape[1:])
        .transpose(1, 2)
        .reshape(out_dim, *w.shape[1:])
        .contiguous()
    )


@functools.cache
def _open_cached(path: Path, mtime_ns: int, size: int) -> GGUFModelFile:
    return GGUFModelFile(path)


def open_gguf(path: Path) -> GGUFModelFile:
    """Open a GGUF file once per process: parsing its metadata (the 49k-token vocabulary)
    takes seconds, and tests and benchmarks open the same file many times."""
    path = path.resolve()
    try:
        stat = path.stat()
    except OSError as e:
        raise ModelLoadError(f"cannot open {path}: {e}") from e
    return _open_cached(path, stat.st_mtime_ns, stat.st_size)

"""GGUF files with the exact shapes of the models users run, random weights, for
benchmarks at real sizes (`pdserve bench offline --model FILE`, the same file for pdserve
and llama.cpp): the 135M default model says little about a 1B-8B model, where a decode
step reads gigabytes and per-step overhead weighs nothing.

    .venv/bin/python -m pdserve_bench.synthetic_gguf --shape llama-3.2-1b --mix q4_k_m

writes ~/.cache/pdserve/synthetic/llama-3.2-1b.q4_k_m.gguf (once; the path is printed).
Never committed: the files are 0.7-8.5 GB.

Weights: random blocks, each tensor in the format llama.cpp's quantizer gives it for the
mix (Q4_K_M: Q6_K for the output/tied embedding and for attn_v and ffn_down in the layers
`use_more_bits` picks, Q4_K elsewhere; Q4_0: Q4_0 with a Q6_K output; Q8_0), with scales
that give weights of about 0.02 standard deviation. The tokenizer is the default model's,
padded with reserved control tokens to the shape's vocabulary. The text they produce is
noise; `--ignore-eos` and fixed lengths make the work the same for every system.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "pdserve" / "synthetic"


@dataclass(frozen=True)
class Shape:
    arch: str  # GGUF architecture: llama, qwen2 (q/k/v biases), qwen3, gemma3
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    inter: int
    vocab: int
    tied: bool
    rope_theta: float
    sliding_window: int = 0
    """Gemma 3: every layer but each 6th slides over this many keys."""
    rope_linear: float = 0.0
    """Gemma 3 4B+: the global layers' linear rotary scaling."""


# Qwen3's per-head q/k norms and Gemma 3's extra norms follow from the architecture.
SHAPES = {
    "llama-3.2-1b": Shape("llama", 2048, 16, 32, 8, 64, 8192, 128256, True, 500000.0),
    "qwen2.5-3b": Shape("qwen2", 2048, 36, 16, 2, 128, 11008, 151936, True, 1000000.0),
    "llama-3.1-8b": Shape("llama", 4096, 32, 32, 8, 128, 14336, 128256, False, 500000.0),
    "qwen3-1.7b": Shape("qwen3", 2048, 28, 16, 8, 128, 6144, 151936, True, 1000000.0),
    "qwen3-4b": Shape("qwen3", 2560, 36, 32, 8, 128, 9728, 151936, True, 1000000.0),
    "qwen3-8b": Shape("qwen3", 4096, 36, 32, 8, 128, 12288, 151936, False, 1000000.0),
    "gemma-3-1b": Shape("gemma3", 1152, 26, 4, 1, 256, 6912, 262144, True, 1e6, 512),
    "gemma-3-4b": Shape("gemma3", 2560, 34, 8, 4, 256, 10240, 262144, True, 1e6, 1024, 8.0),
    "tiny": Shape("llama", 256, 2, 4, 2, 64, 512, 49152, False, 10000.0),  # for tests
}
_FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}
"""llama.cpp's quantizer's format for a tensor whose rows are not whole 256-weight
super-blocks (Gemma 3 1B's 1152 columns): the K-quant's 32-weight fallback."""
MIXES = ("q4_k_m", "q4_0", "q8_0")

# Per format: (byte offset of each fp16 scale field, its value): weights of ~0.02 standard
# deviation from uniformly random quant bytes (Q4_K: dmin ~ 7.5 d centres d sc q - dmin m).
_SCALES = {
    "Q8_0": ((0, 2.7e-4),),
    "Q4_0": ((0, 4.3e-3),),
    "Q5_0": ((0, 2.2e-3),),
    "Q4_K": ((0, 1.0e-4), (2, 7.5e-4)),
    "Q6_K": ((208, 1.5e-5),),
}


def use_more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's choice of the layers whose attn_v and ffn_down Q4_K_M keeps in Q6_K."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def tensor_type(name: str, layer: int, shape: Shape, mix: str) -> str:
    """The GGUF type llama.cpp's quantizer gives tensor `name` (of layer `layer`) in `mix`."""
    is_output = name == "output.weight" or (shape.tied and name == "token_embd.weight")
    if mix == "q8_0":
        return "Q8_0"
    if is_output:
        return "Q6_K"
    if mix == "q4_0":
        return "Q4_0"
    more = use_more_bits(layer, shape.layers)
    if more and (name.endswith("attn_v.weight") or name.endswith("ffn_down.weight")):
        return "Q6_K"
    return "Q4_K"


def stored_type(name: str, layer: int, shape: Shape, mix: str, cols: int) -> str:
    """`tensor_type`, or its fallback where the rows are not whole super-blocks."""
    qtype = tensor_type(name, layer, shape, mix)
    return _FALLBACK.get(qtype, qtype) if cols % 256 else qtype


def random_blocks(
    qtype: str, rows: int, cols: int, rng: np.random.Generator, random_scales: bool = False
) -> np.ndarray:
    """uint8 [rows, row bytes] of random quants. The fp16 scale fields: `_SCALES`' values
    (weights of ~0.02 deviation), or with `random_scales` (tests, kernel timings; any format
    with kernels) random numbers in [1e-3, 1.1e-2)."""
    import gguf

    from pdserve.model.quant import QuantType, scale_offsets

    weights, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]]
    blocks = rng.integers(0, 256, size=(rows, cols // weights, block_bytes), dtype=np.uint8)
    if random_scales:
        for offset in scale_offsets(QuantType[qtype]):
            scales = (rng.random(blocks.shape[:2]) * 0.01 + 1e-3).astype(np.float16)
            blocks[..., offset : offset + 2] = scales.view(np.uint8).reshape(*blocks.shape[:2], 2)
    else:
        for offset, value in _SCALES[qtype]:
            blocks[..., offset : offset + 2] = np.frombuffer(np.float16(value).tobytes(), np.uint8)
    return blocks.reshape(rows, -1)


def tensors(shape: Shape) -> list[tuple[str, int, tuple[int, int] | tuple[int]]]:
    """(GGUF name, layer, shape as [rows, cols] or [n]) of every tensor, in file order."""
    h, q, kv = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    out: list[tuple[str, int, tuple[int, int] | tuple[int]]] = [
        ("token_embd.weight", -1, (shape.vocab, h))
    ]
    for i in range(shape.layers):
        b = f"blk.{i}."
        out += [(b + "attn_norm.weight", i, (h,)), (b + "attn_q.weight", i, (q, h)),
                (b + "attn_k.weight", i, (kv, h)), (b + "attn_v.weight", i, (kv, h))]  # fmt: skip
        if shape.arch == "qwen2":
            out += [(b + "attn_q.bias", i, (q,)), (b + "attn_k.bias", i, (kv,)),
                    (b + "attn_v.bias", i, (kv,))]  # fmt: skip
        if shape.arch in ("qwen3", "gemma3"):
            out += [(b + "attn_q_norm.weight", i, (shape.head_dim,)),
                    (b + "attn_k_norm.weight", i, (shape.head_dim,))]  # fmt: skip
        if shape.arch == "gemma3":
            out += [(b + "post_attention_norm.weight", i, (h,)),
                    (b + "post_ffw_norm.weight", i, (h,))]  # fmt: skip
        out += [(b + "attn_output.weight", i, (h, q)), (b + "ffn_norm.weight", i, (h,)),
                (b + "ffn_gate.weight", i, (shape.inter, h)),
                (b + "ffn_up.weight", i, (shape.inter, h)),
                (b + "ffn_down.weight", i, (h, shape.inter))]  # fmt: skip
    out.append(("output_norm.weight", -1, (h,)))
    if not shape.tied:
        out.append(("output.weight", -1, (shape.vocab, h)))
    return out


def write(path: Path, shape: Shape, mix: str, seed: int = 0) -> None:
    """Write the synthetic file (to a temporary name, renamed when complete)."""
    import gguf

    from pdserve.model.files import default_model_path

    source = gguf.GGUFReader(default_model_path())
    partial = path.with_suffix(".partial")
    writer = gguf.GGUFWriter(partial, shape.arch)
    a = shape.arch
    writer.add_name(f"synthetic {path.stem}")
    writer.add_uint32(f"{a}.context_length", 8192)
    writer.add_uint32(f"{a}.embedding_length", shape.hidden)
    writer.add_uint32(f"{a}.block_count", shape.layers)
    writer.add_uint32(f"{a}.feed_forward_length", shape.inter)
    writer.add_uint32(f"{a}.attention.head_count", shape.heads)
    writer.add_uint32(f"{a}.attention.head_count_kv", shape.kv_heads)
    writer.add_uint32(f"{a}.rope.dimension_count", shape.head_dim)
    writer.add_uint32(f"{a}.attention.key_length", shape.head_dim)
    writer.add_uint32(f"{a}.attention.value_length", shape.head_dim)
    writer.add_float32(f"{a}.rope.freq_base", shape.rope_theta)
    if shape.sliding_window:
        writer.add_uint32(f"{a}.attention.sliding_window", shape.sliding_window)
    if shape.rope_linear:
        writer.add_string(f"{a}.rope.scaling.type", "linear")
        writer.add_float32(f"{a}.rope.scaling.factor", shape.rope_linear)
    writer.add_float32(f"{a}.attention.layer_norm_rms_epsilon", 1e-5)
    writer.add_uint32(f"{a}.vocab_size", shape.vocab)
    _copy_tokenizer(source, writer, shape.vocab)
    rng = np.random.default_rng(seed)
    for name, layer, dims in tensors(shape):
        if len(dims) == 1:  # norms: ones; biases: zeros
            value = 1.0 if name.endswith("norm.weight") else 0.0
            writer.add_tensor(name, np.full(dims, value, np.float32))
            continue
        qtype = stored_type(name, layer, shape, mix, dims[1])
        data = random_blocks(qtype, dims[0], dims[1], rng)
        writer.add_tensor(name, data, raw_dtype=gguf.GGMLQuantizationType[qtype])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    partial.rename(path)


def _copy_tokenizer(source: object, writer: object, vocab: int) -> None:
    """The default model's tokenizer fields, its token list padded to `vocab` with
    reserved control tokens (never produced from text)."""
    import gguf

    for key, field in source.fields.items():  # type: ignore[attr-defined]
        if not key.startswith("tokenizer."):
            continue
        value = field.contents()
        if key == "tokenizer.ggml.tokens":
            value = value + [f"<|reserved_{i}|>" for i in range(len(value), vocab)]
        elif key == "tokenizer.ggml.token_type":
            value = value + [int(gguf.TokenType.CONTROL)] * (vocab - len(value))
        sub = field.types[1] if len(field.types) > 1 else None
        writer.add_key_value(key, value, field.types[0], sub)  # type: ignore[attr-defined]


def synthetic_path(shape: str, mix: str, seed: int = 0) -> Path:
    """The file for `shape` and `mix`, written on first use."""
    if shape not in SHAPES or mix not in MIXES:
        raise ValueError(f"shape one of {sorted(SHAPES)}, mix one of {MIXES}")
    path = CACHE / f"{shape}.{mix}.gguf"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        write(path, SHAPES[shape], mix, seed)
    return path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", required=True, choices=sorted(SHAPES))
    p.add_argument("--mix", default="q4_k_m", choices=MIXES)
    args = p.parse_args()
    path = synthetic_path(args.shape, args.mix)
    print(f"{path} ({path.stat().st_size / 1e9:.2f} GB)")


if __name__ == "__main__":
    main()

"""Read a GGUF file: architecture, tokenizer and dequantized weights in pdserve's names
(Hugging Face's Llama names; `family.py` maps each family's llama.cpp names onto them).

llama.cpp's converter permutes the Q and K projections of `llama`-architecture models so
its rotary kernel can rotate interleaved pairs (x0,x1),(x2,x3)...; pdserve (like Hugging
Face) rotates halves (x0,x_{d/2}),..., so those two weights are permuted back here
(`Family.gguf_interleaved_qk`). Without that step the model runs but its output is
garbage. The other families' files keep Hugging Face's order.
"""

from __future__ import annotations

import functools
import mmap
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from pdserve.errors import ModelLoadError
from pdserve.model.arch import ModelArch
from pdserve.model.family import GGUF_GLOBAL_NAMES, Family, family_for_gguf
from pdserve.model.tokenizer import Tokenizer

if TYPE_CHECKING:
    import torch

    from pdserve.model.quant import QuantizedTensor

_ROPE_FACTORS = ("rope_factors_long.weight", "rope_factors_short.weight")
"""LongRoPE's frequency factors (Phi-3): read into the architecture, not weights."""


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: Any
    """gguf.GGMLQuantizationType"""
    shape: tuple[int, ...]
    """GGUF's order: the innermost (contiguous) dimension first."""
    data: np.ndarray
    """Memory-mapped, read-only: typed for float and int types, raw bytes (rows of
    blocks) for quantized ones, as `gguf.quants.dequantize` takes them."""


# GGUF metadata value types: scalars by struct format; 8 = string, 9 = array.
_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
                   10: "<Q", 11: "<q", 12: "<d"}  # fmt: skip
_STRING, _ARRAY = 8, 9
_TYPED_TENSORS = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8,
                  "I16": np.int16, "I32": np.int32, "I64": np.int64}  # fmt: skip


class _Cursor:
    """Reads GGUF's little-endian header values from a buffer, front to back."""

    def __init__(self, buffer: Any) -> None:
        self.buffer, self.pos = buffer, 0

    def scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.buffer, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.scalar("<Q")
        text = bytes(self.buffer[self.pos : self.pos + n]).decode("utf-8")
        self.pos += n
        return text

    def value(self, value_type: int) -> Any:
        if value_type == _STRING:
            return self.string()
        if value_type == _ARRAY:
            item_type, count = self.scalar("<I"), self.scalar("<Q")
            if item_type in _SCALAR_FORMATS:  # numbers: one numpy read, not `count` calls
                dtype = np.dtype(_SCALAR_FORMATS[item_type])
                items = np.frombuffer(self.buffer, dtype, count, self.pos)
                self.pos += dtype.itemsize * count
                return items.tolist()
            return [self.value(item_type) for _ in range(count)]
        if value_type not in _SCALAR_FORMATS:
            raise ValueError(f"unknown metadata value type {value_type}")
        return self.scalar(_SCALAR_FORMATS[value_type])


def read_gguf(path: Path) -> tuple[dict[str, Any], list[GGUFTensor], mmap.mmap]:
    """(metadata, tensors, the mapping their data lives in) of a GGUF v2/v3 file.

    Our own reader of the header: gguf's GGUFReader builds a numpy view per element and
    takes ~4 s for SmolLM2's 49k-token vocabulary and 48k merges, on every process start
    (each node, each test server); this takes ~0.1 s. gguf still dequantizes."""
    import gguf  # imported here: only GGUF loads pay for it

    with open(path, "rb") as f:
        mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    c = _Cursor(mapping)
    if c.scalar("<4s") != b"GGUF":
        raise ValueError("no GGUF magic number")
    version = c.scalar("<I")
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} (big-endian?) is not supported; 2 and 3 are")
    num_tensors, num_fields = c.scalar("<Q"), c.scalar("<Q")
    fields = {}
    for _ in range(num_fields):
        key = c.string()
        fields[key] = c.value(c.scalar("<I"))
    infos = []
    for _ in range(num_tensors):
        name, num_dims = c.string(), c.scalar("<I")
        shape = tuple(c.scalar("<Q") for _ in range(num_dims))
        infos.append((name, gguf.GGMLQuantizationType(c.scalar("<I")), shape, c.scalar("<Q")))
    alignment = int(fields.get("general.alignment", 32))
    data_start = -(-c.pos // alignment) * alignment
    tensors = []
    for name, kind, shape, offset in infos:
        rows = tuple(reversed(shape))
        typed = _TYPED_TENSORS.get(kind.name)
        if typed is not None:
            count, dtype = int(np.prod(shape)), np.dtype(typed)
        else:
            block_size, type_size = gguf.GGML_QUANT_SIZES[kind]
            count, dtype = int(np.prod(shape)) // block_size * type_size, np.dtype(np.uint8)
            rows = (*rows[:-1], rows[-1] // block_size * type_size)
        data = np.frombuffer(mapping, dtype, count, data_start + offset).reshape(rows)
        tensors.append(GGUFTensor(name, kind, shape, data))
    return fields, tensors, mapping


class GGUFModelFile:
    """An opened GGUF file. Tensor data is memory-mapped and dequantized on iteration."""

    def __init__(self, path: Path) -> None:
        import gguf

        try:
            self.fields, self._tensors, self._mapping = read_gguf(path)
        except Exception as e:  # truncated or foreign files fail in assorted ways
            raise ModelLoadError(f"{path} is not a readable GGUF file: {e}") from e
        self.path = path
        self._gguf = gguf

    @property
    def num_tensors(self) -> int:
        return len(self._tensors)

    @property
    def family(self) -> Family:
        return family_for_gguf(self.fields.get("general.architecture"))

    def arch(self) -> ModelArch:
        family = self.family
        kind = family.gguf_architecture
        if any(t.name == "rope_freqs.weight" for t in self._tensors):
            raise ModelLoadError("GGUF rope frequency tables (Llama 3.1) are not supported yet")
        f = self.fields
        if f.get(f"{kind}.final_logit_softcapping") or f.get(f"{kind}.attn_logit_softcapping"):
            raise ModelLoadError("logit soft-capping (Gemma 2) is not supported")
        try:
            num_heads = int(f[f"{kind}.attention.head_count"])
            hidden = int(f[f"{kind}.embedding_length"])
            num_layers = int(f[f"{kind}.block_count"])
            head_dim = int(f.get(f"{kind}.attention.key_length", hidden // num_heads))
            rotary = int(f.get(f"{kind}.rope.dimension_count", head_dim))
            tokens = f.get("tokenizer.ggml.tokens") or []
            scale = None
            if num_layers in family.gguf_scale_by_hidden_at:
                scale = (hidden // num_heads) ** -0.5
            return ModelArch(
                architecture=family.name,
                vocab_size=int(f.get(f"{kind}.vocab_size", len(tokens))),
                hidden_size=hidden,
                intermediate_size=int(f[f"{kind}.feed_forward_length"]),
                num_layers=num_layers,
                num_heads=num_heads,
                num_kv_heads=int(f.get(f"{kind}.attention.head_count_kv", num_heads)),
                head_dim=head_dim,
                rms_norm_eps=float(f[f"{kind}.attention.layer_norm_rms_epsilon"]),
                rope_theta=float(f.get(f"{kind}.rope.freq_base", 10000.0)),
                max_position_embeddings=int(f.get(f"{kind}.context_length", 4096)),
                tie_word_embeddings=not any(t.name == "output.weight" for t in self._tensors),
                attention_bias=family.qkv_bias,
                rope_scaling=self._rope_scaling(kind),
                bos_token_id=f.get("tokenizer.ggml.bos_token_id"),
                eos_token_ids=tuple(
                    int(f[k])
                    for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")
                    if k in f
                ),
                rotary_dim=rotary if rotary != head_dim else None,
                attention_scale=scale,
                layer_windows=self._layer_windows(family, num_layers),
                sliding_rope_theta=(
                    float(f.get(f"{kind}.rope.freq_base_swa", 10000.0))
                    if family.sliding_rope
                    else None
                ),
            )
        except KeyError as e:
            raise ModelLoadError(f"GGUF metadata lacks {e}") from e

    def _layer_windows(self, family: Family, num_layers: int) -> tuple[int, ...]:
        """Each layer's sliding window, as llama.cpp lays them out: an explicit pattern
        (a flag per layer, or every n-th layer full), else the family's."""
        kind = family.gguf_architecture
        window = int(self.fields.get(f"{kind}.attention.sliding_window", 0))
        if not window:
            return ()
        pattern = self.fields.get(f"{kind}.attention.sliding_window_pattern")
        if isinstance(pattern, list):
            return tuple(window if bool(p) else 0 for p in pattern)
        n = int(pattern) if pattern is not None else family.gguf_sliding_pattern
        return tuple(window if n == 0 or i % n < n - 1 else 0 for i in range(num_layers))

    def _rope_scaling(self, kind: str | None) -> tuple[tuple[str, Any], ...] | None:
        """Linear scaling (`rope.scaling.type`), or LongRoPE from its factor tensors."""
        f = self.fields
        factors = {t.name: t for t in self._tensors if t.name in _ROPE_FACTORS}
        if factors:
            long, short = (np.asarray(factors[n].data, np.float32).tolist() for n in _ROPE_FACTORS)
            scaling: dict[str, Any] = {
                "rope_type": "longrope",
                "long_factor": long,
                "short_factor": short,
                "original_max_position_embeddings": int(
                    f[f"{kind}.rope.scaling.original_context_length"]
                ),
                "max_position_embeddings": int(f.get(f"{kind}.context_length", 4096)),
            }
            if f"{kind}.rope.scaling.attn_factor" in f:
                scaling["attention_factor"] = float(f[f"{kind}.rope.scaling.attn_factor"])
            return tuple(sorted(scaling.items()))
        kind_of_scaling = f.get(f"{kind}.rope.scaling.type", "none")
        if kind_of_scaling == "none":
            return None
        if kind_of_scaling != "linear":
            raise ModelLoadError(f"GGUF rope scaling {kind_of_scaling!r} is not supported yet")
        return (("factor", float(f[f"{kind}.rope.scaling.factor"])), ("rope_type", "linear"))

    def tokenizer(self) -> Tokenizer:
        return Tokenizer.from_gguf_fields(self.fields)

    def tensor_types(self) -> dict[str, str]:
        """pdserve's name -> the file's type name for it (`F32`, `Q4_1`, ...)."""
        family = self.family
        return {_name(t.name, family) or t.name: t.tensor_type.name for t in self._tensors}

    def weights(
        self, arch: ModelArch, keep: frozenset[str] = frozenset()
    ) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
        """Yield (Hugging Face name, tensor) for every tensor in the file: float32, or the
        file's blocks as they are (a `QuantizedTensor`) for the names in `keep` whose type
        has kernels (quant.QuantType)."""
        family = self.family
        base = np.frombuffer(self._mapping, np.uint8).ctypes.data
        for t in self._tensors:
            if t.name in _ROPE_FACTORS:
                continue
            yield self._tensor(t, arch, keep, family)
            # The model holds its copy now: drop the file's pages from this process (they
            # stay in the page cache), so loading never holds the weights twice (an 8B
            # Q4_K_M file peaked at 11.9 GB of RSS for 5.1 GB of weights before).
            self._release(t.data.ctypes.data - base, t.data.nbytes)

    def _release(self, offset: int, length: int) -> None:
        start = offset // mmap.PAGESIZE * mmap.PAGESIZE
        if hasattr(mmap, "MADV_DONTNEED"):
            self._mapping.madvise(mmap.MADV_DONTNEED, start, offset + length - start)

    def _tensor(
        self, t: GGUFTensor, arch: ModelArch, keep: frozenset[str], family: Family
    ) -> tuple[str, torch.Tensor | QuantizedTensor]:
        """(pdserve's name, tensor) for `t`: its blocks when kept, else float32."""
        import torch  # here: reading the metadata and the tokenizer needs no torch (the proxy)

        from pdserve.model.quant import QuantizedTensor, QuantType

        permute = family.gguf_interleaved_qk
        name = _name(t.name, family)
        if name is None:
            raise ModelLoadError(f"unexpected tensor {t.name!r} in {self.path}")
        shape = tuple(int(d) for d in reversed(t.shape))
        if name in keep and t.tensor_type.name in QuantType.__members__:
            blocks = torch.from_numpy(np.array(t.data, copy=True))
            if permute and name.endswith(("q_proj.weight", "k_proj.weight")):
                heads = arch.num_heads if "q_proj" in name else arch.num_kv_heads
                blocks = _unpermute(blocks, heads)  # whole rows: blocks run along K
            qtype = QuantType[t.tensor_type.name]
            return name, QuantizedTensor(blocks, qtype, (shape[0], shape[1]))
        try:
            array = self._gguf.quants.dequantize(t.data, t.tensor_type)
        except Exception as e:
            raise ModelLoadError(f"cannot dequantize {t.name} ({t.tensor_type.name}): {e}") from e
        tensor = torch.from_numpy(np.array(array, copy=True).reshape(shape))
        if permute and name.endswith("q_proj.weight"):
            tensor = _unpermute(tensor, arch.num_heads)
        elif permute and name.endswith("k_proj.weight"):
            tensor = _unpermute(tensor, arch.num_kv_heads)
        return name, tensor


def _name(gguf_name: str, family: Family) -> str | None:
    """pdserve's name for a tensor of the file, or None for one it does not know."""
    if gguf_name in GGUF_GLOBAL_NAMES:
        return GGUF_GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".", 2)
    name = family.gguf_layer_name(parts[2]) if len(parts) == 3 and parts[0] == "blk" else None
    return None if name is None else f"model.layers.{parts[1]}.{name}"


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

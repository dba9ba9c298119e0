"""Compiling the fused CPU kernel libraries: which source and flags serve a dtype at a CPU
level (`BUILDS`), why none may run here (`unavailable_reason`), and the build itself, once
per source, flags and CPU into pdserve's cache (`library_path`). `cpu_kernels.load` loads
what this builds."""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from pdserve import envs
from pdserve.model import cpu_isa
from pdserve.model.cpu_isa import CpuIsa

CSRC = Path(__file__).parent / "csrc"


@dataclass(frozen=True)
class Build:
    """One kernel library: the source, the compiler flags, the dtype it computes in and
    the lowest CPU level that runs it."""

    name: str
    source: Path
    flags: tuple[str, ...]
    dtype: torch.dtype
    isa: CpuIsa


BUILDS = (
    Build("bf16", CSRC / "cpu_kernels.cpp", ("-march=native",), torch.bfloat16,
          CpuIsa.AVX512_BF16),
    Build("fp32-avx512", CSRC / "cpu_kernels_fp32.cpp",
          ("-march=x86-64-v4", "-mtune=native", "-DPD_VEC_AVX512"), torch.float32, CpuIsa.AVX512),
    Build("fp32-avx2", CSRC / "cpu_kernels_fp32.cpp", ("-march=x86-64-v3", "-mtune=native"),
          torch.float32, CpuIsa.AVX2),
)  # fmt: skip
"""Best first: `build_for` takes the first one a dtype and a level allow."""


def build_for(dtype: torch.dtype, isa: CpuIsa) -> Build | None:
    """The library for `dtype` at CPU level `isa`, or None (PyTorch ops)."""
    return next((b for b in BUILDS if b.dtype == dtype and isa >= b.isa), None)


def unavailable_reason(dtype: torch.dtype, isa: CpuIsa | None = None) -> str | None:
    """Why no kernels run for `dtype` at `isa` (default: this machine's level), or None."""
    isa = cpu_isa.effective() if isa is None else isa
    if platform.system() != "Linux" or platform.machine() != "x86_64":
        return f"not Linux/x86-64 ({platform.system()}/{platform.machine()})"
    if build_for(dtype, isa) is None:
        needs = {torch.bfloat16: "avx512_bf16", torch.float32: "avx2"}.get(dtype)
        if needs is None:
            return f"no CPU kernels compute in {dtype}"
        return f"{dtype} kernels need the {needs} level; this CPU runs at {isa.label}"
    if shutil.which(os.environ.get("CXX", "g++")) is None:
        return "no C++ compiler (g++, or $CXX) on PATH"
    return None


def compile_command(build: Build, output: str) -> list[str]:
    flags = ["-O3", *build.flags, "-fopenmp", "-shared", "-fPIC", "-fno-semantic-interposition"]
    return [os.environ.get("CXX", "g++"), *flags, "-std=c++17", "-o", output, str(build.source)]


def build_library(build: Build, target: Path) -> None:
    """Compile to a temporary file, then rename: concurrent processes never see a torn .so."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    cmd = compile_command(build, tmp)
    try:
        subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=300)
        os.replace(tmp, target)
    except subprocess.CalledProcessError as e:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{e.stderr[-2000:]}") from e
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def library_path(build: Build) -> Path:
    """Where `build` is cached: keyed by every source and header, its flags, the CPU."""
    key = hashlib.sha256()
    for source in sorted(CSRC.iterdir()):  # the source and the headers it includes
        key.update(source.name.encode() + source.read_bytes())
    key.update(" ".join(compile_command(build, "")).encode())
    key.update(" ".join(sorted(cpu_isa.cpu_flags())).encode())
    return envs.cache_dir() / "kernels" / f"cpu_kernels-{build.name}-{key.hexdigest()[:16]}.so"

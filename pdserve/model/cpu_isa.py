"""What the CPU can compute natively, read once: the fused-kernel path and the default dtype.

CPU classes form a ladder; each level includes the ones below it:

    none < avx2 < avx512 < avx512_bf16 < amx

- `avx2`: x86-64 with AVX2 and FMA (AMD Zen 1-3, Intel since Haswell, most cloud VMs):
  float32 kernels on 8 lanes (csrc/cpu_kernels_fp32.cpp).
- `avx512`: AVX-512 F/BW/DQ/VL: the same float32 kernels on 16 lanes.
- `avx512_bf16`: also AVX512-BF16 (AMD Zen 4+, Intel Cooper Lake+): bf16 is native, so it is
  the default dtype, with the bf16 kernels (csrc/cpu_kernels.cpp).
- `amx`: also AMX-BF16 tiles (Intel Sapphire Rapids+): the bf16 kernels' AMX linear and
  prefill attention.
- `none`: anything else (Arm included: no fused kernels yet, plain PyTorch).

`PDSERVE_CPU_ISA` caps the level (`avx2` on an AMX machine runs, and so tests and
benchmarks, the AVX2 path and its float32 default); asking for a level the CPU lacks is a
`ConfigError` at start-up, never a silent downgrade.
"""

from __future__ import annotations

import enum
import functools
import platform
from pathlib import Path

from pdserve import envs
from pdserve.errors import ConfigError


class CpuIsa(enum.IntEnum):
    NONE = 0
    AVX2 = 1
    AVX512 = 2
    AVX512_BF16 = 3
    AMX = 4

    @property
    def label(self) -> str:
        return self.name.lower()

    @property
    def native_bf16(self) -> bool:
        """True where bf16 arithmetic is native rather than emulated in float32."""
        return self >= CpuIsa.AVX512_BF16


_REQUIRED_FLAGS: dict[CpuIsa, tuple[str, ...]] = {
    CpuIsa.AVX2: ("avx2", "fma"),
    CpuIsa.AVX512: ("avx512f", "avx512bw", "avx512dq", "avx512vl"),
    CpuIsa.AVX512_BF16: ("avx512_bf16",),
    CpuIsa.AMX: ("amx_tile", "amx_bf16"),
}


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo (`flags` on x86, `Features` on Arm)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def detect(flags: frozenset[str] | None = None) -> CpuIsa:
    """The highest level whose flags (and every lower level's) the CPU has."""
    flags = cpu_flags() if flags is None else flags
    if platform.machine() not in ("x86_64", "AMD64"):
        return CpuIsa.NONE
    level = CpuIsa.NONE
    for isa, required in _REQUIRED_FLAGS.items():
        if not all(f in flags for f in required):
            break
        level = isa
    return level


def parse(name: str) -> CpuIsa | None:
    """`auto` -> None; a level's label -> that level; anything else -> ConfigError."""
    if name == "auto":
        return None
    try:
        return CpuIsa[name.upper()]
    except KeyError:
        labels = ", ".join(["auto", *(isa.label for isa in CpuIsa)])
        raise ConfigError(f"PDSERVE_CPU_ISA must be one of {labels}, got {name!r}") from None


@functools.cache
def effective() -> CpuIsa:
    """The level pdserve runs at: what the CPU has, capped by PDSERVE_CPU_ISA."""
    detected, forced = detect(), parse(envs.cpu_isa())
    if forced is None:
        return detected
    if forced > detected:
        raise ConfigError(
            f"PDSERVE_CPU_ISA={forced.label}, but this CPU's level is {detected.label} "
            f"(missing {', '.join(missing_flags(forced))})"
        )
    return forced


def missing_flags(isa: CpuIsa) -> list[str]:
    """Flags `isa` needs (with the levels below it) that this CPU lacks."""
    flags = cpu_flags()
    return [f for level, req in _REQUIRED_FLAGS.items() if level <= isa for f in req
            if f not in flags]  # fmt: skip


def native_bf16() -> bool:
    """Whether bf16 is native here: the x86 level says so, or an Arm CPU has `bf16`."""
    if platform.machine() in ("aarch64", "arm64"):
        return "bf16" in cpu_flags()
    return effective().native_bf16


def describe() -> str:
    """The level in use and where it came from, for logs and benchmark reports."""
    detected, level = detect(), effective()
    if level == detected:
        return f"{level.label} (detected)"
    return f"{level.label} (PDSERVE_CPU_ISA; the CPU has {detected.label})"

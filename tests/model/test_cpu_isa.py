"""The CPU level ladder, PDSERVE_CPU_ISA, and the dtype `auto` picks from them."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

import pytest
import torch

from pdserve.errors import ConfigError
from pdserve.model import cpu_isa
from pdserve.model.cpu_isa import CpuIsa
from pdserve.model.loader import resolve_dtype

AVX2 = {"avx", "avx2", "fma", "f16c"}
AVX512 = AVX2 | {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512cd"}
AVX512_BF16 = AVX512 | {"avx512_bf16", "avx512_vnni"}
AMX = AVX512_BF16 | {"amx_tile", "amx_bf16", "amx_int8"}
CPU = torch.device("cpu")
FakeCpu = Callable[..., None]


@pytest.fixture
def fake_cpu(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeCpu]:
    """Pretend to be an x86-64 CPU with the flags given to the returned setter."""

    def use(flags: set[str], forced: str | None = None, machine: str = "x86_64") -> None:
        monkeypatch.setattr(cpu_isa, "cpu_flags", lambda: frozenset(flags))
        monkeypatch.setattr(cpu_isa.platform, "machine", lambda: machine)
        if forced is None:
            monkeypatch.delenv("PDSERVE_CPU_ISA", raising=False)
        else:
            monkeypatch.setenv("PDSERVE_CPU_ISA", forced)
        cpu_isa.effective.cache_clear()

    yield use
    cpu_isa.effective.cache_clear()


@pytest.mark.parametrize(
    ("flags", "level"),
    [
        (set(), CpuIsa.NONE),
        ({"avx", "avx2"}, CpuIsa.NONE),  # AVX2 without FMA: no float32 kernels
        (AVX2, CpuIsa.AVX2),
        (AVX512, CpuIsa.AVX512),
        (AVX512_BF16, CpuIsa.AVX512_BF16),
        (AMX, CpuIsa.AMX),
        (AVX2 | {"avx512_bf16", "amx_bf16", "amx_tile"}, CpuIsa.AVX2),  # a ladder, no gaps
    ],
)
def test_detect_climbs_the_ladder_while_every_flag_is_there(
    fake_cpu: FakeCpu, flags: set[str], level: CpuIsa
) -> None:
    fake_cpu(flags)
    assert cpu_isa.detect() == level
    assert cpu_isa.effective() == level


def test_arm_has_no_kernel_level_but_native_bf16_from_its_flag(fake_cpu: FakeCpu) -> None:
    fake_cpu({"fp", "asimd", "bf16"}, machine="aarch64")
    assert cpu_isa.detect() == CpuIsa.NONE
    assert cpu_isa.native_bf16()
    fake_cpu({"fp", "asimd"}, machine="aarch64")
    assert not cpu_isa.native_bf16()


def test_forced_level_caps_and_never_raises_it(fake_cpu: FakeCpu) -> None:
    fake_cpu(AMX, forced="avx2")
    assert cpu_isa.effective() == CpuIsa.AVX2
    assert "PDSERVE_CPU_ISA" in cpu_isa.describe() and "amx" in cpu_isa.describe()
    fake_cpu(AVX2, forced="amx")
    with pytest.raises(ConfigError, match=r"PDSERVE_CPU_ISA=amx.*avx512f.*amx_bf16"):
        cpu_isa.effective()
    fake_cpu(AVX2, forced="sse9")
    with pytest.raises(ConfigError, match="must be one of auto, none, avx2"):
        cpu_isa.effective()


@pytest.mark.parametrize(
    ("flags", "forced", "expected"),
    [
        (AVX2, None, torch.float32),
        (AVX512, None, torch.float32),
        (AVX512_BF16, None, torch.bfloat16),
        (AMX, None, torch.bfloat16),
        (AMX, "avx2", torch.float32),  # the forced AVX2 path is the AVX2 class, dtype included
        (AMX, "avx512_bf16", torch.bfloat16),
    ],
)
def test_auto_dtype_is_bf16_only_where_bf16_is_native(
    fake_cpu: FakeCpu, flags: set[str], forced: str | None, expected: torch.dtype
) -> None:
    fake_cpu(flags, forced)
    assert resolve_dtype("auto", CPU) == expected
    assert resolve_dtype("float32", CPU) == torch.float32


def test_explicit_bf16_without_native_bf16_works_with_a_warning(
    fake_cpu: FakeCpu, caplog: pytest.LogCaptureFixture
) -> None:
    fake_cpu(AVX2)
    with caplog.at_level(logging.WARNING, logger="pdserve.model.loader"):
        assert resolve_dtype("bfloat16", CPU) == torch.bfloat16
    assert "emulates bf16: slow and less accurate" in caplog.text
    caplog.clear()
    fake_cpu(AVX512_BF16)
    with caplog.at_level(logging.WARNING, logger="pdserve.model.loader"):
        resolve_dtype("bfloat16", CPU)
    assert caplog.text == ""

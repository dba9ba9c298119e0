"""CPU tensors on transparent huge pages (pdserve/model/huge_pages.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from pdserve.model import huge_pages

THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _thp_mode() -> str | None:
    """The bracketed transparent-huge-page mode ("always", "madvise", "never"), or None."""
    try:
        text = THP_MODE.read_text()
    except OSError:
        return None
    return text.split("[", 1)[1].split("]", 1)[0] if "[" in text else None


def _huge_kib(t: torch.Tensor) -> int:
    """AnonHugePages (KiB) of the mapping holding t's first byte, from /proc/self/smaps."""
    address, in_mapping, huge = t.data_ptr(), False, 0
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            start, end = (int(x, 16) for x in head.split("-"))
            in_mapping = start <= address < end
        elif in_mapping and head == "AnonHugePages:":
            huge = int(line.split()[1])
    return huge


def test_arena_hands_out_aligned_disjoint_tensors() -> None:
    arena = huge_pages.Arena(chunk_bytes=1 << 20)
    tensors = [arena.empty((n,), torch.bfloat16) for n in (3, 1000, 70_000, 1_200_000)]
    for i, t in enumerate(tensors):
        assert t.data_ptr() % huge_pages.ALIGN == 0
        t.fill_(i)
    for i, t in enumerate(tensors):
        assert torch.equal(t, torch.full_like(t, i)), "a later tensor overwrote an earlier one"
    # the last tensor (2.4 MB) does not fit the first chunk (1 MiB, rounded up to a huge
    # page): a new mapping, starting on a huge-page boundary
    assert tensors[-1].data_ptr() % huge_pages.HUGE_PAGE == 0


def test_zeros_is_zero_and_shaped() -> None:
    t = huge_pages.zeros((3, 5, 7), torch.float32)
    assert t.shape == (3, 5, 7) and t.dtype == torch.float32 and t.is_contiguous()
    assert not t.any()


@pytest.mark.skipif(_thp_mode() not in ("always", "madvise"), reason="THP is off here")
def test_zeros_are_backed_by_huge_pages() -> None:
    t = huge_pages.zeros((8 << 20,), torch.uint8)
    assert _huge_kib(t) >= 2048


@pytest.mark.skipif(_thp_mode() != "madvise", reason="needs THP mode madvise to tell apart")
def test_huge_pages_off_keeps_ordinary_pages(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSERVE_HUGE_PAGES", "0")
    t = huge_pages.zeros((8 << 20,), torch.uint8)
    assert _huge_kib(t) == 0


def test_move_parameters_keeps_values_and_ties() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(50, 16), nn.Linear(16, 50, bias=True))
    model[1].weight = model[0].weight  # tied, like an LM head
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    huge_pages.move_parameters(model)
    after = dict(model.named_parameters())
    assert after.keys() == before.keys()
    for name, value in before.items():
        assert torch.equal(after[name], value)
    assert model[1].weight is model[0].weight
    x = torch.tensor([1, 2, 3])
    assert model(x).shape == (3, 50)

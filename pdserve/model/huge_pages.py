"""CPU tensors on transparent huge pages (2 MiB) instead of 4 KiB pages.

A CPU decode step streams every weight byte and, with long contexts, gigabytes of KV
blocks scattered over the cache. With 4 KiB pages each block of a sequence sits on pages
of its own, and the TLB misses cost bandwidth: reading a mixed-benchmark step's KV blocks
in table order ran at 15.8 GB/s on 4 KiB pages and 21 GB/s on huge pages (the machine's
sequential read speed) on the 2-core dev machine; see docs/benchmarks.md.

Linux backs anonymous memory with huge pages where `madvise(MADV_HUGEPAGE)` asks (the
transparent-huge-page mode `madvise`, a common default). An `Arena` maps memory itself,
advises it, and hands out tensors carved from it. Where the advice is refused (THP off,
another OS) or PDSERVE_HUGE_PAGES=0 turns it off, the memory is ordinary pages: a
slower, never a failing, path.
"""

from __future__ import annotations

import logging
import math
import mmap

import torch
from torch import nn

from pdserve import envs

logger = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
ALIGN = 64
"""Byte alignment of each tensor inside a chunk (a cache line; what the kernels load)."""


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def _advise(chunk: mmap.mmap) -> bool:
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is None or not envs.huge_pages():
        return False
    try:
        chunk.madvise(advice)
    except OSError:
        return False
    return True


class Arena:
    """A bump allocator over huge-page-advised anonymous mappings.

    Tensors are views of a chunk (`torch.frombuffer`, which keeps the mapping alive as long
    as any of them lives), so nothing is ever freed piecemeal: an arena suits memory that
    lives as long as the model, its weights and its KV cache.
    """

    def __init__(self, chunk_bytes: int = 64 << 20) -> None:
        self.chunk_bytes = chunk_bytes
        self._chunk: torch.Tensor | None = None
        self._used = 0
        self.advised = True

    def empty(self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
        nbytes = math.prod(shape) * dtype.itemsize
        if self._chunk is None or self._used + nbytes > self._chunk.numel():
            self._chunk, self._used = self._map(max(nbytes, self.chunk_bytes)), 0
        start = self._used
        self._used = _round_up(start + nbytes, ALIGN)
        return self._chunk[start : start + nbytes].view(dtype).view(shape)

    def copy_of(self, t: torch.Tensor) -> torch.Tensor:
        out = self.empty(t.shape, t.dtype)
        out.copy_(t)
        return out

    def _map(self, nbytes: int) -> torch.Tensor:
        """A fresh mapping of at least nbytes starting on a huge-page boundary (a huge
        page backs only an aligned 2 MiB range, so the mapping is over-sized by one)."""
        size = _round_up(nbytes, HUGE_PAGE) + HUGE_PAGE
        chunk = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if not _advise(chunk) and self.advised:
            self.advised = False
            logger.info("CPU tensors on ordinary pages (huge pages off or unavailable)")
        raw = torch.frombuffer(chunk, dtype=torch.uint8)
        offset = (-raw.data_ptr()) % HUGE_PAGE
        return raw[offset : offset + size - HUGE_PAGE]


def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed tensor in a mapping of its own. The zeros are written (not left to the
    kernel's lazy zero pages) so the memory is committed now, like torch.zeros, and no
    decode step later pays for its page faults."""
    t = Arena(chunk_bytes=0).empty(shape, dtype)
    t.zero_()
    return t


def move_parameters(module: nn.Module) -> None:
    """Copy every CPU parameter and buffer of `module` (quantized weights are buffers) into
    one huge-page arena, in place (tied ones stay tied: each tensor object moves once)."""
    params = [p for p in (*module.parameters(), *module.buffers()) if p.device.type == "cpu"]
    if not params:
        return
    arena = Arena(chunk_bytes=sum(_round_up(p.nbytes, ALIGN) for p in params))
    with torch.no_grad():
        for p in params:
            p.data = arena.copy_of(p.data)

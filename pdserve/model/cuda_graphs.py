"""Decode steps replayed from CUDA graphs (opt-in; not wired into the engine yet).

A decode step of a small model is hundreds of kernel launches whose Python and launch
overhead dwarfs the GPU work (Qwen2.5-0.5B: 24 layers x ~15 ops). `DecodeGraphRunner`
captures the model's whole decode-only forward once per padded batch size and replays it:

- every input lives in a static device buffer, filled each step by ONE host-to-device
  copy from a pinned staging buffer (token ids, positions, KV slots, sequence lengths,
  block tables packed in one int64 array), unpacked inside the graph;
- a batch of n runs in the smallest captured size >= n; padded rows attend nothing
  (sequence length 0) and write their K/V to `pad_block`, a block the caller reserves;
- block tables are `max_blocks_per_seq` wide for every size, so nothing about a step's
  shapes depends on its sequences' lengths;
- the step issues no host sync: the caller reads the logits (sampling is the one sync).

With a paged-decode backend (`TritonOps`) the kernel reads only each row's own keys. With
the PyTorch backend the graph builds one decode group over the full table width with its
mask computed on the device; it works, but every row gathers `max_blocks_per_seq` blocks.

On a CPU (or `use_graphs=False`) the same static-buffer function runs eagerly, so the
padding, packing and metadata are testable without a GPU.

What the engine needs to use it: a reserved pad block in the KV pool, decode-only steps
routed here (mixed steps keep the eager path), and `ModelRunner` owning one instance
sized by `max_num_seqs` and `max_model_len`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from pdserve.model.attention import AttentionMetadata, DecodeGroup
from pdserve.model.decoder import DecoderModel
from pdserve.model.ops import TorchOps

_COLUMNS = 5  # token id, position, slot block, slot offset, sequence length; then the table


def default_batch_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then multiples of 16 up to max_batch (vLLM's spacing, coarser)."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_batch]
    sizes += list(range(16, max_batch, 16))
    return [*sizes, max_batch]


class DecodeGraphRunner:
    def __init__(
        self,
        model: DecoderModel,
        kv_cache: torch.Tensor,
        ops: TorchOps,
        block_size: int,
        max_batch: int,
        max_blocks_per_seq: int,
        pad_block: int,
        batch_sizes: Sequence[int] | None = None,
        use_graphs: bool | None = None,
    ) -> None:
        self.model, self.kv_cache, self.ops = model, kv_cache, ops
        self.block_size = block_size
        self.max_blocks = max_blocks_per_seq
        self.pad_block = pad_block
        self.device = kv_cache.device
        self.use_graphs = self.device.type == "cuda" if use_graphs is None else use_graphs
        self.batch_sizes = sorted(set(batch_sizes or default_batch_sizes(max_batch)))
        self.max_batch = self.batch_sizes[-1]
        width = _COLUMNS + max_blocks_per_seq
        pin = self.device.type == "cuda"
        self.host = torch.zeros((self.max_batch, width), dtype=torch.int64, pin_memory=pin)
        self.staged = torch.zeros((self.max_batch, width), dtype=torch.int64, device=self.device)
        self._host_np = self.host.numpy()
        self._copied: torch.cuda.Event | None = None
        self.kv_scratch: torch.Tensor | None = None
        if not ops.paged_decode:  # the gathered SDPA path needs its K/V scratch to be static
            self.kv_scratch = torch.empty(
                (2, self.max_batch * max_blocks_per_seq, *kv_cache.shape[3:]),
                dtype=kv_cache.dtype,
                device=self.device,
            )
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    # -- the captured function -------------------------------------------------------

    def _step(self, batch: int) -> torch.Tensor:
        """One decode step over the first `batch` staged rows; logits [batch, V] (model dtype)."""
        staged = self.staged[:batch]
        input_ids = staged[:, 0].contiguous()
        positions = staged[:, 1].contiguous()
        seq_lens = staged[:, 4].contiguous()
        tables = staged[:, _COLUMNS:].contiguous()
        groups: tuple[DecodeGroup, ...] = ()
        if not self.ops.paged_decode:
            keys = torch.arange(self.max_blocks * self.block_size, device=self.device)
            # Padded rows (length 0) attend key 0 of the pad block instead of nothing: an
            # all -inf row would be NaN, harmless but noisy.
            visible = keys[None, :] < seq_lens.clamp(min=1)[:, None]
            zero = torch.zeros((), dtype=self.kv_cache.dtype, device=self.device)
            mask = torch.where(visible, zero, float("-inf"))[:, None, None, :]
            groups = (DecodeGroup(None, block_tables=tables, mask=mask, seq_lens=seq_lens),)
        meta = AttentionMetadata(
            num_decode_tokens=batch,
            slot_block_ids=staged[:, 2].contiguous(),
            slot_offsets=staged[:, 3].contiguous(),
            decode_groups=groups,
            decode_block_tables=tables if self.ops.paged_decode else None,
            decode_seq_lens=seq_lens if self.ops.paged_decode else None,
            decode_kv_buffer=self.kv_scratch,
            prefills=(),
        )
        logits_indices = torch.arange(batch, device=self.device)
        return self.model(input_ids, positions, self.kv_cache, meta, logits_indices, self.ops)

    # -- capture and replay ------------------------------------------------------------

    def capture(self) -> None:
        """Capture one graph per batch size, largest first, all in one memory pool.
        Padded rows are staged first, so warm-up and capture see valid inputs."""
        self._stage([], [], [])
        self._upload(self.max_batch)
        if not self.use_graphs:
            return
        torch.cuda.synchronize(self.device)
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        for batch in reversed(self.batch_sizes):
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                for _ in range(2):  # compiles Triton kernels, settles cuBLAS workspaces
                    self._step(batch)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[batch] = self._step(batch)
            self.graphs[batch] = graph
        torch.cuda.synchronize(self.device)

    def run(
        self,
        token_ids: Sequence[int],
        positions: Sequence[int],
        block_tables: Sequence[Sequence[int]],
    ) -> torch.Tensor:
        """Decode one token per sequence: `positions[i]` is the new token's position (its
        context length), `block_tables[i]` covers position + 1 tokens. Returns the
        logits [n, V] (model dtype), a view of a static buffer valid until the next `run`."""
        n = len(token_ids)
        batch = self.padded_size(n)
        self._stage(token_ids, positions, block_tables)
        self._upload(batch)
        if self.use_graphs:
            if batch not in self.graphs:
                raise RuntimeError("capture() before run()")
            self.graphs[batch].replay()
            return self.outputs[batch][:n]
        return self._step(batch)[:n]

    def padded_size(self, n: int) -> int:
        for size in self.batch_sizes:
            if size >= n:
                return size
        raise ValueError(f"batch of {n} exceeds the largest captured size {self.max_batch}")

    def _stage(
        self,
        token_ids: Sequence[int],
        positions: Sequence[int],
        block_tables: Sequence[Sequence[int]],
    ) -> None:
        n = len(token_ids)
        if len(positions) != n or len(block_tables) != n:
            raise ValueError("token_ids, positions and block_tables differ in length")
        if self._copied is not None:
            self._copied.synchronize()  # the last upload has left the pinned buffer
        host = self._host_np
        bs = self.block_size
        pos = np.asarray(positions, dtype=np.int64)
        host[:n, 0] = np.asarray(token_ids, dtype=np.int64)
        host[:n, 1] = pos
        host[:n, 3] = pos % bs
        host[:n, 4] = pos + 1
        host[:n, _COLUMNS:] = self.pad_block
        for row, table in enumerate(block_tables):
            if len(table) * bs <= pos[row] or len(table) > self.max_blocks:
                raise ValueError(f"row {row}: block table of {len(table)} blocks for {pos[row]}")
            host[row, _COLUMNS : _COLUMNS + len(table)] = table
            host[row, 2] = table[pos[row] // bs]
        host[n:, :2] = 0
        host[n:, 2] = self.pad_block
        host[n:, 3:5] = 0
        host[n:, _COLUMNS:] = self.pad_block

    def _upload(self, batch: int) -> None:
        self.staged[:batch].copy_(self.host[:batch], non_blocking=True)
        if self.device.type == "cuda":
            self._copied = torch.cuda.Event()
            self._copied.record()

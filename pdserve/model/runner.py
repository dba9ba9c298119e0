"""Owns the model and the KV cache tensor; turns a `SchedulerOutput` into sampled tokens.

Per step: build flat input tensors (token ids, positions, slots) and attention metadata
from the scheduled requests, run the model on every token at once, compute logits only
for the requests that sample this step, and sample.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from pdserve.batch import ScheduledRequest, SchedulerOutput
from pdserve.errors import ConfigError
from pdserve.model import cpu_isa, huge_pages, kv_format
from pdserve.model.attention import (
    AttentionMetadata,
    DecodeGroup,
    PrefillChunk,
)
from pdserve.model.backends import select_ops
from pdserve.model.loader import LoadedModel
from pdserve.model.sampler import grammar_masks, prompt_logprobs, sample
from pdserve.outputs import ComputeInfo, TokenLogprob

logger = logging.getLogger(__name__)

MAX_DECODE_GROUPS = 4


@dataclass(frozen=True)
class ModelOutput:
    sampled: list[int | None]
    """Per scheduled entry: the new token, or None for a prefill chunk that does not sample."""
    logprobs: list[TokenLogprob | None]
    prompt_logprobs: list[list[TokenLogprob] | None] | None = None
    """Per scheduled entry of a request with `prompt_logprobs`: the entries of the prompt
    tokens this step's chunk predicts (positions `num_context_tokens + 1` on); else None."""


def keep_freed_memory_mapped() -> None:
    """Stop glibc from returning large freed blocks to the OS after every use.

    Each decode step allocates and frees tens of MB of temporaries per layer; by default
    glibc serves those with fresh mmap()s whose pages fault in on first touch, which on
    CPU costs more than the arithmetic. Raising the mmap and trim thresholds keeps freed
    memory in the heap for reuse. No effect (and no error) where mallopt is unavailable.
    """
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        m_trim_threshold, m_mmap_threshold = -1, -3
        libc.mallopt(m_mmap_threshold, 1 << 30)
        libc.mallopt(m_trim_threshold, 1 << 31)
    except (OSError, AttributeError):
        logger.debug("mallopt unavailable; keeping the default allocator settings")


def kv_cache_bytes_per_block(loaded: LoadedModel, block_size: int, cache_dtype: torch.dtype) -> int:
    a = loaded.arch
    row = kv_format.head_width(cache_dtype, a.head_dim) * cache_dtype.itemsize
    return a.num_layers * 2 * block_size * a.num_kv_heads * row


class ModelRunner:
    def __init__(
        self,
        loaded: LoadedModel,
        num_blocks: int,
        block_size: int,
        seed: int = 0,
        kernels: str = "auto",
        cache_dtype: torch.dtype | None = None,
        batch_invariant: bool = False,
    ) -> None:
        """`cache_dtype`: the KV cache's (kv_format.resolve); default the model's dtype.
        `batch_invariant`: ModelConfig.batch_invariant."""
        self.model = loaded.model
        self.dtype = loaded.dtype
        self.vocab_size = loaded.arch.vocab_size
        cache_dtype = cache_dtype or loaded.dtype
        self.ops = select_ops(kernels, loaded.device, loaded.dtype, loaded.arch, batch_invariant)
        self.batch_invariant = batch_invariant
        if kv_format.is_quantized(cache_dtype) and self.ops.name == "triton":
            raise ConfigError("the 8-bit KV cache has no Triton kernel; use kernels='auto'")
        logger.info("model ops: %s; KV cache %s", self.ops.label, kv_format.name(cache_dtype))
        self.compute = ComputeInfo(
            dtype=str(loaded.dtype).removeprefix("torch."),
            dtype_reason=loaded.dtype_reason,
            device=str(loaded.device),
            ops=self.ops.label,
            cpu_level=cpu_isa.describe() if loaded.device.type == "cpu" else None,
            quantization=loaded.quantization,
            kv_cache_dtype=kv_format.name(cache_dtype),
        )
        self.device = loaded.device
        self.block_size = block_size
        a = loaded.arch
        row = kv_format.head_width(cache_dtype, a.head_dim)
        shape = (num_blocks, a.num_layers, 2, block_size, a.num_kv_heads, row)
        if self.device.type == "cpu":
            self.kv_cache = huge_pages.zeros(shape, cache_dtype)
        else:
            self.kv_cache = torch.zeros(shape, dtype=cache_dtype, device=self.device)
        self.generator = torch.Generator().manual_seed(seed)
        self._kv_scratch = torch.empty((2, 0, *self.kv_cache.shape[3:]), dtype=cache_dtype)
        if self.device.type == "cpu":
            keep_freed_memory_mapped()

    def _scratch(self, num_blocks: int) -> torch.Tensor:
        """A [2, num_blocks, block_size, Hkv, D] view of a grow-only scratch buffer."""
        if self._kv_scratch.shape[1] < num_blocks:
            shape = (2, max(num_blocks, 2 * self._kv_scratch.shape[1]), *self.kv_cache.shape[3:])
            self._kv_scratch = torch.empty(shape, dtype=self.kv_cache.dtype, device=self.device)
        return self._kv_scratch[:, :num_blocks]

    def execute(self, output: SchedulerOutput) -> ModelOutput:
        samplers = [s.request for s in output.scheduled if s.samples]
        masks = grammar_masks(samplers, self.vocab_size)
        scored = _prompt_rows(output)
        logits = self.forward(output, scored_rows=[row for *_, rows in scored for row in rows])
        tokens, entries = sample(logits[: len(samplers)], samplers, self.generator, masks)
        sampled: list[int | None] = []
        logprobs: list[TokenLogprob | None] = []
        it = iter(zip(tokens, entries, strict=True))
        for s in output.scheduled:
            token, entry = next(it) if s.samples else (None, None)
            sampled.append(token)
            logprobs.append(entry)
        return ModelOutput(sampled, logprobs, self._prompt_logprobs(output, scored, logits))

    def forward(
        self, output: SchedulerOutput, every_token: bool = False, scored_rows: Sequence[int] = ()
    ) -> torch.Tensor:
        """Run the model over the step; logits (model dtype) of the entries that sample,
        then of `scored_rows` (flat token indices of the step: prompt logprobs), or of
        every new token of the step with `every_token` (scoring a text through the paged
        cache: `pdserve bench accuracy`)."""
        input_ids, positions, meta, logits_indices = self._prepare(output)
        if every_token:
            logits_indices = torch.arange(input_ids.numel(), device=self.device)
        elif scored_rows:
            extra = torch.tensor(scored_rows, dtype=torch.long, device=self.device)
            logits_indices = torch.cat([logits_indices, extra])
        return self.model(input_ids, positions, self.kv_cache, meta, logits_indices, self.ops)

    @staticmethod
    def _prompt_logprobs(
        output: SchedulerOutput, scored: list[tuple[int, list[int], range]], logits: torch.Tensor
    ) -> list[list[TokenLogprob] | None] | None:
        """The prompt logprob entries of the scored rows, whose logits follow the samplers'."""
        if not scored:
            return None
        per_entry: list[list[TokenLogprob] | None] = [None] * len(output.scheduled)
        at = int(sum(s.samples for s in output.scheduled))
        for index, targets, rows in scored:
            n = output.scheduled[index].request.params.prompt_logprobs or 0
            per_entry[index] = prompt_logprobs(logits[at : at + len(rows)], targets, n)
            at += len(rows)
        return per_entry

    def _prepare(
        self, output: SchedulerOutput
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        bs = self.block_size
        token_ids: list[int] = []
        positions: list[np.ndarray] = []
        block_tables: list[np.ndarray] = []
        logits_indices: list[int] = []
        for s in output.scheduled:
            start, n = s.num_context_tokens, s.num_new_tokens
            token_ids.extend(s.request.token_ids[start : start + n])
            positions.append(np.arange(start, start + n, dtype=np.int64))
            block_tables.append(np.asarray(s.block_ids, dtype=np.int64))
            if s.samples:
                logits_indices.append(len(token_ids) - 1)
        pos = np.concatenate(positions)
        slot_blocks = np.concatenate(
            [bt[p // bs] for bt, p in zip(block_tables, positions, strict=True)]
        )
        dev = self.device
        nd = output.num_decodes
        prefills = output.scheduled[nd:]
        tables: torch.Tensor | None
        seq_lens: torch.Tensor | None
        if self.batch_invariant:
            # Every row attends through the paged decode kernel, prompt rows too: a row's
            # sums then run over its keys in one order whether its prompt came in one
            # chunk or several, from the prefix cache or from another node. (The prefill
            # kernels block keys by where a chunk starts, and a prompt's last token
            # scheduled alone would take the decode kernel.)
            groups: tuple[DecodeGroup, ...] = ()
            tables, seq_lens = self._row_tables(output.scheduled, block_tables, positions)
            nd, prefills = len(token_ids), ()
        elif self.ops.paged_decode:
            groups = ()
            tables, seq_lens = self._decode_tables(output.scheduled[:nd], block_tables[:nd])
        else:
            groups = self._decode_groups(output.scheduled[:nd], block_tables[:nd])
            tables = seq_lens = None
        num_gathered = max((g.block_tables.numel() for g in groups), default=0)
        meta = AttentionMetadata(
            num_decode_tokens=nd,
            slot_block_ids=torch.from_numpy(slot_blocks).to(dev),
            slot_offsets=torch.from_numpy(pos % bs).to(dev),
            decode_groups=groups,
            decode_block_tables=tables,
            decode_seq_lens=seq_lens,
            decode_kv_buffer=self._scratch(num_gathered) if num_gathered else None,
            prefills=self._prefill_chunks(prefills, block_tables[nd:], nd),
        )
        return (
            torch.tensor(token_ids, dtype=torch.long, device=dev),
            torch.from_numpy(pos).to(dev),
            meta,
            torch.tensor(logits_indices, dtype=torch.long, device=dev),
        )

    def _decode_tables(
        self, entries: tuple[ScheduledRequest, ...], tables: list[np.ndarray]
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Padded block tables and sequence lengths for decode attention read in place."""
        if not entries:
            return None, None
        padded, seq_lens = _padded_tables(entries, tables, range(len(entries)))
        return torch.from_numpy(padded).to(self.device), torch.from_numpy(seq_lens).to(self.device)

    def _row_tables(
        self,
        entries: tuple[ScheduledRequest, ...],
        tables: list[np.ndarray],
        positions: list[np.ndarray],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every row of the step as a decode: its entry's block table (padded) and the
        tokens it attends to (its position + 1)."""
        padded = np.zeros((sum(len(p) for p in positions), max(map(len, tables))), np.int64)
        row = 0
        for s, table in zip(entries, tables, strict=True):
            padded[row : row + s.num_new_tokens, : len(table)] = table
            row += s.num_new_tokens
        seq_lens = np.concatenate(positions) + 1
        return torch.from_numpy(padded).to(self.device), torch.from_numpy(seq_lens).to(self.device)

    def _decode_groups(
        self, entries: tuple[ScheduledRequest, ...], tables: list[np.ndarray]
    ) -> tuple[DecodeGroup, ...]:
        """Split decodes into groups whose block counts are within 2x of the group's longest
        (at most MAX_DECODE_GROUPS), so padding never more than doubles the attended keys."""
        if not entries:
            return ()
        num_blocks = [len(t) for t in tables]
        order = sorted(range(len(entries)), key=lambda i: -num_blocks[i])
        groups: list[list[int]] = [[order[0]]]
        for i in order[1:]:
            longest = num_blocks[groups[-1][0]]
            if 2 * num_blocks[i] <= longest and len(groups) < MAX_DECODE_GROUPS:
                groups.append([i])
            else:
                groups[-1].append(i)
        if len(groups) == 1:
            return (self._decode_group(None, entries, tables),)
        return tuple(self._decode_group(sorted(g), entries, tables) for g in groups)

    def _decode_group(
        self,
        members: list[int] | None,
        entries: tuple[ScheduledRequest, ...],
        tables: list[np.ndarray],
    ) -> DecodeGroup:
        rows = members if members is not None else range(len(entries))
        padded, seq_lens = _padded_tables(entries, tables, rows)
        keys = np.arange(padded.shape[1] * self.block_size, dtype=np.int64)
        mask = np.where(keys[None, :] < seq_lens[:, None], 0.0, -np.inf).astype(np.float32)
        dev = self.device
        return DecodeGroup(
            indices=None if members is None else torch.tensor(members, device=dev),
            block_tables=torch.from_numpy(padded).to(dev),
            mask=torch.from_numpy(mask).to(dev, self.dtype)[:, None, None, :],
            seq_lens=torch.from_numpy(seq_lens).to(dev),
        )

    def _prefill_chunks(
        self, entries: tuple[ScheduledRequest, ...], tables: list[np.ndarray], start: int
    ) -> tuple[PrefillChunk, ...]:
        chunks = []
        for s, table in zip(entries, tables, strict=True):
            n, ctx = s.num_new_tokens, s.num_context_tokens
            num_blocks = -(-(ctx + n) // self.block_size)
            chunks.append(
                PrefillChunk(
                    token_start=start,
                    num_tokens=n,
                    num_context_tokens=ctx,
                    block_table=torch.from_numpy(table[:num_blocks]).to(self.device),
                )
            )
            start += n
        return tuple(chunks)


def _prompt_rows(output: SchedulerOutput) -> list[tuple[int, list[int], range]]:
    """For each entry of a request with `prompt_logprobs` whose chunk predicts prompt
    tokens: (its index, the prompt tokens predicted, the step's flat rows predicting them).
    Row `p` predicts token `p + 1`; the prompt's last row samples instead."""
    scored, offset = [], 0
    for i, s in enumerate(output.scheduled):
        r, start = s.request, s.num_context_tokens
        end = min(start + s.num_new_tokens, r.num_prompt_tokens - 1)
        if r.params.prompt_logprobs is not None and end > start:
            targets = r.token_ids[start + 1 : end + 1]
            scored.append((i, targets, range(offset, offset + end - start)))
        offset += s.num_new_tokens
    return scored


def _padded_tables(
    entries: tuple[ScheduledRequest, ...], tables: list[np.ndarray], rows: Sequence[int]
) -> tuple[np.ndarray, np.ndarray]:
    """Block tables of the decode entries `rows`, padded with block 0 to the longest, and
    the number of tokens each attends to (its context plus the new token)."""
    padded = np.zeros((len(rows), max(len(tables[i]) for i in rows)), dtype=np.int64)
    for r, i in enumerate(rows):
        padded[r, : len(tables[i])] = tables[i]
    seq_lens = np.array([entries[i].num_context_tokens + 1 for i in rows], dtype=np.int64)
    return padded, seq_lens

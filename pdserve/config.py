"""Engine configuration: frozen dataclasses with a documented default per field.

Built once (from CLI flags, an optional config file, or `pdserve.LLM(...)` keyword
arguments) and validated at construction: a bad value raises `ConfigError` at start-up,
never later. Environment variables are read in one place, `pdserve.envs`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.errors import ConfigError

DTYPES = ("auto", "float32", "bfloat16", "float16")
ROLES = ("both", "prefill", "decode")
KV_LOAD_FAILURE_POLICIES = ("recompute", "fail")
KV_TRANSPORTS = ("nixl", "inprocess")
LOAD_FORMATS = ("auto", "gguf", "safetensors", "dummy")
KERNEL_CHOICES = ("auto", "torch", "triton")
QUANTIZATIONS = ("auto", "none", "q8_0", "q4_0", "q4_1")


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


@dataclass(frozen=True)
class ModelConfig:
    model: str = "default"
    """A Hugging Face directory, a .gguf file, or `default` (SmolLM2-135M-Instruct)."""
    load_format: str = "auto"
    """`auto` (by file type), `gguf`, `safetensors`, or `dummy` (random weights)."""
    dtype: str = "auto"
    """`auto` = bfloat16 (float32 on a CPU without bf16 support), or float32/bfloat16/float16."""
    device: str = "auto"
    """`auto` = cuda when available, else cpu."""
    max_model_len: int | None = None
    """Longest prompt + output in tokens; default: the model's context length."""
    seed: int = 0
    """Seed for dummy weights and for the sampler of unseeded requests."""
    kernels: str = "auto"
    """`auto`: the fused CPU kernels where the CPU has them for the dtype (bf16 on
    AVX512-BF16, float32 on AVX2 and up; built on first use with g++), else PyTorch;
    `torch`: always plain PyTorch ops; `triton`: decode attention through the Triton
    paged kernel (CUDA; opt-in until measured on a GPU)."""
    quantization: str = "auto"
    """How the weights are kept in memory. `auto`: in float32 on the CPU kernels, a GGUF
    file's Q8_0/Q4_0/Q4_1 tensors stay in their blocks (the kernels compute from them:
    the same products as the dequantized weights', 2.5-3.5x faster at batch 1); anything
    else, and every weight in bf16, is dequantized to `dtype` at load; `none`: dequantize
    everything; `q8_0`/`q4_0`/`q4_1`: every linear in that format (quantized at load where
    the checkpoint has another) and the embedding table (the LM head when tied) in Q8_0,
    as llama.cpp keeps it; needs the CPU kernels."""

    def __post_init__(self) -> None:
        _require(self.dtype in DTYPES, f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        _require(
            self.load_format in LOAD_FORMATS,
            f"load_format must be one of {LOAD_FORMATS}, got {self.load_format!r}",
        )
        _require(
            self.kernels in KERNEL_CHOICES,
            f"kernels must be one of {KERNEL_CHOICES}, got {self.kernels!r}",
        )
        _require(
            self.quantization in QUANTIZATIONS,
            f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}",
        )
        _require(
            self.max_model_len is None or self.max_model_len >= 2,
            f"max_model_len must be >= 2, got {self.max_model_len}",
        )


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 64
    """Tokens per KV block. 64 because decode attention streams each sequence's blocks,
    scattered over the pool, from memory: longer contiguous runs keep the hardware
    prefetchers going (the mixed benchmark 1.02-1.09x faster than with 16, outputs
    identical; docs/benchmarks.md). vLLM's CPU backend defaults to 128 for the same
    reason. Smaller blocks share shorter prompt prefixes; pass 16 where that matters more."""
    num_blocks: int | None = None
    """Blocks in the pool; default: derived from `kv_cache_memory_bytes`."""
    kv_cache_memory_bytes: int = 1 << 30
    """Memory budget for the KV pool when `num_blocks` is not given (1 GiB)."""
    enable_prefix_caching: bool = True
    """Reuse blocks of a repeated prompt prefix."""

    def __post_init__(self) -> None:
        _require(
            self.block_size in (1, 2, 4, 8, 16, 32, 64, 128),
            f"block_size must be a power of two <= 128, got {self.block_size}",
        )
        _require(
            self.num_blocks is None or self.num_blocks >= 1,
            f"num_blocks must be >= 1, got {self.num_blocks}",
        )
        _require(self.kv_cache_memory_bytes > 0, "kv_cache_memory_bytes must be > 0")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    """Most requests in one step's batch."""
    max_num_batched_tokens: int = 2048
    """Token budget per step (prefill chunks + one token per decoding request)."""
    enable_chunked_prefill: bool = True
    """Split prompts longer than the remaining budget across steps."""

    def __post_init__(self) -> None:
        _require(self.max_num_seqs >= 1, f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        _require(
            self.max_num_batched_tokens >= 1,
            f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}",
        )


@dataclass(frozen=True)
class KVTransferConfig:
    """Prefill/decode disaggregation (DESIGN §2). Unused on a `both` node."""

    role: str = "both"
    """`both` (one node serves everything), `prefill` (holds prompts' KV for remote decode
    nodes) or `decode` (pulls prompts' KV from prefill nodes)."""
    lease_s: float = 5.0
    """Prefill node: a held handoff not renewed for this long is released (crashed decode)."""
    claim_timeout_s: float = 10.0
    """Prefill node: a claimed handoff whose read has not ended by then is released; the
    decode node stops trusting its read a margin before that."""
    kv_load_failure: str = "recompute"
    """Decode node, when a claim is refused or a read fails: `recompute` the prompt locally
    (same output) or `fail` the request."""
    transport: str = "nixl"
    """`nixl` (NIXL over UCX, the real data plane) or `inprocess` (unit tests only)."""
    cluster_secret: str | None = None
    """Bearer credential for node-to-node control calls; default: the node's API key."""
    debug_read_delay_s: float = 0.0
    """Testing only: a decode node waits this long between a granted claim and its read,
    to open the "claimed, reading" window (S6, S10) wide enough to hit on purpose."""

    def __post_init__(self) -> None:
        _require(self.role in ROLES, f"role must be one of {ROLES}, got {self.role!r}")
        _require(self.lease_s > 0, f"lease_s must be > 0, got {self.lease_s}")
        _require(self.debug_read_delay_s >= 0, "debug_read_delay_s must be >= 0")
        _require(
            self.claim_timeout_s > 1,
            f"claim_timeout_s must be > 1 s (the decode node keeps a margin), "
            f"got {self.claim_timeout_s}",
        )
        _require(
            self.kv_load_failure in KV_LOAD_FAILURE_POLICIES,
            f"kv_load_failure must be one of {KV_LOAD_FAILURE_POLICIES}, "
            f"got {self.kv_load_failure!r}",
        )
        _require(
            self.transport in KV_TRANSPORTS,
            f"transport must be one of {KV_TRANSPORTS}, got {self.transport!r}",
        )


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    kv_transfer: KVTransferConfig = field(default_factory=KVTransferConfig)

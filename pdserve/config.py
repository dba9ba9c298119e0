"""Configuration: frozen dataclasses with a documented default per field, for the engine,
a node's HTTP server and the proxy (a node's P/D settings: `pdserve.disagg.config`).

Built once (from CLI flags, an optional config file, or `pdserve.LLM(...)` keyword
arguments) and validated at construction: a bad value raises `ConfigError` at start-up,
never later. The CLI's defaults are these fields' defaults. Environment variables are read
in one place, `pdserve.envs`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from pdserve.errors import ConfigError
from pdserve.tls import TLSConfig

DTYPES = ("auto", "float32", "bfloat16", "float16")
LOAD_FORMATS = ("auto", "gguf", "safetensors", "dummy")
KERNEL_CHOICES = ("auto", "torch", "triton")
QUANTIZATIONS = ("auto", "none", "q8_0", "q4_0", "q4_1")
KV_CACHE_DTYPES = ("auto", "bfloat16", "bf16", "float32", "fp32", "int8", "fp8_e4m3")
FP8_NOT_BUILT = (
    "kv_cache_dtype fp8_e4m3 is not implemented: x86 CPUs before AVX10.2 have no fp8 "
    "conversion, and int8 stores the same bytes per value; use int8"
)


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
    """How the weights are kept in memory. `auto`: on the CPU kernels (float32 or bf16), a
    GGUF file's Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K/Q6_K tensors stay in their blocks (the
    kernels compute from them: memory follows the file, 2.5x faster at batch 1 than dense
    bf16 on the default model); a fused q/k/v whose parts differ in format is kept in Q8_0;
    anything else is dequantized to `dtype` at load; `none`: dequantize everything;
    `q8_0`/`q4_0`/`q4_1`: every linear in that format (quantized at load where the
    checkpoint has another) and the embedding table (the LM head when tied) in Q8_0, as
    llama.cpp keeps it; needs the CPU kernels."""
    batch_invariant: bool = False
    """Compute every sequence's numbers the same way whatever else is in its step: each
    linear takes one kernel for every row count (AMX tiles where the CPU has them, else
    the weight-streaming loop; never oneDNN/MKL, which pick kernels by shape), so a
    request's tokens and logprobs do not depend on its batch, its prefill chunks or
    prefix-cache hits. Greedy output then equals the same request alone in bf16 too,
    which `pdserve bench chaos` relies on. Costs prefill speed at large batches
    (docs/benchmarks.md); needs the CPU kernels and dense weights."""

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
        _require(
            not self.batch_invariant or self.quantization in ("auto", "none"),
            f"batch_invariant computes on dense weights; quantization {self.quantization} "
            "keeps them in blocks, whose kernel changes with the row count",
        )
        _require(
            not self.batch_invariant or self.kernels == "auto",
            f"batch_invariant needs the CPU kernels (kernels auto); with kernels "
            f"{self.kernels} PyTorch picks each GEMM's kernel by its shape",
        )


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 64
    """Tokens per KV block. 64 because decode attention streams each sequence's blocks,
    scattered over the pool, from memory: longer contiguous runs keep the hardware
    prefetchers going (measured against 16 in docs/benchmarks.md, outputs identical).
    vLLM's CPU backend defaults to 128 for the same reason. Smaller blocks share shorter
    prompt prefixes; pass 16 where that matters more."""
    num_blocks: int | None = None
    """Blocks in the pool; default: derived from `kv_cache_memory_bytes`."""
    kv_cache_memory_bytes: int = 1 << 30
    """Memory budget for the KV pool when `num_blocks` is not given (1 GiB)."""
    enable_prefix_caching: bool = True
    """Reuse blocks of a repeated prompt prefix."""
    kv_cache_dtype: str = "auto"
    """`auto`: K and V in the model's dtype; `int8`: 8-bit values with a float32 scale per
    token and kv head, 53% of bf16's bytes (pdserve/model/kv_format.py). The P/D nodes of
    a pair must agree."""

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
        _require(
            self.kv_cache_dtype in KV_CACHE_DTYPES,
            f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}",
        )
        if self.kv_cache_dtype == "fp8_e4m3":
            raise ConfigError(FP8_NOT_BUILT)


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
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)


@dataclass(frozen=True)
class ServerConfig:
    """One node's HTTP server (`pdserve serve`)."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    """Bearer key clients must send; None: no authentication."""
    served_model_name: str | None = None
    """The model's id in the API; default: the model path given to the engine."""
    drain_timeout_s: float = 30.0
    """After SIGTERM, how long in-flight requests may take before they are aborted."""
    parent_pid: int | None = None
    """Drain and exit once this process is gone (launchers such as `pdserve up` set it)."""
    tls: TLSConfig = field(default_factory=TLSConfig)
    """Serve HTTPS (`pdserve/tls.py`); default: plain HTTP."""
    response_store: str | None = None
    """Stored `/v1/responses`: a SQLite file, a `postgresql://` URL, or None (the default
    file under the user's data directory, `agent_api/store.py`)."""

    def __post_init__(self) -> None:
        _require(0 <= self.port < 65536, f"port must be in [0, 65535], got {self.port}")
        _require(self.drain_timeout_s >= 0, "drain_timeout_s must be >= 0")


class RoutingPolicy(enum.Enum):
    """How the proxy picks a node for a leg (`proxy/routing.py`)."""

    LEAST_LOADED = "least-loaded"
    CACHE_AWARE = "cache-aware"
    ROUND_ROBIN = "round-robin"


@dataclass(frozen=True)
class ProxyConfig:
    """The P/D proxy (`pdserve proxy`, `pdserve up`)."""

    prefill_urls: tuple[str, ...]
    """The prefill nodes, `http://host:port` each."""
    decode_urls: tuple[str, ...]
    """The decode nodes."""
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    """Bearer key clients must send; None: no authentication."""
    node_api_key: str | None = None
    """Bearer key sent to the nodes; None: none."""
    prefill_timeout_s: float = 300.0
    """The whole prefill leg."""
    decode_timeout_s: float = 300.0
    """The longest silence of a decode leg: connecting, until its first token, and between
    two chunks of its stream (every leg streams). Never a bound on the answer's length."""
    health_interval_s: float = 1.0
    """Between two health checks of every node (and polls of their prefix summaries)."""
    parent_pid: int | None = None
    """Stop once this process is gone."""
    response_store: str | None = None
    """Stored `/v1/responses`, as `ServerConfig.response_store`."""
    model: str | None = "default"
    """The nodes' model, for its tokenizer: the proxy hashes prompts as the nodes do. None:
    no tokenizer, so no cache-aware choice and no selective P/D (load alone)."""
    prefill_routing: RoutingPolicy = RoutingPolicy.CACHE_AWARE
    decode_routing: RoutingPolicy = RoutingPolicy.CACHE_AWARE
    disagg_min_tokens: int = 0
    """A request whose prompt has fewer tokens than this that the chosen decode node does
    not cache runs whole on that node, without a prefill leg. 0 (the default): every
    request takes both legs. On one host P/D never paid below 256 tokens and 256 cut
    multi-turn chat's TTFT p50 5.5x (docs/benchmarks.md, `pdserve bench routing`), but
    where it pays across hosts is not measured yet, so it is not the default."""
    max_concurrency: int = 256
    """Client requests in flight through the proxy (streams until they end); more wait."""
    max_queue: int = 256
    """Requests waiting for a slot; one more is answered 429 at once."""
    max_queue_wait_s: float = 5.0
    """The longest a request waits for a slot before its 429."""
    max_concurrency_per_key: int = 0
    """Requests in flight per API key (bearer token); 0: no per-key limit."""
    tls: TLSConfig = field(default_factory=TLSConfig)
    """Serve HTTPS to clients, and verify `https://` nodes against its CA (`pdserve/tls.py`)."""

    def __post_init__(self) -> None:
        _require(bool(self.prefill_urls), "at least one prefill node is needed")
        _require(bool(self.decode_urls), "at least one decode node is needed")
        _require(0 <= self.port < 65536, f"port must be in [0, 65535], got {self.port}")
        for name in ("prefill_timeout_s", "decode_timeout_s", "health_interval_s"):
            value = getattr(self, name)
            _require(value > 0, f"{name} must be > 0, got {value}")
        for name in ("max_concurrency", "max_queue_wait_s"):
            value = getattr(self, name)
            _require(value > 0, f"{name} must be > 0, got {value}")
        for name in ("disagg_min_tokens", "max_queue", "max_concurrency_per_key"):
            value = getattr(self, name)
            _require(value >= 0, f"{name} must be >= 0, got {value}")
        wants_tokens = RoutingPolicy.CACHE_AWARE in (self.prefill_routing, self.decode_routing)
        _require(
            self.model is not None or not wants_tokens,
            "cache-aware routing needs the nodes' model (--model) for its tokenizer",
        )

"""The flags of one node (`pdserve serve`), defined once: the engine's, the node server's
and P/D's. `serve` parses them; the launchers (`pdserve up`, `pdserve ray up`) take the same
flags (`add_node_args(launched=True)`) and hand each node the ones a user set
(`node_argv`), so a node a launcher starts can be anything `serve` can start. A flag added
here reaches both.

What a launcher decides per node is not among them: `--role`, the address (`--host`,
`--port`), `--parent-pid`, TLS files; nor what it shares with its proxy and passes itself
(`--api-key`, `--log-level`, `--otlp-endpoint`).
"""

from __future__ import annotations

import argparse

from pdserve.config import (
    DTYPES,
    KERNEL_CHOICES,
    KV_CACHE_DTYPES,
    LOAD_FORMATS,
    QUANTIZATIONS,
    CacheConfig,
    ModelConfig,
    SchedulerConfig,
    ServerConfig,
)
from pdserve.disagg.config import KVLoadFailurePolicy, KVTransferConfig, KVTransportKind, Role

GIB = 1 << 30


def add_node_args(parser: argparse.ArgumentParser, launched: bool = False) -> None:
    """Every flag of a node but its address and process ties; `launched`: as a launcher
    takes them (no `--role`, no `--config`: a launcher reads the file itself)."""
    node = parser.add_argument_group("node")
    node.add_argument("--served-model-name", default=None, help="model id in the API")
    node.add_argument(
        "--drain-timeout-s",
        type=float,
        default=ServerConfig.drain_timeout_s,
        help="SIGTERM grace period",
    )
    add_response_store_arg(node)
    if not launched:
        node.add_argument(
            "--config", default=None, help="YAML file of flag values; flags override it"
        )
    add_disagg_args(parser.add_argument_group("prefill/decode disaggregation"), launched)
    add_engine_args(parser)


def add_response_store_arg(group: argparse._ActionsContainer) -> None:
    """`--response-store`, for every server of `/v1/responses` (nodes and the proxy)."""
    group.add_argument(
        "--response-store",
        default=None,
        metavar="PATH|URL",
        help="where /v1/responses are stored: a SQLite file, or postgresql://... for several "
        "proxies (default: $XDG_DATA_HOME/pdserve/responses.sqlite3)",
    )


def node_argv(args: argparse.Namespace) -> list[str]:
    """The node flags in `args` that differ from their defaults, as a node's command line."""
    reference = argparse.ArgumentParser(add_help=False)
    add_node_args(reference, launched=True)
    argv: list[str] = []
    for action in reference._actions:  # argparse keeps no public list of them
        value = getattr(args, action.dest, action.default)
        if value == action.default or not action.option_strings:
            continue
        flag = action.option_strings[0]
        argv += [flag] if isinstance(action, argparse._StoreTrueAction) else [flag, str(value)]
    return argv


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Engine flags shared by every command that builds an engine."""
    g = parser.add_argument_group("engine")
    g.add_argument(
        "--model",
        default=ModelConfig.model,
        help="HF directory, .gguf file, `default` (SmolLM2-135M-Instruct) or `gemma3-270m` "
        "(the gemma3 extra)",
    )
    g.add_argument("--load-format", default=ModelConfig.load_format, choices=LOAD_FORMATS)
    g.add_argument("--dtype", default=ModelConfig.dtype, choices=DTYPES)
    g.add_argument("--device", default=ModelConfig.device, help="auto, cpu, cuda, cuda:N")
    g.add_argument("--max-model-len", type=int, default=ModelConfig.max_model_len)
    g.add_argument(
        "--block-size", type=int, default=CacheConfig.block_size, help="tokens per KV block"
    )
    g.add_argument(
        "--num-kv-blocks", type=int, default=CacheConfig.num_blocks, help="KV pool size in blocks"
    )
    g.add_argument(
        "--kv-cache-memory-gib", type=float, default=CacheConfig.kv_cache_memory_bytes / GIB
    )
    g.add_argument("--max-num-seqs", type=int, default=SchedulerConfig.max_num_seqs)
    g.add_argument(
        "--max-num-batched-tokens", type=int, default=SchedulerConfig.max_num_batched_tokens
    )
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--seed", type=int, default=ModelConfig.seed)
    g.add_argument(
        "--kernels",
        default=ModelConfig.kernels,
        choices=KERNEL_CHOICES,
        help="auto: the fused CPU kernels where the CPU has them for the dtype; torch: "
        "PyTorch ops; triton: Triton paged decode attention on CUDA",
    )
    g.add_argument(
        "--quantization",
        default=ModelConfig.quantization,
        choices=QUANTIZATIONS,
        help="auto: on the CPU kernels, keep a GGUF file's weights in their blocks (Q4_0, "
        "Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K); none: dequantize at load; q8_0/q4_0/q4_1: "
        "every linear in that format",
    )
    g.add_argument(
        "--batch-invariant",
        action="store_true",
        help="one kernel per linear at every batch size, so a request's output does not "
        "depend on what else runs with it (bf16 included); slower prefill at large batches",
    )
    g.add_argument(
        "--kv-cache-dtype",
        default=CacheConfig.kv_cache_dtype,
        choices=KV_CACHE_DTYPES,
        help="auto: the model's dtype; int8: 8-bit values with a scale per token and head "
        "(about half of bf16's bytes); P/D nodes of a pair must agree",
    )


def engine_options(args: argparse.Namespace) -> dict[str, object]:
    return {
        "load_format": args.load_format,
        "dtype": args.dtype,
        "device": args.device,
        "max_model_len": args.max_model_len,
        "block_size": args.block_size,
        "num_blocks": args.num_kv_blocks,
        "kv_cache_memory_bytes": int(args.kv_cache_memory_gib * GIB),
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "enable_prefix_caching": not args.no_prefix_caching,
        "seed": args.seed,
        "kernels": args.kernels,
        "quantization": args.quantization,
        "batch_invariant": args.batch_invariant,
        "kv_cache_dtype": args.kv_cache_dtype,
    }


def add_disagg_args(pd: argparse._ArgumentGroup, launched: bool = False) -> None:
    """P/D's flags; `launched`: without `--role`, which a launcher sets per node."""
    if not launched:
        pd.add_argument(
            "--role",
            default=KVTransferConfig.role.value,
            choices=[r.value for r in Role],
            help="both: a whole node; prefill: holds prompts' KV for decode nodes; decode: "
            "pulls it",
        )
    pd.add_argument(
        "--advertise-host",
        default=None,
        help="prefill: the address decode nodes use to reach this node (remote_host); "
        "default: --host, or this machine's address when --host is 0.0.0.0",
    )
    pd.add_argument(
        "--lease-s",
        type=float,
        default=KVTransferConfig.lease_s,
        help="prefill: unrenewed handoff life",
    )
    pd.add_argument(
        "--claim-timeout-s",
        type=float,
        default=KVTransferConfig.claim_timeout_s,
        help="prefill: longest read",
    )
    pd.add_argument(
        "--kv-load-failure",
        default=KVTransferConfig.kv_load_failure.value,
        choices=[p.value for p in KVLoadFailurePolicy],
        help="decode: what to do when a claim is refused or a read fails",
    )
    pd.add_argument(
        "--kv-transport",
        default=KVTransferConfig.transport.value,
        choices=[t.value for t in KVTransportKind],
    )
    pd.add_argument("--debug-kv-read-delay-s", type=float, default=0.0, help=argparse.SUPPRESS)
    pd.add_argument(
        "--cluster-secret",
        default=None,
        help="bearer credential between nodes (or PDSERVE_CLUSTER_SECRET; default: the API key)",
    )

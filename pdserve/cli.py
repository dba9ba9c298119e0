"""The `pdserve` command line: `serve` (one node: a whole one, or the prefill or decode
half of a P/D pair), `proxy` (the P/D router in front of such nodes), `up` (a local proxy +
prefill + decode cluster in one command), `generate` (offline) and `bench`.

This is the launcher: it builds every configuration once from its flags (their defaults are
the config dataclasses' own) and, for `serve`, picks the engine's KV connector by role.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from pdserve import envs, logs, tracing
from pdserve.config import ProxyConfig, ServerConfig
from pdserve.disagg.config import KVLoadFailurePolicy, KVTransferConfig, KVTransportKind, Role
from pdserve.errors import ConfigError, PdserveError
from pdserve.node_flags import (
    add_engine_args,
    add_node_args,
    add_response_store_arg,
    engine_options,
)
from pdserve.seams import Seams
from pdserve.tls import add_tls_args, tls_options


def _generate(args: argparse.Namespace) -> int:
    from pdserve import LLM, SamplingParams

    llm = LLM(args.model, **engine_options(args))
    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        max_tokens=args.max_tokens,
        seed=args.sample_seed,
        stop=tuple(args.stop or ()),
    )
    prompts = args.prompt
    if args.chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
    else:
        outputs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outputs, strict=True):
        text = out.outputs[0].text
        print(text if args.chat or args.quiet else f"{prompt}{text}")
    return 0


def _serve(args: argparse.Namespace) -> int:
    import asyncio

    from pdserve.api.lifecycle import run_server
    from pdserve.disagg.connectors import connector_factory
    from pdserve.engine.async_client import AsyncEngineClient
    from pdserve.llm import engine_config

    api_key = args.api_key or envs.api_key()
    tls = tls_options(args)
    server = ServerConfig(
        host=args.host,
        port=args.port,
        api_key=api_key,
        served_model_name=args.served_model_name,
        drain_timeout_s=args.drain_timeout_s,
        parent_pid=args.parent_pid,
        tls=tls,
        response_store=args.response_store,
    )
    kv_transfer = KVTransferConfig(
        role=Role(args.role),
        lease_s=args.lease_s,
        claim_timeout_s=args.claim_timeout_s,
        kv_load_failure=KVLoadFailurePolicy(args.kv_load_failure),
        transport=KVTransportKind(args.kv_transport),
        cluster_secret=args.cluster_secret or envs.cluster_secret() or api_key,
        advertise_host=args.advertise_host,
        tls=tls,
    )
    seams = Seams(kv_read_delay_s=args.debug_kv_read_delay_s, step_delay_s=args.debug_step_delay_s)
    engine = engine_config(model=args.model, **engine_options(args))
    client = AsyncEngineClient(engine, connector_factory(kv_transfer, seams))
    asyncio.run(run_server(client, server, kv_transfer, seams))
    return 0


def _proxy(args: argparse.Namespace) -> int:
    import asyncio

    from pdserve.proxy.app import run_proxy
    from pdserve.proxy.membership import FileMembership, read_members
    from pdserve.proxy.routing import routing_options
    from pdserve.proxy.state import ProxyState

    api_key = args.api_key or envs.api_key()
    prefill, decode, membership = args.prefill, args.decode, None
    if args.members_file:
        if prefill or decode:
            raise ConfigError("--members-file names the nodes: no --prefill/--decode with it")
        try:
            membership = FileMembership(args.members_file)  # before the read: no change missed
        except OSError as e:
            raise ConfigError(f"members file {args.members_file}: {e}") from e
        members = read_members(args.members_file)
        prefill, decode = members["prefill"], members["decode"]
    config = ProxyConfig(
        prefill_urls=tuple(prefill),
        decode_urls=tuple(decode),
        host=args.host,
        port=args.port,
        api_key=api_key,
        node_api_key=args.node_api_key or api_key,
        prefill_timeout_s=args.prefill_timeout_s,
        decode_timeout_s=args.decode_timeout_s,
        health_interval_s=args.health_interval_s,
        parent_pid=args.parent_pid,
        model=None if args.model == "none" else args.model,
        response_store=args.response_store,
        tls=tls_options(args),
        **routing_options(args),
    )
    seams = Seams(between_legs_s=args.debug_delay_between_legs_s)
    asyncio.run(run_proxy(ProxyState(config, seams, membership)))
    return 0


def add_log_level_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--log-level",
        default=None,
        choices=logs.LEVELS,
        help="default: PDSERVE_LOG_LEVEL, else info; debug adds every HTTP client request",
    )


def _trace_service_name(args: argparse.Namespace) -> str:
    """The `service.name` of this process's spans: pdserve-proxy, pdserve-prefill, ..."""
    role = getattr(args, "role", None)
    if args.command == "serve":
        return "pdserve" if role in (None, Role.BOTH.value) else f"pdserve-{role}"
    return "pdserve-proxy" if args.command in ("up", "ray") else f"pdserve-{args.command}"


def add_parent_pid_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--parent-pid",
        type=int,
        default=None,
        help="drain and exit once this process is gone (launchers such as `pdserve up` set it)",
    )


def build_parser(with_bench: bool = True) -> argparse.ArgumentParser:
    """The command line. Without `with_bench`, `bench` is there by name only: the benchmarks'
    options import their modules, and with them torch (~1.4 s of CPU and ~200 MB in every
    proxy and node API process, which need neither)."""
    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate_parser(sub)
    _add_serve_parser(sub)
    _add_proxy_parser(sub)

    from pdserve.proxy.up import add_parser as add_up_parser

    add_up_parser(sub)

    from pdserve.cluster.ray_cli import add_parser as add_ray_parser

    add_ray_parser(sub)

    if with_bench:
        from pdserve.bench.cli import add_bench_parser

        add_bench_parser(sub)
    else:
        sub.add_parser("bench", help="benchmarks")
    return parser


def _add_generate_parser(sub: argparse._SubParsersAction) -> None:
    gen = sub.add_parser("generate", help="generate text offline")
    gen.add_argument("prompt", nargs="+")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--sample-seed", type=int, default=None, help="per-request sampling seed")
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument("--chat", action="store_true", help="apply the model's chat template")
    gen.add_argument("--quiet", action="store_true", help="print only the completion")
    add_engine_args(gen)
    gen.set_defaults(func=_generate)


def _add_serve_parser(sub: argparse._SubParsersAction) -> None:
    srv = sub.add_parser("serve", help="serve the OpenAI API on one node")
    srv.add_argument("--host", default=ServerConfig.host)
    srv.add_argument("--port", type=int, default=ServerConfig.port)
    srv.add_argument("--api-key", default=None, help="require this bearer key (or PDSERVE_API_KEY)")
    srv.add_argument("--debug-step-delay-s", type=float, default=0.0, help=argparse.SUPPRESS)
    add_parent_pid_arg(srv)
    add_log_level_arg(srv)
    tracing.add_otlp_arg(srv)
    add_tls_args(srv)
    add_node_args(srv)
    srv.set_defaults(func=_serve)


def _add_proxy_parser(sub: argparse._SubParsersAction) -> None:
    prx = sub.add_parser("proxy", help="the OpenAI API in front of prefill and decode nodes")
    prx.add_argument("--host", default=ProxyConfig.host)
    prx.add_argument("--port", type=int, default=ProxyConfig.port)
    prx.add_argument("--prefill", action="append", default=[], help="prefill node URL")
    prx.add_argument("--decode", action="append", default=[], help="decode node URL")
    prx.add_argument(
        "--members-file",
        default=None,
        metavar="PATH",
        help='the nodes as JSON {"prefill": [URL, ...], "decode": [...]}, followed while '
        "serving (instead of --prefill/--decode)",
    )
    prx.add_argument("--api-key", default=None, help="required from clients (or PDSERVE_API_KEY)")
    prx.add_argument("--node-api-key", default=None, help="sent to the nodes; default: --api-key")
    add_response_store_arg(prx)
    prx.add_argument("--prefill-timeout-s", type=float, default=ProxyConfig.prefill_timeout_s)
    prx.add_argument(
        "--decode-timeout-s",
        type=float,
        default=ProxyConfig.decode_timeout_s,
        help="longest silence of a decode leg (until its first token, then between "
        "tokens); an answer that keeps coming is never cut",
    )
    prx.add_argument("--health-interval-s", type=float, default=ProxyConfig.health_interval_s)
    prx.add_argument(
        "--model",
        default="default",
        help="the nodes' model: its tokenizer hashes prompts for cache-aware routing "
        "(none: no tokenizer; routing by load alone)",
    )
    from pdserve.proxy.routing import add_routing_args

    add_routing_args(prx)
    add_parent_pid_arg(prx)
    add_log_level_arg(prx)
    tracing.add_otlp_arg(prx)
    add_tls_args(prx)
    prx.add_argument(
        "--debug-delay-between-legs-s", type=float, default=0.0, help=argparse.SUPPRESS
    )
    prx.set_defaults(func=_proxy)


def _config_file_argv(path: str) -> list[str]:
    """A YAML file of flag values as command-line flags, placed before the real ones so
    that explicit flags win (argparse keeps the last value).

    Keys are flag names with or without dashes (`max-num-seqs` or `max_num_seqs`); a true
    boolean turns a switch on.
    """
    import yaml

    try:
        with open(path) as f:
            values = yaml.safe_load(f) or {}
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f"cannot read config file {path}: {e}") from e
    if not isinstance(values, dict):
        raise ConfigError(f"config file {path} must map flag names to values")
    argv: list[str] = []
    for key, value in values.items():
        flag = "--" + str(key).replace("_", "-")
        if value is True:
            argv.append(flag)
        elif value is not False and value is not None:
            argv += [flag, str(value)]
    return argv


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """Parse the command line, with `--config FILE` values under the explicit flags."""
    parser = build_parser(with_bench=list(argv[:1]) == ["bench"])
    args = parser.parse_args(argv)
    if getattr(args, "config", None):
        args = parser.parse_args([argv[0], *_config_file_argv(args.config), *argv[1:]])
    return args


def main(argv: Sequence[str] | None = None) -> int:
    envs.force_hub_offline()
    try:
        args = parse_args(sys.argv[1:] if argv is None else argv)
        logs.configure(getattr(args, "log_level", None) or envs.log_level())
        tracing.configure(getattr(args, "otlp_endpoint", None), _trace_service_name(args))
        return int(args.func(args))
    except PdserveError as e:
        print(f"pdserve: error: {e.message}", file=sys.stderr)
        return 2
    finally:
        tracing.shutdown()


if __name__ == "__main__":
    sys.exit(main())

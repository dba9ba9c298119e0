"""pdserve's packages form layers that point one way (docs/architecture.md, "Layers"): a
module imports only from its own layer or those below, and the packages of one layer import
each other without a cycle. Every import counts: module level, inside functions, and under
TYPE_CHECKING (a type is a dependency too). A new top-level module or package must be given
a layer here, where the next engineer will look.

Live processes are checked too: the proxy and a node's API process never load torch.
"""

from __future__ import annotations

import ast
import itertools
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

import httpx
import pytest

from pdserve.launch import free_port, launch, stop, wait_healthy

ROOT = Path(__file__).resolve().parents[1] / "pdserve"

LAYERS: list[set[str]] = [
    # foundations: errors, settings of the process, and the contract types between layers
    {"errors", "envs", "logs", "tls", "seams", "heap", "parent_watch", "launch",
     "sampling_params", "outputs", "batch", "tracing", "structured", "tools", "reasoning"},
    # configs; the OpenAI request/response layer and the agent APIs over it (node and proxy)
    {"config", "openai_api", "agent_api"},
    {"kv_cache"},  # the paged KV pool and prefix cache
    {"model"},  # weights, kernels, the runner (takes `batch` contracts)
    {"engine"},  # scheduler, step loop, engine process
    {"disagg", "node_flags"},  # P/D: the connectors, the handoff table, the wire; a node's flags
    {"api"},  # a node's HTTP server
    {"proxy"},  # the P/D router
    {"cluster", "vllm"},  # integrations: Ray, vLLM's processes
    {"llm", "__init__"},  # the offline API (`from pdserve import LLM`)
    {"bench"},  # measurements, peers
    {"cli"},  # the `pdserve` command
]  # fmt: skip
LAYER_OF = {package: i for i, layer in enumerate(LAYERS) for package in layer}


def package_of(module: str) -> str:
    """`pdserve.engine.scheduler` -> `engine`; `pdserve.tls` -> `tls`; `pdserve` -> `__init__`."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _is_module(name: str) -> bool:
    return (ROOT / f"{name}.py").exists() or (ROOT / name / "__init__.py").exists()


def imports() -> list[tuple[str, str, int]]:
    """(importing module, imported pdserve module, line) for every import in pdserve/."""
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        module = ".".join(path.relative_to(ROOT.parent).with_suffix("").parts)
        module = module.removesuffix(".__init__")
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
                if node.module == "pdserve":  # `from pdserve import launch` (a module), `LLM`
                    names = [
                        f"pdserve.{a.name}" if _is_module(a.name) else "pdserve" for a in node.names
                    ]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            found += [(module, n, node.lineno) for n in names if n.split(".")[0] == "pdserve"]
    return found


def test_every_package_has_a_layer() -> None:
    modules = {p.stem for p in ROOT.glob("*.py")}
    packages = {p.name for p in ROOT.iterdir() if (p / "__init__.py").exists()}
    unplaced = sorted((modules | packages) - LAYER_OF.keys())
    assert not unplaced, f"give these a layer in tests/test_layers.py: {unplaced}"


def test_imports_point_down_the_layers() -> None:
    upward = [
        f"{src}:{line} imports {dst} ({package_of(src)} is layer {LAYER_OF[package_of(src)]},"
        f" {package_of(dst)} is layer {LAYER_OF[package_of(dst)]})"
        for src, dst, line in imports()
        if LAYER_OF[package_of(dst)] > LAYER_OF[package_of(src)]
    ]
    assert not upward, "imports against the layer order:\n" + "\n".join(upward)


NEVER = {"proxy": {"api"}, "cluster": {"api"}, "vllm": {"api"}}
"""Packages that a layer allows but the design does not: the proxy and the integrations
speak to nodes over HTTP and share the OpenAI layer (`openai_api`), never the node server."""


def test_pdserve_never_imports_the_benchmarks() -> None:
    """`bench/pdserve_bench` imports pdserve; pdserve finds its commands by an entry point
    (`pdserve.bench`), never by name."""
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            names += [a.name for a in node.names] if isinstance(node, ast.Import) else []
            found += [f"{path}:{node.lineno}" for n in names if n.split(".")[0] == "pdserve_bench"]
    assert not found, found


def test_the_proxy_and_the_integrations_never_import_the_node_server() -> None:
    found = [
        f"{src}:{line} imports {dst}"
        for src, dst, line in imports()
        if package_of(dst) in NEVER.get(package_of(src), ())
    ]
    assert not found, "\n".join(found)


def test_packages_import_each_other_without_a_cycle() -> None:
    edges: dict[str, set[str]] = defaultdict(set)
    where: dict[tuple[str, str], str] = {}
    for src, dst, line in imports():
        a, b = package_of(src), package_of(dst)
        if a != b:
            edges[a].add(b)
            where.setdefault((a, b), f"{src}:{line}")
    cycle = _find_cycle(edges)
    assert cycle is None, (
        "a cycle between packages: "
        + " -> ".join(f"{a} ({where[(a, b)]})" for a, b in itertools.pairwise(cycle))
        + f" -> {cycle[-1]}"
    )


def _find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)) is not None:
                return found
        state[node] = 2
        path.pop()
        return None

    for node in sorted(edges):
        if node not in state and (found := visit(node)) is not None:
            return found
    return None


def test_the_cycle_finder_finds_cycles() -> None:
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": {"c"}}) is None


# -- live processes ------------------------------------------------------------------------


def _maps_have_torch(pid: int) -> bool:
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/PID/maps")
@pytest.mark.timeout(180)
def test_a_running_proxy_and_node_api_process_map_no_libtorch(tiny_model_dir: object) -> None:
    """The proxy with cache-aware routing on the default model (it loads the tokenizer to
    hash prompts), and a node serving: the proxy's process and the node's API process have
    no libtorch mapped; the node's engine process does (the check can see it)."""
    model = str(tiny_model_dir("llama"))  # type: ignore[operator]
    env = {"PDSERVE_LOG_LEVEL": "WARNING"}
    node = launch(["--model", model, "--dtype", "float32", "--num-kv-blocks", "32"], env=env)
    proxy = None
    try:
        wait_healthy(node, 120)
        port = free_port()
        args = ["--prefill", node.url, "--decode", node.url, "--model", "default",
                "--routing", "cache-aware"]  # fmt: skip
        proxy = wait_healthy(launch(args, env=env, command="proxy", port=port), 60)
        body = {"prompt": [5, 6, 7], "max_tokens": 2}
        httpx.post(f"{node.url}/v1/completions", json=body, timeout=60).raise_for_status()
        time.sleep(0.2)
        engine = [
            int(p)
            for p in os.listdir("/proc")
            if p.isdigit() and _parent(int(p)) == node.process.pid
        ]
        assert engine and any(_maps_have_torch(pid) for pid in engine)
        assert not _maps_have_torch(node.process.pid), "the node's API process mapped libtorch"
        assert not _maps_have_torch(proxy.process.pid), "the proxy mapped libtorch"
    finally:
        if proxy is not None:
            stop(proxy)
        stop(node)


def _parent(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return -1


def test_modules_of_a_package_import_each_other_without_a_cycle() -> None:
    """Within a package too (issue 56): a type-only import counts, since a type a module
    needs is a dependency (a shared state type belongs in a module of its own, a backend's
    interface in a protocol)."""
    edges: dict[str, set[str]] = defaultdict(set)
    for src, dst, _ in imports():
        if package_of(src) == package_of(dst) and src != dst and src.count(".") > 1:
            edges[src].add(dst)
    cycle = _find_cycle(edges)
    assert cycle is None, "a cycle between modules: " + " -> ".join(cycle or ())

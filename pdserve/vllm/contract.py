"""What `PdserveConnector` needs of vLLM, checked from vLLM's source: every name it touches
(`versions.CONTRACT`) and the behaviours it relies on (`BEHAVIOURS`).

The check reads source text and parses it (`ast`); it never imports vLLM. So one checker
serves the installed vLLM at load (`versions.check_vllm`: the files beside the installed
package) and any wheel (`tests/vllm/test_contract.py`: the files inside it, for the CUDA
releases that cannot run here). A class's methods and attributes are looked up through its
bases as Python would (a base named by an import is followed to its module); a method's
parameters are compared by name, in order.
"""

from __future__ import annotations

import ast
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

Source = Callable[[str], str | None]
"""A module's source text by its dotted name, or None where the module is not there."""


def _candidates(module: str) -> tuple[str, str]:
    path = module.replace(".", "/")
    return f"{path}.py", f"{path}/__init__.py"


def directory_source(root: Path) -> Source:
    """Modules under `root`, the directory that holds the `vllm` package."""

    def source(module: str) -> str | None:
        for name in _candidates(module):
            if (root / name).is_file():
                return (root / name).read_text(encoding="utf-8")
        return None

    return source


def wheel_source(wheel: Path) -> Source:
    """Modules inside a wheel, read without unpacking or installing it."""
    archive = zipfile.ZipFile(wheel)
    members = set(archive.namelist())

    def source(module: str) -> str | None:
        for name in _candidates(module):
            if name in members:
                return archive.read(name).decode("utf-8")
        return None

    return source


@dataclass(frozen=True)
class Name:
    """A name of vLLM's that pdserve uses: `Class`, `Class.method` (with its parameters,
    `self` included) or `Class.attribute` (set on the class or its instances)."""

    module: str
    qualname: str
    params: tuple[str, ...] | None = None

    def __str__(self) -> str:
        where = f"{self.module}.{self.qualname}"
        return f"{where}({', '.join(self.params)})" if self.params is not None else where


@dataclass
class _Class:
    module: str
    node: ast.ClassDef
    imports: dict[str, str]
    """Names the class's module imports: local name -> the module it comes from."""


class Reader:
    """vLLM's classes, read from `source` on demand."""

    def __init__(self, source: Source) -> None:
        self.source = source
        self._trees: dict[str, ast.Module | None] = {}

    def tree(self, module: str) -> ast.Module | None:
        if module not in self._trees:
            text = self.source(module)
            self._trees[module] = None if text is None else ast.parse(text)
        return self._trees[module]

    def find_class(self, module: str, name: str) -> _Class | None:
        tree = self.tree(module)
        if tree is None:
            return None
        imports: dict[str, str] = {}
        for node in tree.body:
            if isinstance(node, ast.ClassDef) and node.name == name:
                return _Class(module, node, _imports(tree))
            if isinstance(node, ast.ImportFrom) and node.module:
                imports.update({a.asname or a.name: node.module for a in node.names})
        if name in imports:  # re-exported: follow it
            return self.find_class(imports[name], name)
        return None

    def lineage(self, cls: _Class) -> list[_Class]:
        """The class and its bases, nearest first, as far as vLLM's source names them."""
        found, todo = [], [cls]
        while todo:
            current = todo.pop(0)
            found.append(current)
            for base in current.node.bases:
                name = base.id if isinstance(base, ast.Name) else None
                module = current.imports.get(name or "", current.module)
                parent = self.find_class(module, name) if name else None
                if parent is not None:
                    todo.append(parent)
        return found

    def method(self, cls: _Class, name: str) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
        for c in self.lineage(cls):
            for node in c.node.body:
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
                    return node
        return None

    def has_attribute(self, cls: _Class, name: str) -> bool:
        """Set in a class body (a field, an assignment) or on `self` in a method."""
        for c in self.lineage(cls):
            for node in ast.walk(c.node):
                if _binds(node, name):
                    return True
        return self.method(cls, name) is not None  # a property


def _binds(node: ast.AST, name: str) -> bool:
    """`name: T` or `name = ...` in a class body, or `self.name = ...` in a method."""
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return node.target.id == name
    if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
        return node.attr == name and isinstance(node.value, ast.Name)
    if isinstance(node, ast.Assign):
        return any(isinstance(t, ast.Name) and t.id == name for t in node.targets)
    return False


def _imports(tree: ast.Module) -> dict[str, str]:
    return {
        a.asname or a.name: node.module
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module
        for a in node.names
    }


def _params(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> tuple[str, ...]:
    args = fn.args
    return tuple(a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs))


def check_names(names: tuple[Name, ...], reader: Reader) -> list[str]:
    """What moved: one line per name that is missing or whose parameters changed."""
    problems = []
    for name in names:
        class_name, _, member = name.qualname.partition(".")
        cls = reader.find_class(name.module, class_name)
        if cls is None:
            problems.append(f"{name.module}.{class_name} is gone")
        elif member and name.params is not None:
            fn = reader.method(cls, member)
            if fn is None:
                problems.append(f"{name.module}.{name.qualname} is gone")
            elif _params(fn) != name.params:
                problems.append(f"{name} now takes ({', '.join(_params(fn))})")
        elif member and not reader.has_attribute(cls, member):
            problems.append(f"{name.module}.{name.qualname} is gone")
    return problems


# -- the behaviours relied on ---------------------------------------------------------------


def _reaps_expired_sends(reader: Reader) -> str | None:
    """The worker frees a held request whose `reqs_to_send` deadline has passed in the same
    step's `get_transfer_results` (so a release, which sets a past deadline, frees within
    one step): that method, or one it calls on `self`, expires `_reqs_to_send` entries."""
    module = "vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker"
    cls = reader.find_class(module, "NixlPullConnectorWorker")
    fn = reader.method(cls, "get_transfer_results") if cls else None
    if cls is None or fn is None:
        return "NixlPullConnectorWorker.get_transfer_results is gone"
    called = {name for n in ast.walk(fn) if (name := _self_call(n))}
    for method in [fn, *(m for c in called if (m := reader.method(cls, c)) is not None)]:
        text = ast.unparse(method)
        if "_reqs_to_send" in text and "expire" in text.lower():
            return None
    return "get_transfer_results no longer expires _reqs_to_send entries itself"


def _self_call(node: ast.AST) -> str | None:
    """The method's name where `node` is a call `self.method(...)`."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
        return None
    target = node.func.value
    return node.func.attr if isinstance(target, ast.Name) and target.id == "self" else None


def _connector_output_before_asserts(reader: Reader) -> str | None:
    """The scheduler hands the connector its `KVConnectorOutput` before its own asserts on
    the same output's id sets, so filtering them in `update_connector_output` keeps late
    and duplicate signals away from those asserts."""
    cls = reader.find_class("vllm.v1.core.sched.scheduler", "Scheduler")
    fn = reader.method(cls, "_update_from_kv_xfer_finished") if cls else None
    if fn is None:
        return "Scheduler._update_from_kv_xfer_finished is gone"
    order = [
        ("call" if "update_connector_output" in ast.unparse(s) else "assert")
        for s in fn.body
        if "update_connector_output" in ast.unparse(s) or any(
            isinstance(n, ast.Assert) for n in ast.walk(s)
        )
    ]  # fmt: skip
    if not order or order[0] != "call":
        return "the scheduler asserts on KVConnectorOutput before the connector sees it"
    return None


def _hybrid_read_failures_by_request(reader: Reader) -> str | None:
    """A failed read of a model with several KV cache groups (sliding-window layers beside
    global ones: Gemma 3, gpt-oss) reaches the scheduler through `failed_recving` alone:
    the scheduler raises on `invalid_block_ids` for such models (block ids are unique only
    within a group), so the worker must queue them only where the hybrid KV cache manager
    is off (`if not self._is_hma_required`). pdserve's connector reports none itself."""
    module = "vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker"
    cls = reader.find_class(module, "NixlBaseConnectorWorker")
    if cls is None:
        return "NixlBaseConnectorWorker is gone"
    queued = guarded = 0
    for guard in ast.walk(cls.node):
        for node in ast.iter_child_nodes(guard):
            if not (isinstance(node, ast.Expr) and "_invalid_block_ids.put" in ast.unparse(node)):
                continue
            queued += 1
            test = ast.unparse(guard.test) if isinstance(guard, ast.If) else ""
            guarded += test == "not self._is_hma_required"
    if queued == 0 or guarded < queued:
        return (
            "the NIXL worker may report invalid_block_ids for a model with several KV cache "
            "groups (a failed read would raise in the scheduler instead of recomputing)"
        )
    return None


BEHAVIOURS: tuple[Callable[[Reader], str | None], ...] = (
    _reaps_expired_sends,
    _connector_output_before_asserts,
    _hybrid_read_failures_by_request,
)


def check(names: tuple[Name, ...], source: Source) -> list[str]:
    """Every name and behaviour, against the vLLM that `source` reads: what moved, or []."""
    reader = Reader(source)
    return check_names(names, reader) + [p for b in BEHAVIOURS if (p := b(reader)) is not None]

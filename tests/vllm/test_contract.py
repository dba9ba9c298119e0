"""The contract tier: every vLLM release `PdserveConnector` supports is checked from its own
wheel (`pip download --no-deps`, cached), with no GPU and no import of vLLM: every name in
`versions.CONTRACT` with its parameters, and the behaviours in `contract.BEHAVIOURS`. A copy
of a wheel's source with one touched name renamed, or a behaviour changed, must fail,
naming it.

The wheels are large (vllm 0.34: 240 MB), so this tier runs with `make test-vllm`, which CI
runs; the cache (`~/.cache/pdserve/vllm-wheels`) makes later runs read them in place.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from pdserve.vllm.contract import Source, wheel_source
from pdserve.vllm.versions import CHECKED, UnsupportedVLLMError, check_vllm

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1800)]

CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "pdserve" / "vllm-wheels"
RELEASES = [(dist, release) for dist, releases in CHECKED.items() for release in releases]


def wheel(dist: str, release: str) -> Path:
    """The wheel of `dist==release`, fetched once into the cache."""
    stem = dist.replace("-", "_")
    found = sorted(CACHE.glob(f"{stem}-{release}-*.whl"))
    if not found:
        CACHE.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
             "--quiet", "--dest", str(CACHE), f"{dist}=={release}"],
            check=True,
        )  # fmt: skip
        found = sorted(CACHE.glob(f"{stem}-{release}-*.whl"))
    assert found, f"pip download {dist}=={release} left no wheel in {CACHE}"
    return found[0]


@pytest.mark.parametrize(("dist", "release"), RELEASES)
def test_every_supported_release_keeps_the_contract(dist: str, release: str) -> None:
    assert check_vllm(release, wheel_source(wheel(dist, release))) == release


def renamed(source: Source, module: str, old: str, new: str) -> Source:
    def edited(name: str) -> str | None:
        text = source(name)
        if text is not None and name == module:
            assert old in text, f"{old!r} is not in {module}: the mutation would prove nothing"
            text = text.replace(old, new)
        return text

    return edited


@pytest.mark.parametrize(
    ("module", "old", "new", "named"),
    [
        ("vllm.v1.outputs", "failed_recving", "failed_receiving",
         "KVConnectorOutput.failed_recving is gone"),
        ("vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker",
         "def register_kv_caches(self, kv_caches", "def register_kv_caches(self, caches",
         "register_kv_caches(self, kv_caches) now takes (self, caches)"),
        ("vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler",
         "class NixlPullConnectorScheduler(", "class NixlPullScheduler(",
         "NixlPullConnectorScheduler is gone"),
        ("vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker",
         "if not self._is_hma_required:\n", "if True:\n",
         "invalid_block_ids for a model with several KV cache groups"),
    ],
)  # fmt: skip
def test_a_renamed_name_in_a_copy_of_the_newest_wheel_is_refused_by_name(
    module: str, old: str, new: str, named: str
) -> None:
    release = CHECKED["vllm"][-1]
    source = renamed(wheel_source(wheel("vllm", release)), module, old, new)
    with pytest.raises(UnsupportedVLLMError, match=named.replace("(", r"\(").replace(")", r"\)")):
        check_vllm(release, source)


CONNECTOR_MODULES = ("producer", "consumer", "control_server", "settings", "versions", "signals")
"""What `pdserve.vllm.connector` imports of pdserve (it also imports vLLM, absent here)."""
VIA = {"httpx": "openai"}
"""A package vLLM does not name itself but gets through one it names (openai requires
httpx)."""
NOT_ON_THE_CONNECTOR_S_PATH = {"cryptography"}
"""Imported inside `pdserve.tls.make_cluster_certs` (`pdserve up --tls`'s throwaway CA),
which the connector never calls: it takes certificate files."""


def connector_needs() -> set[str]:
    """The third-party packages pdserve's own code imports, at module level or inside a
    function, in every pdserve module that loading the connector loads."""
    code = (
        "import sys, pdserve.vllm\n"
        f"for m in {CONNECTOR_MODULES!r}: __import__('pdserve.vllm.' + m)\n"
        "print('\\n'.join(m.__file__ for n, m in sys.modules.items()"
        " if n.startswith('pdserve') and getattr(m, '__file__', None)))"
    )
    files = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.split()
    needs = set()
    for path in files:
        for node in ast.walk(ast.parse(Path(path).read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                needs.add(node.module.split(".")[0])
            elif isinstance(node, ast.Import):
                needs.update(a.name.split(".")[0] for a in node.names)
    return {n for n in needs if n not in sys.stdlib_module_names and n not in ("pdserve", "vllm")}


def requirements(wheel_path: Path) -> set[str]:
    """The distributions a wheel requires (names only, extras and markers dropped)."""
    with zipfile.ZipFile(wheel_path) as archive:
        meta = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        lines = archive.read(meta).decode().splitlines()
    names = (line.split(":", 1)[1].strip() for line in lines if line.startswith("Requires-Dist:"))
    return {re.split(r"[\s\[<>=!~;(]", n, maxsplit=1)[0].lower() for n in names}


@pytest.mark.parametrize(("dist", "release"), RELEASES)
def test_the_connector_installs_with_no_deps_into_any_supported_vllm(
    dist: str, release: str
) -> None:
    """`pip install --no-deps pdserve` into a vLLM environment changes nothing vLLM pins:
    every package the connector's code imports is one vLLM requires (or one it gets through
    a package it requires)."""
    needs = connector_needs()
    assert needs >= {"httpx", "pydantic"}, needs  # the measurement sees the imports
    vllm_requires = requirements(wheel(dist, release))
    missing = {
        n for n in needs - NOT_ON_THE_CONNECTOR_S_PATH
        if n not in vllm_requires and VIA.get(n) not in vllm_requires
    }  # fmt: skip
    assert not missing, f"{dist} {release} does not bring {missing}"

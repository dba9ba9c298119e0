"""The contract tier: every vLLM release `PdserveConnector` supports is checked from its own
wheel (`pip download --no-deps`, cached), with no GPU and no import of vLLM: every name in
`versions.CONTRACT` with its parameters, and the behaviours in `contract.BEHAVIOURS`. A copy
of a wheel's source with one touched name renamed must fail, naming it.

The wheels are large (vllm 0.34: 240 MB), so this tier runs with `make test-vllm`, which CI
runs; the cache (`~/.cache/pdserve/vllm-wheels`) makes later runs read them in place.
"""

from __future__ import annotations

import os
import subprocess
import sys
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
    ],
)  # fmt: skip
def test_a_renamed_name_in_a_copy_of_the_newest_wheel_is_refused_by_name(
    module: str, old: str, new: str, named: str
) -> None:
    release = CHECKED["vllm"][-1]
    source = renamed(wheel_source(wheel("vllm", release)), module, old, new)
    with pytest.raises(UnsupportedVLLMError, match=named.replace("(", r"\(").replace(")", r"\)")):
        check_vllm(release, source)

"""The proxy's node sources (pdserve/proxy/membership.py): a members file, checked at
start, followed while serving; end to end against the real P/D test nodes."""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any

import pytest

from pdserve.errors import ConfigError
from pdserve.proxy.membership import FileMembership, read_members
from tests.api.conftest import free_port
from tests.disagg.conftest import Cluster, completion, make_prompt, post, wait_idle


def write(path: Path, prefill: list[str], decode: list[str]) -> None:
    tmp = path.with_suffix(".tmp")  # atomic, as a deploy tool writes it
    tmp.write_text(json.dumps({"prefill": prefill, "decode": decode}))
    os.replace(tmp, path)


def test_a_bad_members_file_is_refused_naming_the_problem(tmp_path: Path) -> None:
    path = tmp_path / "members.json"
    with pytest.raises(ConfigError, match="No such file"):
        read_members(str(path))
    path.write_text("{not json")
    with pytest.raises(ConfigError, match="members file"):
        read_members(str(path))
    path.write_text(json.dumps({"prefill": ["http://a:1"], "decode": "http://b:2"}))
    with pytest.raises(ConfigError, match="'decode' must be a list"):
        read_members(str(path))
    write(path, ["http://a:1"], ["ftp://b:2"])
    with pytest.raises(ConfigError, match="http"):
        read_members(str(path))


def test_the_file_is_read_again_only_when_it_changes_and_junk_keeps_the_last(
    tmp_path: Path,
) -> None:
    path = tmp_path / "members.json"
    write(path, ["http://a:1"], ["http://b:2"])
    source = FileMembership(str(path))
    assert asyncio.run(source.members()) is None  # unchanged since the start
    time.sleep(0.01)
    write(path, ["http://a:1"], ["http://b:2", "http://c:3"])
    assert asyncio.run(source.members()) == {
        "prefill": ["http://a:1"], "decode": ["http://b:2", "http://c:3"]
    }  # fmt: skip
    time.sleep(0.01)
    path.write_text("{half written")
    assert asyncio.run(source.members()) is None  # keep the last


def test_the_proxy_follows_its_members_file_while_serving(
    cluster: Cluster, proxy_for: Any, tmp_path: Path
) -> None:
    path = tmp_path / "members.json"
    write(path, [cluster.prefill.url], [cluster.decode.url])
    proxy = proxy_for([], [], "--members-file", str(path), "--routing", "least-loaded")
    body = completion(make_prompt(24, seed=70), max_tokens=4)
    assert post(proxy, "/v1/completions", body).status_code == 200
    gone = f"http://127.0.0.1:{free_port()}"  # the decode node "moved" to nowhere
    write(path, [cluster.prefill.url], [gone])
    deadline = time.monotonic() + 10
    while (status := post(proxy, "/v1/completions", body).status_code) == 200:
        assert time.monotonic() < deadline, "the proxy never followed the file"
        time.sleep(0.1)
    assert status == 503
    wait_idle(cluster.prefill, 3.0)  # the refused request's handoff was let go
    write(path, [cluster.prefill.url], [cluster.decode.url])
    deadline = time.monotonic() + 10
    while post(proxy, "/v1/completions", body).status_code != 200:
        assert time.monotonic() < deadline, "the decode node never came back"
        time.sleep(0.1)

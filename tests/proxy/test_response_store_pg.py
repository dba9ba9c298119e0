"""Stored responses in a real PostgreSQL server, shared by two proxies of one cluster: a
conversation continues on whichever proxy a turn reaches, another key reads none of it,
and a database that goes away is a 503 until it is back (then the store reconnects).

The server is Debian's `postgresql` package, started here in a scratch directory (`.ci/run`
installs the package where a machine lacks it)."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openai
import psycopg
import pytest

from pdserve.launch import Node, free_port, stop_all
from tests.api.conftest import Server
from tests.proxy.conftest import start_agent_proxy

pytestmark = pytest.mark.timeout(240)


def _bindir() -> Path | None:
    found = shutil.which("initdb")
    if found:
        return Path(found).resolve().parent
    versions = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"))
    return versions[-1].parent if versions else None


@dataclass
class Postgres:
    bindir: Path
    root: Path
    port: int = field(default_factory=free_port)
    process: subprocess.Popen[bytes] | None = None

    @property
    def as_user(self) -> list[str]:
        """The server refuses to run as root: it runs as Debian's `postgres` user then."""
        return ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []

    @property
    def url(self) -> str:
        return f"postgresql://pdserve@127.0.0.1:{self.port}/postgres"

    def init(self) -> None:
        if os.geteuid() == 0:
            shutil.chown(self.root, "postgres")
        subprocess.run(
            [*self.as_user, str(self.bindir / "initdb"), "-D", str(self.root / "data"),
             "-A", "trust", "-U", "pdserve", "--no-sync"],
            check=True, capture_output=True,
        )  # fmt: skip

    def start(self) -> None:
        self.process = subprocess.Popen(
            [*self.as_user, str(self.bindir / "postgres"), "-D", str(self.root / "data"),
             "-p", str(self.port), "-k", str(self.root), "-c", "listen_addresses=127.0.0.1",
             "-c", "fsync=off"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + 30
        while True:
            try:
                psycopg.connect(self.url, connect_timeout=2).close()
                return
            except psycopg.OperationalError:
                assert self.process.poll() is None, "postgres exited"
                assert time.monotonic() < deadline, "postgres never accepted a connection"
                time.sleep(0.1)

    def stop(self) -> None:
        """A fast shutdown (the proxies' connections are cut, not waited for)."""
        if self.process is not None and self.process.poll() is None:
            pg_ctl = [
                str(self.bindir / "pg_ctl"),
                "stop",
                "-m",
                "fast",
                "-D",
                str(self.root / "data"),
            ]
            subprocess.run([*self.as_user, *pg_ctl], capture_output=True, timeout=60)
            self.process.wait(30)


@pytest.fixture(scope="module")
def postgres() -> Iterator[Postgres]:
    bindir = _bindir()
    if bindir is None:
        pytest.skip("no PostgreSQL server here: install Debian's postgresql (.ci/run does)")
    root = Path(tempfile.mkdtemp(prefix="pdserve-pg-"))  # not under pytest's 0700 tree
    server = Postgres(bindir, root)
    try:
        server.init()
        server.start()
        yield server
    finally:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def proxies(agent_nodes: tuple[Server, Server], postgres: Postgres) -> Iterator[list[Node]]:
    fronts: list[Node] = []
    try:
        for _ in range(2):
            fronts.append(start_agent_proxy(agent_nodes, postgres.url))
        yield fronts
    finally:
        stop_all(fronts)


def sdk(proxy: Node, key: str = "alice") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{proxy.url}/v1", api_key=key, max_retries=0)


def turn(proxy: Node, previous: str | None, text: str, key: str = "alice") -> Any:
    return sdk(proxy, key).responses.create(
        model="default", input=text, previous_response_id=previous, max_output_tokens=6,
        temperature=0.0,
    )  # fmt: skip


def test_a_conversation_continues_on_either_proxy(proxies: list[Node]) -> None:
    first, second = proxies
    questions = ["one", "two", "three"]
    turns = [turn(first, None, questions[0])]
    turns.append(turn(second, turns[-1].id, questions[1]))
    turns.append(turn(first, turns[-1].id, questions[2]))
    messages: list[dict[str, Any]] = []
    for question, done in zip(questions, turns, strict=True):
        messages += [{"role": "user", "content": question},
                     {"role": "assistant", "content": done.output_text}]  # fmt: skip
    chat = sdk(first).chat.completions.create(
        model="default",
        messages=messages[:-1],
        max_tokens=6,
        temperature=0.0,  # type: ignore[arg-type]
    )
    assert turns[-1].output_text == chat.choices[0].message.content
    assert sdk(second).responses.retrieve(turns[0].id).output_text == turns[0].output_text
    with pytest.raises(openai.NotFoundError):
        sdk(second, "bob").responses.retrieve(turns[0].id)
    with pytest.raises(openai.NotFoundError):
        turn(second, turns[-1].id, "four", key="bob")


def test_a_database_that_goes_away_is_a_503_until_it_is_back(
    proxies: list[Node], postgres: Postgres
) -> None:
    kept = turn(proxies[0], None, "kept")
    postgres.stop()
    try:
        for proxy in proxies:
            with pytest.raises(openai.APIStatusError) as refused:
                turn(proxy, None, "lost")
            assert refused.value.status_code == 503, refused.value
            assert "response store is unavailable" in str(refused.value)
    finally:
        postgres.start()
    again = turn(proxies[1], kept.id, "back")  # a new connection, the old rows
    assert again.status in ("completed", "incomplete")

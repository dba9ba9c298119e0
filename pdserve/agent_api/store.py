"""Stored responses (`/v1/responses` with `store`), in a real database: SQLite by default (a
file under the user's data directory, or `--response-store PATH`), PostgreSQL when several
proxies serve one cluster (`--response-store postgresql://…`, through psycopg).

One table, one row per response: the Response object as the API returns it, and the
conversation it ends (its context's items, its input's, its output's), which is what a
later `previous_response_id` continues. Every row belongs to the credential that created it
(`owner`: a SHA-256 of the key the client presented); another owner reads nothing, so a
stored response of another key is a 404, never a 403 that says it exists.

The drivers are blocking (sqlite3, psycopg's sync connection): each call runs in a worker
thread under one lock per store, so the event loop never waits on the disk or the network.
A store that cannot be opened, reached or written is a 503 naming why (`StoreUnavailable`):
a response is never reported stored that was not.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import sqlite3
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdserve.errors import ConfigError, StatusError

TABLE = "pdserve_responses"
SCHEMA = f"""CREATE TABLE IF NOT EXISTS {TABLE} (
    id TEXT PRIMARY KEY,
    owner TEXT NOT NULL,
    created_at BIGINT NOT NULL,
    response TEXT NOT NULL,
    conversation TEXT NOT NULL,
    input TEXT NOT NULL
)"""


class StoreUnavailable(StatusError):
    def __init__(self, why: str) -> None:
        super().__init__(
            f"the response store is unavailable: {why}",
            status=503,
            error_type="service_unavailable",
        )


def owner_of(credential: str) -> str:
    """The owner a credential's rows are filed under (the key itself is never stored)."""
    return hashlib.sha256(credential.encode()).hexdigest()


@dataclass(frozen=True)
class Stored:
    response: dict[str, Any]
    conversation: list[dict[str, Any]]
    """The items a continuation starts from: its context, its input and its output."""
    input: list[dict[str, Any]]
    """Its own input items (`GET /v1/responses/{id}/input_items`)."""


class ResponseStore:
    """A table of stored responses behind one blocking DB-API connection, opened on first
    use (a node that never serves `/v1/responses` creates no file)."""

    placeholder = "?"

    def __init__(self, target: str) -> None:
        self.target = target
        self._lock = threading.Lock()
        self._conn: Any = None

    def _connect(self) -> Any:
        raise NotImplementedError

    def _errors(self) -> tuple[type[BaseException], ...]:
        raise NotImplementedError

    def _run(self, sql: str, params: tuple[Any, ...], fetch: bool) -> Any:
        """One statement. A connection that fails is dropped; a kept one that fails (the
        server restarted since) is tried once more on a new one. Every statement here can
        run twice to the same end (an upsert, a delete, a read)."""
        sql = sql.replace("%s", self.placeholder)
        with self._lock:
            while True:
                fresh = self._conn is None
                try:
                    if self._conn is None:
                        self._conn = self._connect()
                        self._conn.execute(SCHEMA)
                    cursor = self._conn.execute(sql, params)
                    return cursor.fetchone() if fetch else cursor.rowcount
                except self._errors() as e:
                    self._drop()
                    if fresh:
                        raise StoreUnavailable(f"{type(e).__name__}: {e}".strip()) from e

    def _drop(self) -> None:
        """Forget a connection that failed (the next call opens a new one)."""
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):  # already broken
                conn.close()

    async def _call(self, sql: str, params: tuple[Any, ...], fetch: bool = False) -> Any:
        return await asyncio.to_thread(self._run, sql, params, fetch)

    async def put(self, response_id: str, owner: str, stored: Stored) -> None:
        """Insert or replace (a background response's row is rewritten when it ends)."""
        await self._call(
            f"INSERT INTO {TABLE} (id, owner, created_at, response, conversation, input) "
            "VALUES (%s, %s, %s, %s, %s, %s) ON CONFLICT (id) DO UPDATE SET "
            "response = excluded.response, conversation = excluded.conversation",
            (
                response_id,
                owner,
                int(stored.response.get("created_at") or 0),
                json.dumps(stored.response),
                json.dumps(stored.conversation),
                json.dumps(stored.input),
            ),
        )

    async def get(self, response_id: str, owner: str) -> Stored | None:
        row = await self._call(
            f"SELECT response, conversation, input FROM {TABLE} WHERE id = %s AND owner = %s",
            (response_id, owner),
            fetch=True,
        )
        if row is None:
            return None
        return Stored(json.loads(row[0]), json.loads(row[1]), json.loads(row[2]))

    async def delete(self, response_id: str, owner: str) -> bool:
        count = await self._call(
            f"DELETE FROM {TABLE} WHERE id = %s AND owner = %s", (response_id, owner)
        )
        return bool(count)

    def close(self) -> None:
        with self._lock:
            self._drop()


class SQLiteStore(ResponseStore):
    placeholder = "?"

    def _connect(self) -> Any:
        Path(self.target).parent.mkdir(parents=True, exist_ok=True)
        # autocommit (isolation_level None): every statement is its own transaction, so a
        # put has reached the file when it returns. WAL lets several processes (a restarted
        # proxy beside a stopping one) read while one writes.
        conn = sqlite3.connect(
            self.target, isolation_level=None, check_same_thread=False, timeout=10.0
        )
        conn.execute("PRAGMA journal_mode=WAL")
        return conn

    def _errors(self) -> tuple[type[BaseException], ...]:
        return (sqlite3.Error, OSError)


class PostgresStore(ResponseStore):
    placeholder = "%s"

    def _connect(self) -> Any:
        import psycopg  # only where a PostgreSQL store is configured

        return psycopg.connect(self.target, autocommit=True, connect_timeout=5)

    def _errors(self) -> tuple[type[BaseException], ...]:
        import psycopg

        return (psycopg.Error, OSError)


def default_path() -> Path:
    """`$XDG_DATA_HOME/pdserve/responses.sqlite3` (`~/.local/share/…` without it)."""
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "pdserve" / "responses.sqlite3"


def open_store(target: str | None) -> ResponseStore:
    """`--response-store`: a PostgreSQL URL, a SQLite file's path, or None (the default
    file). Nothing is opened until the first call."""
    if target and target.startswith(("postgresql://", "postgres://")):
        try:
            import psycopg  # noqa: F401  (checked at start, not at the first request)
        except ImportError as e:
            raise ConfigError(
                "--response-store postgresql://... needs psycopg: pip install 'pdserve[postgres]'"
            ) from e
        return PostgresStore(target)
    return SQLiteStore(target or str(default_path()))

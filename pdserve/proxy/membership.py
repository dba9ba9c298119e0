"""Where the proxy learns its nodes while it serves: one pool abstraction, several sources.

- fixed URLs (`--prefill URL --decode URL`, the default): the pools never change;
- a members file (`--members-file PATH`): JSON `{"prefill": [URL, ...], "decode": [...]}`,
  read again whenever it changes (a deploy tool, a config map or consul-template writes it);
- Ray (`pdserve ray up`, `cluster/ray_nodes.py` `RayMembership`): the controller's list.

Each source answers `members()` once per health interval (`app._follow`); the pools follow
it (`BackendPool.set_members`): new URLs join, missing ones leave. A source that cannot
answer keeps the last membership.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Protocol

from pdserve.errors import ConfigError

logger = logging.getLogger(__name__)

ROLES = ("prefill", "decode")


class Membership(Protocol):
    async def members(self) -> dict[str, list[str]] | None:
        """Node URLs by role (`prefill`, `decode`); None: unknown now, keep the last."""
        ...


def read_members(path: str) -> dict[str, list[str]]:
    """A members file, checked: both roles, each a list of http(s) URLs; ConfigError
    naming what is wrong otherwise."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"members file {path}: {e}") from e
    if not isinstance(data, dict):
        raise ConfigError(f'members file {path}: want {{"prefill": [...], "decode": [...]}}')
    members: dict[str, list[str]] = {}
    for role in ROLES:
        urls = data.get(role)
        if not isinstance(urls, list) or not all(
            isinstance(u, str) and u.startswith(("http://", "https://")) for u in urls
        ):
            raise ConfigError(f"members file {path}: {role!r} must be a list of http(s) URLs")
        members[role] = urls
    return members


class FileMembership:
    """The members file, read again when its modification time changes."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._mtime_ns = os.stat(path).st_mtime_ns
        self._warned = False

    async def members(self) -> dict[str, list[str]] | None:
        try:
            mtime_ns = os.stat(self.path).st_mtime_ns
            if mtime_ns == self._mtime_ns:
                return None  # unchanged: the pools stay as they are
            members = read_members(self.path)
        except (OSError, ConfigError) as e:
            if not self._warned:  # a file being rewritten: say so once, keep the last
                logger.warning("members file ignored until it reads again: %s", e)
                self._warned = True
            return None
        self._mtime_ns, self._warned = mtime_ns, False
        return members

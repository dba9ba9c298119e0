"""vLLM EngineCore: the worker's completion signals, admitted once each (S8)."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

logger = logging.getLogger(f"vllm.{__name__}")  # under vLLM's logging: its format, its level

DUPLICATE_SIGNALS_SEAM = "PDSERVE_VLLM_SEAM_DUPLICATE_SIGNALS"
"""Test seam, never configuration: a file path; while that file exists, the worker reports
every finished id again a step later, and an id nobody asked for, as vLLM bugs and restarts
do (tests/vllm: the S8 storm)."""


class SignalFilter:
    """What the worker may report, once each: `finished_sending` for a request whose blocks
    vLLM holds for a decode node, `finished_recving` for a request reading remote blocks.
    Anything else (a duplicate, a late id after an expiry or a restart) would trip vLLM's
    scheduler asserts and kill EngineCore (vllm#43226): dropped and counted here, in
    `update_connector_output`, which vLLM calls before those asserts on the same object."""

    def __init__(self) -> None:
        self._sending: set[str] = set()
        self._recving: set[str] = set()
        self.num_dropped = 0

    def expect_sending(self, request_id: str) -> None:
        self._sending.add(request_id)

    def expect_recving(self, request_id: str) -> None:
        self._recving.add(request_id)

    def admit(self, output: Any) -> set[str]:
        """Filter the output's id sets in place; returns the `finished_sending` admitted."""
        sending = self._take(output.finished_sending, self._sending, "finished_sending")
        recving = self._take(output.finished_recving, self._recving, "finished_recving")
        output.finished_sending, output.finished_recving = sending, recving
        return sending

    def _take(self, reported: Iterable[str] | None, expected: set[str], what: str) -> set[str]:
        admitted = set()
        for request_id in reported or ():
            if request_id in expected:
                expected.remove(request_id)
                admitted.add(request_id)
            else:
                self.num_dropped += 1
                logger.warning("dropped a late or duplicate %s for %s", what, request_id)
        return admitted

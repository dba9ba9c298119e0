"""`pdserve.vllm.contract`'s checker on small hand-written sources (no vLLM): names found
through re-exports and bases, parameters compared in order, each behaviour told apart.
The same checker runs on real wheels in `test_contract.py` (`make test-vllm`)."""

from __future__ import annotations

import logging
import textwrap

import pytest

from pdserve.vllm.contract import BEHAVIOURS, Name, Reader, Source, check, check_names
from pdserve.vllm.versions import CONTRACT, UnsupportedVLLMError, check_vllm

MODULES = {
    "pkg.base": """
        class Base:
            field: int
            def inherited(self, y): ...
            @property
            def shown(self): ...
    """,
    "pkg.impl": """
        from pkg.base import Base
        class Impl(Base):
            def __init__(self, config):
                self.attr = config
            def own(self, x, *, flag=False): ...
    """,
    "pkg": "from pkg.impl import Impl\n",
}


def source(modules: dict[str, str]) -> Source:
    return lambda name: textwrap.dedent(modules[name]) if name in modules else None


def test_names_are_found_through_re_exports_and_bases() -> None:
    names = (
        Name("pkg", "Impl.inherited", ("self", "y")),
        Name("pkg.impl", "Impl.own", ("self", "x", "flag")),
        Name("pkg.impl", "Impl.field"),
        Name("pkg.impl", "Impl.attr"),
        Name("pkg.impl", "Impl.shown"),
        Name("pkg.base", "Base"),
    )
    assert check_names(names, Reader(source(MODULES))) == []


def test_what_moved_is_named() -> None:
    names = (
        Name("pkg.impl", "Impl.own", ("self", "x")),
        Name("pkg.impl", "Impl.gone", ("self",)),
        Name("pkg.impl", "Impl.nothing"),
        Name("pkg.other", "Thing"),
    )
    assert check_names(names, Reader(source(MODULES))) == [
        "pkg.impl.Impl.own(self, x) now takes (self, x, flag)",
        "pkg.impl.Impl.gone is gone",
        "pkg.impl.Impl.nothing is gone",
        "pkg.other.Thing is gone",
    ]


WORKER = "vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker"
SCHEDULER = "vllm.v1.core.sched.scheduler"
BASE_WORKER = "vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker"
HOLDS = {
    WORKER: """
        class NixlPullConnectorWorker:
            def get_transfer_results(self):
                self._reap()
            def _reap(self):
                for rid, deadline in self._reqs_to_send.items():
                    if deadline < now():
                        expired.append(rid)
    """,
    SCHEDULER: """
        class Scheduler:
            def _update_from_kv_xfer_finished(self, output):
                if self.connector is not None:
                    self.connector.update_connector_output(output)
                for rid in output.finished_sending:
                    assert rid in self.requests
    """,
    BASE_WORKER: """
        class NixlBaseConnectorWorker:
            def get_transfer_results(self):
                for rid in done:
                    if rid in failed:
                        if not self._is_hma_required:
                            self._invalid_block_ids.put(set(meta.local_block_ids[0]))
                        continue
    """,
}


def test_the_behaviours_hold_where_the_source_keeps_them() -> None:
    assert check((), source(HOLDS)) == []


def test_each_behaviour_that_changed_is_named() -> None:
    broken = {
        WORKER: HOLDS[WORKER].replace("self._reap()", "pass"),
        SCHEDULER: """
            class Scheduler:
                def _update_from_kv_xfer_finished(self, output):
                    for rid in output.finished_sending:
                        assert rid in self.requests
                    self.connector.update_connector_output(output)
        """,
        BASE_WORKER: HOLDS[BASE_WORKER].replace("if not self._is_hma_required:", "if True:"),
    }
    problems = check((), source(broken))
    assert len(problems) == len(BEHAVIOURS) == 3
    assert "no longer expires" in problems[0] and "before the connector sees it" in problems[1]
    assert "several KV cache groups" in problems[2]
    unguarded = """
        class NixlBaseConnectorWorker:
            def get_transfer_results(self):
                self._invalid_block_ids.put(set(meta.local_block_ids[0]))
    """
    assert "several KV cache groups" in check((), source({**HOLDS, BASE_WORKER: unguarded}))[0]


def test_the_contract_touches_no_private_vllm_name() -> None:
    members = [n.qualname.rpartition(".")[2] for n in CONTRACT]
    assert [m for m in members if m.startswith("_") and m != "__init__"] == []


def everything() -> dict[str, str]:
    """A vLLM whose source has every contracted name, in the form the contract uses, and
    keeps every behaviour (`HOLDS`)."""
    modules = {m: textwrap.dedent(text).strip().splitlines() for m, text in HOLDS.items()}
    for name in CONTRACT:
        cls, _, member = name.qualname.partition(".")
        lines = modules.setdefault(name.module, [])
        if f"class {cls}:" not in lines:
            lines += [f"class {cls}:", "    pass"]
        if member and not any(f"def {member}(" in line for line in lines):
            params = ", ".join(name.params or ())
            body = f"    def {member}({params}): ..." if name.params else f"    {member}: int"
            lines.insert(lines.index(f"class {cls}:") + 1, body)
    return {m: "\n".join(lines) + "\n" for m, lines in modules.items()}


def test_the_policy_older_refused_newer_warned_moved_named(
    caplog: pytest.LogCaptureFixture,
) -> None:
    vllm = source(everything())
    assert check_vllm("0.34.0", vllm) == "0.34.0"
    assert check_vllm("0.32.0+cpu", vllm) == "0.32.0"
    with caplog.at_level(logging.WARNING, logger="pdserve.vllm"):
        assert check_vllm("0.35.2", vllm) == "0.35.2"
    assert "newer than the newest" in caplog.text
    with pytest.raises(UnsupportedVLLMError, match="older than any it checks"):
        check_vllm("0.31.1", vllm)
    gone = {**everything(), "vllm.v1.request": "class Request:\n    request_id: str\n"}
    with pytest.raises(UnsupportedVLLMError, match=r"Request\.kv_transfer_params is gone"):
        check_vllm("0.34.0", source(gone))

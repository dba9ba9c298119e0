"""n > 1 on a request that loads its KV from another node (a decode leg): the first sample
loads, the others wait for the load to end and then run from the prefix cache; a failed or
aborted load ends them all, nothing left waiting. On the tiny model with a connector whose
loads end when the test says."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pdserve.engine.engine import LLMEngine
from pdserve.engine.kv_connector import KVConnector
from pdserve.engine.kv_types import ConnectorEvents, KVTransferSpec, LoadResult
from pdserve.engine.request import Request
from pdserve.llm import engine_config
from pdserve.outputs import RequestOutput
from pdserve.sampling_params import SamplingParams

PROMPT = [(5 * i + 11) % 200 + 3 for i in range(40)]


class Loader(KVConnector):
    """Every request with a transfer spec loads all its prompt; the load ends with
    `outcome` once set."""

    def __init__(self) -> None:
        self.loading: list[str] = []
        self.outcome: LoadResult | None = None

    def get_num_remote_tokens(self, request: Request, num_local_tokens: int) -> int:
        if request.kv_transfer is None:
            return 0
        return request.num_prompt_tokens - num_local_tokens

    def on_admitted(self, request: Request, block_ids: Sequence[int], num_remote: int) -> None:
        if num_remote:
            self.loading.append(request.request_id)

    def on_step_finished(self, output: Any) -> ConnectorEvents:
        if self.outcome is None or not self.loading:
            return ConnectorEvents()
        ended = tuple(LoadResult(r, self.outcome.ok, self.outcome.error) for r in self.loading)
        self.loading = []
        return ConnectorEvents(loads_finished=ended)


def _engine(tiny_model_dir: Any) -> tuple[LLMEngine, Loader]:
    loader = Loader()
    config = engine_config(model=str(tiny_model_dir("llama")), dtype="float32", block_size=16,
                           num_blocks=64, max_model_len=256)  # fmt: skip
    return LLMEngine(config, connector_factory=lambda *_: loader), loader


def _run(engine: LLMEngine, steps: int = 200) -> list[RequestOutput]:
    outputs = []
    for _ in range(steps):
        if not engine.has_unfinished():
            break
        outputs += engine.step()
    return outputs


def test_the_other_samples_run_once_the_load_ends(tiny_model_dir: Any) -> None:
    engine, loader = _engine(tiny_model_dir)
    params = SamplingParams(n=3, max_tokens=5, temperature=0.8, seed=3)
    engine.add_request(PROMPT, params, "r", kv_transfer=KVTransferSpec())
    for _ in range(3):
        assert engine.step() == []  # the first sample loads; the others wait
    assert len(engine.scheduler.requests) == 1 and len(loader.loading) == 1
    loader.outcome = LoadResult("", ok=False)  # read nothing: recompute the prompt
    [*_, last] = _run(engine)
    assert last.finished and last.error is None
    assert [len(c.token_ids) for c in last.outputs] == [5, 5, 5]
    reference, _ = _engine(tiny_model_dir)
    reference.add_request(PROMPT, params, "r")
    [*_, alone] = _run(reference)
    assert [c.token_ids for c in last.outputs] == [c.token_ids for c in alone.outputs]
    assert engine.kv.num_free_blocks == reference.kv.num_free_blocks


def test_a_failed_load_or_an_abort_ends_every_sample(tiny_model_dir: Any) -> None:
    engine, loader = _engine(tiny_model_dir)
    params = SamplingParams(n=3, max_tokens=5)
    engine.add_request(PROMPT, params, "failed", kv_transfer=KVTransferSpec())
    engine.step()
    loader.outcome = LoadResult("", ok=False, error="claim refused")
    [*_, last] = _run(engine)
    assert last.finished and last.error == "claim refused"
    assert not engine.has_unfinished() and not engine.outputs.request_ids()

    loader.outcome = None
    engine.add_request(PROMPT, params, "aborted", kv_transfer=KVTransferSpec())
    engine.step()
    [aborted] = engine.abort(["aborted"])
    assert aborted.finished and aborted.aborted
    assert not engine.outputs.request_ids()

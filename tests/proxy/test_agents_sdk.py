"""The OpenAI Agents SDK (`openai-agents`) runs an agent against `pdserve up` on the default
model, through P/D, over the Responses API: a task that needs three tools, one turn each,
then a final answer. SmolLM2-135M does not call tools by itself, so the agent forces it
(`tool_choice: required`, grammar-enforced); each tool is offered until it has been used,
and `finish` once all three have, so the run needs every tool and ends by itself."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Annotated

import httpx
import openai
import pytest
from pydantic import BaseModel, Field

from pdserve.launch import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

Short = Annotated[str, Field(max_length=40)]
"""A tool's text argument: bounded, so that a forced call always closes (a small model
left to itself writes strings on and on)."""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`pdserve up` (proxy, prefill node, decode node) on the default model."""
    port = free_port()
    store = tmp_path_factory.mktemp("store") / "r.sqlite3"
    cmd = [sys.executable, "-m", "pdserve.cli", "up", "--port", str(port),
           "--response-store", str(store)]  # fmt: skip
    env = {**os.environ, "PDSERVE_LOG_LEVEL": "WARNING", "HF_HUB_OFFLINE": "1"}
    process = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while not _healthy(url):
            assert process.poll() is None, "pdserve up exited"
            assert time.monotonic() < deadline, "pdserve up never became healthy"
            time.sleep(0.2)
        yield url
    finally:
        process.terminate()  # up stops its nodes, then itself
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_a_three_tool_agent_runs_through_p_d(cluster: str) -> None:
    from agents import (
        Agent,
        ModelSettings,
        OpenAIResponsesModel,
        RunContextWrapper,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)  # traces would go to OpenAI's servers
    used: list[str] = []

    def offered_until_used(name: str):  # type: ignore[no-untyped-def]
        return lambda ctx, agent: name not in used

    @function_tool(is_enabled=offered_until_used("get_weather"))
    def get_weather(city: Short) -> str:
        """The weather in a city now."""
        used.append("get_weather")
        return "18 C and cloudy"

    @function_tool(is_enabled=offered_until_used("to_fahrenheit"))
    def to_fahrenheit(celsius: Annotated[float, Field(ge=-90, le=60)]) -> str:
        """A temperature in Celsius, in Fahrenheit."""
        used.append("to_fahrenheit")
        return f"{celsius * 9 / 5 + 32:.1f} F"

    @function_tool(is_enabled=offered_until_used("save_report"))
    def save_report(text: Short) -> str:
        """Saves a weather report."""
        used.append("save_report")
        return "saved"

    def all_used(ctx: RunContextWrapper[None], agent: object) -> bool:
        return len(set(used)) == 3

    @function_tool(is_enabled=all_used)
    def finish(answer: Short) -> str:
        """The final answer to the user."""
        return answer

    client = openai.AsyncOpenAI(base_url=f"{cluster}/v1", api_key="agent", max_retries=0)
    agent = Agent(
        name="weather",
        instructions="Get the weather in Paris, convert it to Fahrenheit, save a report, "
        "then finish with a one-line answer.",
        tools=[get_weather, to_fahrenheit, save_report, finish],
        model=OpenAIResponsesModel(model="default", openai_client=client),
        model_settings=ModelSettings(
            tool_choice="required", parallel_tool_calls=False, max_tokens=120, temperature=0.0
        ),
        reset_tool_choice=False,  # forced every turn: the offered tools decide which
        tool_use_behavior={"stop_at_tool_names": ["finish"]},
    )
    result = Runner.run_sync(agent, "What is the weather in Paris?", max_turns=6)
    assert sorted(used) == ["get_weather", "save_report", "to_fahrenheit"]
    assert isinstance(result.final_output, str)
    calls = [i for i in result.new_items if i.type == "tool_call_item"]
    assert [c.raw_item.name for c in calls][-1] == "finish"  # type: ignore[union-attr]
    assert len(result.raw_responses) == 4  # one model turn per tool, and finish


class City(BaseModel):
    name: str
    country: str


def test_the_openai_sdk_on_the_default_model(cluster: str) -> None:
    client = openai.OpenAI(base_url=f"{cluster}/v1", api_key="user", max_retries=0)
    first = client.responses.create(
        model="default", input="What is the capital of France?", temperature=0.0,
        max_output_tokens=24,
    )  # fmt: skip
    assert "Paris" in first.output_text
    with client.responses.stream(
        model="default", input="And of Italy?", previous_response_id=first.id,
        temperature=0.0, max_output_tokens=24,
    ) as stream:  # fmt: skip
        text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert "Rome" in text and final.output_text == text
    parsed = client.responses.parse(
        model="default", input="Name a city and its country.", text_format=City,
        max_output_tokens=60, temperature=0.0,
    )  # fmt: skip
    assert isinstance(parsed.output_parsed, City)

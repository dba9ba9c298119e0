"""Structured outputs (pdserve/structured.py): OpenAI's `response_format` and vLLM's
`structured_outputs`, through the `openai` SDK against a node on the default model, and
offline on the engine. Every output of a 200 fits what was asked; what cannot be served is
a 400 before the engine sees it."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated, Any, Literal

import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, ConfigDict, Field, create_model

from pdserve.errors import InvalidRequestError
from pdserve.structured import check, grammar_for
from tests.api.conftest import API_KEY, Server

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)


class City(BaseModel):
    name: str = Field(max_length=24)
    country: str = Field(max_length=24)
    population_millions: int = Field(ge=0, le=100)


def test_sdk_parse_returns_a_validated_object(client: openai.OpenAI) -> None:
    done = client.chat.completions.parse(
        model="default",
        messages=[{"role": "user", "content": "Describe Paris as JSON."}],
        response_format=City,
        max_tokens=120,
        temperature=0,
    )
    choice = done.choices[0]
    assert choice.finish_reason == "stop", choice
    assert isinstance(choice.message.parsed, City)


def test_json_object_choice_regex_and_grammar(client: openai.OpenAI) -> None:
    def ask(**extra: Any) -> str:
        done = client.chat.completions.create(
            model="default",
            messages=[{"role": "user", "content": "Is the sky blue? Answer."}],
            max_tokens=60,
            temperature=0,
            **extra,
        )
        return done.choices[0].message.content or ""

    assert isinstance(json.loads(ask(response_format={"type": "json_object"})), dict)
    choices = ["yes", "no", "it depends"]
    assert ask(extra_body={"structured_outputs": {"choice": choices}}) in choices
    assert re.fullmatch(
        r"[A-Z][a-z]{2,8}!", ask(extra_body={"structured_outputs": {"regex": r"[A-Z][a-z]{2,8}!"}})
    )
    lark = 'start: "answer: " ("yes" | "no")'
    assert ask(extra_body={"structured_outputs": {"grammar": lark}}) in (
        "answer: yes",
        "answer: no",
    )
    gbnf = 'root ::= "maybe " [0-9]'
    assert re.fullmatch(r"maybe [0-9]", ask(extra_body={"structured_outputs": {"grammar": gbnf}}))


def test_completions_take_response_format_and_stream_it(client: openai.OpenAI) -> None:
    schema = City.model_json_schema()
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": schema}}
    done = client.completions.create(
        model="default", prompt="The capital of Italy as JSON:", max_tokens=120, temperature=0,
        extra_body={"response_format": fmt},
    )  # fmt: skip
    City.model_validate_json(done.choices[0].text)
    stream = client.completions.create(
        model="default", prompt="The capital of Italy as JSON:", max_tokens=120, temperature=0,
        stream=True, extra_body={"response_format": fmt},
    )  # fmt: skip
    assert "".join(c.choices[0].text for c in stream if c.choices) == done.choices[0].text


BAD_SCHEMA = {"name": "x", "schema": {"type": "strnig"}}


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": BAD_SCHEMA}}, "strnig"),
        ({"response_format": {"type": "yaml"}}, "yaml"),
        ({"structured_outputs": {"regex": "(a|b"}}, "regex"),
        ({"structured_outputs": {"choice": []}}, "choice"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "exactly one"),
        ({"structured_outputs": {"grammar": "start: undefined_rule"}}, "undefined_rule"),
        ({"structured_outputs": {"json": {"type": "string", "format": "no-such"}}}, "no-such"),
        ({"structured_outputs": {"json": "{not json"}}, "not valid JSON"),
        ({"guided_json": {"type": "object"}}, "structured_outputs"),
    ],
)  # fmt: skip
def test_bad_constraints_are_400s_naming_the_problem(
    client: openai.OpenAI, server: Server, extra: dict[str, Any], says: str
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model="default", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
            extra_body=extra,
        )  # fmt: skip
    assert says in str(caught.value), caught.value


# -- properties, offline: many schemas in one batch -----------------------------------------

STRICT = ConfigDict(extra="forbid")
# Bounded values only: an unbounded integer or any float lets greedy decoding on the default
# model write digits until max_tokens (a 200 with finish_reason length, as OpenAI answers;
# docs/api.md), and JSON Schema cannot bound a float's digits.
_FIELD_TYPES = st.sampled_from(["str", "int", "bool", "enum", "list"])


def _field(kind: str) -> tuple[Any, Any]:
    if kind == "str":
        return (str, Field(max_length=12))
    if kind == "int":
        return (int, Field(ge=-50, le=5000))
    if kind == "bool":
        return (bool, ...)
    if kind == "enum":
        return (Literal["red", "green", "blue"], ...)
    return (list[Annotated[int, Field(ge=0, le=99)]], Field(max_length=3))


@st.composite
def models(draw: st.DrawFn) -> type[BaseModel]:
    names = draw(
        st.lists(st.from_regex(r"[a-z]{1,8}", fullmatch=True), min_size=1, max_size=4, unique=True)
    )
    fields = {n: _field(draw(_FIELD_TYPES)) for n in names}
    if draw(st.booleans()):
        inner = create_model("Inner", __config__=STRICT, x=(int, Field(ge=0, le=9)))
        fields["inner"] = (inner, ...)
    # Closed objects, as the SDK's `parse` sends them (strict): an open one lets the model
    # add properties without end, and a 135M model does.
    return create_model("Generated", __config__=STRICT, **fields)  # type: ignore[call-overload, no-any-return]


def drawn_models(count: int = 20) -> list[type[BaseModel]]:
    drawn: list[type[BaseModel]] = []

    @settings(
        max_examples=count, deadline=None, suppress_health_check=list(HealthCheck), database=None
    )
    @given(models())
    def collect(model: type[BaseModel]) -> None:
        drawn.append(model)

    collect()
    assert len(drawn) == count
    return drawn


def parse_each(client: openai.OpenAI, drawn: list[type[BaseModel]], model: str | None) -> None:
    """The SDK's `parse` for each model, 8 at a time: each returns a validated object."""

    def parse(schema: type[BaseModel]) -> Any:
        done = client.chat.completions.parse(
            model=model,  # type: ignore[arg-type]
            messages=[{"role": "user", "content": "Some JSON, please."}],
            response_format=schema, max_tokens=400, temperature=0,
        )  # fmt: skip
        return done.choices[0].message.parsed

    with ThreadPoolExecutor(8) as pool:
        parsed = list(pool.map(parse, drawn))
    for schema, value in zip(drawn, parsed, strict=True):
        assert isinstance(value, schema), (schema.model_json_schema(), value)


def test_sdk_parse_of_20_generated_schemas(client: openai.OpenAI) -> None:
    """Issue 34's acceptance on one node: 20 schemas drawn by hypothesis, served at once."""
    parse_each(client, drawn_models(), "default")


def test_grammar_for_each_form() -> None:
    for fmt in ({"type": "json_object"}, {"type": "json_schema", "json_schema": {"name": "n"}}):
        check(grammar_for(fmt, None) or "", "response_format")
    assert grammar_for({"type": "text"}, None) is None and grammar_for(None, None) is None
    with pytest.raises(InvalidRequestError, match="not both"):
        grammar_for({"type": "json_object"}, {"regex": "a"})
    with pytest.raises(InvalidRequestError, match="Invalid type"):
        check(grammar_for(None, {"json": {"type": "strnig"}}) or "", "structured_outputs")

"""What a node does with each request field that OpenAI's API or vLLM's extensions define
beyond the ones it honours (`protocol.py`): refuse it with a 400 naming it, unless its
value asks for nothing (`false`, `null`, the default), or accept it as a label that
changes no output (logged once per process).

A field no model and no table here names is refused too, in OpenAI's words
("Unrecognized request argument supplied: ..."): a typo or a feature this server lacks
never becomes a 200 that ignores what was asked. docs/api.md lists the three sets.
"""

from __future__ import annotations

import logging
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, model_validator
from pydantic.json_schema import JsonDict

from pdserve.errors import InvalidRequestError

logger = logging.getLogger(__name__)

OLD_TOOLS = "OpenAI's deprecated form: send tools and tool_choice"
OLD_STRUCTURED = "vLLM's older name: send structured_outputs (json, regex, choice, grammar)"

NOT_SERVED: dict[str, tuple[str, tuple[Any, ...]]] = {
    # field: (why, the values that ask for nothing and are accepted)
    "best_of": ("pdserve returns every sample it draws (use n)", (None, 1)),
    "suffix": ("pdserve does not insert text (no suffix)", (None, "")),
    "prompt_logprobs": (
        "send echo with logprobs: the prompt's logprobs in OpenAI's shape",
        (None,),
    ),
    "guided_json": (OLD_STRUCTURED, (None,)),
    "guided_regex": (OLD_STRUCTURED, (None,)),
    "guided_choice": (OLD_STRUCTURED, (None,)),
    "guided_grammar": (OLD_STRUCTURED, (None,)),
    "guided_decoding_backend": ("pdserve's grammar engine is llguidance", (None,)),
    "guided_whitespace_pattern": (OLD_STRUCTURED, (None,)),
    "priority": ("requests are served first come, first served", (None, 0)),
    "chat_template": ("the model's own chat template is used", (None,)),
    "add_generation_prompt": ("the assistant's turn is always opened", (None, True)),
    "continue_final_message": ("a chat always opens a new assistant turn", (None, False)),
    "truncate_prompt_tokens": ("prompts are never truncated", (None,)),
    "allowed_token_ids": ("use logit_bias", (None,)),
    "bad_words": ("use logit_bias or stop", (None, [])),
    "use_beam_search": ("pdserve has no beam search", (None, False)),
    "length_penalty": ("pdserve has no beam search", (None, 1, 1.0)),
    "spaces_between_special_tokens": ("special tokens decode as they are", (None, True)),
    "store": ("pdserve stores no completions", (None, False)),
    "audio": ("pdserve answers in text only", (None,)),
    "modalities": ("pdserve answers in text only", (None, ["text"])),
    "prediction": ("pdserve has no predicted outputs", (None,)),
    "reasoning_effort": ("the model has no reasoning setting", (None,)),
    "verbosity": ("the model has no verbosity setting", (None,)),
    "web_search_options": ("pdserve has no web search", (None,)),
    "functions": (OLD_TOOLS, (None, [])),
    "function_call": (OLD_TOOLS, (None, "none")),
}
"""Fields pdserve does not serve: a value other than these is a 400 naming the field."""

NO_EFFECT: dict[str, str] = {
    "user": "an end user's id, for the operator's own records",
    "metadata": "labels for stored completions (pdserve stores none)",
    "safety_identifier": "an end user's id, for the operator's own records",
    "service_tier": "pdserve has one tier",
    "prompt_cache_key": "pdserve's prefix cache needs no key: it matches prompts by content",
    "prompt_cache_retention": "pdserve's prefix cache keeps blocks until it needs the space",
}
"""Labels and hints that change no output: accepted, logged once per process."""

_logged: set[str] = set()


def screen(
    data: dict[str, Any],
    served: set[str],
    not_served: dict[str, tuple[str, tuple[Any, ...]]] = NOT_SERVED,
    no_effect: dict[str, str] = NO_EFFECT,
) -> dict[str, Any]:
    """`data` without the fields that ask for nothing (or only label the request); a 400
    naming the first field that asks for what is not served. `served`: the fields the
    request model honours, passed as they are; the tables: the API's (chat and
    completions by default)."""
    kept = {}
    for name, value in data.items():
        if name in served:
            kept[name] = value
        elif name in not_served:
            why, accepted = not_served[name]
            if not any(value == ok and type(value) is type(ok) for ok in accepted):
                raise InvalidRequestError(f"parameter {name} is not supported: {why}", param=name)
        elif name in no_effect:
            if name not in _logged:
                _logged.add(name)
                logger.info("accepted %s, which changes no output: %s", name, no_effect[name])
        else:
            kept[name] = value  # the model refuses it: unrecognized
    return kept


def _document_screened(schema: JsonDict, model: type[BaseModel]) -> None:
    """/openapi.json: the fields a body's tables pass, with what is done with them."""
    properties = schema.setdefault("properties", {})
    assert isinstance(properties, dict)
    not_served: dict[str, tuple[str, tuple[Any, ...]]] = getattr(model, "not_served", {})
    no_effect: dict[str, str] = getattr(model, "no_effect", {})
    for name, (why, accepted) in not_served.items():
        if name not in properties:
            allowed = ", ".join("null" if v is None else repr(v) for v in accepted)
            properties[name] = {"description": f"refused (400) unless {allowed}: {why}"}
    for name, effect in no_effect.items():
        properties.setdefault(name, {"description": f"accepted, changes no output: {effect}"})


class ScreenedBody(BaseModel):
    """A request body whose fields beyond its own are screened (`screen`) against its API's
    tables, then refused by pydantic if still there (`extra="forbid"`); its schema in
    /openapi.json names them too."""

    model_config = ConfigDict(extra="forbid", json_schema_extra=_document_screened)
    not_served: ClassVar[dict[str, tuple[str, tuple[Any, ...]]]] = NOT_SERVED
    no_effect: ClassVar[dict[str, str]] = NO_EFFECT

    @model_validator(mode="before")
    @classmethod
    def _screen(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        return screen(data, set(cls.model_fields), cls.not_served, cls.no_effect)

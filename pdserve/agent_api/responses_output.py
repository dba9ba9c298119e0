"""A Response object built from a chat answer, with the stream events that build it.

`ResponseRun` folds chat deltas (a stream's chunks, or a whole answer's message as one
delta) into the response's output items, and records the events the Responses stream
sends for each step, in the order OpenAI's SDK folds them (`response.output_item.added`,
`response.content_part.added`, `response.output_text.delta`, … `response.completed`).
A streamed and a non-streamed answer are the same fold, so they cannot disagree.

Items, in the order the model produced them:
    reasoning_content → a `reasoning` item (its text as `reasoning_text` content)
    content           → a `message` item with one `output_text` part (logprobs with it)
    tool_calls        → one `function_call` item per call (chat sends each whole)
"""

from __future__ import annotations

import copy
import time
from typing import Any

from pdserve.agent_api.responses_input import ResponsesRequest, new_id


class ResponseRun:
    def __init__(self, body: ResponsesRequest, response_id: str | None = None) -> None:
        self.body = body
        self.response: dict[str, Any] = {
            "id": response_id or new_id("resp"),
            "object": "response",
            "created_at": int(time.time()),
            "status": "in_progress",
            "background": body.background,
            "error": None,
            "incomplete_details": None,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "model": body.model,
            "output": [],
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id,
            "reasoning": {"effort": (body.reasoning or {}).get("effort"), "summary": None},
            "store": body.store,
            "temperature": 1.0 if body.temperature is None else body.temperature,
            "text": body.text or {"format": {"type": "text"}},
            "tool_choice": body.tool_choice or "auto",
            "tools": body.tools or [],
            "top_logprobs": body.top_logprobs,
            "top_p": 1.0 if body.top_p is None else body.top_p,
            "truncation": "disabled",
            "usage": None,
            "user": body.user,
            "metadata": body.metadata or {},
        }
        self.events: list[dict[str, Any]] = []
        """Events not yet sent (`take_events`)."""
        self._sequence = 0
        self._open: dict[str, Any] | None = None
        """The item deltas are being added to (a reasoning or message item)."""
        self.started = False
        self.num_input = 0
        """How many items of the conversation are this request's input."""

    @property
    def id(self) -> str:
        return str(self.response["id"])

    @property
    def output(self) -> list[dict[str, Any]]:
        return list(self.response["output"])

    def _emit(self, kind: str, **fields: Any) -> None:
        self.events.append({"type": kind, "sequence_number": self._sequence, **fields})
        self._sequence += 1

    def take_events(self) -> list[dict[str, Any]]:
        events, self.events = self.events, []
        return events

    def start(self, model: str | None) -> None:
        """`response.created` and `response.in_progress` (the model's name as served)."""
        if self.started:
            return
        self.started = True
        if self.response["model"] is None:
            self.response["model"] = model
        for kind in ("response.created", "response.in_progress"):
            self._emit(kind, response=copy.deepcopy(self.response))

    def feed(self, delta: dict[str, Any], logprobs: dict[str, Any] | None = None) -> None:
        """One chat delta (or a whole message), with its choice's logprobs if any."""
        if delta.get("reasoning_content"):
            self._add_text("reasoning", delta["reasoning_content"], None)
        if delta.get("content") or (logprobs and logprobs.get("content")):
            entries = (logprobs or {}).get("content") or []
            self._add_text("message", delta.get("content") or "", entries)
        for call in delta.get("tool_calls") or ():
            self._add_call(call)

    def _add_text(self, kind: str, text: str, logprobs: list[dict[str, Any]] | None) -> None:
        if self._open is None or self._open["type"] != kind:
            self._close()
            self._open_item(kind)
        item = self._open
        assert item is not None
        part = item["content"][0]
        part["text"] += text
        where = {"item_id": item["id"], "output_index": self._index(item), "content_index": 0}
        if kind == "message":
            part["logprobs"] += logprobs or []
            self._emit("response.output_text.delta", **where, delta=text, logprobs=logprobs or [])
        else:
            self._emit("response.reasoning_text.delta", **where, delta=text)

    def _open_item(self, kind: str) -> None:
        item: dict[str, Any]
        part: dict[str, Any]
        if kind == "message":
            item = {
                "id": new_id("msg"),
                "type": "message",
                "status": "in_progress",
                "role": "assistant",
                "content": [],
            }
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        else:
            item = {
                "id": new_id("rs"),
                "type": "reasoning",
                "summary": [],
                "content": [],
                "status": "in_progress",
            }
            part = {"type": "reasoning_text", "text": ""}
        self.response["output"].append(item)
        self._emit(
            "response.output_item.added", output_index=self._index(item), item=copy.deepcopy(item)
        )
        item["content"].append(part)
        self._emit(
            "response.content_part.added",
            item_id=item["id"],
            output_index=self._index(item),
            content_index=0,
            part=copy.deepcopy(part),
        )
        self._open = item

    def _close(self, status: str = "completed") -> None:
        item, self._open = self._open, None
        if item is None:
            return
        part = item["content"][0]
        item["status"] = status
        where = {"item_id": item["id"], "output_index": self._index(item), "content_index": 0}
        if item["type"] == "message":
            self._emit(
                "response.output_text.done", **where, text=part["text"], logprobs=part["logprobs"]
            )
        else:
            self._emit("response.reasoning_text.done", **where, text=part["text"])
        self._emit("response.content_part.done", **where, part=copy.deepcopy(part))
        self._emit(
            "response.output_item.done",
            output_index=where["output_index"],
            item=copy.deepcopy(item),
        )

    def _add_call(self, call: dict[str, Any]) -> None:
        self._close()
        function = call.get("function") or {}
        arguments = function.get("arguments") or ""
        item = {
            "id": new_id("fc"),
            "type": "function_call",
            "status": "in_progress",
            "call_id": call.get("id") or new_id("call"),
            "name": function.get("name"),
            "arguments": "",
        }
        self.response["output"].append(item)
        index = self._index(item)
        self._emit("response.output_item.added", output_index=index, item=copy.deepcopy(item))
        self._emit(
            "response.function_call_arguments.delta",
            item_id=item["id"],
            output_index=index,
            delta=arguments,
        )
        item.update(arguments=arguments, status="completed")
        self._emit(
            "response.function_call_arguments.done",
            item_id=item["id"],
            output_index=index,
            name=item["name"],
            arguments=arguments,
        )
        self._emit("response.output_item.done", output_index=index, item=copy.deepcopy(item))

    def _index(self, item: dict[str, Any]) -> int:
        return next(i for i, o in enumerate(self.response["output"]) if o is item)

    def finish(self, finish_reason: str | None, usage: dict[str, Any] | None) -> None:
        """The response's end: `completed`, or `incomplete` when max_output_tokens cut it."""
        cut = finish_reason == "length"
        self._close("incomplete" if cut else "completed")
        self.response["usage"] = responses_usage(usage)
        if cut:
            self.response.update(
                status="incomplete", incomplete_details={"reason": "max_output_tokens"}
            )
        else:
            self.response["status"] = "completed"

    def final_event(self) -> None:
        kind = (
            "response.incomplete"
            if self.response["status"] == "incomplete"
            else "response.completed"
        )
        self._emit(kind, response=copy.deepcopy(self.response))

    def error_event(self, code: str, message: str) -> None:
        """The stream's `error` event (the response could not be stored)."""
        self._emit("error", code=code, message=message, param=None)

    def fail(self, error: dict[str, Any]) -> None:
        """The chat request failed after the response began (its stream's error event)."""
        self._close("incomplete")
        code = error.get("type") or "server_error"
        self.response.update(
            status="failed", error={"code": code, "message": str(error.get("message", ""))}
        )
        self._emit("response.failed", response=copy.deepcopy(self.response))


def responses_usage(usage: dict[str, Any] | None) -> dict[str, Any] | None:
    """Chat's usage in the Responses API's words."""
    if not usage:
        return None
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    reasoning = (usage.get("completion_tokens_details") or {}).get("reasoning_tokens") or 0
    return {
        "input_tokens": usage.get("prompt_tokens", 0),
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": usage.get("completion_tokens", 0),
        "output_tokens_details": {"reasoning_tokens": reasoning},
        "total_tokens": usage.get("total_tokens", 0),
    }

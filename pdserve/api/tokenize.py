"""`POST /tokenize` and `POST /detokenize`, as vLLM serves them: a prompt, or chat messages
through the model's chat template, to the token ids the engine computes for them, and ids
back to text.

    /tokenize    {"prompt": "..."} or {"messages": [...], "tools": [...] (optional),
                  "add_generation_prompt": true}
                 → {"count", "max_model_len", "tokens", "token_strs" (with return_token_strs)}
    /detokenize  {"tokens": [...]} → {"prompt": "..."}

The node's API process loads the model's tokenizer (no weights, no torch: `model/files.py`)
on the first call, so a node that is never asked pays nothing.
"""

from __future__ import annotations

import asyncio
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pdserve.errors import InvalidRequestError, PdserveError
from pdserve.model.tokenizer import Tokenizer
from pdserve.openai_api.errors import MAX_BODY_BYTES, from_exception, read_json, validate_body
from pdserve.openai_api.protocol import (
    DetokenizeRequest,
    TokenizeRequest,
    check_model,
)
from pdserve.tools import ToolSpec


class Tokenization:
    """The node's tokenizer for these routes, loaded once on first use."""

    def __init__(self, model: str, model_name: str) -> None:
        self.model, self.model_name = model, model_name
        self._lock = asyncio.Lock()
        self._tokenizer: Tokenizer | None = None

    async def tokenizer(self) -> Tokenizer:
        async with self._lock:
            if self._tokenizer is None:
                from pdserve.model.files import load_tokenizer

                loaded = await asyncio.to_thread(load_tokenizer, self.model)
                if loaded is None:
                    raise InvalidRequestError("this model has no tokenizer: it takes token ids")
                self._tokenizer = loaded
            return self._tokenizer

    async def tokenize(self, request: Request, max_model_len: int | None) -> Response:
        try:
            body = validate_body(await read_json(request, MAX_BODY_BYTES), TokenizeRequest)
            check_model(body.model, self.model_name)
            if (body.prompt is None) == (body.messages is None):
                raise InvalidRequestError("send either prompt or messages", param="prompt")
            if body.tools and body.messages is None:
                raise InvalidRequestError("tools belong with messages", param="tools")
            tok = await self.tokenizer()
            if body.messages is not None:
                messages = [m.template_input() for m in body.messages]
                spec = ToolSpec.parse(body.tools, None, None)
                tools = spec.template_tools() if spec is not None else None
                text = tok.apply_chat_template(
                    messages, body.add_generation_prompt, tools, body.chat_template_kwargs
                )
            else:
                assert body.prompt is not None
                text = body.prompt
            ids = tok.encode(text, add_special_tokens=body.add_special_tokens)
        except PdserveError as e:
            return from_exception(e)
        answer: dict[str, Any] = {
            "count": len(ids),
            "max_model_len": max_model_len,
            "tokens": ids,
            "token_strs": [tok.id_to_token(t) for t in ids] if body.return_token_strs else None,
        }
        return JSONResponse(answer)

    async def detokenize(self, request: Request) -> Response:
        try:
            body = validate_body(await read_json(request, MAX_BODY_BYTES), DetokenizeRequest)
            check_model(body.model, self.model_name)
            tok = await self.tokenizer()
            outside = [t for t in body.tokens if not 0 <= t < tok.vocab_size]
            if outside:
                raise InvalidRequestError(
                    f"token ids must be in [0, {tok.vocab_size}): {outside[:5]}", param="tokens"
                )
        except PdserveError as e:
            return from_exception(e)
        return JSONResponse({"prompt": tok.decode(body.tokens, skip_special_tokens=False)})

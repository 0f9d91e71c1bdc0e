"""A vLLM server's GET /v1/models answer, for the fake fleets of the fleet client's unit tests (the client
reads it before a server's first turn: shared/inference/fleet_servers.py)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import httpx

Handler = Callable[[httpx.Request], Awaitable[httpx.Response]]


def models_body(served_name: str = "tiny", max_model_len: int = 1024, root: str = "/models/tiny") -> dict:
    """/v1/models as vLLM 0.32 answers it for one served model."""
    card = {"id": served_name, "object": "model", "created": 0, "owned_by": "vllm", "root": root,
            "parent": None, "max_model_len": max_model_len}
    return {"object": "list", "data": [card]}


def answering_models(handler: Handler, max_model_len: int = 1024) -> Handler:
    """`handler`, with GET /v1/models answered as a vLLM server of `max_model_len` tokens answers it."""

    async def answer(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json=models_body(max_model_len=max_model_len))
        return await handler(request)

    return answer

"""The gateway's HTTP app for tests, with the project's tokenizer and real Redis, vLLM replaced by a scripted
fleet (`ScriptedFleet`); conftest.py makes it a fixture, `gateway_app`.

    client, fleet, store = gateway_app(**settings_overrides)
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from fastapi.testclient import TestClient

from rollstream.services.gateway.main import build_app
from rollstream.services.gateway.prompts import ChatTemplate
from rollstream.services.gateway.sessions import SessionStore
from rollstream.services.gateway.turns import Gateway
from rollstream.shared.contract.redis_round_trips import connect_round_trips
from rollstream.shared.inference.fleet import StreamDelta
from rollstream.shared.runtime.config import Settings

MODEL = Path(__file__).resolve().parents[4] / "models" / "tiny-llama-warm"
CONTEXT = 4096
"""The context the scripted fleet's servers report: model.max_model_len (1024) does not limit a turn."""


class ScriptedFleet:
    """Stands in for the vLLM fleet: each generation samples the next of `texts`, tokenized with the served
    tokenizer and closed with the end-of-turn token, a few ids a delta; `asked` keeps each request (with the
    model it names), `during` runs while it samples. Its servers hold `context` tokens."""

    def __init__(self, template: ChatTemplate) -> None:
        self.template = template
        self.context = CONTEXT
        self.texts: list[str] = []
        self.asked: list[dict[str, Any]] = []
        self.during: Callable[[], object] = lambda: None

    def _sample(self, prompt_ids: list[int], max_tokens: int, model: str | None) -> list[int]:
        self.during()
        ids = self.template.encode(self.texts.pop(0)) + [self.template.tokenizer.eos_token_id]
        self.asked.append({"prompt_ids": list(prompt_ids), "max_tokens": max_tokens, "response_ids": ids,
                           "model": model})
        return ids

    async def longest_context(self) -> int:
        return self.context

    async def stream(self, prompt_ids: list[int], *, max_tokens: int, **sampling: Any):
        ids = self._sample(prompt_ids, max_tokens, sampling.get("model"))
        for start in range(0, len(ids), 3):
            piece = ids[start:start + 3]
            yield StreamDelta(token_ids=piece, logprobs=[-0.5] * len(piece), server_url="http://vllm",
                              finish_reason="stop" if start + 3 >= len(ids) else None)

    async def complete(self, prompt_ids: list[int], *, max_tokens: int, **sampling: Any):
        ids = self._sample(prompt_ids, max_tokens, sampling.get("model"))
        return SimpleNamespace(token_ids=ids, logprobs=[-0.5] * len(ids), server_url="http://vllm",
                               finish_reason="stop")


@contextlib.contextmanager
def gateway_apps(bus, template: ChatTemplate, redis_url: str) -> Iterator[Callable[..., tuple]]:
    """Makes the app, with the settings given, and its client, entered: one event loop serves every request,
    as uvicorn's does, and it holds the store's asyncio Redis client."""
    with contextlib.ExitStack() as stack:
        def make(**overrides: Any) -> tuple[TestClient, ScriptedFleet, SessionStore]:
            settings = Settings(model={"path": str(MODEL)}, **overrides)
            fleet = ScriptedFleet(template)
            limits = settings.gateway
            store = SessionStore(bus, connect_round_trips(redis_url, ride_out_outages=False),
                                 limits.session_ttl_s, limits.finish_grace_s)
            gateway = Gateway(settings=settings, store=store, template=template, fleet=fleet)
            app = build_app(gateway, SimpleNamespace(log=logging.getLogger("gateway-test")))
            client = stack.enter_context(TestClient(app))
            stack.callback(client.portal.call, store.aclose)  # on the client's loop, before it ends
            return client, fleet, store

        yield make

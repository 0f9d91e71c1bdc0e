"""What the gateway's routes share, held by the app rather than by closures: the gateway (settings, session
store, chat template, fleet: turns.Gateway) and the service's log. A route asks for it as a dependency,
`state: AppState = Depends(app_state)`.

    python -m pytest tests/unit/services/gateway/test_gateway_app.py -q
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from fastapi import FastAPI, Request

from rollstream.services.gateway.sessions import SessionStore
from rollstream.services.gateway.turns import Gateway
from rollstream.shared.runtime.config import Settings


@dataclass(frozen=True)
class AppState:
    gateway: Gateway
    log: logging.Logger

    @property
    def settings(self) -> Settings:
        return self.gateway.settings

    @property
    def store(self) -> SessionStore:
        return self.gateway.store


def attach_state(app: FastAPI, state: AppState) -> None:
    app.state.shared = state


async def app_state(request: Request) -> AppState:
    # A coroutine: FastAPI would run a plain function in a worker thread, one hop per request.
    return request.app.state.shared

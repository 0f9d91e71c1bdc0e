"""The console's HTTP API: the page, and the JSON it polls.

    GET /                          the page (console.html: HTML and plain JavaScript, no data; open)
    GET /api/overview              services and replicas with their health (a policy server's with the
                                   version of the policy and of each adapter it serves), consumer groups and
                                   their consumers, streams (length, lag, pending, events per minute), dead
                                   letters
    GET /api/curves                reward and staleness per policy version (with each role's version),
                                   mean reward per minute
    GET /api/rollouts?limit=N      the latest finished rollouts with status, grade, reward (each role's, where
                                   the roles have their own) (N: 1 to 500)
    GET /api/rollouts/{rollout}    one rollout for the inspector (each segment's role, each turn's version as
                                   its role's); 404 saying which rollouts there are

The /api routes ask for security.http_token as `Authorization: Bearer` when it is set (401 without it, 403
with another: shared/runtime/health_api.py's rules); the page takes the token from its URL's fragment
(`/#token=...`, which a browser never sends) and sends it with every request. Errors are `{"error": why}`.
Redis not answering is a 503 that says so. A float that is not finite is the string "NaN", "Infinity" or
"-Infinity" (ConsoleJSON).

    python -m pytest tests/unit/services/console -q
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from importlib import resources
from typing import Any

import pydantic_core
import redis
from fastapi import APIRouter, Depends, FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse

from rollstream.services.console.health import probe_all
from rollstream.services.console.inspector import inspect_rollout
from rollstream.services.console.watch import RunWatch
from rollstream.shared.contract.bus import Bus
from rollstream.shared.contract.rollout_view import TokenDecoder
from rollstream.shared.contract.run_source import RunSource, open_run
from rollstream.shared.contract.stream_state import collect_streams
from rollstream.shared.errors import RollstreamError, RunDataNotFound
from rollstream.shared.runtime.config import Settings
from rollstream.shared.runtime.health_api import auth_failure, challenge

PAGE = resources.files("rollstream.services.console").joinpath("console.html").read_bytes()
MAX_ROLLOUTS = 500


class Denied(RollstreamError):
    """A request without the token the /api routes ask for (401), or with another one (403)."""

    def __init__(self, status: int) -> None:
        super().__init__("bearer token required" if status == 401 else "wrong token")
        self.status = status


class ConsoleJSON(JSONResponse):
    """The API's answers, written by pydantic's JSON writer, in which a float that is not finite (a loss gone
    NaN, a logprob of -inf) is the string "NaN", "Infinity" or "-Infinity": JSON has no such numbers, and null
    would say there was no value (a loss not reported, a token shown as likely). The page's arithmetic reads
    the strings as the numbers they name."""

    def render(self, content: Any) -> bytes:
        return pydantic_core.to_json(content, inf_nan_mode="strings")


@dataclass(frozen=True)
class ConsoleState:
    """What the routes share: the settings, the run's bus, what is kept of it, and the tokenizer."""

    settings: Settings
    bus: Bus
    watch: RunWatch
    decoder: TokenDecoder | None


async def state_of(request: Request) -> ConsoleState:
    # A coroutine: FastAPI would run a plain function in a worker thread, one hop per request.
    return request.app.state.console


async def require_token(request: Request) -> None:
    token = request.app.state.console.settings.security.http_token
    denied = auth_failure(request.headers.get("authorization"), token)
    if denied:
        raise Denied(denied)


api = APIRouter(prefix="/api", dependencies=[Depends(require_token)])


@api.get("/overview")
async def overview(state: ConsoleState = Depends(state_of)) -> ConsoleJSON:
    settings = state.settings
    await asyncio.to_thread(state.watch.refresh)
    # the run as Redis has it now, even before its first event (open_run would call it no run)
    source = RunSource(settings.run_id, settings.storage_uri, state.bus, None)
    streams = await asyncio.to_thread(collect_streams, source, False)
    versions = await asyncio.to_thread(state.bus.fleet_versions)
    replicas = await probe_all(settings.console.health_urls, list(settings.policy_servers()), versions)
    throughput = state.watch.streams_throughput()
    return ConsoleJSON({"run_id": settings.run_id, "time": time.time(), "replicas": replicas,
                        "streams": [{**_plain(stream), **throughput[stream.stream]} for stream in streams],
                        "dead": await asyncio.to_thread(state.watch.dead_letters)})


@api.get("/curves")
async def curves(state: ConsoleState = Depends(state_of)) -> ConsoleJSON:
    await asyncio.to_thread(state.watch.refresh)
    return ConsoleJSON(state.watch.curves())


@api.get("/rollouts")
async def rollouts(limit: int = Query(50, ge=1, le=MAX_ROLLOUTS),
                   state: ConsoleState = Depends(state_of)) -> ConsoleJSON:
    await asyncio.to_thread(state.watch.refresh)
    return ConsoleJSON({"run_id": state.settings.run_id, "rollouts": state.watch.recent_rollouts(limit)})


@api.get("/rollouts/{rollout_id}")
async def rollout(rollout_id: str, state: ConsoleState = Depends(state_of)) -> ConsoleJSON:
    settings = state.settings

    def load() -> dict[str, Any]:
        source = open_run(state.bus.redis, settings.storage_uri, settings.run_id)
        return inspect_rollout(source, rollout_id, state.decoder, settings.roles.default_role)

    return ConsoleJSON(await asyncio.to_thread(load))


def _plain(stream) -> dict[str, Any]:
    return {"stream": stream.stream, "live": stream.live, "length": stream.length, "added": stream.added,
            "last_id": stream.last_id, "archived_to": stream.archived_to,
            "groups": [{"name": g.name, "lag": g.lag, "pending": g.pending, "consumers": g.consumers,
                        "members": [vars(member) for member in g.members]} for g in stream.groups]}


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status, headers=headers)


def add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(Denied)
    async def denied(_request: Request, exc: Denied) -> JSONResponse:
        return _error(exc.status, str(exc), challenge(exc.status))

    @app.exception_handler(RunDataNotFound)
    async def not_found(_request: Request, exc: RunDataNotFound) -> JSONResponse:
        return _error(404, str(exc))

    @app.exception_handler(RollstreamError)
    async def unreadable(_request: Request, exc: RollstreamError) -> JSONResponse:
        # e.g. a damaged archive part (ArchiveError): the page shows why instead of a bare 500
        return _error(500, f"{type(exc).__name__}: {exc}")

    @app.exception_handler(redis.ConnectionError)
    async def no_redis(_request: Request, exc: redis.ConnectionError) -> JSONResponse:
        return _error(503, f"Redis unreachable: {exc}")

    @app.exception_handler(RequestValidationError)
    async def bad_request(_request: Request, exc: RequestValidationError) -> JSONResponse:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'][1:])}: {e['msg']}" for e in exc.errors())
        return _error(422, problems)


def build_app(state: ConsoleState) -> FastAPI:
    # No /docs or /redoc: their pages load scripts from a CDN, and the console fetches nothing at run time.
    app = FastAPI(title="rollstream console", version="1", docs_url=None, redoc_url=None)
    app.state.console = state
    add_error_handlers(app)

    @app.get("/", include_in_schema=False)
    async def page() -> HTMLResponse:
        return HTMLResponse(PAGE)

    app.include_router(api)
    return app

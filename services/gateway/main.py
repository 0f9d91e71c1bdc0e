"""Gateway: OpenAI- and Anthropic-compatible endpoints through which agents rollstream did not write are
trained.

A session is one rollout. Whoever runs the agent (the agent-runner's black-box mode, or a user's own
harness) creates it with the rollout's ids and grader, gives the agent only the session's base URL and
key, and finishes it (optionally with a reward); the gateway then publishes the session's samples on
`trajectories` like any other rollout (samples.py), and the rest of the pipeline grades, rewards and trains
them.

    POST   /v1/sessions                     create: ids, grader, role, sampling defaults, time budget -> URLs,
                                            key
    GET    /v1/sessions/{id}                read
    POST   /v1/sessions/{id}/finish         finish: status, reward, artifacts -> samples published
    DELETE /v1/sessions/{id}                discard (nothing published)
    (these ask for security.http_token when it is set; a session with a time budget refuses turns from its
    deadline on and ends gateway.finish_grace_s later, finished or not: sessions.py)

    under /s/{id} (the Anthropic base URL; /s/{id}/v1 is the OpenAI one), with the session's key as
    `Authorization: Bearer` or `x-api-key`:
    POST /v1/chat/completions    POST /v1/responses    POST /v1/messages    POST /v1/messages/count_tokens
    GET  /v1/models
    and without a key, GET or HEAD on either base URL itself: 200 (Claude Code probes it before it starts)

Every turn is rendered with the served model's chat template and generated token-in/token-out; the prompt
continues the session's earlier turns with their exact ids (prompts.py), and the tokens go to the client as
vLLM produces them (turns.py), within the context the servers report on /v1/models: the gateway reads it
as it starts, and a setting that disagrees with a server (a model name it does not serve, a longer context
than its own) stops it there with an error that says how to fix it. Session state is in Redis
(sessions.py): replicas are stateless and any replica serves any turn. Errors come in each API's own shape;
bad input is a 4xx that says why. Tools the model cannot be shown (hosted tools: web search, code
execution, ...) are left out, logged, and named in the response's x-rollstream-ignored-tools header
(gateway.strict_tools refuses them instead).

The routes are grouped by whom they serve: sessions_api.py (whoever runs the agent), agent_api.py (the
agent, under its session's base URL); error_handlers.py answers every failure in its API's shape, and
app_state.py holds what the routes share.

    rollstream-gateway           # configured by RS_* variables or RS_CONFIG_FILE
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import time

import uvicorn
import uvloop
from fastapi import FastAPI
from prometheus_client import Gauge

from rollstream.services.gateway import agent_api, sessions_api
from rollstream.services.gateway.app_state import AppState, attach_state
from rollstream.services.gateway.error_handlers import add_error_handlers
from rollstream.services.gateway.prompts import ChatTemplate
from rollstream.services.gateway.sessions import SessionStore
from rollstream.services.gateway.turns import Gateway
from rollstream.shared.contract.bus import Bus
from rollstream.shared.contract.redis_round_trips import connect_round_trips
from rollstream.shared.runtime.config import Settings
from rollstream.shared.runtime.service import ServiceRuntime

STALL_CHECK_S = 0.05
LOAD_REFRESH_S = 1.0
"""How often each vLLM server's /metrics (running, waiting, KV-cache use) is read for routing."""
LOOP_STALL = Gauge("rollstream_gateway_event_loop_stall_max_seconds",
                   "Longest the gateway's event loop was late to wake up since the process started")


def build_app(gateway: Gateway, runtime: ServiceRuntime) -> FastAPI:
    app = FastAPI(title="rollstream gateway", version="1")
    attach_state(app, AppState(gateway=gateway, log=runtime.log))
    add_error_handlers(app)
    app.include_router(sessions_api.router)
    app.include_router(agent_api.router)
    return app


async def watch_event_loop() -> None:
    """The longest the loop was late to wake up: what a blocking call on it would cost every session."""
    longest = 0.0
    while True:
        before = time.monotonic()
        await asyncio.sleep(STALL_CHECK_S)
        late = time.monotonic() - before - STALL_CHECK_S
        if late > longest:
            longest = late
            LOOP_STALL.set(longest)


class _Server(uvicorn.Server):
    """The service runtime owns SIGTERM (drain, then exit), not uvicorn."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


def load_gateway(settings: Settings) -> Gateway:
    """What every turn needs: Redis, the served model's tokenizer, and the vLLM fleet. Called on the event
    loop that serves: the store's asyncio client belongs to it."""
    from transformers import AutoTokenizer

    from rollstream.shared.inference.fleet import FleetClient

    bus = Bus.connect(settings.redis, settings.run_id, settings.bus)
    round_trips = connect_round_trips(settings.redis, cluster=settings.bus.cluster)
    tokenizer = AutoTokenizer.from_pretrained(settings.model.path)
    fleet = FleetClient.for_run(settings)
    fleet.start_load_refresh(LOAD_REFRESH_S)
    store = SessionStore(bus, round_trips, settings.gateway.session_ttl_s, settings.gateway.finish_grace_s)
    return Gateway(settings=settings, store=store, template=ChatTemplate(tokenizer), fleet=fleet)


async def serve_until_stopped(app: FastAPI, settings: Settings, runtime: ServiceRuntime) -> None:
    """Serves `app` until the runtime is asked to stop (or the server ends), then drains it."""
    server = _Server(uvicorn.Config(app, host=settings.listen_host, port=settings.gateway.port,
                                    log_config=None, access_log=False, timeout_graceful_shutdown=30))
    watcher = asyncio.create_task(watch_event_loop())
    serving = asyncio.create_task(server.serve())
    while not server.started and not serving.done():
        await asyncio.sleep(0.05)
    runtime.not_ready = None
    runtime.status["url"] = settings.gateway.url
    while not runtime.stopping and not serving.done():
        await asyncio.sleep(0.2)
    server.should_exit = True
    await serving
    watcher.cancel()


async def meet_the_fleet(gateway: Gateway, runtime: ServiceRuntime) -> None:
    """Reads what each vLLM server serves (its /v1/models: the model's name and context length) before the
    first turn. A setting that disagrees with a server raises FleetSettingsError here, so the gateway does
    not start; a server that does not answer is logged (by the fleet client) and takes no turn until it
    does (/healthz shows the contexts found here)."""
    not_met = await gateway.fleet.meet_servers()
    runtime.status["vllm_contexts"] = dict(gateway.fleet.contexts)
    runtime.log.info("the vLLM servers say what they serve", extra={
        "contexts": gateway.fleet.contexts, "not_answering": sorted(not_met),
        "models": {url: served.name for url, served in gateway.fleet.servers.served.items()}})


async def serve(settings: Settings, runtime: ServiceRuntime) -> None:
    gateway = load_gateway(settings)
    try:
        await meet_the_fleet(gateway, runtime)
        app = build_app(gateway, runtime)
        # What start-up loaded (transformers, torch, the tokenizer: some 400k objects) lives as long as the
        # process. Left to the collector, each full collection walks all of it on the event loop (0.2 s on
        # an idle core).
        gc.freeze()
        await serve_until_stopped(app, settings, runtime)
    finally:
        await gateway.fleet.aclose()
        await gateway.store.aclose()


def main() -> None:
    settings = Settings()
    runtime = ServiceRuntime("gateway", settings)
    runtime.not_ready = ("starting: loading the tokenizer, reading what the vLLM servers serve, then the API "
                         "server")
    # uvloop's loop: every turn's sockets (agent, Redis, vLLM) are served by it, at a fraction of asyncio's
    # own loop's CPU time per event.
    uvloop.run(serve(settings, runtime))
    runtime.close()


if __name__ == "__main__":
    main()

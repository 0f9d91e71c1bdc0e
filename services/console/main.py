"""Console: one run, live, in a web page: its services and replicas with their health (a policy server's with
the version of the policy and of each role's adapter it serves), its streams (length, lag and pending per
consumer group, events per minute), reward and staleness curves, dead letters, and a rollout inspector (tokens
coloured by loss mask and logprob, each segment's role and every turn's policy version, its role's, tool calls
and results, a coding task's diff, the sandbox's output and each test's result, the samples a gateway session
became, the command that replays it). It only reads: every stream of the run, and the run's files in storage.

    open http://127.0.0.1:8400/#token=<RS_SECURITY__HTTP_TOKEN>     (no token set: http://127.0.0.1:8400/)

api.py has the routes and who may call them, console.html the page (plain JavaScript polling the JSON routes;
nothing is fetched from elsewhere), watch.py what is kept of the run between polls, health.py how services and
replicas are asked, inspector.py one rollout. Replicas share nothing: each reads Redis itself.

    rollstream-console       # configured by RS_* variables or RS_CONFIG_FILE (console.*: port, health_urls)
"""

from __future__ import annotations

import asyncio
import contextlib

import uvicorn
from fastapi import FastAPI

from rollstream.services.console.api import ConsoleState, build_app
from rollstream.services.console.watch import RunWatch
from rollstream.shared.contract.bus import Bus
from rollstream.shared.contract.rollout_view import load_decoder, run_model_path
from rollstream.shared.runtime.config import Settings
from rollstream.shared.runtime.service import ServiceRuntime


class _Server(uvicorn.Server):
    """The service runtime owns SIGTERM (finish the requests in flight, then exit), not uvicorn."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


def load_state(settings: Settings, runtime: ServiceRuntime) -> ConsoleState:
    """The run's bus (failing fast: a page waits on it, and says Redis is unreachable), what is kept of the
    run, and the run's model's tokenizer (token ids shown without one)."""
    bus = Bus.connect(settings.redis, settings.run_id, settings.bus, ride_out_outages=False)
    model = run_model_path(settings.storage_uri, settings.run_id, settings.model.path)
    decoder, why = load_decoder(model)
    if decoder is None:
        runtime.log.warning("no tokenizer: the inspector shows token ids",
                            extra={"model": str(model), "why": why})
    return ConsoleState(settings=settings, bus=bus, watch=RunWatch(bus, settings.storage_uri),
                        decoder=decoder)


async def serve_until_stopped(app: FastAPI, settings: Settings, runtime: ServiceRuntime) -> None:
    """Serves `app` until the runtime is asked to stop (or the server ends), then lets it finish."""
    server = _Server(uvicorn.Config(app, host=settings.listen_host, port=settings.console.port,
                                    log_config=None, access_log=False, timeout_graceful_shutdown=10))
    serving = asyncio.create_task(server.serve())
    while not server.started and not serving.done():
        await asyncio.sleep(0.05)
    if server.started:
        port = server.servers[0].sockets[0].getsockname()[1]
        runtime.status["url"] = f"http://{settings.url_host}:{port}/"
        runtime.log.info("console serving", extra={"url": runtime.status["url"]})
        runtime.not_ready = None
    while not runtime.stopping and not serving.done():
        await asyncio.sleep(0.2)
    server.should_exit = True
    await serving


def main() -> None:
    settings = Settings()
    runtime = ServiceRuntime("console", settings)
    runtime.not_ready = "starting: the page and its API"
    app = build_app(load_state(settings, runtime))
    asyncio.run(serve_until_stopped(app, settings, runtime))
    runtime.close()


if __name__ == "__main__":
    main()

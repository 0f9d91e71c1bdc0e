"""A metering pass-through proxy in front of one real vLLM server: the busy-time counters the simulated
servers of bench/sim_fleet.py report, counted from the completions in flight through it, on
GET /meter/metrics. bench/bench_async.py puts one in front of its vLLM server, so that a real fleet and a
simulated one are measured alike.

    python bench/sim_fleet.py --proxy-to http://127.0.0.1:8000
"""

from __future__ import annotations

import asyncio

try:  # run as a script: bench/ is first on sys.path
    from asgi_host import AsgiHost
except ImportError:  # imported as bench.metered_proxy (the tests)
    from bench.asgi_host import AsgiHost


class InFlightMeter:
    """Busy time of a server seen from in front of it: time with a completion in flight, not paused."""

    def __init__(self, now: float) -> None:
        self.started = self.last = now
        self.in_flight = 0
        self.paused = False
        self.busy_s = 0.0
        self.running_s = 0.0

    def advance(self, now: float) -> None:
        dt = max(0.0, now - self.last)
        self.last = max(self.last, now)
        if self.in_flight and not self.paused:
            self.busy_s += dt
            self.running_s += dt * self.in_flight

    def enter(self, now: float) -> None:
        self.advance(now)
        self.in_flight += 1

    def leave(self, now: float) -> None:
        self.advance(now)
        self.in_flight -= 1

    def pause(self, now: float) -> None:
        self.advance(now)
        self.paused = True

    def resume(self, now: float) -> None:
        self.advance(now)
        self.paused = False

    def metrics(self, now: float) -> str:
        self.advance(now)
        return "\n".join([
            "# TYPE sim:in_flight_requests gauge",
            f"sim:in_flight_requests {self.in_flight}.0",
            "# TYPE sim:busy_seconds_total counter",
            f"sim:busy_seconds_total {self.busy_s!r}",
            "# TYPE sim:running_seconds_total counter",
            f"sim:running_seconds_total {self.running_s!r}",
            "# TYPE sim:uptime_seconds gauge",
            f"sim:uptime_seconds {now - self.started!r}",
        ]) + "\n"


PROXIED_HEADERS = ("content-type", "accept", "x-session-id", "x-smg-routing-key", "authorization")


class MeteredProxy(AsgiHost):
    """A pass-through proxy in front of one real server that meters its busy time the way the simulated
    servers count theirs; GET /meter/metrics reports it, every other path is forwarded.

    vLLM's own vllm:num_requests_running cannot stand in for it on a CPU server: /metrics is answered by
    the same event loop that streams the engine's outputs, so a scrape is served mostly between
    requests and short requests are almost never seen running."""

    METRICS_PATH = "/meter/metrics"

    def __init__(self, upstream: str, *, port: int = 0, host: str = "127.0.0.1") -> None:
        super().__init__([port], host)
        self.upstream = upstream.rstrip("/")
        self.meter: InFlightMeter | None = None
        self.session = None

    def build_app(self):
        import aiohttp
        from starlette.applications import Starlette
        from starlette.requests import ClientDisconnect, Request
        from starlette.responses import PlainTextResponse, Response
        from starlette.routing import Route

        loop = asyncio.get_running_loop()
        self.meter = meter = InFlightMeter(loop.time())

        async def forward(request: Request) -> Response:
            path = request.url.path
            if path == self.METRICS_PATH:
                return PlainTextResponse(meter.metrics(loop.time()), media_type="text/plain; version=0.0.4")
            if self.session is None:
                self.session = aiohttp.ClientSession(
                    timeout=aiohttp.ClientTimeout(total=None),
                    connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=300))
            try:
                body = await request.body()
            except ClientDisconnect:
                return Response(status_code=499)
            headers = {k: v for k, v in request.headers.items() if k in PROXIED_HEADERS}
            completion = path == "/v1/completions"
            if completion:
                meter.enter(loop.time())
            try:
                async with self.session.request(request.method, self.upstream + path,
                                                params=request.query_params, data=body,
                                                headers=headers) as upstream:
                    content = await upstream.read()
                    status, media_type = upstream.status, upstream.headers.get("content-type")
            except aiohttp.ClientError as exc:
                return PlainTextResponse(f"upstream {self.upstream}: {type(exc).__name__}: {exc}",
                                         status_code=502)
            finally:
                if completion:
                    meter.leave(loop.time())
            if status == 200 and path == "/pause":
                meter.pause(loop.time())
            elif status == 200 and path == "/resume":
                meter.resume(loop.time())
            return Response(content, status_code=status, media_type=media_type)

        return Starlette(routes=[Route("/{path:path}", forward, methods=["GET", "POST", "PUT", "DELETE"])])

    async def aclose(self) -> None:
        if self.session is not None:
            await self.session.close()

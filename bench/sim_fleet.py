"""A simulated vLLM fleet: many servers in one process, each answering the HTTP API rollstream's fleet
client uses, with a latency model instead of a GPU. It lets the real pipeline (dispatcher,
agent-runners, reward, trainer) run against a fleet far larger than this machine could serve.

    python bench/sim_fleet.py --servers 64 --base-port 0 --model models/tiny-llama \
        [--decode-ms 25] [--prefill-ms 0.1] [--overhead-ms 2] [--batch 8] [--reload-s 0.05]

prints one line `SIM_FLEET_READY {"urls": [...]}` once every port listens, then serves until SIGTERM.
Importable: `SimFleet(...).start()` serves from a background thread (tests), `.stop()` ends it.

This module is the fleet's HTTP face: one port per server, the routes of vLLM's API, and the command line.
What a server does is bench/sim_server.py's: a request costs `overhead + uncached prompt tokens x prefill +
generated tokens x decode` seconds of work, at full speed up to `batch` concurrent requests and shared
beyond (bench/sim_latency.py); a session's next turn on the same server is prefix-cached; while paused,
requests freeze (pause mode `keep`, what weight sync uses). Sampled tokens are random, prompt logprobs
real: a forward pass of the checkpoint the server was last told to load (bench/sim_checkpoints.py), so the
trainer's parity check after a weight sync holds.

Accounting, on GET /metrics in Prometheus text like vLLM: `vllm:num_requests_running`, the token
and request counters, and `sim:busy_seconds_total` (time with at least one request progressing),
`sim:running_seconds_total` (integral of the running count) and `sim:uptime_seconds`.

    python bench/sim_fleet.py --proxy-to http://127.0.0.1:8000

serves instead a metering pass-through proxy in front of a real vLLM server (bench/metered_proxy.py): the
same busy-time counters, from the completions in flight through it, on GET /meter/metrics.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path

import msgspec

try:  # run as a script: bench/ is first on sys.path
    from asgi_host import AsgiHost
    from metered_proxy import MeteredProxy
    from sim_checkpoints import Checkpoints
    from sim_latency import LatencyModel
    from sim_server import HttpError, SimServer, server_spec
except ImportError:  # imported as bench.sim_fleet (the tests)
    from bench.asgi_host import AsgiHost
    from bench.metered_proxy import MeteredProxy
    from bench.sim_checkpoints import Checkpoints
    from bench.sim_latency import LatencyModel
    from bench.sim_server import HttpError, SimServer, server_spec


# ------------------------------------------------------------------------------------ the HTTP app
def _server_of(servers: dict[int, SimServer], request) -> SimServer:
    """The server of the port the request came in on."""
    return servers[request.scope["server"][1]]


def _error(exc: HttpError):
    from starlette.responses import JSONResponse

    return JSONResponse({"error": {"message": str(exc), "type": exc.kind, "code": exc.status}},
                        status_code=exc.status)


def _api_routes(servers: dict[int, SimServer]) -> list:
    """What an OpenAI-compatible client calls: health, the served model, completions of token ids."""
    from starlette.requests import ClientDisconnect, Request
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    async def completions(request: Request) -> Response:
        try:
            body = msgspec.json.decode(await request.body())
        except msgspec.DecodeError as exc:
            return _error(HttpError(400, f"body is not JSON: {exc}"))
        except ClientDisconnect:  # the caller gave up (timeout, shutdown): nothing to answer
            return Response(status_code=499)
        try:
            result = await _server_of(servers, request).completions(body, request.headers.get("x-session-id"))
        except HttpError as exc:
            return _error(exc)
        return Response(msgspec.json.encode(result), media_type="application/json")

    async def health(request: Request) -> Response:
        return Response(status_code=200)

    async def models(request: Request) -> Response:
        spec = _server_of(servers, request).spec  # the card's fields the fleet client reads, as vLLM's
        card = {"id": spec.served_name, "object": "model", "owned_by": "sim", "root": spec.model_path,
                "parent": None, "max_model_len": spec.max_model_len}
        return JSONResponse({"object": "list", "data": [card]})

    return [
        Route("/health", health, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/completions", completions, methods=["POST"]),
    ]


def _control_routes(servers: dict[int, SimServer]) -> list:
    """What the trainer and the bench call: pause and resume, the prefix cache, a weight reload
    (collective_rpc), metrics."""
    from starlette.requests import Request
    from starlette.responses import JSONResponse, PlainTextResponse, Response
    from starlette.routing import Route

    async def pause(request: Request) -> Response:
        mode = request.query_params.get("mode", "abort")
        if mode not in ("abort", "wait", "keep"):
            return _error(HttpError(400, f"unknown pause mode {mode!r}"))
        await _server_of(servers, request).pause(mode)
        return JSONResponse({"status": "paused"})

    async def resume(request: Request) -> Response:
        _server_of(servers, request).resume()
        return JSONResponse({"status": "resumed"})

    async def is_paused(request: Request) -> Response:
        return JSONResponse({"is_paused": _server_of(servers, request).engine.paused})

    async def reset_prefix_cache(request: Request) -> Response:
        _server_of(servers, request).prefix.clear()
        return Response(status_code=200)

    async def collective_rpc(request: Request) -> Response:
        try:
            body = msgspec.json.decode(await request.body())
            return JSONResponse(await _server_of(servers, request).collective_rpc(body))
        except msgspec.DecodeError as exc:
            return _error(HttpError(400, f"body is not JSON: {exc}"))
        except HttpError as exc:
            return _error(exc)

    async def metrics(request: Request) -> Response:
        text = _server_of(servers, request).metrics()
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    return [
        Route("/pause", pause, methods=["POST"]),
        Route("/resume", resume, methods=["POST"]),
        Route("/is_paused", is_paused, methods=["GET"]),
        Route("/reset_prefix_cache", reset_prefix_cache, methods=["POST"]),
        Route("/collective_rpc", collective_rpc, methods=["POST"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]


def build_app(servers: dict[int, SimServer]):
    """One app for every server: a request is answered by the server of the port it came in on."""
    from starlette.applications import Starlette

    return Starlette(routes=[*_api_routes(servers), *_control_routes(servers)])


# ------------------------------------------------------------------------------------- the fleet
class SimFleet(AsgiHost):
    """`servers` simulated vLLM servers on consecutive ports from `base_port` (0: any free ports)."""

    def __init__(self, model_path: Path | str, servers: int = 1, *, base_port: int = 0,
                 host: str = "127.0.0.1", served_name: str = "tiny", latency: LatencyModel | None = None,
                 max_model_len: int = 1024, seed: int = 0) -> None:
        super().__init__([base_port + i if base_port else 0 for i in range(servers)], host)
        self.model_path = Path(model_path)
        self.served_name = served_name
        self.latency = latency or LatencyModel()
        self.max_model_len = max_model_len
        self.seed = seed
        self.servers: dict[int, SimServer] = {}
        self.checkpoints = Checkpoints()

    def build_app(self):
        spec, tokenizer = server_spec(self.model_path, self.served_name, self.max_model_len)
        for index, port in enumerate(self.ports):
            self.servers[port] = SimServer(index, spec, self.latency, self.checkpoints, tokenizer, self.seed)
        return build_app(self.servers)


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {metric name without labels: value}, summed over label sets."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_part, _, value = line.rpartition(" ")
        name = name_part.split("{", 1)[0]
        try:
            values[name] = values.get(name, 0.0) + float(value)
        except ValueError:
            continue
    return values


# -------------------------------------------------------------------------------- the command line
def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--servers", type=int, default=64)
    add("--base-port", type=int, default=0, help="first port; 0: any free ports")
    add("--host", default="127.0.0.1")
    add("--model", type=Path, default=Path("models/tiny-llama"))
    add("--served-name", default="tiny")
    add("--max-model-len", type=int, default=1024)
    add("--prefill-ms", type=float, default=0.1, help="per uncached prompt token")
    add("--decode-ms", type=float, default=25.0, help="per generated token")
    add("--overhead-ms", type=float, default=2.0, help="per request")
    add("--batch", type=int, default=8, help="requests per server that run at full speed")
    add("--reload-s", type=float, default=0.05, help="time a weight reload takes")
    add("--seed", type=int, default=0)
    add("--proxy-to", metavar="URL", help="instead: meter a real server (MeteredProxy) on one port")
    return parser.parse_args()


def host_of(args: argparse.Namespace) -> AsgiHost:
    """The simulated fleet the arguments describe, or with --proxy-to the metering proxy."""
    if args.proxy_to:
        return MeteredProxy(args.proxy_to, port=args.base_port, host=args.host)
    latency = LatencyModel(prefill_s_per_token=args.prefill_ms / 1000,
                           decode_s_per_token=args.decode_ms / 1000, overhead_s=args.overhead_ms / 1000,
                           batch_size=args.batch, reload_s=args.reload_s)
    return SimFleet(args.model, args.servers, base_port=args.base_port, host=args.host,
                    served_name=args.served_name, latency=latency, max_model_len=args.max_model_len,
                    seed=args.seed)


def main() -> None:
    host = host_of(parse_args())

    async def run() -> None:
        serving = asyncio.create_task(host.serve())
        while not host.ready and not serving.done():
            await asyncio.sleep(0.01)
        if not serving.done():
            print("SIM_FLEET_READY " + json.dumps({"urls": host.urls}), flush=True)
        await serving

    try:
        import uvloop
    except ImportError:
        asyncio.run(run())
    else:
        uvloop.run(run())
    sys.exit(0)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # prompt logprobs are tiny forward passes: the cores are the pipeline's
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()

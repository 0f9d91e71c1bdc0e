"""The fleet client's transport (shared/inference/aiohttp_transport.py) against a real HTTP server on
loopback: answers whole and streamed as they arrive, the request's headers and body as sent, each failure as
the httpx error the fleet client handles, and idle connections dropped after their keep-alive expiry.

    python -m pytest tests/unit/shared/inference/test_aiohttp_transport.py -q
"""

from __future__ import annotations

import asyncio
import contextlib
import json

import httpx
import pytest
from aiohttp import web

from rollstream.cli.vllm_server import free_port
from rollstream.shared.inference.aiohttp_transport import AiohttpTransport


async def echo(request: web.Request) -> web.Response:
    body = {"body": (await request.read()).decode(), "session": request.headers.get("X-Session-ID"),
            "peer": request.transport.get_extra_info("peername")[1]}
    return web.json_response(body, headers={"X-Answer": "yes"})


async def stream(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    for n in range(3):
        await response.write(f"data: {n}\n\n".encode())
        await asyncio.sleep(0.05)
    return response


async def cut(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse()
    response.content_length = 1000
    await response.prepare(request)
    await response.write(b"data: partial\n\n")
    request.transport.close()  # the server dies in the middle of its answer
    return response


async def slow(request: web.Request) -> web.Response:
    await asyncio.sleep(2)
    return web.Response(text="late")


@contextlib.asynccontextmanager
async def server():
    app = web.Application()
    app.add_routes([web.post("/echo", echo), web.get("/stream", stream), web.get("/cut", cut),
                    web.get("/slow", slow)])
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


def client(keepalive_expiry_s: float = 2.0, read_s: float = 5.0) -> httpx.AsyncClient:
    transport = AiohttpTransport(max_connections=16, keepalive_expiry_s=keepalive_expiry_s)
    # The pool's wait (aiohttp's `connect`: a free connection, or a new one made) stays long: a short read
    # timeout alone must not turn a slow connect on a loaded machine into a timeout the test does not expect
    return httpx.AsyncClient(transport=transport, timeout=httpx.Timeout(5.0, connect=1.0, read=read_s))


def test_a_whole_answer_carries_the_requests_headers_and_body_and_reuses_the_connection():
    async def scenario():
        async with server() as url, client() as http:
            first = await http.post(f"{url}/echo", json={"prompt": [1, 2]}, headers={"X-Session-ID": "s1"})
            second = await http.post(f"{url}/echo", content=b"again")
            assert first.status_code == 200 and first.headers["x-answer"] == "yes"
            assert (json.loads(first.json()["body"]), first.json()["session"]) == ({"prompt": [1, 2]}, "s1")
            assert second.json()["body"] == "again"
            assert second.json()["peer"] == first.json()["peer"]  # kept alive

    asyncio.run(scenario())


def test_an_idle_connection_is_not_used_after_its_keep_alive_expiry():
    async def scenario():
        async with server() as url, client(keepalive_expiry_s=0.2) as http:
            first = (await http.post(f"{url}/echo")).json()["peer"]
            await asyncio.sleep(0.5)
            assert (await http.post(f"{url}/echo")).json()["peer"] != first

    asyncio.run(scenario())


def test_a_streamed_answer_arrives_as_the_server_writes_it():
    async def scenario():
        async with server() as url, client() as http, http.stream("GET", f"{url}/stream") as response:
            loop = asyncio.get_running_loop()
            arrivals = [(line, loop.time()) async for line in response.aiter_lines() if line]
            assert [line for line, _ in arrivals] == ["data: 0", "data: 1", "data: 2"]
            assert arrivals[-1][1] - arrivals[0][1] >= 0.05  # not held back until the end

    asyncio.run(scenario())


def test_each_failure_is_the_httpx_error_the_fleet_client_handles():
    async def scenario():
        async with server() as url, client(read_s=0.3) as http:
            with pytest.raises(httpx.ConnectError):
                await http.get(f"http://127.0.0.1:{free_port()}/")  # nothing listens
            with pytest.raises(httpx.ReadTimeout):
                await http.get(f"{url}/slow")
            async with http.stream("GET", f"{url}/cut") as response:
                with pytest.raises(httpx.ReadError):
                    async for _ in response.aiter_bytes():
                        pass
            assert (await http.post(f"{url}/echo")).status_code == 200  # and the transport goes on

    asyncio.run(scenario())

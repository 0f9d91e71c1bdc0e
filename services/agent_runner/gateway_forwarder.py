"""The agent-runner's end of a black-box episode's way to the gateway: a unix socket, bound into the episode's
sandbox (which has no network), on which the agent's HTTP requests arrive through the sandbox's own forwarder
(sandbox_forwarder.py). A request for the episode's own session, a path that is `/s/{session}` or lies under
`/s/{session}/`, goes on to the gateway (gateway.url) with its headers and body as sent; its answer comes back
as the gateway sends it, chunk by chunk, so streamed answers (SSE) are not held back. Anything else gets 403
and the connection is closed: the sessions API (/v1/sessions...), other sessions, a path with dot segments,
empty segments, percent escapes or backslashes (which the gateway might resolve to another session's path),
a target in absolute form (a proxy request for another host).

    async with SessionForwarder(socket_path, "http://127.0.0.1:8300", session_id):
        ...  # the sandbox runs; its requests reach the session

Connections with no request on them are held open until the forwarder closes: the sandbox's forwarder keeps
one as its lifeline (it ends the sandbox when that connection ends).

    python -m pytest tests/unit/services/agent_runner/test_forwarders.py -q
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from pathlib import Path

import h11
import httpx

log = logging.getLogger(__name__)

MAX_REQUEST_BYTES = 32 * 1024 * 1024
"""Largest request body forwarded (it is read whole before it goes on); larger gets 413."""
READ_CHUNK = 65536
HOP_BY_HOP = {b"connection", b"keep-alive", b"proxy-connection", b"proxy-authenticate",
              b"proxy-authorization", b"te", b"trailer", b"transfer-encoding", b"upgrade"}
"""Headers of one connection, not of the message: each side of the forwarder frames its own."""
UPSTREAM_TIMEOUT = httpx.Timeout(None, connect=10.0)
"""No read timeout: a turn may take as long as the gateway takes, and the sandbox's wall clock ends the
episode (and this forwarder with it) anyway."""


def session_path(target: bytes, session_id: str) -> bool:
    """Whether an HTTP request target is the session's own: in origin form, its path `/s/{session_id}` or
    under `/s/{session_id}/`, with no dot or empty segments, percent escapes or backslashes in the path (the
    query is the gateway's to read)."""
    try:
        text = target.decode("ascii")
    except UnicodeDecodeError:
        return False
    path = text.split("?", 1)[0]
    base = f"/s/{session_id}"
    if path != base and not path.startswith(base + "/"):
        return False
    if "%" in path or "\\" in path:
        return False
    segments = path.split("/")[1:]
    # a trailing slash leaves one last empty segment, which names nothing else
    return (all(segment not in ("", ".", "..") for segment in segments[:-1])
            and segments[-1] not in (".", ".."))


class SessionForwarder:
    """Serves the episode's unix socket while it is entered (the socket is made 0666: the sandbox's user is
    not ours); see the module docstring."""

    def __init__(self, socket_path: Path, gateway_url: str, session_id: str) -> None:
        self.socket_path = Path(socket_path)
        self.gateway_url = gateway_url.rstrip("/")
        self.session_id = session_id
        self.connections: set[asyncio.Task] = set()

    async def __aenter__(self) -> SessionForwarder:
        self.server = await asyncio.start_unix_server(self.serve, path=str(self.socket_path))
        os.chmod(self.socket_path, 0o666)
        # the agent's headers go on as it sent them: none of httpx's defaults (Accept-Encoding,
        # User-Agent) added
        self.client = httpx.AsyncClient(timeout=UPSTREAM_TIMEOUT)
        self.client.headers.clear()
        return self

    async def __aexit__(self, *exc) -> None:
        self.server.close()
        for connection in list(self.connections):
            connection.cancel()
        await asyncio.gather(*self.connections, return_exceptions=True)
        await self.server.wait_closed()
        await self.client.aclose()
        self.socket_path.unlink(missing_ok=True)

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self.connections.add(task)
        connection = h11.Connection(h11.SERVER, max_incomplete_event_size=64 * 1024)
        try:
            while True:
                request = await next_event(connection, reader)
                if not isinstance(request, h11.Request):
                    return  # the client closed the connection
                if not session_path(request.target, self.session_id):
                    target = request.target.decode("ascii", "replace")[:200]
                    await refuse(connection, writer, 403, "the sandbox reaches only its own gateway session, "
                                 f"/s/{self.session_id}/..., not {target}")
                    return
                body = await read_body(connection, reader, writer)
                if body is None:
                    await refuse(connection, writer, 413,
                                 f"a request body may have at most {MAX_REQUEST_BYTES} bytes")
                    return
                await self.forward(connection, writer, request, body)
                if connection.our_state is not h11.DONE or connection.their_state is not h11.DONE:
                    return
                connection.start_next_cycle()
        except (h11.ProtocolError, ConnectionError) as exc:
            log.debug("sandbox connection ended: %s", exc)
        finally:
            writer.close()
            self.connections.discard(task)

    async def forward(self, connection: h11.Connection, writer: asyncio.StreamWriter, request: h11.Request,
                      body: bytes) -> None:
        headers = [(name, value) for name, value in request.headers
                   if name not in HOP_BY_HOP and name not in (b"host", b"content-length")]
        upstream = self.client.build_request(request.method.decode("ascii"),
                                             self.gateway_url + request.target.decode("ascii"),
                                             headers=headers, content=body)
        try:
            response = await self.client.send(upstream, stream=True)
        except httpx.HTTPError as exc:
            await refuse(connection, writer, 502, f"the gateway at {self.gateway_url} did not answer: "
                                                  f"{type(exc).__name__}: {exc}")
            return
        try:
            await send(connection, writer, h11.Response(
                status_code=response.status_code,
                headers=[(name, value) for name, value in response.headers.raw
                         if name.lower() not in HOP_BY_HOP]))
            # raw: the bytes as the gateway sent them (its Content-Encoding and Content-Length hold for them)
            async for chunk in response.aiter_raw():
                await send(connection, writer, h11.Data(data=chunk))
            await send(connection, writer, h11.EndOfMessage())
        finally:
            await response.aclose()


async def next_event(connection: h11.Connection, reader: asyncio.StreamReader):
    while True:
        event = connection.next_event()
        if event is not h11.NEED_DATA:
            return event
        connection.receive_data(await reader.read(READ_CHUNK))  # b"" at the end: h11 then says it closed


async def read_body(connection: h11.Connection, reader: asyncio.StreamReader,
                    writer: asyncio.StreamWriter) -> bytes | None:
    """The request's whole body, or None when it is larger than MAX_REQUEST_BYTES."""
    if connection.they_are_waiting_for_100_continue:
        await send(connection, writer, h11.InformationalResponse(status_code=100, headers=[]))
    body = bytearray()
    while True:
        event = await next_event(connection, reader)
        if isinstance(event, h11.EndOfMessage):
            return bytes(body)
        if not isinstance(event, h11.Data):
            raise h11.RemoteProtocolError(f"the request ended early ({type(event).__name__})")
        body += event.data
        if len(body) > MAX_REQUEST_BYTES:
            return None


async def refuse(connection: h11.Connection, writer: asyncio.StreamWriter, status: int, message: str) -> None:
    """An error in the shape OpenAI and Anthropic clients read, then the connection's end."""
    data = json.dumps({"type": "error", "error": {"type": "forwarder_error", "message": message}}).encode()
    await send(connection, writer, h11.Response(status_code=status, headers=[
        (b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()),
        (b"connection", b"close")]))
    await send(connection, writer, h11.Data(data=data))
    await send(connection, writer, h11.EndOfMessage())


async def send(connection: h11.Connection, writer: asyncio.StreamWriter, event) -> None:
    writer.write(connection.send(event))
    await writer.drain()

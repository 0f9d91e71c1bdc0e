"""The fleet client's HTTP transport: httpx's transport interface, served by aiohttp's client.

httpx stays what the fleet client speaks (its tests hand it httpx's mock transports); this sends the bytes.
httpcore, httpx's own transport, cost a generation request five times aiohttp's CPU time (0.45 ms against
0.09 ms a request to a local server): its pool polls every idle connection's socket each time a request
starts or ends, and its anyio streams add their own layers. A gateway turn is one such request.

Errors come as httpx's, which the fleet client handles as before: a server that cannot be reached is
httpx.ConnectError, one that does not connect in time httpx.ConnectTimeout, one that does not answer in time
httpx.ReadTimeout, a connection lost before or during the answer httpx.ReadError. Timeouts are the request's
(httpx.Timeout: connect, read, and pool, the wait for a free connection).

    python -m pytest tests/unit/shared/inference/test_aiohttp_transport.py -q
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import httpx

_SET_BY_AIOHTTP = {"host", "content-length", "transfer-encoding", "connection"}


class AiohttpTransport(httpx.AsyncBaseTransport):
    """Connections kept alive for keepalive_expiry_s once idle, at most max_connections at once."""

    def __init__(self, *, max_connections: int, keepalive_expiry_s: float) -> None:
        self.max_connections = max_connections
        self.keepalive_expiry_s = keepalive_expiry_s
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        # made at the first request: a session belongs to the event loop that runs it
        if self._session is None:
            connector = aiohttp.TCPConnector(limit=self.max_connections,
                                             keepalive_timeout=self.keepalive_expiry_s)
            self._session = aiohttp.ClientSession(connector=connector, auto_decompress=False)
        return self._session

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        timeouts = request.extensions.get("timeout", {})
        timeout = aiohttp.ClientTimeout(total=None, connect=timeouts.get("pool"),
                                        sock_connect=timeouts.get("connect"), sock_read=timeouts.get("read"))
        headers = [(name, value) for name, value in request.headers.multi_items()
                   if name.lower() not in _SET_BY_AIOHTTP]
        try:
            response = await self._client().request(request.method, str(request.url), headers=headers,
                                                    data=await request.aread(), allow_redirects=False,
                                                    timeout=timeout)
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise _as_httpx(exc, request) from exc
        return httpx.Response(response.status, headers=list(response.raw_headers),
                              stream=_Body(response, request), request=request)

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


class _Body(httpx.AsyncByteStream):
    """An answer's body as it arrives; closing it before its end closes its connection."""

    def __init__(self, response: aiohttp.ClientResponse, request: httpx.Request) -> None:
        self.response = response
        self.request = request

    async def __aiter__(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self.response.content.iter_any():
                yield chunk
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise _as_httpx(exc, self.request) from exc

    async def aclose(self) -> None:
        self.response.release()


def _as_httpx(exc: BaseException, request: httpx.Request) -> httpx.TransportError:
    message = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        return httpx.ConnectTimeout(message, request=request)
    if isinstance(exc, TimeoutError):
        return httpx.ReadTimeout(message, request=request)
    if isinstance(exc, aiohttp.ClientConnectorError):
        return httpx.ConnectError(message, request=request)
    return httpx.ReadError(message, request=request)

"""Serving one ASGI app on a set of listening sockets, from a background thread (tests) or in the
caller's event loop (a bench process): what the simulated fleet (bench/sim_fleet.py) and the metering proxy
(bench/metered_proxy.py) share.
"""

from __future__ import annotations

import asyncio
import socket
import threading


def listening_socket(host: str, port: int) -> socket.socket:
    # proto given explicitly: asyncio turns Nagle off only on sockets whose proto is IPPROTO_TCP, and
    # with Nagle on, a response written as headers then body waits ~40 ms for the client's delayed ACK
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind((host, port))
    sock.listen(1024)
    sock.setblocking(False)
    return sock


class AsgiHost:
    """Serves one ASGI app on a set of listening sockets, from a background thread or in a loop."""

    def __init__(self, ports: list[int], host: str) -> None:
        self.host = host
        self.sockets = [listening_socket(host, port) for port in ports]
        self.ports = [s.getsockname()[1] for s in self.sockets]
        self._uvicorn = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None

    @property
    def ready(self) -> bool:
        """Whether the server has started listening (or failed to start)."""
        return self._ready.is_set()

    @property
    def urls(self) -> list[str]:
        return [f"http://{self.host}:{port}" for port in self.ports]

    def build_app(self):
        raise NotImplementedError

    async def serve(self) -> None:
        import uvicorn

        # keep-alive longer than any client's idle gap: a server closing a pooled connection while the
        # client reuses it fails that request, which the fleet client would count against the server
        config = uvicorn.Config(self.build_app(), lifespan="off", log_level="warning", access_log=False,
                                http="httptools", timeout_keep_alive=300, backlog=1024)
        self._uvicorn = uvicorn.Server(config)
        serving = asyncio.create_task(self._uvicorn.serve(sockets=self.sockets))
        while not self._uvicorn.started and not serving.done():
            await asyncio.sleep(0.01)
        self._ready.set()
        try:
            await serving
        finally:
            await self.aclose()

    async def aclose(self) -> None:
        """Release what the app holds, once the server has stopped."""

    def start(self, timeout_s: float = 60.0):
        def run() -> None:
            try:
                asyncio.run(self.serve())
            except BaseException as exc:  # surfaced by start()
                self._error = exc
                self._ready.set()

        self._thread = threading.Thread(target=run, name=type(self).__name__, daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout_s) or self._error is not None:
            raise RuntimeError(f"{type(self).__name__} did not start: {self._error!r}")
        return self

    def stop(self) -> None:
        if self._uvicorn is not None:
            self._uvicorn.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None
        for sock in self.sockets:
            sock.close()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

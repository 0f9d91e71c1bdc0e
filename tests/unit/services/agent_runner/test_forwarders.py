"""The two forwarders between a black-box agent's sandbox and the gateway, on real sockets: the agent-runner's
(gateway_forwarder.SessionForwarder, a unix socket) in front of a stub gateway (a real HTTP server that
records what reaches it), alone and behind the sandbox's own (sandbox_forwarder.py, run here as a plain
process on a TCP port of this machine). Only the session's own paths reach the gateway; streamed answers (SSE)
come through as they are sent, not when they end.

    python -m pytest tests/unit/services/agent_runner/test_forwarders.py -q
"""

from __future__ import annotations

import asyncio
import json
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from rollstream.services.agent_runner import gateway_forwarder, sandbox_forwarder
from rollstream.services.agent_runner.gateway_forwarder import SessionForwarder, session_path
from tests.support import free_port, wait_for

SESSION = "3f2a"


class StubGateway:
    """Answers every request with what it received (JSON); /s/{session}/v1/stream answers with two server-sent
    events, the second only once the test says the client holds the first."""

    def __init__(self) -> None:
        self.requests: list[dict] = []
        self.first_event_seen = threading.Event()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self.handler())
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def handler(self):
        stub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def answer(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                seen = {"method": self.command, "path": self.path, "headers": dict(self.headers),
                        "body": body.decode()}
                stub.requests.append(seen)
                if self.path.endswith("/v1/stream"):
                    self.send_response(200)
                    self.send_header("Content-Type", "text/event-stream")
                    self.send_header("Connection", "close")  # ends the stream: no length, no chunks
                    self.end_headers()
                    self.wfile.write(b"data: first\n\n")
                    self.wfile.flush()
                    held = stub.first_event_seen.wait(10)
                    self.wfile.write(b"data: second (the first was %s)\n\n"
                                     % (b"seen" if held else b"held back"))
                    self.close_connection = True
                    return
                data = json.dumps(seen).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_HEAD = answer

        return Handler


@pytest.fixture
def gateway():
    stub = StubGateway()
    yield stub
    stub.close()


@pytest.fixture
def socket_dir():
    path = Path(tempfile.mkdtemp(prefix="rs-fwd-"))  # short: a unix socket's path has at most 107 bytes
    yield path
    shutil.rmtree(path, ignore_errors=True)


class Running:
    """A SessionForwarder served by an event loop in a thread, as the agent-runner's loop serves it."""

    def __init__(self, socket_path: Path, gateway_url: str) -> None:
        self.socket_path = socket_path
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.forwarder = SessionForwarder(socket_path, gateway_url, SESSION)
        asyncio.run_coroutine_threadsafe(self.forwarder.__aenter__(), self.loop).result(10)

    def close(self) -> None:
        if self.loop.is_closed():
            return
        asyncio.run_coroutine_threadsafe(self.forwarder.__aexit__(None, None, None), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()

    def client(self) -> httpx.Client:
        return httpx.Client(transport=httpx.HTTPTransport(uds=str(self.socket_path)),
                            base_url="http://sandbox", timeout=15)


@pytest.fixture
def forwarder(gateway, socket_dir):
    running = Running(socket_dir / "gateway.sock", gateway.url)
    yield running
    running.close()


def raw_request(socket_path: Path, head: bytes) -> bytes:
    """Send one request as written (no client normalizes its target) and read until the server closes."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
        connection.settimeout(10)
        connection.connect(str(socket_path))
        connection.sendall(head)
        received = b""
        while chunk := connection.recv(65536):
            received += chunk
    return received


@pytest.mark.parametrize("target, allowed", [
    (f"/s/{SESSION}", True),  # Claude Code probes its base URL with HEAD
    (f"/s/{SESSION}/", True),
    (f"/s/{SESSION}/v1/chat/completions", True),
    (f"/s/{SESSION}/v1/messages?beta=true&x=%2F..", True),  # the query is the gateway's to read
    ("/v1/sessions", False),
    (f"/v1/sessions/{SESSION}/finish", False),
    ("/s/other/v1/chat/completions", False),
    (f"/s/{SESSION}x/v1/chat/completions", False),
    (f"/s/{SESSION}/../other/v1/chat/completions", False),
    (f"/s/{SESSION}/v1/./chat", False),
    (f"/s/{SESSION}/%2e%2e/other/v1/models", False),
    (f"/s/{SESSION}%2F..%2Fother/v1/models", False),
    (f"/s/{SESSION}//v1/models", False),
    (f"/s/{SESSION}/v1\\..\\..\\other", False),
    (f"http://gateway/s/{SESSION}/v1/models", False),  # absolute form: a proxy request
    ("gateway:443", False),  # CONNECT's authority form
    ("*", False),
    (f"/s/{SESSION}/v1/caf\u00e9".encode().decode("latin-1"), False),
])
def test_only_the_sessions_own_paths_are_allowed(target, allowed):
    assert session_path(target.encode("latin-1"), SESSION) is allowed


def test_a_request_for_the_session_reaches_the_gateway_as_sent(forwarder, gateway):
    with forwarder.client() as client:
        response = client.post(f"/s/{SESSION}/v1/chat/completions?x=1", content=b'{"model": "m"}',
                               headers={"Authorization": "Bearer key", "x-api-key": "key",
                                        "anthropic-version": "2023-06-01",
                                        "Content-Type": "application/json"})
        again = client.get(f"/s/{SESSION}/v1/models")  # the same connection, kept alive
    assert response.status_code == 200 and again.status_code == 200
    (first, second) = gateway.requests
    assert (first["method"], first["path"], first["body"]) == ("POST",
                                                               f"/s/{SESSION}/v1/chat/completions?x=1",
                                                               '{"model": "m"}')
    headers = {name.lower(): value for name, value in first["headers"].items()}
    assert headers["authorization"] == "Bearer key" and headers["x-api-key"] == "key"
    assert headers["anthropic-version"] == "2023-06-01"
    assert headers["host"] == gateway.url.removeprefix("http://")
    assert response.json() == first
    assert second["path"] == f"/s/{SESSION}/v1/models"


@pytest.mark.parametrize("target", ["/s/other/v1/chat/completions", "/v1/sessions",
                                    f"/s/{SESSION}/../other/v1/chat/completions",
                                    f"http://127.0.0.1/s/{SESSION}/v1/chat/completions"])
def test_anything_else_is_refused_and_never_reaches_the_gateway(forwarder, gateway, target):
    answer = raw_request(forwarder.socket_path,
                         b"POST %s HTTP/1.1\r\nHost: sandbox\r\nContent-Length: 2\r\n\r\n{}"
                         % target.encode())
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 403 ") and b"connection: close" in head.lower()
    assert "only its own gateway session" in json.loads(body)["error"]["message"]
    assert gateway.requests == []


def test_each_request_of_a_kept_alive_connection_is_checked(forwarder, gateway):
    with forwarder.client() as client:
        assert client.get(f"/s/{SESSION}/v1/models").status_code == 200
        assert client.get("/s/other/v1/models").status_code == 403
    assert [seen["path"] for seen in gateway.requests] == [f"/s/{SESSION}/v1/models"]


def test_a_streamed_answer_comes_through_as_it_is_sent(forwarder, gateway):
    with forwarder.client() as client, client.stream("POST", f"/s/{SESSION}/v1/stream",
                                                     content=b"{}") as response:
        chunks = response.iter_raw()
        first = next(chunks)
        gateway.first_event_seen.set()
        rest = b"".join(chunks)
    assert first == b"data: first\n\n"
    assert rest == b"data: second (the first was seen)\n\n"


def test_a_body_too_large_is_refused(forwarder, gateway, monkeypatch):
    monkeypatch.setattr(gateway_forwarder, "MAX_REQUEST_BYTES", 1000)
    with forwarder.client() as client:
        response = client.post(f"/s/{SESSION}/v1/chat/completions", content=b"x" * 5000)
    assert response.status_code == 413 and gateway.requests == []


def test_a_gateway_that_does_not_answer_is_a_502(socket_dir):
    running = Running(socket_dir / "gateway.sock", f"http://127.0.0.1:{free_port()}")
    try:
        with running.client() as client:
            response = client.get(f"/s/{SESSION}/v1/models")
    finally:
        running.close()
    assert response.status_code == 502 and "did not answer" in response.json()["error"]["message"]
    assert not (socket_dir / "gateway.sock").exists()


# ---------------------------------------------------------------------------------- the sandbox's forwarder
def start_sandbox_forwarder(socket_path: Path, port: int) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, sandbox_forwarder.__file__, str(socket_path), str(port)],
                          capture_output=True, text=True, timeout=30)


def accepts(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        return False
    return True


def test_both_forwarders_carry_the_sessions_requests_and_streams_and_nothing_else(forwarder, gateway):
    port = free_port()
    started = start_sandbox_forwarder(forwarder.socket_path, port)
    assert (started.returncode, started.stdout) == (0, f"{sandbox_forwarder.READY}\n"), started.stderr
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=15) as client:
            assert client.post(f"/s/{SESSION}/v1/chat/completions", content=b"{}").status_code == 200
            assert client.post("/s/other/v1/chat/completions", content=b"{}").status_code == 403
            with client.stream("POST", f"/s/{SESSION}/v1/stream", content=b"{}") as response:
                chunks = response.iter_raw()
                first = next(chunks)
                gateway.first_event_seen.set()
                rest = b"".join(chunks)
        assert (first, rest) == (b"data: first\n\n", b"data: second (the first was seen)\n\n")
        assert [seen["path"] for seen in gateway.requests] == [f"/s/{SESSION}/v1/chat/completions",
                                                               f"/s/{SESSION}/v1/stream"]
    finally:
        # its lifeline ends: the sandbox's forwarder stops (and, not in a sandbox, kills nothing)
        forwarder.close()
    wait_for(lambda: not accepts(port), 10, "the sandbox's forwarder to stop with its lifeline")


def test_the_sandbox_forwarder_says_why_it_cannot_start(socket_dir):
    started = start_sandbox_forwarder(socket_dir / "missing.sock", free_port())
    assert started.returncode == 1 and started.stdout == ""
    assert "cannot reach the agent-runner at" in started.stderr and "missing.sock" in started.stderr


def test_the_sandbox_forwarder_answers_502_when_the_agent_runner_is_gone_but_its_socket_is_left(socket_dir):
    path = socket_dir / "gateway.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen()  # takes the lifeline, and is then closed for every later connection
    port = free_port()
    try:
        assert start_sandbox_forwarder(path, port).returncode == 0
        lifeline, _ = listener.accept()
        listener.close()
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=15) as client:
            response = client.get(f"/s/{SESSION}/v1/models")
        assert response.status_code == 502 and "does not answer" in response.json()["error"]["message"]
        lifeline.close()
        wait_for(lambda: not accepts(port), 10, "the sandbox's forwarder to stop with its lifeline")
    finally:
        listener.close()

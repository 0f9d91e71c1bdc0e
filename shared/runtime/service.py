"""What every service process has: structured logs, a health endpoint, metrics, SIGTERM drain.

    runtime = ServiceRuntime("reward", settings)   # logs, /healthz + /metrics, signal handlers
    while not runtime.stopping: ...                 # SIGTERM/SIGINT set `stopping`; finish, then exit
"""

from __future__ import annotations

import gc
import json
import logging
import signal
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

import redis
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from rollstream.shared.runtime.config import Settings
from rollstream.shared.runtime.health_api import auth_failure, challenge, openapi_document, required_token

_STANDARD_RECORD_FIELDS = set(logging.makeLogRecord({}).__dict__) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, service, logger, message, and any `extra` fields."""

    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": round(record.created, 3),
            "level": record.levelname,
            "service": self.service,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in record.__dict__.items():
            if key not in _STANDARD_RECORD_FIELDS:
                entry[key] = value
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def configure_logging(service: str, level: str = "INFO") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(service))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    for noisy in ("httpx", "httpcore", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


class ServiceRuntime:
    """Logs, health endpoint and graceful-shutdown flag of one service process."""

    def __init__(self, name: str, settings: Settings) -> None:
        self.name = name
        self.settings = settings
        self.started = time.time()
        self.stopping = False
        self.status: dict[str, Any] = {}
        """Free-form facts the service wants /healthz to show (counts, version)."""
        self.not_ready: str | None = None
        """Why the service cannot do its work now (shown by /healthz, which then answers 503)."""
        # Its own client, which fails fast: /healthz must say "Redis unreachable" while the service's
        # client waits for Redis to come back.
        self._redis_probe = (redis.Redis.from_url(settings.redis, socket_timeout=1, socket_connect_timeout=1)
                             if settings.redis_url else None)
        configure_logging(name, settings.log_level)
        self.log = logging.getLogger(name)
        signal.signal(signal.SIGTERM, self._request_stop)
        signal.signal(signal.SIGINT, self._request_stop)
        self.health_server = self._serve_health(settings.health_port)
        self.log.info("service started", extra={"run_id": settings.run_id, "health_port": self.health_port,
                                                "listen_host": settings.listen_host})
        # What the process imported (some 67k objects for a consumer) lives as long as it does: frozen, it is
        # not walked by each full collection that a busy consumer's decoding brings (about 30 ms a pass).
        gc.freeze()

    @property
    def health_port(self) -> int:
        return self.health_server.server_address[1]

    def should_stop(self) -> bool:
        return self.stopping

    def readiness_problem(self) -> str | None:
        """Why /healthz answers 503 now: the service's own reason, or a Redis it cannot reach."""
        if self.not_ready:
            return self.not_ready
        if self._redis_probe is not None:
            try:
                self._redis_probe.ping()
            except redis.RedisError as exc:
                return f"Redis unreachable: {exc}"
        return None

    def _request_stop(self, signum: int, _frame: Any) -> None:
        if not self.stopping:
            self.log.info("stop requested; draining", extra={"signal": signal.Signals(signum).name})
        self.stopping = True

    def _serve_health(self, port: int) -> ThreadingHTTPServer:
        runtime = self
        security = self.settings.security
        openapi = json.dumps(openapi_document(self.name, security)).encode()

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
                # Exact routes: a prefix match would let /metricsX past /metrics's own token rule.
                route = urlsplit(self.path).path
                denied = auth_failure(self.headers.get("Authorization"), required_token(route, security))
                if denied:
                    body = json.dumps({"error": "bearer token required" if denied == 401 else "wrong token"})
                    self._reply(denied, "application/json", body.encode(), challenge(denied))
                elif route == "/healthz":
                    problem = None if runtime.stopping else runtime.readiness_problem()
                    state = "stopping" if runtime.stopping else "not ready" if problem else "ok"
                    reason = {"reason": problem} if problem else {}
                    body = json.dumps({"service": runtime.name, "status": state, **reason,
                                       "uptime_s": round(time.time() - runtime.started, 1), **runtime.status},
                                      default=str).encode()
                    self._reply(200 if state == "ok" else 503, "application/json", body)
                elif route == "/metrics":
                    self._reply(200, CONTENT_TYPE_LATEST, generate_latest())
                elif route == "/openapi.json":
                    self._reply(200, "application/json", openapi)
                else:
                    self._reply(404, "text/plain", b"not found\n")

            def __getattr__(self, name: str) -> Any:
                # http.server answers a method without a do_<METHOD> with 501, a server error: every
                # method but GET is the client's, 405.
                if name.startswith("do_"):
                    return self._method_not_allowed
                raise AttributeError(name)

            def _method_not_allowed(self) -> None:
                self._reply(405, "text/plain", b"", {"Allow": "GET"})

            def _reply(self, code: int, content_type: str, body: bytes,
                       headers: dict[str, str] | None = None) -> None:
                self.send_response(code)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                for name, value in (headers or {}).items():
                    self.send_header(name, value)
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *_args: Any) -> None:
                pass

        host = self.settings.listen_host

        class Server(ThreadingHTTPServer):
            address_family = socket.AF_INET6 if ":" in host else socket.AF_INET

        server = Server((host, port), Handler)
        threading.Thread(target=server.serve_forever, name="health", daemon=True).start()
        return server

    def close(self) -> None:
        self.health_server.shutdown()
        self.log.info("service stopped")

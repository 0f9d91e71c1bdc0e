"""What every service process has: structured logs, a health endpoint, metrics, SIGTERM drain.

    runtime = ServiceRuntime("reward", settings)   # logs, /healthz + /metrics, signal handlers
    while not runtime.stopping: ...                 # SIGTERM/SIGINT set `stopping`; finish, then exit

SIGHUP (what the local run's services get when the run dies, cli/child_processes.py) and SIGQUIT stop a
service as SIGTERM does, where a service gave SIGTERM to a handler of its own too (the sandbox-grader's RQ
worker): they raise SIGTERM for it.

A service asked to stop while Redis is unreachable has nothing left to drain to: no acknowledgement or
hand-back reaches Redis, and what it holds stays pending for another consumer to reclaim. Its Redis client
would retry for as long as the outage lasts (shared/contract/redis_clients.py), so once a stop is
requested the runtime probes Redis, and after REDIS_GONE_PROBES failed probes in a row it ends the process,
its children first, saying where the service was waiting.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
import traceback
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

import psutil
import redis
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from rollstream.shared.runtime.config import Settings
from rollstream.shared.runtime.health_api import auth_failure, challenge, openapi_document, required_token

_STANDARD_RECORD_FIELDS = set(logging.makeLogRecord({}).__dict__) | {"message", "asctime"}
REDIS_PROBE_INTERVAL_S = 1.0
REDIS_GONE_PROBES = 3
"""Failed probes in a row, REDIS_PROBE_INTERVAL_S apart, after which a stopping service takes Redis for gone
(a Redis that reads its append-only file back answers LOADING: no failure)."""


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
        self._stop_requested = threading.Event()
        self._closed = threading.Event()
        signal.signal(signal.SIGTERM, self._request_stop)
        signal.signal(signal.SIGINT, self._request_stop)
        signal.signal(signal.SIGHUP, self._stop_as_sigterm_does)
        signal.signal(signal.SIGQUIT, self._stop_as_sigterm_does)
        if self._redis_probe is not None:
            threading.Thread(target=self._exit_once_redis_is_gone_while_stopping, name="stop-watch",
                             daemon=True).start()
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
        self._stop_requested.set()

    def _stop_as_sigterm_does(self, signum: int, frame: Any) -> None:
        """SIGHUP, SIGQUIT: what SIGTERM does now, whoever handles it."""
        if signal.getsignal(signal.SIGTERM) == self._request_stop:
            self._request_stop(signum, frame)
            return
        self.log.info("stop requested; raising SIGTERM for its handler",
                      extra={"signal": signal.Signals(signum).name})
        self._stop_requested.set()
        signal.raise_signal(signal.SIGTERM)

    def _exit_once_redis_is_gone_while_stopping(self) -> None:
        """The stop watch (a thread): from the stop request until close(), end the process once Redis has
        failed REDIS_GONE_PROBES probes in a row (see the module docstring)."""
        self._stop_requested.wait()
        failures = 0
        while not self._closed.wait(REDIS_PROBE_INTERVAL_S):
            failures = 0 if self._redis_answers() else failures + 1
            if failures >= REDIS_GONE_PROBES:
                self._exit_without_draining()

    def _redis_answers(self) -> bool:
        assert self._redis_probe is not None
        try:
            self._redis_probe.ping()
        except (redis.AuthenticationError, redis.BusyLoadingError):
            return True  # a Redis that is there: it refused the login, or reads its append-only file
        except (redis.ConnectionError, redis.TimeoutError):
            return False
        except redis.RedisError:
            return True
        return True

    def _exit_without_draining(self) -> None:
        main = sys._current_frames().get(threading.main_thread().ident or 0)
        waiting_in = "".join(traceback.format_stack(main))[-4000:] if main is not None else ""
        self.log.warning("Redis unreachable while stopping: exiting without draining; what this process "
                         "holds stays pending for another consumer to reclaim",
                         extra={"waiting_in": waiting_in})
        for child in psutil.Process().children(recursive=True):  # an RQ work-horse, an agent's command
            try:
                child.kill()
            except psutil.Error:
                pass
        os._exit(1)

    def _serve_health(self, port: int) -> ThreadingHTTPServer:
        runtime = self
        security = self.settings.security
        openapi = json.dumps(openapi_document(self.name, security)).encode()

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # http.server's naming
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
        self._closed.set()
        self.health_server.shutdown()
        self.log.info("service stopped")

"""A vLLM server's GET /v1/models answer, for the fake fleets of the fleet client's and the gateway's unit
tests (the client reads it before a server's first turn: shared/inference/fleet_servers.py), and a small
real HTTP server answering it."""

from __future__ import annotations

import json
import threading
from collections.abc import Awaitable, Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx

Handler = Callable[[httpx.Request], Awaitable[httpx.Response]]


def models_body(served_name: str = "tiny", max_model_len: int = 1024, root: str = "/models/tiny") -> dict:
    """/v1/models as vLLM 0.32 answers it for one served model."""
    card = {"id": served_name, "object": "model", "created": 0, "owned_by": "vllm", "root": root,
            "parent": None, "max_model_len": max_model_len}
    return {"object": "list", "data": [card]}


def answering_models(handler: Handler, max_model_len: int = 1024) -> Handler:
    """`handler`, with GET /v1/models answered as a vLLM server of `max_model_len` tokens answers it."""

    async def answer(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json=models_body(max_model_len=max_model_len))
        return await handler(request)

    return answer


class VllmLikeServer:
    """Answers GET /v1/models with `models` (or the HTTP status `models_status`), POST /v1/completions with
    one token per request and POST /v1/chat/completions with "yes"; counts the requests of each path."""

    def __init__(self, max_model_len: int = 1024, served_name: str = "tiny") -> None:
        self.models = models_body(served_name=served_name, max_model_len=max_model_len)
        self.models_status = 200
        self.requests: dict[str, int] = {}
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                server.requests[self.path] = server.requests.get(self.path, 0) + 1
                if self.path != "/v1/models":
                    return self._answer(404, {"error": "no such route"})
                self._answer(server.models_status, server.models if server.models_status == 200 else {})

            def do_POST(self) -> None:
                server.requests[self.path] = server.requests.get(self.path, 0) + 1
                self.rfile.read(int(self.headers["content-length"]))
                if self.path == "/v1/chat/completions":
                    message = {"role": "assistant", "content": "yes"}
                    return self._answer(200, {"choices": [{"message": message}]})
                choice = {"token_ids": [7], "logprobs": {"token_logprobs": [-0.5]}, "finish_reason": "length"}
                self._answer(200, {"choices": [choice]})

            def _answer(self, status: int, body: dict) -> None:
                content = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(content)))
                self.end_headers()
                self.wfile.write(content)

            def log_message(self, *args) -> None:
                pass

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"
        threading.Thread(target=self.http.serve_forever, args=(0.05,), daemon=True).start()

    def close(self) -> None:
        self.http.shutdown()
        self.http.server_close()

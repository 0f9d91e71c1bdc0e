"""A fake token server: a benchmark's stand-in for a GPU fleet, which answers at once with fixed tokens, so
that what a benchmark measures in front of it is the cost of the client or proxy, not of generation.

It answers the endpoints of vLLM's OpenAI server that rollstream and a proxy in front of it use, in the shapes
vLLM 0.32 gives (shared/inference/fleet.py's docstring lists the fields the fleet client reads):

    POST /v1/completions         `prompt` as token ids; whole, or streamed (`stream: true`: one chunk per
                                 token, the first echoing prompt_token_ids, the last with the finish_reason,
                                 then `data: [DONE]`); choices[0].token_ids and logprobs.token_logprobs
    POST /v1/chat/completions    whole only: the fixed text as the assistant's content (a proxy's upstream)
    GET  /health  /v1/models  /metrics (vllm:num_requests_running, _waiting, kv_cache_usage_perc)

The answer is --token-ids, repeated as far as max_tokens asks with `ignore_eos` (finish_reason "length"),
else cut at max_tokens ("length") or whole ("stop"). `text` is --text, not a decoding of the ids: the fleet
client reads only ids. Nothing is sampled, nothing checked against a model; a real vLLM server is what the
integration tests run against (tests/integration/test_gateway.py).

    python bench/fake_token_server.py --port 8000 --token-ids 450,1234,29889 --text "The end."
        [--served-name tiny] [--max-model-len 1024]

serves until SIGTERM; /health answers once it listens. Importable: `FakeTokenServer` is the ASGI app.
"""

from __future__ import annotations

import argparse
import itertools
import time
import uuid
from typing import Any

import msgspec
import uvicorn

LOGPROB = -0.5
"""The logprob every fixed token is reported with."""
_json = msgspec.json.Encoder()


class FakeTokenServer:
    """The ASGI app: each request is answered from the fixed tokens, without awaiting anything but the
    request's body."""

    def __init__(self, token_ids: list[int], text: str, served_name: str, max_model_len: int) -> None:
        if not token_ids:
            raise ValueError("the fake token server needs at least one token id")
        self.token_ids = token_ids
        self.text = text
        self.served_name = served_name
        self.max_model_len = max_model_len
        self.running = 0

    def answer(self, body: dict[str, Any]) -> tuple[list[int], str]:
        """The ids a request gets and why they end."""
        max_tokens = int(body.get("max_tokens") or 16)
        if body.get("ignore_eos"):
            return list(itertools.islice(itertools.cycle(self.token_ids), max_tokens)), "length"
        if max_tokens < len(self.token_ids):
            return self.token_ids[:max_tokens], "length"
        return list(self.token_ids), "stop"

    def completion(self, body: dict[str, Any]) -> dict[str, Any]:
        ids, finish = self.answer(body)
        prompt = list(body.get("prompt") or [])
        choice = {"index": 0, "text": self.text, "token_ids": ids, "prompt_token_ids": prompt,
                  "logprobs": {"tokens": None, "token_logprobs": [LOGPROB] * len(ids), "top_logprobs": None,
                               "text_offset": None},
                  "finish_reason": finish, "stop_reason": None}
        return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": self.served_name, "choices": [choice],
                "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(ids),
                          "total_tokens": len(prompt) + len(ids)}}

    def completion_chunks(self, body: dict[str, Any]) -> list[bytes]:
        """The stream of a completion: one `data:` event per token, then [DONE]."""
        ids, finish = self.answer(body)
        head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": self.served_name}
        events = []
        for index, token in enumerate(ids):
            last = index == len(ids) - 1
            choice = {"index": 0, "text": self.text if last else "", "token_ids": [token],
                      "logprobs": {"tokens": None, "token_logprobs": [LOGPROB], "top_logprobs": None,
                                   "text_offset": None},
                      "finish_reason": finish if last else None, "stop_reason": None}
            if index == 0:
                choice["prompt_token_ids"] = list(body.get("prompt") or [])
            events.append(b"data: " + _json.encode({**head, "choices": [choice]}) + b"\n\n")
        return [*events, b"data: [DONE]\n\n"]

    def chat_completion(self, body: dict[str, Any]) -> dict[str, Any]:
        ids, finish = self.answer(body)
        return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion",
                "created": int(time.time()), "model": body.get("model") or self.served_name,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": self.text},
                             "finish_reason": finish, "logprobs": None}],
                "usage": {"prompt_tokens": 0, "completion_tokens": len(ids), "total_tokens": len(ids)}}

    def metrics(self) -> str:
        labels = f'{{engine="0",model_name="{self.served_name}"}}'
        return "".join(f"# TYPE {name} gauge\n{name}{labels} {value}\n" for name, value in
                       (("vllm:num_requests_running", self.running), ("vllm:num_requests_waiting", 0),
                        ("vllm:kv_cache_usage_perc", 0.0)))

    def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": self.served_name, "object": "model", "created": 0,
                                            "owned_by": "fake", "max_model_len": self.max_model_len}]}

    async def __call__(self, scope, receive, send) -> None:
        route = (scope["method"], scope["path"])
        if route == ("GET", "/health"):
            await _respond(send, 200, b"", b"text/plain")
        elif route == ("GET", "/metrics"):
            await _respond(send, 200, self.metrics().encode(), b"text/plain; version=0.0.4")
        elif route == ("GET", "/v1/models"):
            await _respond(send, 200, _json.encode(self.models()))
        elif route in (("POST", "/v1/completions"), ("POST", "/v1/chat/completions")):
            try:
                body = msgspec.json.decode(await _read_body(receive))
            except msgspec.DecodeError as exc:
                await _respond(send, 400, _json.encode({"error": {"message": str(exc), "code": 400}}))
                return
            self.running += 1
            try:
                if route[1] == "/v1/chat/completions":
                    await _respond(send, 200, _json.encode(self.chat_completion(body)))
                elif body.get("stream"):
                    await _stream(send, self.completion_chunks(body))
                else:
                    await _respond(send, 200, _json.encode(self.completion(body)))
            finally:
                self.running -= 1
        else:
            await _respond(send, 404, _json.encode({"error": {"message": f"no route {route}", "code": 404}}))


async def _read_body(receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(chunks)


async def _respond(send, status: int, body: bytes, content_type: bytes = b"application/json") -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", content_type), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


async def _stream(send, events: list[bytes]) -> None:
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"text/event-stream")]})
    for event in events:
        await send({"type": "http.response.body", "body": event, "more_body": True})
    await send({"type": "http.response.body", "body": b""})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--token-ids", required=True, help="comma-separated ids every answer is made of")
    parser.add_argument("--text", default="", help="the answer's text in chat completions and `text` fields")
    parser.add_argument("--served-name", default="tiny")
    parser.add_argument("--max-model-len", type=int, default=1024)
    args = parser.parse_args()
    app = FakeTokenServer([int(t) for t in args.token_ids.split(",")], args.text, args.served_name,
                          args.max_model_len)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", access_log=False, lifespan="off")


if __name__ == "__main__":
    main()

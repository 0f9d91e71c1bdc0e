"""What a vLLM server answers a generation with, read into the sampled ids and their logprobs.

Response fields used (vLLM 0.32, /v1/completions with `return_token_ids`, `logprobs: 0`):
    choices[0].token_ids                  [int, ...]          sampled ids
    choices[0].logprobs.token_logprobs    [float, ...]        one per sampled id
    choices[0].prompt_logprobs            [null, {"<id>": {"logprob": float, "rank": int,
                                                          "decoded_token": str}}, ...]
With `stream: true` the answer is server-sent events, `data: <chunk>` then `data: [DONE]`. Each chunk's
choices[0] holds the ids sampled since the previous chunk in `token_ids` with their
`logprobs.token_logprobs`, and `finish_reason` (null until the last chunk, which carries the last ids
too); the first chunk also echoes `prompt_token_ids`. A failure after the HTTP 200 comes as a chunk
`{"error": {"message", "type", "code"}}` (code: the HTTP status it stands for) before [DONE].

Library module, not run directly (the fleet client reads its answers with it):
    python -m pytest tests/unit/shared/inference/test_fleet_streaming.py -q
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from rollstream.shared.errors import FleetRequestError, RollstreamError

# vLLM ends a request with "abort" when the server drops it (shutdown, a pause that aborts): for the
# client that is a server failure, not the end of the generation.
SERVER_DROPPED = "abort"


@dataclass(frozen=True)
class Completion:
    token_ids: list[int]
    # One per token id. vLLM's default logprobs_mode is raw_logprobs: the model's log-softmax BEFORE
    # temperature, logit_bias, top-k/p. That is the sampling distribution only at temperature 1 with no
    # other processing; otherwise start vLLM with --logprobs-mode processed_logprobs.
    logprobs: list[float]
    finish_reason: str  # "stop" (eos / stop token, which is included in token_ids) or "length"
    server_url: str


@dataclass(frozen=True)
class StreamDelta:
    """Ids sampled since the previous delta, one logprob each (same semantics as Completion.logprobs)."""

    token_ids: list[int]
    logprobs: list[float]
    server_url: str
    finish_reason: str | None  # None until the last delta of the generation


class StreamBroken(RollstreamError, RuntimeError):
    """The server stopped serving a stream it had accepted; the stream goes on elsewhere."""


def parse_completion(body: dict[str, Any], url: str) -> Completion:
    """A whole (not streamed) generation's answer; FleetRequestError when it lacks the ids or logprobs."""
    try:
        choice = body["choices"][0]
        token_ids = [int(t) for t in choice["token_ids"]]
        logprobs = [float(lp) for lp in choice["logprobs"]["token_logprobs"]]
        finish_reason = str(choice["finish_reason"])
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        raise FleetRequestError(f"{url} answered without token ids / logprobs: {str(body)[:500]}") from exc
    if len(token_ids) != len(logprobs):
        raise FleetRequestError(f"{url} returned {len(token_ids)} token ids but {len(logprobs)} logprobs")
    return Completion(token_ids=token_ids, logprobs=logprobs, finish_reason=finish_reason, server_url=url)


def parse_stream_chunk(payload: str, url: str) -> StreamDelta | None:
    """One `data:` payload of a stream as a delta; None for a chunk without a choice (the usage chunk)."""
    try:
        chunk = json.loads(payload)
    except json.JSONDecodeError as exc:
        raise StreamBroken(f"malformed chunk: {payload[:300]}") from exc
    if not isinstance(chunk, dict):
        raise StreamBroken(f"malformed chunk: {payload[:300]}")
    if "error" in chunk:
        error = chunk["error"] if isinstance(chunk["error"], dict) else {}
        code = error.get("code")
        if isinstance(code, int) and 400 <= code < 500:
            raise FleetRequestError(f"{url} failed the request mid-stream: {payload[:500]}")
        raise StreamBroken(f"error chunk: {payload[:300]}")
    try:
        if not chunk["choices"]:
            return None
        choice = chunk["choices"][0]
        token_ids = [int(t) for t in choice.get("token_ids") or []]
        logprobs = [float(lp) for lp in (choice.get("logprobs") or {}).get("token_logprobs") or []]
        finish_reason = choice.get("finish_reason")
    except (KeyError, IndexError, TypeError, ValueError, AttributeError) as exc:
        raise StreamBroken(f"malformed chunk: {payload[:300]}") from exc
    if len(token_ids) != len(logprobs):
        raise StreamBroken(f"{len(token_ids)} ids but {len(logprobs)} logprobs in chunk: {payload[:300]}")
    if finish_reason == SERVER_DROPPED:
        raise StreamBroken("the server aborted the request")
    return StreamDelta(
        token_ids=token_ids,
        logprobs=logprobs,
        server_url=url,
        finish_reason=None if finish_reason is None else str(finish_reason),
    )

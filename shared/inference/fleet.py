"""FleetClient: token-in/token-out calls to a fleet of vLLM servers, session-sticky, plus weight sync.

Agent-runners call `complete()` with prompt token ids and get back the sampled token ids with their
logprobs, exactly as vLLM reported them: text is never re-tokenized (the token-exactness rule).
`stream()` gives the same as deltas while vLLM produces them, and survives a server that fails in the
middle: the generation goes on on the session's next server from prompt + the tokens already yielded.

Routing: rendezvous hashing of the session id picks the same server for every turn of a session (its
prefix cache stays warm), with bounded load: a server already carrying more than (1 + epsilon) times the
average load is passed over for the session's next-ranked server, and so is one whose KV cache is nearly
full. A server's load is this client's requests open on it plus the other clients' requests vLLM reports
on /metrics (`refresh_load()`, or a background `start_load_refresh()`); without metrics, only ours. A
connection error or a 5xx marks a server unhealthy for a cool-down and the call is retried on the next
server; when no server can serve, FleetUnavailable. Every request carries `X-Session-ID` and a routing
header (`X-SMG-Routing-Key` unless fleet.routing_header names another) so that an external router
(vllm-router, SGLang model gateway) in front of the fleet keeps the same stickiness. Requests go through
httpx's interface on aiohttp's client (aiohttp_transport.py), a generation straight to the transport.

The trainer / fleet controller uses the per-server helpers: `reload_weights()` (pause, reload from an HF
safetensors directory on the server's filesystem, reset the prefix cache, resume), `prompt_logprobs()`
(to check logprob parity after a reload) and `health()`. The server needs VLLM_SERVER_DEV_MODE=1.

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
/metrics (Prometheus text) gauges read, one sample per engine: vllm:num_requests_running,
vllm:num_requests_waiting, vllm:kv_cache_usage_perc (a fraction, 1 = full).

Library module, not run directly; the integration tests exercise it on real servers:
    python -m pytest tests/unit/shared/inference tests/integration/test_vllm_fleet.py \
        tests/integration/test_fleet_streaming.py -q
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import math
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import httpx
import msgspec
from prometheus_client import Counter, Gauge, Histogram
from prometheus_client.parser import text_string_to_metric_families

from rollstream.shared.errors import (
    FleetRequestError,
    FleetUnavailable,
    RollstreamError,
    WeightSyncError,
)
from rollstream.shared.inference.aiohttp_transport import AiohttpTransport

if TYPE_CHECKING:
    from rollstream.shared.runtime.config import Settings

SESSION_HEADER = "X-Session-ID"
ROUTING_HEADER = "X-SMG-Routing-Key"
KEEPALIVE_EXPIRY_S = 2.0
MAX_CONNECTIONS = 1024
RUNNING_METRIC = "vllm:num_requests_running"
WAITING_METRIC = "vllm:num_requests_waiting"
KV_CACHE_METRIC = "vllm:kv_cache_usage_perc"
# vLLM ends a request with "abort" when the server drops it (shutdown, a pause that aborts): for the
# client that is a server failure, not the end of the generation.
_SERVER_DROPPED = "abort"


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


REQUESTS = Counter("rollstream_fleet_requests_total",
                   "Whole (not streamed) generation requests to a vLLM server, by outcome: ok, failed (the "
                   "server did not answer or answered 5xx; the request went to the next server), rejected "
                   "(4xx).",
                   ["server", "outcome"])
REQUEST_SECONDS = Histogram("rollstream_fleet_request_seconds",
                            "Wall time of a whole generation request a vLLM server answered.", ["server"],
                            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120))
SERVER_REQUESTS = Gauge("rollstream_fleet_server_requests",
                        "Requests a vLLM server reported in its own /metrics (vllm:num_requests_running and "
                        "_waiting), at this client's last reading.", ["server", "state"])
SERVER_KV_CACHE = Gauge("rollstream_fleet_server_kv_cache_usage_ratio",
                        "Fraction of a vLLM server's KV cache in use, at this client's last reading.",
                        ["server"])


@dataclass(frozen=True)
class ServerLoad:
    """One reading of a server's /metrics; counts are summed over its engines."""

    running: int
    waiting: int
    kv_cache_usage: float  # fraction of the KV cache in use, averaged over the engines
    own_in_flight: int  # this client's requests open on the server when the reading came back


class _StreamBroken(RollstreamError, RuntimeError):
    """The server stopped serving a stream it had accepted; the stream goes on elsewhere."""


def _rank(session_id: str, url: str) -> int:
    """Rendezvous score; stable across processes (unlike hash()), so every replica routes alike."""
    digest = hashlib.blake2b(f"{url}\x00{session_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


class FleetClient:
    """Async client over the vLLM servers at `urls`; one instance per process, shared by its tasks."""

    def __init__(
        self,
        urls: Sequence[str],
        *,
        model: str | None = None,
        epsilon: float = 0.25,
        cooldown_s: float = 10.0,
        timeout_s: float = 600.0,
        kv_cache_full: float = 0.95,
        metrics_timeout_s: float = 2.0,
        transport: httpx.AsyncBaseTransport | None = None,
        routing_header: str = ROUTING_HEADER,
        contexts: Mapping[str, int] | None = None,
    ) -> None:
        if not urls:
            raise ValueError("FleetClient needs at least one server URL")
        self.urls = [u.rstrip("/") for u in urls]
        if len(set(self.urls)) != len(self.urls):
            raise ValueError(f"duplicate server URLs: {self.urls}")
        self.model = model  # None: vLLM uses the one model it serves
        self.contexts = {url.rstrip("/"): length for url, length in (contexts or {}).items()}
        """Server -> its context length (vLLM's --max-model-len), where known: a session goes to a server
        whose context holds its turn when one does (a long-context group beside the rest)."""
        self.session_headers = (SESSION_HEADER, routing_header)
        self.epsilon = epsilon
        self.cooldown_s = cooldown_s
        self.kv_cache_full = kv_cache_full
        self.metrics_timeout_s = metrics_timeout_s
        self.in_flight = {u: 0 for u in self.urls}
        self.server_load: dict[str, ServerLoad | None] = {u: None for u in self.urls}
        self._unhealthy_until = {u: 0.0 for u in self.urls}
        self._load_refresher: asyncio.Task | None = None
        # Idle connections expire before vLLM's own keep-alive (5 s) ends them: a connection the server is
        # closing is never picked for a request, which would fail with a ReadError and put the server in its
        # cool-down.
        self._transport = transport or AiohttpTransport(max_connections=MAX_CONNECTIONS,
                                                        keepalive_expiry_s=KEEPALIVE_EXPIRY_S)
        self._timeout = httpx.Timeout(timeout_s, connect=5.0)
        # made once, not at every generation: httpx parses a URL given as text each time (20 us a request)
        self._generation_urls = {u: httpx.URL(f"{u}/v1/completions") for u in self.urls}
        self._generation_timeouts = self._timeout.as_dict()
        self._http = httpx.AsyncClient(transport=self._transport, timeout=self._timeout)
        """For what is not a generation: /metrics, /health, scoring, weight syncs. A generation goes to the
        transport itself (`_send`): httpx's client layer (redirects, cookies, auth, hooks, none of which it
        has) cost more CPU time than the rest of the request."""

    @classmethod
    def for_run(cls, settings: Settings, **options: Any) -> FleetClient:
        """The client of a run's fleet, as its settings say: servers (fleet.urls and the policy groups') with
        their context lengths, served name, timeout, routing header."""
        servers = settings.policy_servers()
        return cls(list(servers), model=settings.model.served_name, contexts=servers,
                   timeout_s=settings.fleet.request_timeout_s, routing_header=settings.fleet.routing_header,
                   **options)

    async def aclose(self) -> None:
        if self._load_refresher is not None:
            self._load_refresher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._load_refresher
            self._load_refresher = None
        await self._http.aclose()

    async def __aenter__(self) -> FleetClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    # -- health bookkeeping -------------------------------------------------------------------------
    def is_healthy(self, url: str) -> bool:
        return time.monotonic() >= self._unhealthy_until[url]

    def mark_unhealthy(self, url: str, cooldown_s: float | None = None) -> None:
        cooldown = self.cooldown_s if cooldown_s is None else cooldown_s
        self._unhealthy_until[url] = time.monotonic() + cooldown

    def mark_healthy(self, url: str) -> None:
        self._unhealthy_until[url] = 0.0

    # -- load ---------------------------------------------------------------------------------------
    def load(self, url: str) -> int:
        """Requests on `url`: this client's open ones now, plus the other clients' at the last reading.

        vLLM's running + waiting already include the requests this client had open when /metrics was
        read; counting them again beside in_flight would make every busy-with-us server look twice as
        busy. So the reading minus our share at that moment is the others' load, and ours is counted
        live. (Our requests sent but not yet queued by vLLM can make the difference negative: 0 then.)
        """
        reading = self.server_load[url]
        others = 0 if reading is None else max(0, reading.running + reading.waiting - reading.own_in_flight)
        return self.in_flight[url] + others

    def kv_cache_is_full(self, url: str) -> bool:
        reading = self.server_load[url]
        return reading is not None and reading.kv_cache_usage >= self.kv_cache_full

    async def refresh_load(self) -> dict[str, ServerLoad | None]:
        """Read every server's /metrics; a server that does not answer (or answers garbage) keeps its
        last reading. Returns the readings routing now uses."""
        await asyncio.gather(*(self._refresh_server_load(u) for u in self.urls))
        return dict(self.server_load)

    def start_load_refresh(self, interval_s: float) -> None:
        """Refresh the load every interval_s in the background until aclose(); needs a running loop."""
        if self._load_refresher is not None:
            raise RuntimeError("the load refresher is already running")
        self._load_refresher = asyncio.create_task(self._refresh_load_forever(interval_s))

    async def _refresh_load_forever(self, interval_s: float) -> None:
        while True:
            await self.refresh_load()
            await asyncio.sleep(interval_s)

    async def _refresh_server_load(self, url: str) -> None:
        try:
            response = await self._http.get(f"{url}/metrics", timeout=self.metrics_timeout_s)
            if response.status_code != 200:
                return
            # vLLM's whole exposition (histograms and all) takes 15-30 ms to parse: not on the event loop
            running, waiting, kv_usages = await asyncio.to_thread(_read_load_metrics, response.text)
        except (httpx.HTTPError, ValueError):
            return
        self.server_load[url] = reading = ServerLoad(
            running=running,
            waiting=waiting,
            kv_cache_usage=sum(kv_usages) / len(kv_usages) if kv_usages else 0.0,
            own_in_flight=self.in_flight[url],
        )
        SERVER_REQUESTS.labels(url, "running").set(reading.running)
        SERVER_REQUESTS.labels(url, "waiting").set(reading.waiting)
        SERVER_KV_CACHE.labels(url).set(reading.kv_cache_usage)

    # -- routing ------------------------------------------------------------------------------------
    def route(self, session_id: str, tokens: int = 0) -> list[str]:
        """Healthy servers in the order this session should try them (first: the one to use now); when some
        servers' context holds `tokens` (prompt and answer) and others' does not, only those that hold it."""
        healthy = [u for u in self.urls if self.is_healthy(u)]
        holding = [u for u in healthy if self.contexts.get(u, tokens) >= tokens]
        healthy = holding or healthy
        if not healthy:
            return []
        ranked = sorted(healthy, key=lambda u: _rank(session_id, u), reverse=True)
        # Bounded load: capacity is (1 + eps) x the average load including this request. With equal
        # loads every server is within it, so a session keeps its own server.
        loads = {u: self.load(u) for u in healthy}
        total = sum(loads.values()) + 1
        capacity = math.ceil((1 + self.epsilon) * total / len(healthy))
        with_room = [u for u in ranked if loads[u] + 1 <= capacity and not self.kv_cache_is_full(u)]
        return with_room + [u for u in ranked if u not in with_room]

    # -- generation ---------------------------------------------------------------------------------
    async def complete(
        self,
        prompt_ids: list[int],
        *,
        max_tokens: int,
        temperature: float = 1.0,
        session_id: str,
        stop_token_ids: Sequence[int] | None = None,
        seed: int | None = None,
        extra: Mapping[str, Any] | None = None,
    ) -> Completion:
        """Sample up to max_tokens after prompt_ids on the session's server; ids and logprobs as vLLM gave them."""
        body = self._completion_body(prompt_ids, max_tokens, temperature, stop_token_ids, seed, extra)
        headers = {name: session_id for name in self.session_headers}

        candidates = self.route(session_id, len(prompt_ids) + max_tokens)
        if not candidates:
            raise FleetUnavailable(f"all {len(self.urls)} servers are in their unhealthy cool-down")
        failures: list[str] = []
        for url in candidates:
            self.in_flight[url] += 1
            started = time.perf_counter()
            try:
                response = await self._send(url, body, headers)
                try:
                    await response.aread()
                finally:
                    await response.aclose()
            except httpx.TransportError as exc:
                failures.append(f"{url}: {type(exc).__name__}: {exc}")
                self.mark_unhealthy(url)
                REQUESTS.labels(url, "failed").inc()
                continue
            finally:
                self.in_flight[url] -= 1
            if response.status_code >= 500:
                failures.append(f"{url}: HTTP {response.status_code}: {response.text[:300]}")
                self.mark_unhealthy(url)
                REQUESTS.labels(url, "failed").inc()
                continue
            if response.status_code != 200:
                REQUESTS.labels(url, "rejected").inc()
                raise FleetRequestError(f"{url} rejected the request: HTTP {response.status_code}: {response.text}")
            REQUESTS.labels(url, "ok").inc()
            REQUEST_SECONDS.labels(url).observe(time.perf_counter() - started)
            return _parse_completion(response.json(), url)
        raise FleetUnavailable("no server could serve the request: " + "; ".join(failures))

    async def stream(
        self,
        prompt_ids: list[int],
        *,
        max_tokens: int,
        temperature: float = 1.0,
        session_id: str,
        stop_token_ids: Sequence[int] | None = None,
        seed: int | None = None,
        extra: Mapping[str, Any] | None = None,
    ) -> AsyncIterator[StreamDelta]:
        """Like complete(), as deltas while vLLM samples them; the last delta has the finish_reason.

        A server that fails mid-stream (connection lost, 5xx, an error chunk, a malformed chunk, the
        stream ending unfinished) is marked unhealthy and the generation continues on the session's
        next server with prompt_ids + the ids yielded so far as the prompt, for the tokens still
        allowed: the deltas read as one generation. A seeded generation restarts its seed there, so
        its continuation differs from what the failed server would have sampled. FleetUnavailable
        when no server is left (the ids yielded before it stand); FleetRequestError for a rejected
        request (a 4xx), on which no server is marked.
        """
        body = self._completion_body(prompt_ids, max_tokens, temperature, stop_token_ids, seed, extra)
        body["stream"] = True
        headers = {name: session_id for name in self.session_headers}
        yielded: list[int] = []
        tried: list[str] = []
        failures: list[str] = []
        while True:
            remaining = max_tokens - len(yielded)
            if tried and remaining <= 0:  # the failed server had sent every allowed token, not the last chunk
                yield StreamDelta(token_ids=[], logprobs=[], server_url=tried[-1], finish_reason="length")
                return
            candidates = [u for u in self.route(session_id, len(prompt_ids) + max_tokens) if u not in tried]
            if not candidates:
                why = "; ".join(failures) or f"all {len(self.urls)} servers are in their unhealthy cool-down"
                done = f"{len(yielded)} of {max_tokens} tokens"
                raise FleetUnavailable(f"no server left to stream from after {done}: {why}")
            url = candidates[0]
            tried.append(url)
            request_body = {**body, "prompt": [*prompt_ids, *yielded], "max_tokens": remaining}
            if "min_tokens" in request_body:  # counts generated tokens, like max_tokens
                request_body["min_tokens"] = max(0, int(request_body["min_tokens"]) - len(yielded))
            self.in_flight[url] += 1
            try:
                async with contextlib.aclosing(self._stream_from(url, request_body, headers)) as deltas:
                    async for delta in deltas:
                        yielded.extend(delta.token_ids)
                        yield delta
                        if delta.finish_reason is not None:
                            return
            except (httpx.RequestError, _StreamBroken) as exc:
                failures.append(f"{url} after {len(yielded)} tokens: {type(exc).__name__}: {exc}")
                self.mark_unhealthy(url)
            finally:
                self.in_flight[url] -= 1

    async def _send(self, url: str, body: dict[str, Any], headers: dict[str, str]) -> httpx.Response:
        """POST /v1/completions on `url`; the caller reads the answer's body and closes the answer."""
        # msgspec writes a prompt's ids several times faster than the json module httpx's `json=` uses
        request = httpx.Request("POST", self._generation_urls[url], content=msgspec.json.encode(body),
                                headers={**headers, "content-type": "application/json"},
                                extensions={"timeout": self._generation_timeouts})
        return await self._transport.handle_async_request(request)

    async def _stream_from(
        self, url: str, body: dict[str, Any], headers: dict[str, str]
    ) -> AsyncIterator[StreamDelta]:
        response = await self._send(url, body, headers)
        async with contextlib.aclosing(response):
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                if response.status_code >= 500:
                    raise _StreamBroken(f"HTTP {response.status_code}: {text[:300]}")
                raise FleetRequestError(f"{url} rejected the request: HTTP {response.status_code}: {text}")
            lines = response.aiter_lines()
            async for line in lines:
                if not line.startswith("data:"):
                    continue  # blank separators, SSE comments
                payload = line[len("data:") :].strip()
                if payload == "[DONE]":
                    break
                delta = _parse_stream_chunk(payload, url)
                if delta is None:
                    continue
                if delta.finish_reason is None:
                    if delta.token_ids:
                        yield delta
                    continue
                # Read to [DONE] before handing out the end, so the connection goes back to the pool.
                with contextlib.suppress(httpx.RequestError):
                    async for _ in lines:
                        pass
                yield delta
                return
            raise _StreamBroken("the stream ended without a finish_reason")

    def _completion_body(
        self,
        prompt_ids: list[int],
        max_tokens: int,
        temperature: float,
        stop_token_ids: Sequence[int] | None,
        seed: int | None,
        extra: Mapping[str, Any] | None,
    ) -> dict[str, Any]:
        body: dict[str, Any] = {
            "prompt": list(prompt_ids),
            "max_tokens": max_tokens,
            "temperature": temperature,
            "logprobs": 0,
            "return_token_ids": True,
            "skip_special_tokens": False,
        }
        if self.model is not None:
            body["model"] = self.model
        if stop_token_ids:
            body["stop_token_ids"] = list(stop_token_ids)
        if seed is not None:
            body["seed"] = seed
        if extra:
            body.update(extra)
        return body

    # -- per-server helpers for the trainer / fleet controller --------------------------------------
    async def health(self, url: str) -> bool:
        try:
            response = await self._http.get(f"{url.rstrip('/')}/health", timeout=5.0)
        except httpx.HTTPError:
            return False
        return response.status_code == 200

    async def prompt_logprobs(self, url: str, prompt_ids: list[int]) -> list[float]:
        """logprob of prompt token i given tokens < i, for i = 1..n-1 (n-1 values) on server `url`."""
        body: dict[str, Any] = {"prompt": list(prompt_ids), "max_tokens": 1, "prompt_logprobs": 0}
        if self.model is not None:
            body["model"] = self.model
        response = await self._http.post(f"{url.rstrip('/')}/v1/completions", json=body)
        if response.status_code != 200:
            raise FleetRequestError(f"{url} prompt_logprobs: HTTP {response.status_code}: {response.text}")
        per_position = response.json()["choices"][0]["prompt_logprobs"]
        if per_position is None or len(per_position) != len(prompt_ids):
            raise FleetRequestError(f"{url} returned no prompt_logprobs for {len(prompt_ids)} prompt tokens")
        # Position 0 is null; position i maps str(token id) -> {"logprob", "rank", "decoded_token"}.
        return [float(entry[str(tok)]["logprob"]) for tok, entry in zip(prompt_ids[1:], per_position[1:])]

    async def reload_weights(self, url: str, weights_dir: str) -> None:
        """Pause `url`, load the HF safetensors checkpoint at weights_dir (a path on the server), resume.

        In-flight requests are kept (paused, not aborted) and go on with the new weights. A failed reload
        kills vLLM's engine (observed on vLLM 0.32: EngineDeadError, the server exits), so on failure the
        server is also marked unhealthy here and has to be restarted.
        """
        url = url.rstrip("/")
        rpc = {"method": "reload_weights", "kwargs": {"weights_path": str(weights_dir)}}
        await self._sync_step(url, "pause", "/pause", params={"mode": "keep"})
        try:
            await self._sync_step(url, "reload_weights", "/collective_rpc", json=rpc)
            await self._sync_step(url, "reset_prefix_cache", "/reset_prefix_cache")
        except BaseException as exc:
            if isinstance(exc, WeightSyncError):
                self.mark_unhealthy(url, cooldown_s=max(self.cooldown_s, 60.0))
            try:  # resume anyway; the first error is the one to report
                await self._sync_step(url, "resume", "/resume")
            except WeightSyncError:
                pass
            raise
        await self._sync_step(url, "resume", "/resume")

    async def _sync_step(self, url: str, step: str, path: str, **kwargs: Any) -> None:
        try:
            response = await self._http.post(f"{url}{path}", **kwargs)
        except httpx.HTTPError as exc:
            raise WeightSyncError(f"{url}: {step} failed: {type(exc).__name__}: {exc}") from exc
        if response.status_code != 200:
            raise WeightSyncError(f"{url}: {step} failed: HTTP {response.status_code}: {response.text}")


def _parse_completion(body: dict[str, Any], url: str) -> Completion:
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


def _parse_stream_chunk(payload: str, url: str) -> StreamDelta | None:
    """One `data:` payload of a stream as a delta; None for a chunk without a choice (the usage chunk)."""
    try:
        chunk = json.loads(payload)
    except json.JSONDecodeError as exc:
        raise _StreamBroken(f"malformed chunk: {payload[:300]}") from exc
    if not isinstance(chunk, dict):
        raise _StreamBroken(f"malformed chunk: {payload[:300]}")
    if "error" in chunk:
        error = chunk["error"] if isinstance(chunk["error"], dict) else {}
        code = error.get("code")
        if isinstance(code, int) and 400 <= code < 500:
            raise FleetRequestError(f"{url} failed the request mid-stream: {payload[:500]}")
        raise _StreamBroken(f"error chunk: {payload[:300]}")
    try:
        if not chunk["choices"]:
            return None
        choice = chunk["choices"][0]
        token_ids = [int(t) for t in choice.get("token_ids") or []]
        logprobs = [float(lp) for lp in (choice.get("logprobs") or {}).get("token_logprobs") or []]
        finish_reason = choice.get("finish_reason")
    except (KeyError, IndexError, TypeError, ValueError, AttributeError) as exc:
        raise _StreamBroken(f"malformed chunk: {payload[:300]}") from exc
    if len(token_ids) != len(logprobs):
        raise _StreamBroken(f"{len(token_ids)} ids but {len(logprobs)} logprobs in chunk: {payload[:300]}")
    if finish_reason == _SERVER_DROPPED:
        raise _StreamBroken("the server aborted the request")
    return StreamDelta(
        token_ids=token_ids,
        logprobs=logprobs,
        server_url=url,
        finish_reason=None if finish_reason is None else str(finish_reason),
    )


def _read_load_metrics(text: str) -> tuple[int, int, list[float]]:
    """(running, waiting, KV cache usage per engine) from Prometheus text; ValueError if unreadable or
    without the request counts (then it is no reading, rather than a reading of an idle server)."""
    values: dict[str, list[float]] = {RUNNING_METRIC: [], WAITING_METRIC: [], KV_CACHE_METRIC: []}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in values:
                if not math.isfinite(sample.value):
                    raise ValueError(f"{sample.name} is {sample.value}")
                values[sample.name].append(sample.value)
    if not values[RUNNING_METRIC] or not values[WAITING_METRIC]:
        raise ValueError(f"no {RUNNING_METRIC} / {WAITING_METRIC} in the metrics")
    return round(sum(values[RUNNING_METRIC])), round(sum(values[WAITING_METRIC])), values[KV_CACHE_METRIC]

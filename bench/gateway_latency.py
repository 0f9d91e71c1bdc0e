"""Latency and CPU time the gateway adds to a turn, next to its upstream called directly and LiteLLM's proxy
in front of the same upstream, in the same run.

Every agent holds a conversation of --turns non-streamed Chat Completions turns: the answer and a follow-up
question are appended each time, so through the gateway every turn after the first continues its session's
recorded tokens (services/gateway/prompts.py). The same agents send the same requests (temperature 0, a
fixed seed, `ignore_eos`, so every turn samples exactly --max-tokens tokens) to

    direct    the upstream's own /v1/chat/completions (vLLM renders the chat template itself; the fake answers
              at once)
    gateway   one session per agent, {openai_base_url}/chat/completions (upstream /v1/completions, token ids)
    litellm   LiteLLM's proxy, `litellm --model hosted_vllm/<name> --api_base <upstream>/v1`, when it starts:
              a proxy process like the gateway, whose CPU time per turn is counted the same way

The upstream (--upstream):

    vllm      one vLLM server on the CPU (cli/local_run.py starts it): the whole path, but on a small machine
              the server shares the cores with the gateway, so turns at many sessions measure its queue
    fake      bench/fake_token_server.py, which answers at once with fixed tokens: what is left is the
              gateway's own cost, which a GPU fleet would not hide

At each number of concurrent sessions an untimed round of all three comes first (vLLM on the CPU speeds up
over its first requests of a new batch shape), then --rounds timed rounds, the order rotating each round,
so that the upstream's drift and the machine's other load hit the three alike. Each of the concurrent slots
runs agents one after another until at least --min-turns turns were measured per round, so a single session
gives percentiles too. Every agent has an HTTP client of its own, as separate agent processes would.

    p50, p99      per-turn wall time at the client, from sending the request to the end of the response body
    +p50, x p50   added latency against direct: the difference of the per-turn times at the same
                  percentile, and their ratio (same for p99)
    turns/s       turns answered / wall time of the rounds
    tok/turn      completion tokens per turn as the endpoint reports them: --max-tokens when ignore_eos
                  got through
    failed        requests that failed (a turn, or creating or deleting a gateway session); each ends its
                  conversation, and the most common errors are printed below the table
    vLLM e2e      vLLM's own mean request time (vllm:e2e_request_latency_seconds) over the rounds: what the
                  upstream spent on the turns, whichever path they took (the fake reports none)
    CPU ms/turn   user + system CPU time of the endpoint's own process (gateway, LiteLLM proxy) per turn
    turns/s/core  turns per CPU second of that process: what one core of it serves

A second table sets the gateway beside LiteLLM at each level: the latency each adds at p50 and p99, their
CPU time per turn, and the ratio gateway / LiteLLM of the CPU time.

Below the tables, for the gateway: its longest event-loop stall (its own gauge, the maximum since the
process started, read before and after each level), its mean turn time inside run_turn
(rollstream_gateway_turn_seconds) next to the client's, and the conversations it started: one per
session when every later turn continued its session's tokens.

The upstream, the gateway and a Redis (the machine's at --redis when it answers, else an embedded one) are
started here (the gateway with cli/local_run.py); everything is stopped at the end, on an error or Ctrl-C too.

    python bench/gateway_latency.py [--upstream vllm|fake] [--sessions 1,32] [--turns 3] [--max-tokens 8]
        [--rounds 2] [--min-turns 48] [--litellm PATH | --no-litellm] [--redis redis://127.0.0.1:6379/0]
        [--smoke] [--json PATH]

--sessions and --min-turns default to 1,32 and 48 against vLLM, 1,64,256 and 192 against the fake.
--litellm: the `litellm` command of an environment with LiteLLM's proxy extra (default: .venv-litellm's,
which `make bench` installs, else the one beside this Python, else PATH's). When the proxy cannot start or
answer, the output says why and the other two are reported.
--smoke: a few turns against the fake, without LiteLLM (seconds; checks that the benchmark runs).
--json: also write the figures (bench/results.py): each endpoint's p50 and p99 against direct, and the
gateway's CPU time per turn against LiteLLM's.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import shutil
import ssl
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path

import httpx
import psutil
import redis

from rollstream.cli.local_run import LocalRun
from rollstream.shared.runtime.config import Settings

try:  # run as a script: bench/ is first on sys.path
    from gateway_latency_report import (
        COMPARE_HEADER,
        DIRECT,
        GATEWAY,
        LITELLM,
        TABLE_HEADER,
        Measured,
        compare_row,
        figures_of,
        format_table,
        mean_of_histogram,
        metric_totals,
        table_row,
    )
    from gateway_latency_servers import FakeUpstream, LiteLLMProxy, default_litellm
    from results import Figure, parse_args, write_result
except ImportError:  # imported as bench.gateway_latency (the tests of its pure parts)
    from bench.gateway_latency_report import (
        COMPARE_HEADER,
        DIRECT,
        GATEWAY,
        LITELLM,
        TABLE_HEADER,
        Measured,
        compare_row,
        figures_of,
        format_table,
        mean_of_histogram,
        metric_totals,
        table_row,
    )
    from bench.gateway_latency_servers import FakeUpstream, LiteLLMProxy, default_litellm
    from bench.results import Figure, parse_args, write_result

SEED = 1234
QUESTIONS = ("What is 17 + 25?", "Name a prime number larger than 50.", "Say hello in French.",
             "How many legs does a spider have?")
FOLLOW_UP = "Go on, tell me more."
VLLM, FAKE = "vllm", "fake"
DEFAULTS = {VLLM: {"sessions": "1,32", "min_turns": 48}, FAKE: {"sessions": "1,64,256", "min_turns": 192}}
"""Per upstream: the levels and turns per round that --sessions and --min-turns leave to it."""
VLLM_E2E = "vllm:e2e_request_latency_seconds"
GW_STALL = "rollstream_gateway_event_loop_stall_max_seconds"
GW_TURN = "rollstream_gateway_turn_seconds"
GW_STARTED = "rollstream_gateway_conversations_started_total"


# ------------------------------------------------------------------------------------------ endpoints
class RequestFailed(Exception):
    """A request of an agent failed; its conversation ends there."""


async def request(client: httpx.AsyncClient, method: str, url: str, what: str, expect: int,
                  **kwargs) -> httpx.Response:
    try:
        response = await client.request(method, url, **kwargs)
    except httpx.HTTPError as exc:
        raise RequestFailed(f"{what}: {type(exc).__name__}: {exc}") from exc
    if response.status_code != expect:
        raise RequestFailed(f"{what}: HTTP {response.status_code}: {response.text[:300]}")
    return response


class Endpoint:
    """An OpenAI-compatible chat endpoint that needs nothing per agent; pid: the process serving it, whose
    CPU time is counted (None: not counted)."""

    def __init__(self, name: str, chat_url: str, model: str, pid: int | None = None) -> None:
        self.name = name
        self.chat_url = chat_url
        self.model = model
        self.pid = pid

    async def open(self, client: httpx.AsyncClient, agent: str) -> tuple[str, dict[str, str]]:
        return self.chat_url, {}

    async def close(self, client: httpx.AsyncClient, agent: str) -> None:
        pass


class GatewayEndpoint(Endpoint):
    """A gateway session per agent; deleted afterwards (nothing to train on in a bench)."""

    def __init__(self, gateway_url: str, pid: int | None = None) -> None:
        super().__init__(GATEWAY, "", "any", pid)
        self.gateway_url = gateway_url

    async def open(self, client: httpx.AsyncClient, agent: str) -> tuple[str, dict[str, str]]:
        body = {"rollout_id": agent, "group_id": agent, "session_id": agent,
                "sampling": {"temperature": 0, "seed": SEED, "ignore_eos": True}}
        session = (await request(client, "POST", f"{self.gateway_url}/v1/sessions", "create session", 201,
                                 json=body)).json()
        headers = {"Authorization": f"Bearer {session['api_key']}"}
        return f"{session['openai_base_url']}/chat/completions", headers

    async def close(self, client: httpx.AsyncClient, agent: str) -> None:
        await request(client, "DELETE", f"{self.gateway_url}/v1/sessions/{agent}", "delete session", 204)


def next_messages(message: dict) -> list[dict]:
    """What an agent appends after an answer: the answer as it came, then tool results or a follow-up."""
    calls = message.get("tool_calls") or []
    answer = {"role": "assistant", "content": message.get("content") or ""}
    if not calls:
        return [answer, {"role": "user", "content": FOLLOW_UP}]
    answer["tool_calls"] = [{"id": c["id"], "type": "function", "function": c["function"]} for c in calls]
    return [answer, *({"role": "tool", "tool_call_id": c["id"], "content": "0"} for c in calls)]


async def converse(client: httpx.AsyncClient, endpoint: Endpoint, agent: str, question: str, turns: int,
                   max_tokens: int, out: Measured) -> None:
    try:
        url, headers = await endpoint.open(client, agent)
    except RequestFailed as exc:
        out.fail(str(exc))
        return
    try:
        messages: list[dict] = [{"role": "user", "content": question}]
        for _ in range(turns):
            body = {"model": endpoint.model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
                    "seed": SEED, "ignore_eos": True}
            started = time.perf_counter()
            response = await request(client, "POST", url, "turn", 200, json=body, headers=headers)
            out.seconds.append(time.perf_counter() - started)
            answer = response.json()
            out.tokens.append(answer["usage"]["completion_tokens"])
            messages += next_messages(answer["choices"][0]["message"])
    except RequestFailed as exc:
        out.fail(str(exc))
    finally:
        try:
            await endpoint.close(client, agent)
        except RequestFailed as exc:
            out.fail(str(exc))


async def run_round(endpoint: Endpoint, sessions: int, agents_per_slot: int, turns: int, max_tokens: int,
                    tag: str) -> Measured:
    """`sessions` slots at once, each running its agents one after another; the clock runs from the first
    turn to the last (a gateway session is opened when its agent starts: part of the wall time, not of
    any turn's). Each slot has an HTTP client of its own, as separate agents do: one shared pool of
    hundreds of connections costs httpx time quadratic in its size, which would load the client, not the
    endpoint."""
    out = Measured()
    # One TLS context for all: httpx makes one per client otherwise, loading the CA bundle (tens of ms of CPU
    # each, on the loop that times the other slots' turns: 64 of them added seconds to the first turns).
    tls = ssl.create_default_context()

    async def slot(index: int) -> None:
        async with httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=30.0), verify=tls) as client:
            for k in range(agents_per_slot):
                question = QUESTIONS[(index + k) % len(QUESTIONS)]
                await converse(client, endpoint, f"{tag}-{index}-{k}", question, turns, max_tokens, out)

    started = time.perf_counter()
    await asyncio.gather(*(slot(i) for i in range(sessions)))
    out.wall_s = time.perf_counter() - started
    return out


# ---------------------------------------------------------------------------------------------- bench
def scrape(url: str) -> dict[str, float]:
    return metric_totals(httpx.get(url, timeout=10).text)


def machine_redis(url: str) -> str | None:
    try:
        redis.Redis.from_url(url, socket_connect_timeout=2).ping()
    except redis.RedisError:
        return None
    return url


def cpu_seconds(pid: int) -> float:
    """User and system CPU time of a process and its living children so far."""
    total = 0.0
    try:
        process = psutil.Process(pid)
        family = [process, *process.children(recursive=True)]
    except psutil.Error:
        return total
    for member in family:
        with contextlib.suppress(psutil.Error):
            times = member.cpu_times()
            total += times.user + times.system
    return total


def timed_round(endpoint: Endpoint, shape: tuple[int, int, int, int], tag: str,
                vllm_metrics: str) -> Measured:
    metrics = scrape(vllm_metrics)
    cpu = cpu_seconds(endpoint.pid) if endpoint.pid else 0.0
    measured = asyncio.run(run_round(endpoint, *shape, tag=tag))
    if endpoint.pid:
        measured.cpu_s = cpu_seconds(endpoint.pid) - cpu
    after = scrape(vllm_metrics)
    measured.vllm_requests = after.get(f"{VLLM_E2E}_count", 0.0) - metrics.get(f"{VLLM_E2E}_count", 0.0)
    measured.vllm_request_s = after.get(f"{VLLM_E2E}_sum", 0.0) - metrics.get(f"{VLLM_E2E}_sum", 0.0)
    return measured


def failure_note(name: str, sessions: int, measured: Measured) -> str:
    common = "; ".join(f"{n} x {error}" for error, n in Counter(measured.errors).most_common(3))
    return (f"{name}, {sessions} sessions: {measured.failed} requests failed (each ends its conversation): "
            f"{common}")


def measure_level(endpoints: list[Endpoint], sessions: int, args: argparse.Namespace, vllm_metrics: str,
                  gateway_metrics: str) -> tuple[dict[str, Measured], list[str]]:
    """The untimed round and the timed rounds at one concurrency; returns the pooled rounds per endpoint
    and what is to be said about them. An endpoint whose untimed round failed every turn is left out."""
    agents_per_slot = max(1, math.ceil(args.min_turns / (sessions * args.turns)))
    shape = (sessions, agents_per_slot, args.turns, args.max_tokens)
    notes: list[str] = []
    stall_before = scrape(gateway_metrics).get(GW_STALL, 0.0)
    for endpoint in list(endpoints):
        warm = asyncio.run(run_round(endpoint, *shape, tag=f"warm-{sessions}-{uuid.uuid4().hex[:6]}"))
        if not warm.seconds:
            endpoints.remove(endpoint)
            notes.append(f"{endpoint.name}: NOT MEASURED, every turn of the untimed round failed: "
                         f"{warm.errors[0]}")
        elif warm.failed:
            notes.append(failure_note(f"{endpoint.name} (untimed round)", sessions, warm))
    pooled = {endpoint.name: Measured() for endpoint in endpoints}
    gw_before = scrape(gateway_metrics)
    for round_index in range(args.rounds):
        shift = round_index % len(endpoints)
        for endpoint in endpoints[shift:] + endpoints[:shift]:
            tag = f"r{round_index}-{sessions}-{uuid.uuid4().hex[:6]}"
            pooled[endpoint.name].add(timed_round(endpoint, shape, tag, vllm_metrics))
    gw_after = scrape(gateway_metrics)
    if GATEWAY in pooled and pooled[GATEWAY].seconds:
        gw = pooled[GATEWAY]
        inside = mean_of_histogram(gw_before, gw_after, GW_TURN) or 0.0
        started = gw_after.get(GW_STARTED, 0) - gw_before.get(GW_STARTED, 0)
        stall = gw_after.get(GW_STALL, 0.0)
        when = (f"set during this level; {stall_before * 1e3:.1f} ms before it" if stall > stall_before
                else "not longer during this level")
        notes.append(f"gateway, {sessions} sessions: longest event-loop stall since its start "
                     f"{stall * 1e3:.1f} ms ({when}); mean turn inside run_turn {inside * 1e3:.1f} ms, "
                     f"as the client saw it {sum(gw.seconds) / len(gw.seconds) * 1e3:.1f} ms; "
                     f"{started:.0f} conversations started for {sessions * agents_per_slot * args.rounds} "
                     "sessions")
    notes += [failure_note(name, sessions, m) for name, m in pooled.items() if m.failed]
    return pooled, notes


def start_litellm(args: argparse.Namespace, upstream_url: str, served: str,
                  workdir: Path) -> tuple[LiteLLMProxy | None, Endpoint | None, str]:
    """LiteLLM's proxy in front of the upstream unless --no-litellm: the proxy, its endpoint, and the line
    saying which LiteLLM was measured, or why none was (a proxy that cannot start is said, not fatal)."""
    if args.no_litellm:
        return None, None, "litellm: not measured: --no-litellm"
    if not args.litellm:
        return None, None, "litellm: NOT MEASURED: no `litellm` command found (give --litellm PATH)"
    proxy = LiteLLMProxy(args.litellm, upstream_url, served, workdir / "litellm.log")
    try:
        proxy.start()
    except RuntimeError as exc:
        proxy.stop()
        return None, None, f"litellm: NOT MEASURED, its proxy did not start ({args.litellm}): {exc}"
    except BaseException:
        proxy.stop()
        raise
    endpoint = Endpoint(LITELLM, f"{proxy.url}/v1/chat/completions", f"hosted_vllm/{served}",
                        proxy.process.pid)
    return proxy, endpoint, f"litellm: {proxy.version} ({args.litellm}), its proxy"


def measure_levels(endpoints: list[Endpoint], levels: list[int], args: argparse.Namespace, vllm_metrics: str,
                   gateway_metrics: str) -> tuple[dict[int, dict[str, Measured]], list[list[str]], list[str]]:
    """Every level in turn: the pooled rounds per level and endpoint, the table's rows, and the notes."""
    measured: dict[int, dict[str, Measured]] = {}
    rows: list[list[str]] = []
    start_stall = scrape(gateway_metrics).get(GW_STALL, 0.0)
    notes = [f"gateway: longest event-loop stall before any turn (start-up) {start_stall * 1e3:.1f} ms"]
    for sessions in levels:
        print(f"measuring {sessions} concurrent sessions ...", flush=True)
        pooled, level_notes = measure_level(endpoints, sessions, args, vllm_metrics, gateway_metrics)
        measured[sessions] = pooled
        rows += [table_row(name, sessions, m, pooled.get(DIRECT)) for name, m in pooled.items()]
        notes += level_notes
    return measured, rows, notes


def run_bench(args: argparse.Namespace, levels: list[int],
              workdir: Path) -> tuple[str, list[Figure], list[str]]:
    """Start everything, measure every level, stop everything; the report, its figures and its notes."""
    redis_url = machine_redis(args.redis)
    overrides = {"model": {"path": args.model}} if args.model else {}
    settings = Settings(run_id=f"bench-gw-{uuid.uuid4().hex[:8]}", redis_url=redis_url,
                        storage_uri=str(workdir / "runs"), recorder={"enabled": False}, **overrides)
    fake = FakeUpstream(settings, workdir / "fake.log") if args.upstream == FAKE else None
    local = LocalRun(settings, services=("gateway",), fleet_urls=[fake.url] if fake else None)
    proxy: LiteLLMProxy | None = None
    try:
        if fake is not None:
            print("starting the fake token server", flush=True)
            fake.start()
        started = "the gateway" if fake else "vLLM (CPU) and the gateway"
        print(f"starting {started}; Redis: {redis_url or 'embedded'}", flush=True)
        local.start()
        upstream_url, served = local.settings.fleet.urls[0], local.settings.model.served_name
        endpoints: list[Endpoint] = [
            Endpoint(DIRECT, f"{upstream_url}/v1/chat/completions", served),
            GatewayEndpoint(local.settings.gateway.url, local.processes["gateway"].pid)]
        proxy, litellm, litellm_note = start_litellm(args, upstream_url, served, workdir)
        endpoints += [litellm] if litellm is not None else []
        print(litellm_note, flush=True)
        gateway_metrics = f"http://127.0.0.1:{local.health_ports['gateway']}/metrics"
        measured, rows, notes = measure_levels(endpoints, levels, args, f"{upstream_url}/metrics",
                                               gateway_metrics)
    finally:
        if proxy is not None:
            proxy.stop()
        local.stop()
        if fake is not None:
            fake.stop()
        if local.bus is not None and redis_url:
            local.bus.delete_run()
    upstream = (f"the fake token server (bench/fake_token_server.py: fixed tokens at once) as {served}"
                if fake else f"one vLLM server (CPU) serving {served}")
    heading = (f"{args.turns}-turn conversations, {args.max_tokens} tokens a turn (ignore_eos, "
               f"temperature 0), non-streamed; {args.rounds} timed rounds per level after an untimed one, "
               f"the order rotating; upstream: {upstream}")
    comparison = format_table(COMPARE_HEADER, [compare_row(n, pooled) for n, pooled in measured.items()])
    report = "\n".join([heading, litellm_note, format_table(TABLE_HEADER, rows), "",
                        "added against direct, and CPU time per turn:", comparison, *notes])
    return report, figures_of(measured), [heading, litellm_note, *notes]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--upstream", choices=(VLLM, FAKE), default=VLLM,
                        help="what answers the turns: vLLM on the CPU, or the fake token server")
    parser.add_argument("--sessions", default=None,
                        help="comma-separated numbers of concurrent sessions (default: per upstream)")
    parser.add_argument("--turns", type=int, default=3, help="turns per conversation")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2, help="timed rounds per endpoint and level")
    parser.add_argument("--min-turns", type=int, default=None,
                        help="least turns measured per endpoint and round (default: per upstream)")
    parser.add_argument("--redis", default="redis://127.0.0.1:6379/0",
                        help="used when it answers; else an embedded Redis is started")
    parser.add_argument("--litellm", default=default_litellm(),
                        help="the litellm command (proxy extra installed)")
    parser.add_argument("--no-litellm", action="store_true")
    parser.add_argument("--model", type=Path, default=None,
                        help="model directory (default: the run's default)")
    parser.add_argument("--keep", action="store_true", help="keep the work directory (logs of every process)")
    args = parse_args(parser, smoke={"upstream": FAKE, "sessions": "1,4", "turns": 2, "rounds": 1,
                                     "min_turns": 4, "no_litellm": True})
    for name, value in DEFAULTS[args.upstream].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    levels = [int(n) for n in args.sessions.split(",")]
    workdir = Path(tempfile.mkdtemp(prefix="rs-gateway-latency-"))
    try:
        report, figures, notes = run_bench(args, levels, workdir)
    finally:
        if args.keep:
            print(f"logs: {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    print()
    print(report)
    write_result(args.json, figures, notes)


if __name__ == "__main__":
    main()

"""Two vLLM CPU servers on one machine: each bound to the same core (what vLLM's automatic binding does on a
2-core machine, core 0 for every server) against each on the core rollstream leases it (cli/cpu_cores.py).

Per way, --servers (2) servers of the tiny model start at once; measured are the seconds from each one's
start to its /health answering, then the generated tokens per second of all of them serving at once: on each
server --requests (64) concurrent completions of --tokens (256) sampled tokens, --loads (3) times (the
median). Then the servers stop and the other way starts. Prints both ways, the ratios (leased / same core),
the load average before, and how many cores the machine's other work kept busy during the loads (its busy
time less this benchmark's and its servers'): other work moves these figures, so run it when the load is
low. `--unbound` adds vLLM with no binding at all (VLLM_CPU_OMP_THREADS_BIND=nobind).

    python bench/bench_vllm_binding.py [--model models/tiny-llama] [--servers 2] [--rounds 1] [--requests 64]
                                       [--tokens 256] [--loads 3] [--unbound] [--smoke] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

import httpx
from results import Figure, parse_args, write_result

from rollstream.cli.cpu_cores import allowed_cores
from rollstream.cli.vllm_server import VllmServer, free_port

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")

Seen = dict[str, list[tuple[list[float], float, float]]]
"""Way -> per round: (each server's seconds to healthy, tokens/s of them all serving, cores the machine's
other work kept busy meanwhile)."""


def ways(unbound: bool) -> dict[str, dict[str, str]]:
    """Each way's environment for its servers: an explicit VLLM_CPU_OMP_THREADS_BIND wins over the lease."""
    same_core = {"VLLM_CPU_OMP_THREADS_BIND": str(allowed_cores()[0])}
    chosen = {f"all on core {same_core['VLLM_CPU_OMP_THREADS_BIND']}": same_core, "leased cores": {}}
    if unbound:
        chosen["unbound"] = {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    return chosen


async def generated_per_s(urls: list[str], requests: int, tokens: int) -> float:
    """Tokens per second that `requests` concurrent completions on every server at once generate together."""
    async with httpx.AsyncClient(timeout=600) as client:
        async def complete(url: str, index: int) -> int:
            response = await client.post(f"{url}/v1/completions", json={
                "model": "tiny", "prompt": f"{index} + {index} =", "max_tokens": tokens, "temperature": 1.0,
                "ignore_eos": True})
            response.raise_for_status()
            return response.json()["usage"]["completion_tokens"]

        await asyncio.gather(*(complete(url, -1) for url in urls))  # one-off first-request costs left out
        started = time.perf_counter()
        counts = await asyncio.gather(*(complete(url, index) for url in urls for index in range(requests)))
        return sum(counts) / (time.perf_counter() - started)


def machine_busy_s() -> float:
    """CPU-seconds the machine's cores have been busy since boot (/proc/stat: all but idle and iowait)."""
    user, nice, system, _, _, irq, softirq, steal = map(int, Path("/proc/stat").read_text().split()[1:9])
    return (user + nice + system + irq + softirq + steal) / CLOCK_TICKS


def own_cpu_s(servers: list[VllmServer]) -> float:
    """CPU-seconds of this process and of every process of the servers' process groups (each its own)."""
    groups = {server.pid for server in servers}
    total = sum(os.times()[:2])
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text() if entry.name.isdigit() else ""
        except OSError:  # gone since the listing
            continue
        fields = stat[stat.rindex(")") + 2:].split() if stat else []
        if fields and int(fields[2]) in groups:
            total += (int(fields[11]) + int(fields[12])) / CLOCK_TICKS
    return total


def serve_load(servers: list[VllmServer], args: argparse.Namespace) -> tuple[float, float]:
    """(tokens/s of one load on all the servers, cores the machine's other work kept busy meanwhile): what
    else ran, measured rather than guessed from the load average, which counts these servers' threads too."""
    busy, own, started = machine_busy_s(), own_cpu_s(servers), time.perf_counter()
    rate = asyncio.run(generated_per_s([server.url for server in servers], args.requests, args.tokens))
    others = (machine_busy_s() - busy) - (own_cpu_s(servers) - own)
    return rate, max(others, 0.0) / (time.perf_counter() - started)


def start_to_healthy(servers: list[VllmServer]) -> list[float]:
    """Start the servers together; each one's seconds from its start to its /health answering."""
    started = {}
    for server in servers:
        started[server.port] = time.perf_counter()
        server.start()

    def healthy(server: VllmServer) -> float:
        server.wait_healthy(timeout_s=900)
        return time.perf_counter() - started[server.port]

    with ThreadPoolExecutor(len(servers)) as pool:
        return list(pool.map(healthy, servers))


def measure(args: argparse.Namespace, log_dir: Path,
            env: dict[str, str]) -> tuple[list[float], float, float]:
    """(seconds to healthy of each server, median tokens/s of them all serving, median cores of other work
    during the loads) of one way."""
    servers = [VllmServer(args.model, free_port(), log_path=log_dir / f"vllm-{index}.log", extra_env=env)
               for index in range(args.servers)]
    with ExitStack() as stack:
        for server in servers:
            stack.callback(server.stop)
        healthy = start_to_healthy(servers)
        print(f"  cores {[server.cores or env['VLLM_CPU_OMP_THREADS_BIND'] for server in servers]}, "
              f"healthy after {', '.join(f'{seconds:.1f}' for seconds in healthy)} s", flush=True)
        rates, others = zip(*(serve_load(servers, args) for _ in range(args.loads)))
        print(f"  generated {', '.join(f'{rate:.0f}' for rate in rates)} tokens/s, other work on the machine "
              f"meanwhile {', '.join(f'{cores:.2f}' for cores in others)} cores", flush=True)
    return healthy, statistics.median(rates), statistics.median(others)


def load_average() -> str:
    return ", ".join(f"{value:.2f}" for value in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=Path("models/tiny-llama"))
    parser.add_argument("--servers", type=int, default=2, help="servers started and serving at once")
    parser.add_argument("--rounds", type=int, default=1, help="each way this many times, alternately")
    parser.add_argument("--requests", type=int, default=64, help="concurrent completions on each server")
    parser.add_argument("--tokens", type=int, default=256, help="sampled tokens of each")
    parser.add_argument("--loads", type=int, default=3, help="loads per way and round (the median counts)")
    parser.add_argument("--unbound", action="store_true", help="also vLLM with no binding (nobind)")
    args = parse_args(parser, smoke={"servers": 1, "requests": 2, "tokens": 8, "loads": 1})
    load_before = load_average()
    print(f"load average before: {load_before} (1, 5, 15 min) on cores {allowed_cores()}", flush=True)
    seen: Seen = {way: [] for way in ways(args.unbound)}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.rounds):
            for way, env in ways(args.unbound).items():
                print(f"{way}:", flush=True)
                seen[way].append(measure(args, Path(tmp), env))
    report(args, seen, f"load average before {load_before} (1, 5, 15 min)")


def report(args: argparse.Namespace, seen: Seen, load_before: str) -> None:
    """Each way's median start and rate, the ratios of the leased way to the first, the other work beside
    them, and the --json figures."""
    starts = {way: [seconds for healthy, _, _ in runs for seconds in healthy] for way, runs in seen.items()}
    rates = {way: [rate for _, rate, _ in runs] for way, runs in seen.items()}
    others = {way: statistics.median(cores for _, _, cores in runs) for way, runs in seen.items()}
    start, rate = ({way: statistics.median(values) for way, values in figures.items()}
                   for figures in (starts, rates))
    for way in seen:
        each = ", ".join(f"{seconds:.1f}" for seconds in starts[way])
        print(f"{way:15s} start to healthy {start[way]:6.1f} s (each: {each})   "
              f"generated, all serving: {rate[way]:7.0f} tokens/s")
    same, leased = list(seen)[:2]
    print(f"{leased} / {same}: start to healthy {start[leased] / start[same]:.2f}x, "
          f"tokens/s {rate[leased] / rate[same]:.2f}x")
    beside = ", ".join(f"{way} {cores:.2f}" for way, cores in others.items())
    notes = [f"{load_before}; other work on the machine while serving (cores, median): {beside}",
             f"{args.rounds} rounds of each way, alternately; tokens/s the median of {args.loads} loads per "
             "round"]
    print(notes[0])
    load = (f"{args.servers} servers serving at once, {args.requests} concurrent completions of "
            f"{args.tokens} tokens each")
    figures = [Figure.repeated(f"{leased}: a server's start to healthy, {args.servers} starting at once",
                               starts[leased], f"{same} (vLLM's automatic binding)", starts[same], "s"),
               Figure.repeated(f"{leased}: generated tokens/s, {load}", rates[leased], same, rates[same],
                               "tokens/s")]
    if "unbound" in seen:
        figures.append(Figure.repeated(f"{leased}: generated tokens/s, {load}", rates[leased],
                                       "unbound (nobind)", rates["unbound"], "tokens/s"))
    write_result(args.json, figures, notes)


if __name__ == "__main__":
    main()

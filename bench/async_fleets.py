"""The fleets bench/bench_async.py runs its modes against, and how it reads their busy time: one real vLLM
CPU server behind a metering proxy, or simulated servers (bench/sim_fleet.py), each simulator in a process
of its own; a poller scraping every server's busy-time counters in a thread.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

# run as a script, so bench/ is first on sys.path
from heavy_tail_agent import banned_tokens
from sim_fleet import parse_metrics

from rollstream.shared.inference.fleet import FleetClient

BENCH = Path(__file__).resolve().parent


class SimProcess:
    """A bench simulator (bench/sim_fleet.py, bench/sim_trainer.py) in a process of its own (its event loop
    must not share a GIL with the bench); started once it printed its ready line."""

    def __init__(self, arguments: list[str], log_path: Path, script: str = "sim_fleet.py",
                 ready_line: str = "SIM_FLEET_READY", env: dict[str, str] | None = None) -> None:
        self.command = [sys.executable, str(BENCH / script), *arguments]
        self.log_path = log_path
        self.ready_line = ready_line
        self.env = env
        self.process: subprocess.Popen | None = None

    def start_and_read(self) -> str:
        """Start it; returns what follows its ready line."""
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(self.command, stdout=subprocess.PIPE, stderr=log, text=True,
                                            start_new_session=True, env=self.env)
        assert self.process.stdout is not None
        for line in self.process.stdout:
            if line.startswith(self.ready_line + " "):
                return line.split(" ", 1)[1].strip()
        raise RuntimeError(f"{self.command[1:]} exited with {self.process.wait()}; see {self.log_path}")

    def start(self) -> list[str]:
        return json.loads(self.start_and_read())["urls"]

    def exit_code(self) -> int | None:
        return None if self.process is None else self.process.poll()

    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()


class RealFleet:
    """One vLLM CPU server, behind a metering proxy (the pipeline talks to the proxy): started here, or the
    running one at `url`."""

    def __init__(self, model: Path, workdir: Path, url: str | None = None) -> None:
        from rollstream.cli.vllm_server import VllmServer, free_port

        self.server = None if url else VllmServer(model, free_port(), log_path=workdir / "vllm.log")
        self.url = url
        self.proxy: SimProcess | None = None
        self.workdir = workdir
        self.servers = 1

    def start(self) -> list[str]:
        if self.server is not None:
            self.server.start()
            self.server.wait_healthy()
            self.url = self.server.url
        self.proxy = SimProcess(["--proxy-to", self.url], self.workdir / "meter.log")
        return self.proxy.start()

    def metric_urls(self, url: str) -> list[str]:
        return [f"{url}/meter/metrics", f"{url}/metrics"]

    def pids(self) -> list[int]:
        return [pid for pid in (self.server and self.server.pid, self.proxy and self.proxy.pid()) if pid]

    def stop(self) -> None:
        if self.proxy is not None:
            self.proxy.stop()
        if self.server is not None:
            self.server.stop()


class SimulatedFleet:
    def __init__(self, model: Path, workdir: Path, args: argparse.Namespace) -> None:
        self.servers = args.servers
        self.process = SimProcess(["--servers", str(args.servers), "--model", str(model),
                                   "--decode-ms", str(args.sim_decode_ms),
                                   "--prefill-ms", str(args.sim_prefill_ms),
                                   "--overhead-ms", str(args.sim_overhead_ms), "--batch", str(args.sim_batch),
                                   "--reload-s", str(args.sim_reload_s), "--seed", str(args.seed)],
                                  workdir / "sim-fleet.log")

    def start(self) -> list[str]:
        return self.process.start()

    def metric_urls(self, url: str) -> list[str]:
        return [f"{url}/metrics"]

    def pids(self) -> list[int]:
        return [pid for pid in (self.process.pid(),) if pid]

    def stop(self) -> None:
        self.process.stop()


async def reload_all(urls: list[str], weights: Path) -> None:
    async with FleetClient(urls) as fleet:
        await asyncio.gather(*(fleet.reload_weights(url, str(weights)) for url in urls))


async def warm_up(url: str, model: Path, requests: int, concurrency: int, max_tokens: int) -> None:
    """Untimed requests of the shapes the bench sends (growing multi-turn prompts, many at once)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    extra = {"ignore_eos": True, "logit_bias": banned_tokens(tokenizer)}
    limit = asyncio.Semaphore(concurrency)
    async with FleetClient([url]) as fleet:
        async def one(index: int) -> None:
            async with limit:
                length = 20 + (index * 37) % (1000 - max_tokens - 20)
                prompt = [3 + (index + i) % 300 for i in range(length)]
                await fleet.complete(prompt, max_tokens=max_tokens, session_id=f"warm-{index % 64}",
                                     extra=extra)

        await asyncio.gather(*(one(i) for i in range(requests)))


# -------------------------------------------------------------------------------- fleet metrics
class MetricsPoller:
    """Scrapes every server's metrics in a thread: (time, values) per server."""

    NAMES = ("vllm:num_requests_running", "sim:busy_seconds_total", "sim:running_seconds_total")

    def __init__(self, servers: dict[str, list[str]], interval_s: float) -> None:
        self.servers = servers
        """server url -> the metrics URLs to scrape for it"""
        self.interval_s = interval_s
        self.samples: dict[str, list[tuple[float, dict[str, float]]]] = {u: [] for u in servers}
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.client = httpx.Client(timeout=5.0)

    def scrape(self, urls: list[str]) -> dict[str, float] | None:
        values: dict[str, float] = {}
        try:
            for url in urls:
                values.update(parse_metrics(self.client.get(url).text))
        except httpx.HTTPError:
            return None
        return {name: values[name] for name in self.NAMES if name in values}

    def run(self) -> None:
        while not self.stopping.is_set():
            started = time.monotonic()
            for server, urls in self.servers.items():
                values = self.scrape(urls)
                if values is not None:
                    self.samples[server].append((time.time(), values))
            self.stopping.wait(max(0.0, self.interval_s - (time.monotonic() - started)))

    def start(self) -> MetricsPoller:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join()
        self.client.close()

    def utilisation(self, t0: float, t1: float) -> tuple[float, float, float]:
        """Per server over [t0, t1], averaged over servers: busy fraction and mean running requests from
        the busy-time counters, and the busy fraction the polled vllm:num_requests_running gauge gives."""
        busy, running, gauge = [], [], []
        for samples in self.samples.values():
            if samples and "sim:busy_seconds_total" in samples[0][1]:
                busy.append(_counter_rate(samples, "sim:busy_seconds_total", t0, t1))
                running.append(_counter_rate(samples, "sim:running_seconds_total", t0, t1))
            inside = [v["vllm:num_requests_running"] for t, v in samples
                      if t0 <= t <= t1 and "vllm:num_requests_running" in v]
            if inside:
                gauge.append(sum(r > 0 for r in inside) / len(inside))

        def mean(values: list[float]) -> float:
            return sum(values) / len(values) if values else float("nan")

        return mean(busy), mean(running), mean(gauge)


def _counter_rate(samples: list[tuple[float, dict[str, float]]], name: str, t0: float, t1: float) -> float:
    times = [t for t, _ in samples]
    values = [v[name] for _, v in samples]

    def at(t: float) -> float:
        i = bisect.bisect_left(times, t)
        if i <= 0:
            return values[0]
        if i >= len(times):
            return values[-1]
        span = times[i] - times[i - 1]
        return values[i - 1] + (values[i] - values[i - 1]) * ((t - times[i - 1]) / span if span else 1.0)

    return (at(t1) - at(t0)) / (t1 - t0) if t1 > t0 else float("nan")


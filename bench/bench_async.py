"""Asynchronous against synchronous training on the same work, in the same run: samples trained per
minute and the fleet's busy fraction with train.max_staleness = 0 (the dispatcher admits a batch only
after the previous policy update: generation waits for the slowest episode and for training and weight
sync) and with max_staleness = eta > 0 (generation keeps going).

The workload has heavy-tailed episode lengths (bench/heavy_tail_agent.py: most episodes ~2 turns, ~5%
10-50x longer), keyed on the sample index with one seed, so both modes run the same prompts and the same
episode lengths. Every mode is the real pipeline: dispatcher, agent-runner, sandbox-grader, reward and
trainer as processes (cli/local_run.py) on the machine's Redis, against
    real   one real vLLM CPU server with the tiny model, started once and shared by both modes, after an
           untimed warm-up (vLLM on the CPU speeds up over its first few hundred requests);
    sim    `--servers` simulated vLLM servers (bench/sim_fleet.py, one process, a latency model).
Before each mode every server reloads the starting weights, so both modes start from the same policy.

Measured, per mode, over the window from the first admitted prompt to the last PolicyUpdated (event
envelope times):
    samples/min   sum of PolicyUpdated.trained_samples / window (samples dropped as too stale do not count)
    steady/min    trained samples of updates 2..V / (time of update V - time of update 1): no start-up ramp
    busy          fraction of the window a server had a request running, averaged over servers, from
                  busy-time counters: the simulator's own (sim:busy_seconds_total); for vLLM those of a
                  metering proxy in front of it (bench/sim_fleet.py --proxy-to: a completion in flight)
    run/server    mean number of requests running per server (sim:running_seconds_total, same sources)
    gauge busy    the busy fraction polling vllm:num_requests_running > 0 gives (4 Hz for vLLM, 1 Hz for
                  the simulator); it misses short requests on a CPU vLLM server, whose /metrics is
                  answered between engine outputs
    turns, tokens model turns and tokens sampled in the episodes (TrajectoryTurn events): the same work in
                  both modes

    python bench/bench_async.py [--mode real|sim|both] [--eta 4] [--batch-size 32] [--group 4] [--versions 8]
                                [--servers 64] [--sim-decode-ms 25] [--sim-batch 8] [--keep]
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import httpx

# run as a script, so bench/ is first on sys.path
from heavy_tail_agent import ENV as AGENT_ENV
from heavy_tail_agent import TailParams, banned_tokens, episode_turns
from sim_fleet import parse_metrics

from rollstream.cli.local_run import LocalRun, ServiceDied
from rollstream.shared.contract.archive import read_history
from rollstream.shared.contract.bus import Bus
from rollstream.shared.contract.events import PolicyUpdated, TrajectoryTurn, decode
from rollstream.shared.inference.fleet import FleetClient
from rollstream.shared.runtime.config import Settings

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent

AGENT = "heavy_tail_agent:heavy_tail_agent"


class BenchFailed(RuntimeError):
    """A mode did not finish; its logs are kept."""


# ------------------------------------------------------------------------------------------ fleets
class SimProcess:
    """bench/sim_fleet.py in a process of its own (its event loop must not share a GIL with the bench)."""

    def __init__(self, arguments: list[str], log_path: Path) -> None:
        self.command = [sys.executable, str(BENCH / "sim_fleet.py"), *arguments]
        self.log_path = log_path
        self.process: subprocess.Popen | None = None

    def start(self) -> list[str]:
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(self.command, stdout=subprocess.PIPE, stderr=log, text=True,
                                            start_new_session=True)
        assert self.process.stdout is not None
        for line in self.process.stdout:
            if line.startswith("SIM_FLEET_READY "):
                return json.loads(line.split(" ", 1)[1])["urls"]
        raise RuntimeError(f"{self.command[2:]} exited with {self.process.wait()}; see {self.log_path}")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()


class RealFleet:
    """One vLLM CPU server, behind a metering proxy (the pipeline talks to the proxy)."""

    def __init__(self, model: Path, workdir: Path) -> None:
        from rollstream.cli.vllm_server import VllmServer, free_port

        self.server = VllmServer(model, free_port(), log_path=workdir / "vllm.log")
        self.proxy: SimProcess | None = None
        self.workdir = workdir
        self.servers = 1

    def start(self) -> list[str]:
        self.server.start()
        self.server.wait_healthy()
        self.proxy = SimProcess(["--proxy-to", self.server.url], self.workdir / "meter.log")
        return self.proxy.start()

    def metric_urls(self, url: str) -> list[str]:
        return [f"{url}/meter/metrics", f"{url}/metrics"]

    def stop(self) -> None:
        if self.proxy is not None:
            self.proxy.stop()
        self.server.stop()


class SimulatedFleet:
    def __init__(self, model: Path, workdir: Path, args: argparse.Namespace) -> None:
        self.servers = args.servers
        self.process = SimProcess(["--servers", str(args.servers), "--model", str(model),
                                   "--decode-ms", str(args.sim_decode_ms), "--prefill-ms", str(args.sim_prefill_ms),
                                   "--overhead-ms", str(args.sim_overhead_ms), "--batch", str(args.sim_batch),
                                   "--reload-s", str(args.sim_reload_s), "--seed", str(args.seed)],
                                  workdir / "sim-fleet.log")

    def start(self) -> list[str]:
        return self.process.start()

    def metric_urls(self, url: str) -> list[str]:
        return [f"{url}/metrics"]

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
                await fleet.complete(prompt, max_tokens=max_tokens, session_id=f"warm-{index % 64}", extra=extra)

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


# ------------------------------------------------------------------------------------------ a mode
@dataclass
class Result:
    fleet: str
    servers: int
    eta: int
    versions: int
    trained: int = 0
    dropped: int = 0
    finished: int = 0
    window_s: float = float("nan")
    total_s: float = float("nan")
    per_min: float = float("nan")
    steady_per_min: float = float("nan")
    busy: float = float("nan")
    running: float = float("nan")
    gauge_busy: float = float("nan")
    turns: int = 0
    generated_tokens: int = 0
    update_times: list[float] = field(default_factory=list)
    run_dir: str = ""

    @property
    def mode(self) -> str:
        return "sync" if self.eta == 0 else "async"


def run_mode(kind: str, fleet, urls: list[str], eta: int, args: argparse.Namespace, model: Path,
             workdir: Path) -> Result:
    asyncio.run(reload_all(urls, model))
    run_id = f"bench-async-{kind}-eta{eta}-{uuid.uuid4().hex[:8]}"
    settings = Settings(
        run_id=run_id, redis_url=args.redis_url, storage_uri=str(workdir / "runs"), log_level="WARNING",
        model={"path": model},
        data={"samples_per_prompt": args.group, "synthetic_sandbox_every": 0, "seed": args.seed},
        rollout={"max_tokens": args.max_tokens, "concurrency": args.concurrency},
        agent={"default": AGENT, "max_turns": 100_000, "max_total_tokens": args.max_total_tokens},
        train={"batch_size": args.batch_size, "max_staleness": eta, "total_versions": args.versions, "seed": args.seed},
    )
    result = Result(fleet=kind, servers=fleet.servers, eta=eta, versions=args.versions)
    poller = MetricsPoller({url: fleet.metric_urls(url) for url in urls},
                           interval_s=0.25 if len(urls) == 1 else 1.0).start()
    local = LocalRun(settings, fleet_urls=urls)
    result.run_dir = str(local.run_dir)
    started = time.time()
    print(f"  {kind} eta={eta}: run {run_id}, logs in {local.log_dir}", flush=True)
    try:
        local.start()
        progress = local.wait_for_version(args.versions, timeout_s=args.timeout)
        result.total_s = time.time() - started
        result.finished = progress.finished
    except BaseException as exc:
        if isinstance(exc, (ServiceDied, TimeoutError)):
            for name in local.processes:
                print(f"--- {name} (last lines)\n{local.log_tail(name, 30)}", file=sys.stderr)
        local.stop()
        poller.stop()
        if local.bus is not None:
            local.bus.delete_run()
        if isinstance(exc, (ServiceDied, TimeoutError)):
            raise BenchFailed(f"{kind} eta={eta} failed: {exc}; logs in {local.log_dir}") from exc
        raise
    time.sleep(2 * poller.interval_s + 0.5)  # a scrape past the last update: the counters cover the window
    poller.stop()
    bus = local.bus
    assert bus is not None
    first_prompt = bus.redis.xrange(bus.keys.stream("prompts"), count=1)
    t0 = decode(first_prompt[0][1]).time
    updates = [(d.envelope.time, d.event) for d in read_history(bus, "policy", local.settings.storage_uri)
               if isinstance(d.event, PolicyUpdated)]
    result.turns, result.generated_tokens = episode_work(bus)
    local.stop()
    if not args.keep:
        bus.delete_run()

    times = [t for t, _ in updates]
    t1 = times[-1]
    result.update_times = [t - t0 for t in times]
    result.trained = sum(u.trained_samples for _, u in updates)
    result.dropped = sum(u.dropped.get("stale", 0) for _, u in updates)
    result.window_s = t1 - t0
    result.per_min = 60 * result.trained / result.window_s
    if len(updates) >= 2 and t1 > times[0]:
        result.steady_per_min = 60 * sum(u.trained_samples for _, u in updates[1:]) / (t1 - times[0])
    result.busy, result.running, result.gauge_busy = poller.utilisation(t0, t1)
    print(f"    window {result.window_s:.1f}s, trained {result.trained}, dropped {result.dropped}, "
          f"{result.per_min:.1f} samples/min, busy {result.busy:.2f}; updates at "
          + ", ".join(f"{t:.0f}" for t in result.update_times) + " s", flush=True)
    return result


def episode_work(bus: Bus) -> tuple[int, int]:
    """Turns and sampled tokens of every published episode (the fleet's own counters also count the
    trainer's parity probes)."""
    turns = tokens = 0
    for _, fields in bus.redis.xrange(bus.keys.stream("trajectories")):
        if fields.get(b"type") == TrajectoryTurn.TYPE.encode():
            turns += 1
            tokens += len(decode(fields).payload.response_ids)
    return turns, tokens


def run_fleet(kind: str, args: argparse.Namespace, model: Path, workdir: Path) -> list[Result]:
    fleet = RealFleet(model, workdir) if kind == "real" else SimulatedFleet(model, workdir, args)
    print(f"{kind}: starting {'vLLM (CPU)' if kind == 'real' else f'{args.servers} simulated servers'}", flush=True)
    results = []
    try:
        urls = fleet.start()
        if kind == "real" and args.warmup:
            print(f"  warm-up: {args.warmup} untimed requests", flush=True)
            asyncio.run(warm_up(urls[0], model, args.warmup, args.concurrency, args.max_tokens))
        etas = [0, args.eta] if args.order == "sync-first" else [args.eta, 0]
        for eta in etas:
            results.append(run_mode(kind, fleet, urls, eta, args, model, workdir))
    finally:
        fleet.stop()
    return results


# ------------------------------------------------------------------------------------------ report
def report(results: list[Result], args: argparse.Namespace, params: TailParams) -> None:
    turns = [episode_turns(i, params) for i in range(args.batch_size * args.versions)]
    long = sum(t >= params.median_turns * params.tail_min for t in turns)
    print()
    print(f"workload: B={args.batch_size} (n={args.group}), {args.versions} versions = {len(turns)} episodes, "
          f"{args.max_tokens} tokens/turn, turns median {sorted(turns)[len(turns) // 2]}, max {max(turns)}, "
          f"{long} episodes >= {params.tail_min:g}x median, {sum(turns)} turns in all; agent-runner concurrency "
          f"{args.concurrency}; seed {args.seed}")
    if any(r.fleet == "sim" for r in results):
        print(f"simulated servers: decode {args.sim_decode_ms} ms/token, prefill {args.sim_prefill_ms} ms/token, "
              f"overhead {args.sim_overhead_ms} ms/request, full speed up to {args.sim_batch} requests, "
              f"reload {args.sim_reload_s} s")
    header = (f"{'fleet':<6}{'servers':>8}{'mode':>7}{'eta':>5}{'versions':>9}{'trained':>9}{'dropped':>9}"
              f"{'window s':>10}{'samples/min':>13}{'steady/min':>12}{'busy':>7}{'run/server':>12}"
              f"{'gauge busy':>12}{'turns':>7}{'tokens':>8}{'wall s':>8}")
    print(header)
    print("-" * len(header))
    for r in results:
        print(f"{r.fleet:<6}{r.servers:>8}{r.mode:>7}{r.eta:>5}{r.versions:>9}{r.trained:>9}{r.dropped:>9}"
              f"{r.window_s:>10.1f}{r.per_min:>13.1f}{r.steady_per_min:>12.1f}{r.busy:>7.2f}{r.running:>12.2f}"
              f"{r.gauge_busy:>12.2f}{r.turns:>7}{r.generated_tokens:>8}{r.total_s:>8.1f}")
    for kind in ("real", "sim"):
        sync = next((r for r in results if r.fleet == kind and r.eta == 0), None)
        asyn = next((r for r in results if r.fleet == kind and r.eta != 0), None)
        if sync and asyn:
            print(f"async/sync {kind} ({sync.servers} server{'s' if sync.servers > 1 else ''}, eta={asyn.eta}): "
                  f"samples/min x{asyn.per_min / sync.per_min:.2f}, "
                  f"steady x{asyn.steady_per_min / sync.steady_per_min:.2f}, "
                  f"busy {sync.busy:.2f} -> {asyn.busy:.2f}, run/server {sync.running:.2f} -> {asyn.running:.2f}, "
                  f"window {sync.window_s:.0f}s -> {asyn.window_s:.0f}s")
    if args.json:
        Path(args.json).write_text(json.dumps([r.__dict__ for r in results], indent=2, default=str))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=("real", "sim", "both"), default="both")
    parser.add_argument("--eta", type=int, default=4, help="max staleness of the async mode (> 0)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--group", type=int, default=4, help="samples per prompt (n)")
    parser.add_argument("--versions", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens per turn")
    parser.add_argument("--max-total-tokens", type=int, default=1024, help="context of one segment")
    parser.add_argument("--concurrency", type=int, default=256, help="episodes the agent-runner runs at once")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--median-turns", type=int, default=2)
    parser.add_argument("--tail-fraction", type=float, default=0.05)
    parser.add_argument("--tail-min", type=float, default=10.0)
    parser.add_argument("--tail-max", type=float, default=50.0)
    parser.add_argument("--servers", type=int, default=64, help="simulated servers")
    parser.add_argument("--sim-decode-ms", type=float, default=25.0)
    parser.add_argument("--sim-prefill-ms", type=float, default=0.1)
    parser.add_argument("--sim-overhead-ms", type=float, default=2.0)
    parser.add_argument("--sim-batch", type=int, default=8)
    parser.add_argument("--sim-reload-s", type=float, default=0.05)
    parser.add_argument("--warmup", type=int, default=400, help="untimed requests to vLLM before the real modes")
    parser.add_argument("--order", choices=("sync-first", "async-first"), default="sync-first")
    parser.add_argument("--model", type=Path, default=ROOT / "models" / "tiny-llama")
    parser.add_argument("--redis-url", default=os.environ.get("RS_REDIS_URL", "redis://127.0.0.1:6379/0"))
    parser.add_argument("--timeout", type=float, default=1500.0, help="seconds one mode may take")
    parser.add_argument("--workdir", type=Path, default=None, help="default: a new directory under /tmp")
    parser.add_argument("--keep", action="store_true",
                        help="keep the work directory (logs, checkpoints) and the runs' Redis streams")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()
    if args.eta < 1:
        parser.error("--eta is the async mode's staleness and must be at least 1")

    model = args.model.resolve()
    if not (model / "config.json").exists():
        from rollstream.cli.model.tiny_model import build_tiny_model

        build_tiny_model(model)
    params = TailParams(seed=args.seed, median_turns=args.median_turns, tail_fraction=args.tail_fraction,
                        tail_min=args.tail_min, tail_max=args.tail_max)
    # the services inherit the environment: this makes the plug-in agent importable and parameterised
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(BENCH), os.environ.get("PYTHONPATH")) if p)
    os.environ[AGENT_ENV] = params.to_env()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="rs-bench-async-", dir="/tmp"))
    workdir.mkdir(parents=True, exist_ok=True)
    print(f"work directory {workdir}", flush=True)
    results: list[Result] = []
    try:
        for kind in (("real", "sim") if args.mode == "both" else (args.mode,)):
            results += run_fleet(kind, args, model, workdir)
    except BenchFailed as exc:
        if results:
            report(results, args, params)
        raise SystemExit(str(exc)) from None
    report(results, args, params)
    if not args.keep:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()

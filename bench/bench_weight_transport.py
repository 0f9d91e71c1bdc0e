"""Weight sync of real vLLM CPU servers by each transport, against the disk path measured in the same run:
seconds per version, bytes moved and the fleet's paused time, for each model shape and fleet size.

For each shape (`HIDDENxLAYERS`, as bench/bench_checkpoint_sync.py builds them: the tiny Llama's architecture,
float32) the shape's servers start one after another (untimed; each serves a model of that shape and has
rollstream's weight-transfer engine). Then, for each fleet size (the first N of them), each path syncs
`--rounds` new versions, after one untimed round (it forms the collective's group and gives delta a base):
- disk: the trainer writes the version's serving checkpoint (a temporary directory renamed into place, as
  the trainer does; its optimizer state, written with every transport, is left out), then every server
  reloads it (DiskTransport, train.sync_concurrency at once). The write is counted in the path's time: a disk
  sync cannot start before it. The servers read it from this machine's page cache, the best case for disk;
  bytes moved are the checkpoint's bytes times the servers that read it.
- collective full: CollectiveTransport over gloo on 127.0.0.1, delta off: every tensor broadcast.
- collective delta: delta on, after a step that changed `--changed` (default 1%) of each tensor's elements,
  chosen at random, each moved by noise; what moves is an int32 index and a float32 value per element.
Before every version the weights move (every element for disk and full; the chosen fraction for delta), so
every round changes what the servers serve, and every round is checked: each server's prompt logprobs of a
probe must match the trainer's within 1e-3 (train.parity_tolerance), or the benchmark fails. Prints the
medians, each path against disk, where the time of a push goes (each weight-update step from its first request
to its last answer, the trainer's broadcast, the probe), and the same buckets broadcast over gloo alone
between plain processes, without vLLM (the wire's own time on this machine).

    python bench/bench_weight_transport.py [--shapes 128x2 1024x4 2048x4] [--fleets 1 4] [--rounds 3]
                                           [--changed 0.01] [--bucket-mb 256 [MB ...]] [--no-wire]
                                           [--workdir DIR] [--smoke] [--json PATH]
        # several --bucket-mb: each collective path measured at each bucket size
        # (2048x4 --fleets 4 --bucket-mb 32 256 1024: where the bucket size moves the time)
    The full default takes about 13 minutes on 2 cores, most of it starting the 12 servers: bench/run_all.py
    needs --timeout 1200 for it.
    python bench/bench_weight_transport.py --fleet-url URL [URL ...] --model models/tiny-llama
        # running servers of --model: only its shape is measured, and they serve --model again at the end
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import multiprocessing
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from bench_checkpoint_sync import PROBE, TOLERANCE, parse_shape, weight_files, write_checkpoint
from results import Figure, parse_args, write_result

from rollstream.cli.vllm_server import VllmServer, free_port
from rollstream.shared.inference.fleet import FleetClient
from rollstream.shared.inference.weight_sync import sync_weights
from rollstream.shared.inference.weight_transport import (
    CollectiveTransport,
    DiskTransport,
    WeightTransport,
    WeightUpdate,
)
from rollstream.shared.runtime.sections.train import TrainSettings

PATHS = ("disk", "full", "delta")
LABELS = {"disk": "disk", "full": "collective full", "delta": "collective delta"}
NUDGE = 0.01
"""Standard deviation of what a step adds to a weight it moves (the weights start at 0.02)."""
SERVER_OVERHEAD = 3 << 30
"""A vLLM CPU server's memory besides its model: three processes and a KV cache (VLLM_CPU_KVCACHE_SPACE=1)."""
MEMORY_WAIT_S = 300


@dataclasses.dataclass
class Version:
    """One synced version: what it took and moved."""

    seconds: float
    """From the start of the sync (the checkpoint's write, for disk) to the last server's parity probe."""
    write_s: float
    push_s: float
    bytes_moved: int
    paused_s: float
    changed: float | None
    worst_diff: float
    phases: dict[str, float]


@dataclasses.dataclass
class Row:
    shape: str
    size: int
    servers: int
    path: str
    bucket_mb: int | None
    """A collective path's bucket size (None: disk)."""
    versions: list[Version]
    wire_s: float | None = None

    def label(self, buckets_vary: bool) -> str:
        sized = buckets_vary and self.bucket_mb is not None
        return LABELS[self.path] + (f", {self.bucket_mb} MiB buckets" if sized else "")

    def median(self, field: str) -> float:
        return statistics.median(getattr(version, field) for version in self.versions)

    def phase_medians(self) -> dict[str, float]:
        names = dict.fromkeys(name for version in self.versions for name in version.phases)
        return {name: statistics.median(v.phases.get(name, 0.0) for v in self.versions) for name in names}


# ------------------------------------------------------------------------------------------- the trainer
class Policy:
    """The trainer's model: moved in place by each step, its probe logprobs what the servers must serve."""

    def __init__(self, checkpoint: Path, tokenizer_source: Path, seed: int = 1) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
        self.tokenizer_source = tokenizer_source
        self.generator = torch.Generator().manual_seed(seed)
        self.expected = self.probe_logprobs()

    def probe_logprobs(self) -> list[float]:
        import torch

        with torch.no_grad():
            logits = self.model(input_ids=torch.tensor([PROBE])).logits[0, :-1]
            expected = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(PROBE[1:])[:, None])
        return expected.squeeze(-1).tolist()

    def step(self, fraction: float) -> None:
        """Move `fraction` of every tensor's elements (1: all of them); the probe must tell the versions
        apart, else parity would not show a server that kept the old one."""
        import torch

        with torch.no_grad():
            for tensor in self.model.state_dict().values():
                if fraction >= 1:
                    tensor.add_(torch.randn(tensor.shape, generator=self.generator) * NUDGE)
                    continue
                flat = tensor.view(-1)
                chosen = (torch.rand(flat.numel(), generator=self.generator) < fraction).nonzero().view(-1)
                flat[chosen] += torch.randn(chosen.numel(), generator=self.generator) * NUDGE
        before, self.expected = self.expected, self.probe_logprobs()
        if max(abs(a - b) for a, b in zip(before, self.expected, strict=True)) < 10 * TOLERANCE:
            raise RuntimeError(f"a step moving {fraction:.0%} of the weights leaves the probe's logprobs "
                               f"within {10 * TOLERANCE:g}: no parity check would tell the versions apart")

    def weights(self):
        return self.model.state_dict().items()

    def write_checkpoint(self, directory: Path) -> Path:
        """The serving checkpoint, as the trainer writes a version: a temporary directory renamed in place."""
        from rollstream.shared.inference.serving_weights import write_serving_checkpoint

        temp = directory.with_name(directory.name + ".tmp")
        write_serving_checkpoint(self.model, temp, tokenizer_source=self.tokenizer_source)
        os.replace(temp, directory)
        return directory


# ---------------------------------------------------------------------------------- timing of a push
class StepClock:
    """When each weight-update step of a push ran: from its first request to the last server's answer."""

    def __init__(self, fleet: FleetClient) -> None:
        self.spans: dict[str, list[float]] = {}
        step_on = fleet.weight_step

        async def timed(url: str, step: str, path: str, **kwargs):
            started = time.perf_counter()
            try:
                return await step_on(url, step, path, **kwargs)
            finally:
                self.note(step, started, time.perf_counter())

        fleet.weight_step = timed  # the fleet's own requests, with a clock around them

    def note(self, step: str, started: float, ended: float) -> None:
        span = self.spans.setdefault(step, [started, ended])
        span[0], span[1] = min(span[0], started), max(span[1], ended)

    def take(self, push_started: float) -> dict[str, float]:
        """Each step's seconds, and `prepare`: the push's start to its first step (copy, delta planning)."""
        spans, self.spans = self.spans, {}
        first = min((span[0] for span in spans.values()), default=push_started)
        steps = {step: end - start for step, (start, end) in spans.items()}
        return {"prepare": first - push_started, **steps}


class TimedPush:
    """Remembers when a transport's last push began and how long it took (put before the transport class)."""

    push_started = 0.0
    push_s = 0.0

    async def push(self, fleet, urls, update):
        self.push_started = time.perf_counter()
        try:
            return await super().push(fleet, urls, update)
        finally:
            self.push_s = time.perf_counter() - self.push_started


class TimedCollective(TimedPush, CollectiveTransport):
    """And how long the trainer's broadcast took."""

    broadcast_s = 0.0

    def broadcast(self, specs, tensors) -> None:
        started = time.perf_counter()
        super().broadcast(specs, tensors)
        self.broadcast_s = time.perf_counter() - started


class TimedDisk(TimedPush, DiskTransport):
    pass


def make_transport(path: str, bucket_bytes: int) -> WeightTransport:
    defaults = TrainSettings()
    if path == "disk":
        return TimedDisk(defaults.sync_concurrency)
    return TimedCollective("gloo", "127.0.0.1", delta=path == "delta", bucket_bytes=bucket_bytes,
                           timeout_s=defaults.sync_timeout_s)


# ------------------------------------------------------------------------------------------ measuring
@dataclasses.dataclass
class Plan:
    rounds: int
    changed: float
    bucket_mbs: list[int]
    """Each collective path is measured at each of these bucket sizes."""
    workdir: Path
    versions: Iterator[int]


async def sync_version(fleet: FleetClient, clock: StepClock, transport: TimedDisk | TimedCollective,
                       policy: Policy, path: str, plan: Plan, urls: list[str], timed: bool) -> Version:
    """A new version (the weights moved first, untimed) synced to `urls`, checked for parity."""
    policy.step(plan.changed if path == "delta" else 1.0)
    version = next(plan.versions)
    started = time.perf_counter()
    checkpoint, write_s = None, 0.0
    if path == "disk":
        checkpoint = policy.write_checkpoint(plan.workdir / f"v{version:05d}")
        write_s = time.perf_counter() - started
    update = WeightUpdate(version, checkpoint=checkpoint, weights=None if checkpoint else policy.weights)
    diffs, report = await sync_weights(fleet, transport, update, PROBE, policy.expected, urls)
    seconds = time.perf_counter() - started
    worst = checked(diffs, report, urls, path, version, timed)
    phases = clock.take(transport.push_started)
    if isinstance(transport, TimedCollective):
        phases["broadcast (trainer)"] = transport.broadcast_s
    phases["probe"] = seconds - write_s - transport.push_s
    moved = report.bytes_sent
    if checkpoint is not None:
        moved = sum(path.stat().st_size for path in weight_files(checkpoint)) * len(urls)
        phases = {"write": write_s, **phases}
        shutil.rmtree(checkpoint)  # every server holds it now
    return Version(seconds, write_s, transport.push_s, moved, report.paused_s, report.changed_fraction, worst,
                   phases)


def checked(diffs: dict[str, float], report, urls: list[str], path: str, version: int, timed: bool) -> float:
    """The worst parity gap of the version's servers; RuntimeError when one failed, is off parity, or the
    push was not of the kind measured."""
    failed = {url: str(failure) for url, failure in report.failures.items() if failure is not None}
    if failed or sorted(diffs) != sorted(urls):
        raise RuntimeError(f"v{version} ({LABELS[path]}): servers left out of the sync: {failed}")
    worst = max(diffs.values())
    if worst > TOLERANCE:
        raise RuntimeError(f"v{version} ({LABELS[path]}): a server serves other logprobs than the trainer "
                           f"after the sync: {worst:.2e} > {TOLERANCE:g}")
    kind = {"disk": "disk", "full": "full", "delta": "delta" if timed else "full"}[path]
    if report.kind != kind:
        raise RuntimeError(f"v{version} ({LABELS[path]}): a {report.kind} push where {kind} was measured "
                           f"(changed fraction {report.changed_fraction})")
    return worst


async def measure_path(path: str, bucket_mb: int, urls: list[str], policy: Policy,
                       plan: Plan) -> list[Version]:
    """`plan.rounds` versions by one path after an untimed one (the group forms, delta gets its base)."""
    transport = make_transport(path, bucket_mb << 20)
    assert isinstance(transport, TimedDisk | TimedCollective)
    versions = []
    async with FleetClient(urls) as fleet:
        clock = StepClock(fleet)
        try:
            for index in range(plan.rounds + 1):
                version = await sync_version(fleet, clock, transport, policy, path, plan, urls, index > 0)
                if index:
                    versions.append(version)
        finally:
            transport.close()
    return versions


# -------------------------------------------------------------------------- gloo alone, without vLLM
def receive_buckets(group: dict, rank: int, sizes: list[int], rounds: int) -> None:
    """A plain process of the wire's group: receives every bucket, `rounds` times, as a server's worker would
    (a fresh buffer per bucket)."""
    import torch

    from rollstream.shared.inference.weight_group import GroupAddress, join

    communicator = join(GroupAddress.from_json(group), rank)
    for _ in range(rounds):
        for size in sizes:
            communicator.broadcast(torch.empty(size, dtype=torch.uint8), 0)
    communicator.close()


def wire_seconds(policy: Policy, receivers: int, bucket_bytes: int, rounds: int) -> float:
    """Median seconds to broadcast the model's bytes, in the transport's buckets, to `receivers` plain
    processes over gloo on 127.0.0.1: what the wire takes here without vLLM on either end."""
    import torch

    from rollstream.shared.inference.weight_buckets import TensorSpec, bucket_size, plan_buckets
    from rollstream.shared.inference.weight_group import GroupAddress, join

    specs = [TensorSpec.of(name, tensor) for name, tensor in policy.weights()]
    sizes = [bucket_size(specs, indices) for indices in plan_buckets(specs, bucket_bytes)]
    buffers = [torch.zeros(size, dtype=torch.uint8) for size in sizes]
    group = GroupAddress("gloo", "127.0.0.1", free_port(), receivers + 1, generation=1, timeout_s=300)
    spawn = multiprocessing.get_context("spawn")
    processes = [spawn.Process(target=receive_buckets, args=(group.to_json(), rank, sizes, rounds))
                 for rank in range(1, receivers + 1)]
    for process in processes:
        process.start()
    try:
        communicator = join(group, 0)
        seconds = []
        for _ in range(rounds):
            started = time.perf_counter()
            for buffer in buffers:
                communicator.broadcast(buffer, 0)
            seconds.append(time.perf_counter() - started)
        communicator.close()
    finally:
        for process in processes:
            process.join(timeout=60)
            if process.is_alive():
                process.kill()
    return statistics.median(seconds)


# ---------------------------------------------------------------------------------------- the servers
def available_memory() -> int:
    meminfo = Path("/proc/meminfo").read_text().splitlines()
    return int(next(line.split()[1] for line in meminfo if line.startswith("MemAvailable"))) << 10


def wait_for_memory(needed: int) -> None:
    """Until the machine has `needed` bytes available; RuntimeError after MEMORY_WAIT_S (a server started
    without them would have the kernel kill something)."""
    deadline = time.monotonic() + MEMORY_WAIT_S
    while (free := available_memory()) < needed:
        if time.monotonic() > deadline:
            raise RuntimeError(f"a vLLM server of this shape needs ~{needed / 2**30:.1f} GiB; the machine "
                               f"has {free / 2**30:.1f} GiB available after {MEMORY_WAIT_S} s of waiting")
        time.sleep(5)


@contextlib.contextmanager
def shape_servers(checkpoint: Path, count: int, size: int, logs: Path) -> Iterator[list[str]]:
    """`count` servers of `checkpoint`, started one after another (untimed), all stopped at the end."""
    with contextlib.ExitStack() as stack:
        urls = []
        for index in range(count):
            wait_for_memory(SERVER_OVERHEAD + 3 * size)  # its model, a host copy for delta, the buckets
            server = stack.enter_context(VllmServer(checkpoint, free_port(),
                                                    log_path=logs / f"vllm-{checkpoint.name}-{index}.log"))
            waited = server.wait_healthy(timeout_s=600)
            print(f"  server {index + 1}/{count} healthy after {waited:.0f} s ({server.url}, cores "
                  f"{server.cores}, load {os.getloadavg()[0]:.1f})", flush=True)
            urls.append(server.url)
        yield urls


async def put_back(urls: list[str], model: Path) -> None:
    async with FleetClient(urls) as fleet:
        for url in urls:
            await fleet.reload_weights(url, str(model.resolve()))


# -------------------------------------------------------------------------------------------- a shape
def measure_shape(args: argparse.Namespace, shape: tuple[int, int] | None, plan: Plan) -> list[Row]:
    """Every fleet size and path of one shape, on servers of that shape (started here unless --fleet-url)."""
    name = "served" if shape is None else f"{shape[0]}x{shape[1]}"
    start, _ = write_checkpoint(args.model, shape, 0, plan.workdir / f"{name}-start")
    size = sum(path.stat().st_size for path in weight_files(start))
    policy = Policy(start, args.model)
    fleets = [n for n in args.fleets if not args.fleet_url or n <= len(args.fleet_url)]
    print(f"{name}: {size / 2**20:.1f} MiB, fleets {fleets}, load average {os.getloadavg()[0]:.1f}",
          flush=True)
    servers = (contextlib.nullcontext(args.fleet_url) if args.fleet_url
               else shape_servers(start, max(fleets), size, plan.workdir))
    rows = []
    with servers as urls:
        try:
            for count in fleets:
                for path, bucket_mb in methods(plan.bucket_mbs):
                    versions = asyncio.run(measure_path(path, bucket_mb or 0, urls[:count], policy, plan))
                    rows.append(Row(name, size, count, path, bucket_mb, versions))
                    print(f"  {count} server(s), {rows[-1].label(True)}: {rows[-1].median('seconds'):.3f} s "
                          f"per version (load {os.getloadavg()[0]:.1f})", flush=True)
        finally:
            if args.fleet_url:
                asyncio.run(put_back(urls, args.model))
    if args.wire:  # once the servers are gone: the plain processes need memory of their own
        for count in fleets:
            wire_s = wire_seconds(policy, count, plan.bucket_mbs[0] << 20, plan.rounds)
            for row in rows:
                if row.servers == count and row.bucket_mb == plan.bucket_mbs[0]:
                    row.wire_s = wire_s
    shutil.rmtree(start)
    return rows


def methods(bucket_mbs: list[int]) -> list[tuple[str, int | None]]:
    """disk, then each collective path at each bucket size."""
    return [("disk", None), *((path, mb) for path in PATHS[1:] for mb in bucket_mbs)]


# ---------------------------------------------------------------------------------------- the report
def table(rows: list[Row], rounds: int, buckets_vary: bool) -> str:
    disk = {(row.shape, row.servers): row for row in rows if row.path == "disk"}
    width = max(len(row.label(buckets_vary)) for row in rows) + 2
    lines = [f"per version, medians of {rounds} rounds; vs disk: the path's seconds / disk's, same shape and "
             "fleet; wire: the same buckets over gloo between plain processes, no vLLM",
             f"{'shape':<8}{'MiB':>7}{'srv':>4}  {'path':<{width}}{'s':>8}{'write s':>9}{'push s':>8}"
             f"{'paused s':>9}{'MiB moved':>11}{'changed':>9}{'parity':>9}{'vs disk':>8}{'wire s':>8}"]
    for row in rows:
        changed = [v.changed for v in row.versions if v.changed is not None]
        changed_text = f"{statistics.median(changed):.2%}" if changed else "-"
        wire = "-" if row.wire_s is None else f"{row.wire_s:.3f}"
        ratio = row.median("seconds") / disk[(row.shape, row.servers)].median("seconds")
        label = row.label(buckets_vary)
        lines.append(f"{row.shape:<8}{row.size / 2**20:>7.1f}{row.servers:>4}  {label:<{width}}"
                     f"{row.median('seconds'):>8.3f}{row.median('write_s'):>9.3f}{row.median('push_s'):>8.3f}"
                     f"{row.median('paused_s'):>9.3f}{row.median('bytes_moved') / 2**20:>11.1f}"
                     f"{changed_text:>9}{max(v.worst_diff for v in row.versions):>9.1e}{ratio:>8.2f}"
                     f"{wire:>8}")
    return "\n".join(lines)


def where_time_goes(rows: list[Row], buckets_vary: bool) -> str:
    lines = ["where a version's time goes (medians, s): each weight-update step from its first request to "
             "the last server's answer (disk: each server runs its steps on its own, so their spans "
             "overlap); prepare: the trainer's copy of its weights and the delta's planning; update_weights: "
             "the servers receiving and loading while the trainer broadcasts; probe: the parity check"]
    for row in rows:
        phases = ", ".join(f"{name} {seconds:.3f}" for name, seconds in row.phase_medians().items())
        lines.append(f"{row.shape} {row.servers} srv {row.label(buckets_vary)}: {phases}")
    return "\n".join(lines)


def figures(rows: list[Row], changed: float, buckets_vary: bool) -> list[Figure]:
    """Each collective path against disk, the largest shape and fleet first."""
    disk = {(row.shape, row.servers): row for row in rows if row.path == "disk"}
    out = []
    for row in sorted(rows, key=lambda row: (-row.size, -row.servers)):
        if row.path == "disk":
            continue
        label = row.label(buckets_vary)
        if row.path == "delta":
            label += f" ({changed:.0%} of elements changed)"
        base = disk[(row.shape, row.servers)]
        out.append(Figure.repeated(
            f"{label}, {row.size / 2**20:.1f} MiB ({row.shape}), {row.servers} server(s): s per version",
            [v.seconds for v in row.versions], "disk: checkpoint write + every server's reload",
            [v.seconds for v in base.versions], "s"))
    return out


def target_line(rows: list[Row], buckets_vary: bool) -> str:
    """The issue's target at the largest shape and fleet measured: collective at most 0.5x disk's time."""
    largest = max(rows, key=lambda row: (row.size, row.servers))
    at = [row for row in rows if (row.shape, row.servers) == (largest.shape, largest.servers)]
    disk = next(row for row in at if row.path == "disk").median("seconds")
    ratios = {row.label(buckets_vary): row.median("seconds") / disk for row in at if row.path != "disk"}
    parts = ", ".join(f"{label} {ratio:.2f}x" for label, ratio in ratios.items())
    verdict = "met" if min(ratios.values()) <= 0.5 else "missed"
    return (f"target (collective at most 0.5x disk) at {largest.size / 2**20:.0f} MiB, {largest.servers} "
            f"server(s): {parts} of disk's {disk:.2f} s: {verdict}")


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=Path("models/tiny-llama"),
                        help="tokenizer and architecture of the shapes; with --fleet-url, what they serve")
    parser.add_argument("--shapes", type=parse_shape, nargs="+", default=[(128, 2), (1024, 4), (2048, 4)],
                        help="HIDDENxLAYERS of each model size")
    parser.add_argument("--fleets", type=int, nargs="+", default=[1, 4], help="servers synced at once")
    parser.add_argument("--rounds", type=int, default=3, help="timed versions per path and fleet")
    parser.add_argument("--changed", type=float, default=0.01,
                        help="share of each tensor's elements a delta step changes")
    parser.add_argument("--bucket-mb", type=int, nargs="+", default=[TrainSettings().sync_bucket_mb],
                        help="a collective broadcast's bucket (train.sync_bucket_mb); several: each measured")
    parser.add_argument("--no-wire", dest="wire", action="store_false",
                        help="leave out the buckets over gloo alone, without vLLM")
    parser.add_argument("--fleet-url", nargs="+", default=None,
                        help="running vLLM servers of --model (with rollstream's engine): its shape only")
    parser.add_argument("--workdir", type=Path, default=None, help="checkpoints and server logs")
    args = parse_args(parser, smoke={"shapes": [(128, 2)], "fleets": [1], "rounds": 1, "wire": False})
    if not 0 < args.changed < 0.5 or args.rounds < 1 or min(args.fleets) < 1 or min(args.bucket_mb) < 1:
        parser.error("--changed must be in (0, 0.5); --rounds, --fleets and --bucket-mb at least 1")
    if args.fleet_url and min(args.fleets) > len(args.fleet_url):
        parser.error(f"--fleets {args.fleets}: only {len(args.fleet_url)} server(s) given by --fleet-url")
    return args


def main() -> None:
    from transformers.utils import logging as hf_logging

    args = arguments()
    hf_logging.disable_progress_bar()  # a bar per checkpoint written would bury the figures
    load_before = os.getloadavg()[0]
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="rs-bench-transport-", dir=args.workdir) as tmp:
        plan = Plan(args.rounds, args.changed, args.bucket_mb, Path(tmp), iter(range(1, 10**9)))
        for shape in [None] if args.fleet_url else args.shapes:
            rows += measure_shape(args, shape, plan)
    load_after = os.getloadavg()[0]
    vary = len(args.bucket_mb) > 1
    report = [table(rows, args.rounds, vary), where_time_goes(rows, vary), target_line(rows, vary)]
    print("\n" + "\n\n".join(report))
    print(f"\nload average {load_before:.1f} at the start, {load_after:.1f} at the end")
    buckets = "/".join(map(str, args.bucket_mb))
    write_result(args.json, figures(rows, args.changed, vary), [
        f"real vLLM CPU servers (float32); collective over gloo on 127.0.0.1, buckets of {buckets} MiB; "
        f"disk: {TrainSettings().sync_concurrency} servers at once, the checkpoint read from the page cache; "
        f"delta after a step changing {args.changed:.0%} of each tensor's elements; one untimed version per "
        f"path first; parity within {TOLERANCE:g} checked on every server every version; load average "
        f"{load_before:.1f} at the start, {load_after:.1f} at the end", *report])


if __name__ == "__main__":
    main()

"""Disk weight-sync time of a whole fleet against how many servers reload at once (train.sync_concurrency).

Starts `--servers` simulated vLLM servers (bench/sim_fleet.py: each loads the real checkpoint it is told to
and answers prompt logprobs with a real forward pass; a reload costs `--reload-s` on top), then syncs them
the way the trainer does (rollstream.shared.inference.weight_sync: pause, reload, reset the prefix cache,
resume, probe for parity), alternating between two checkpoints, `--rounds` times per concurrency. Prints the
median seconds per sync and the ratio to one server at a time, measured in the same run.

    python bench/bench_weight_sync.py [--servers 64] [--reload-s 0.05] [--concurrency 1 4 16 64] [--rounds 3]
                                      [--smoke] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

# run as a script, so bench/ is first on sys.path
from results import Figure, parse_args, write_result
from sim_checkpoints import Checkpoints
from sim_fleet import SimFleet
from sim_latency import LatencyModel

from rollstream.shared.inference.fleet import FleetClient
from rollstream.shared.inference.weight_sync import sync_weights
from rollstream.shared.inference.weight_transport import DiskTransport, WeightUpdate

PROBE = [1, 40, 41, 42, 7, 99, 120, 3, 45, 46, 200]


def expected_logprobs(path: Path) -> list[float]:
    """What the trainer's parity probe expects of a server that loaded `path`."""
    return [logprob for logprob, _ in Checkpoints().prompt_logprobs(str(path), PROBE)]


async def sync_seconds(urls: list[str], checkpoints: list[tuple[Path, list[float]]], concurrency: int,
                       rounds: int) -> list[float]:
    seconds = []
    async with FleetClient(urls, model="tiny") as fleet:
        for index in range(rounds):
            path, expected = checkpoints[index % 2]
            started = time.perf_counter()
            update = WeightUpdate(index, checkpoint=path)
            diffs, _ = await sync_weights(fleet, DiskTransport(concurrency), update, PROBE, expected)
            seconds.append(time.perf_counter() - started)
            worst = max(diffs.values())
            if worst > 1e-4:
                raise AssertionError(f"a server serves other weights after the sync: {worst:.2e}")
    return seconds


def main() -> None:
    from rollstream.cli.model.tiny_model import build_tiny_model

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=Path("models/tiny-llama"))
    parser.add_argument("--servers", type=int, default=64)
    parser.add_argument("--reload-s", type=float, default=0.05)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--rounds", type=int, default=3)
    args = parse_args(parser, smoke={"servers": 4, "concurrency": [1, 4], "rounds": 1})
    if 1 not in args.concurrency:
        parser.error("--concurrency must include 1: one server at a time is the baseline")
    with tempfile.TemporaryDirectory() as tmp:
        other = build_tiny_model(Path(tmp) / "v1", seed=1)
        checkpoints = [(other, expected_logprobs(other)), (args.model, expected_logprobs(args.model))]
        latency = LatencyModel(reload_s=args.reload_s)
        with SimFleet(args.model, args.servers, latency=latency) as sim:
            asyncio.run(sync_seconds(sim.urls, checkpoints, args.servers, 2))  # loads and caches both
            medians = {n: statistics.median(asyncio.run(sync_seconds(sim.urls, checkpoints, n, args.rounds)))
                       for n in args.concurrency}
    serial = medians[1]
    print(f"{args.servers} servers, reload {args.reload_s:g} s each:")
    for n, seconds in medians.items():
        print(f"  {n:3d} at once: {seconds:6.2f} s per sync   {serial / seconds:5.1f}x faster than one at a "
              "time")
    figures = [Figure(f"sync of {args.servers} servers, {n} at once", seconds, "one server at a time", serial,
                      "s") for n, seconds in medians.items() if n != 1]
    write_result(args.json, figures, [
        f"{args.servers} simulated servers (bench/sim_fleet.py), each reload {args.reload_s:g} s (both "
        f"checkpoints loaded and cached by an untimed sync first); medians of {args.rounds} syncs"])


if __name__ == "__main__":
    main()

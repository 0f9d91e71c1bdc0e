"""Stream bus throughput next to raw redis-py, same server, same run.

Publishes N small events (PromptIssued, on `prompts`) and N token-heavy ones (a 512-token TrajectorySegment,
on `trajectories`: each on a stream that carries its type, or the bus dead-letters it) with `Bus.publish`,
consumes them with `Bus.consume` and acknowledges each read's entries in one pipeline of XACKs (services ack
each entry as they finish it, `Bus.ack`: a round trip the bus and raw would pay alike), and does the same with
raw XADD / XREADGROUP / XACK of the already-encoded fields. Prints events/s and bus/raw ratios, for the
client services run (redis-py with hiredis packing the commands and parsing the replies in C) and for redis-py
doing both in Python: against the first, twice as fast, the same work of the bus is a larger share.

Each case runs --repeats times, bus and raw in turn (a run takes a fraction of a second, so one alone swings
with whatever else the machine does): the figures are the medians, each run's beside them.

    python bench/bench_bus.py [--redis redis://127.0.0.1:6379/0] [--events 5000] [--repeats 5] [--smoke]
                              [--json PATH]
"""

from __future__ import annotations

import argparse
import gc
import time
import uuid

import redis
from redis._parsers import Encoder, _RESP3Parser
from redis.connection import PythonRespSerializer
from redis.utils import HIREDIS_AVAILABLE
from results import Figure, parse_args, write_result

from rollstream.shared.contract.bus import Bus
from rollstream.shared.contract.events import PromptIssued, TrajectorySegment, encode, make_envelope
from rollstream.shared.runtime.config import BusSettings


def small(i: int) -> PromptIssued:
    return PromptIssued(sample_index=i, group_size=8,
                        messages=[{"role": "user", "content": "What is 3 + 4?"}], label="7", policy_version=0)


def heavy(i: int) -> TrajectorySegment:
    return TrajectorySegment(segment_index=0, tokens=list(range(i, i + 512)), response_length=256,
                             loss_mask=[0] * 256 + [1] * 256, rollout_logprobs=[-0.5] * 512,
                             turn_policy_versions=[0], status="completed", response_text="7", sample_index=i,
                             group_size=8)


def bench_bus(bus: Bus, stream: str, events: list, batch: int) -> tuple[float, float]:
    bus.ensure_group(stream, "bench")
    key = bus.keys.stream(stream)
    start = time.perf_counter()
    pipe = bus.redis.pipeline(transaction=False)
    for i, event in enumerate(events, 1):
        bus.publish(stream, event, pipe=pipe)
        if i % batch == 0:
            pipe.execute()
    pipe.execute()
    publish = len(events) / (time.perf_counter() - start)
    start = time.perf_counter()
    seen = 0
    while seen < len(events):
        got = bus.consume(stream, "bench", "c", count=batch, block_ms=100)
        if not got:
            raise RuntimeError(f"the bus handed back {seen} of {len(events)} events: "
                               f"{bus.redis.xlen(bus.keys.stream('dead'))} were dead-lettered")
        pipe = bus.redis.pipeline(transaction=False)
        for d in got:
            pipe.xack(key, "bench", d.entry_id)
        pipe.execute()
        seen += len(got)
    return publish, len(events) / (time.perf_counter() - start)


def bench_raw(client: redis.Redis, key: str, fields: list[dict], batch: int) -> tuple[float, float]:
    client.xgroup_create(key, "bench", id="0", mkstream=True)
    start = time.perf_counter()
    pipe = client.pipeline(transaction=False)
    for i, f in enumerate(fields, 1):
        pipe.xadd(key, f)
        if i % batch == 0:
            pipe.execute()
    pipe.execute()
    publish = len(fields) / (time.perf_counter() - start)
    start = time.perf_counter()
    seen = 0
    while seen < len(fields):
        response = client.xreadgroup("bench", "c", {key: ">"}, count=batch, block=100)
        entries = response[0][1] if response else []
        pipe = client.pipeline(transaction=False)
        for entry_id, _ in entries:
            pipe.xack(key, "bench", entry_id)
        pipe.execute()
        seen += len(entries)
    return publish, len(fields) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--redis", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--events", type=int, default=5000)
    parser.add_argument("--batch", type=int, default=100, help="pipeline and read batch size")
    parser.add_argument("--repeats", type=int, default=5, help="runs of each case; figures are their medians")
    args = parse_args(parser, smoke={"events": 200, "batch": 50, "repeats": 2})
    print(f"{args.events} events per case, batches of {args.batch}, {args.repeats} runs, {args.redis}")
    figures = []
    for parser_name, client in clients(args.redis):
        print(f"commands packed and replies parsed by {parser_name}")
        print(f"{'case':<28}{'publish ev/s':>14}{'consume ev/s':>14}")
        figures += measure(client, parser_name, args)
    setting = f"{args.events} events per case, batches of {args.batch}, median of {args.repeats} runs"
    write_result(args.json, figures, [setting])


def clients(url: str) -> list[tuple[str, redis.Redis]]:
    """The client services run (redis-py with hiredis, a dependency, packing commands and parsing replies),
    then redis-py doing both in Python (all there is where hiredis is not installed)."""
    pure_python = PythonRespSerializer(6000, Encoder("utf-8", "strict", decode_responses=False).encode)
    client = redis.Redis.from_url(url, parser_class=_RESP3Parser, command_packer=pure_python)
    python = ("redis-py in Python", client)
    if not HIREDIS_AVAILABLE:
        return [python]
    return [("hiredis", redis.Redis.from_url(url)), python]


def measure(client: redis.Redis, parser_name: str, args: argparse.Namespace) -> list[Figure]:
    cases = (("PromptIssued", "prompts", small), ("Segment 512 tokens", "trajectories", heavy))
    figures = []
    for label, stream, make in cases:
        events = [make(i) for i in range(args.events)]
        # They are the producer's, made before the clock starts: frozen like a service's start-up heap
        # (ServiceRuntime), they are not walked by whichever run a full collection happens to fall in.
        gc.freeze()
        bus_runs, raw_runs = [], []
        for _ in range(args.repeats):
            bus_run, raw_run = run_case(client, stream, events, args.batch)
            bus_runs.append(bus_run)
            raw_runs.append(raw_run)
            print(f"{label + ' (bus)':<28}{bus_run[0]:>14,.0f}{bus_run[1]:>14,.0f}")
            print(f"{label + ' (raw redis-py)':<28}{raw_run[0]:>14,.0f}{raw_run[1]:>14,.0f}")
        for index, (what, baseline) in enumerate((("Bus.publish", "raw XADD"),
                                                  ("Bus.consume + ack", "raw XREADGROUP + XACK"))):
            figure = Figure.repeated(f"{label}: {what} ({parser_name})", [run[index] for run in bus_runs],
                                     f"{baseline}, same client", [run[index] for run in raw_runs], "events/s")
            print(f"{label} {what}: bus/raw {figure.ratio:.2f} (runs "
                  + ", ".join(f"{ratio:.2f}" for ratio in figure.run_ratios) + ")")
            figures.append(figure)
    return figures


def run_case(client: redis.Redis, stream: str, events: list, batch: int) -> tuple[tuple[float, float], ...]:
    """(publish, consume) events/s through the bus, then raw, on streams of a run of their own."""
    run = f"bench-{uuid.uuid4().hex[:8]}"
    bus = Bus(client, run, BusSettings(reclaim_idle_ms=600_000))
    # Raw redis-py gets the same bytes, encoded ahead of time: the difference is the bus's own work.
    fields = [encode(make_envelope(e, run_id=run)) for e in events]
    try:
        through_bus = bench_bus(bus, stream, events, batch)
        return through_bus, bench_raw(client, f"{bus.keys.prefix}:raw", fields, batch)
    finally:
        bus.delete_run()


if __name__ == "__main__":
    main()

"""Stream bus throughput next to raw redis-py, same server, same run.

Publishes N small events (PromptIssued, on `prompts`) and N token-heavy ones (a 512-token TrajectorySegment,
on `trajectories`: each on a stream that carries its type, or the bus dead-letters it) with `Bus.publish`,
consumes and acknowledges them with `Bus.consume` + `Bus.ack`, and does the same with
raw XADD / XREADGROUP / XACK of the already-encoded fields. Prints events/s and bus/raw ratios.

    python bench/bench_bus.py [--redis redis://127.0.0.1:6379/0] [--events 5000] [--smoke] [--json PATH]
"""

from __future__ import annotations

import argparse
import time
import uuid

import redis
from results import Figure, parse_args, write_result

from rollstream.shared.contract.bus import Bus
from rollstream.shared.contract.events import PromptIssued, TrajectorySegment, encode, make_envelope
from rollstream.shared.runtime.config import BusSettings


def small(i: int) -> PromptIssued:
    return PromptIssued(sample_index=i, group_size=8, messages=[{"role": "user", "content": "What is 3 + 4?"}],
                        label="7", policy_version=0)


def heavy(i: int) -> TrajectorySegment:
    return TrajectorySegment(segment_index=0, tokens=list(range(i, i + 512)), response_length=256,
                             loss_mask=[0] * 256 + [1] * 256, rollout_logprobs=[-0.5] * 512,
                             turn_policy_versions=[0], status="completed", response_text="7", sample_index=i,
                             group_size=8)


def bench_bus(bus: Bus, stream: str, events: list, batch: int) -> tuple[float, float]:
    bus.ensure_group(stream, "bench")
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
            pipe.xack(bus.keys.stream(stream), "bench", d.entry_id)
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
    args = parse_args(parser, smoke={"events": 200, "batch": 50})
    client = redis.Redis.from_url(args.redis)
    print(f"{args.events} events per case, batches of {args.batch}, {args.redis}")
    print(f"{'case':<28}{'publish ev/s':>14}{'consume ev/s':>14}")
    cases = (("PromptIssued", "prompts", small), ("Segment 512 tokens", "trajectories", heavy))
    figures = []
    for label, stream, make in cases:
        events = [make(i) for i in range(args.events)]
        run = f"bench-{uuid.uuid4().hex[:8]}"
        bus = Bus(client, run, BusSettings(reclaim_idle_ms=600_000))
        # Raw redis-py gets the same bytes, encoded ahead of time: the difference is the bus's own work.
        fields = [encode(make_envelope(e, run_id=run)) for e in events]
        try:
            bus_pub, bus_con = bench_bus(bus, stream, events, args.batch)
            raw_pub, raw_con = bench_raw(client, f"{bus.keys.prefix}:raw", fields, args.batch)
        finally:
            bus.delete_run()
        print(f"{label + ' (bus)':<28}{bus_pub:>14,.0f}{bus_con:>14,.0f}")
        print(f"{label + ' (raw redis-py)':<28}{raw_pub:>14,.0f}{raw_con:>14,.0f}")
        print(f"{label + ' bus/raw':<28}{bus_pub / raw_pub:>14.2f}{bus_con / raw_con:>14.2f}")
        figures += [Figure(f"{label}: Bus.publish", bus_pub, "raw XADD", raw_pub, "events/s"),
                    Figure(f"{label}: Bus.consume + ack", bus_con, "raw XREADGROUP + XACK", raw_con,
                           "events/s")]
    write_result(args.json, figures, [f"{args.events} events per case, batches of {args.batch}"])


if __name__ == "__main__":
    main()

"""CPU time of the Redis round trip that opens every gateway turn (its session, the fleet's versions and the
turns its history holds: three commands in one pipeline) through the session store's client
(shared/contract/redis_round_trips.py: hiredis, on connections of its own) against redis-py's asyncio
pipeline on connect_async_redis's client, which the store used before; and the same bytes written and read
bare on an asyncio stream, the least any client spends.

The three run in turns, --repeats times, each for --round-trips round trips one after another on uvloop's
event loop, as the gateway runs them; a figure is the median of the runs' CPU time (time.process_time) per
round trip.

    python bench/bench_redis_round_trips.py [--redis redis://127.0.0.1:6379/0] [--round-trips 5000]
        [--repeats 5] [--json PATH] [--smoke]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
import uuid
from collections.abc import Awaitable, Callable

import hiredis
import uvloop
from results import Figure, parse_args, write_result

from rollstream.shared.contract.bus import connect_async_redis
from rollstream.shared.contract.redis_round_trips import (
    HiredisRoundTrips,
    PipelineRoundTrips,
    connect_round_trips,
)

NODE = json.dumps({"appended_ids": list(range(200)), "response_ids": list(range(64)),
                   "logprobs": [-0.5] * 64}).encode()
SPEC = json.dumps({"rollout_id": "r" * 32, "group_id": "g" * 32, "metadata": {"task": "t" * 64},
                   "sampling": {"temperature": 1.0, "max_tokens": 512}}).encode()


def turn_read(prefix: str) -> list[tuple]:
    """A turn's first round trip: HGETALL of the session and of the fleet's versions, HMGET of two nodes."""
    return [("HGETALL", f"{prefix}:session"), ("HGETALL", f"{prefix}:versions"),
            ("HMGET", f"{prefix}:nodes", "a", "b")]


async def seed(prefix: str, round_trips: HiredisRoundTrips) -> None:
    await round_trips.run(
        ("HSET", f"{prefix}:session", "spec", SPEC, "key_digest", "d" * 64, "status", "open",
         "created_at", repr(time.time()), "turns", 3),
        ("HSET", f"{prefix}:versions", "http://127.0.0.1:8000", 7),
        ("HSET", f"{prefix}:nodes", "a", NODE, "b", NODE))


RoundTrip = Callable[[], Awaitable]


async def bare_stream(host: str, port: int, commands: list[tuple]) -> tuple[RoundTrip, Callable]:
    """A round trip written and read bare: one connection, hiredis, nothing else."""
    reader, writer = await asyncio.open_connection(host, port)
    parser = hiredis.Reader()
    payload = b"".join(hiredis.pack_command(command) for command in commands)

    async def round_trip() -> list:
        writer.write(payload)
        replies: list = []
        while len(replies) < len(commands):
            reply = parser.gets()
            if reply is False:
                parser.feed(await reader.read(65536))
            else:
                replies.append(reply)
        return replies

    return round_trip, writer.close


async def cpu_us(round_trip: RoundTrip, count: int) -> float:
    started = time.process_time()
    for _ in range(count):
        await round_trip()
    return (time.process_time() - started) / count * 1e6


async def measure(url: str, count: int, repeats: int) -> dict[str, list[float]]:
    prefix = f"rs-bench:{uuid.uuid4().hex[:8]}"
    commands = turn_read(prefix)
    ours = connect_round_trips(url)
    if not isinstance(ours, HiredisRoundTrips):
        raise SystemExit(f"{url} is not a plain redis:// URL: the session store would use redis-py's "
                         "pipeline there")
    theirs = PipelineRoundTrips(connect_async_redis(url))
    await seed(prefix, ours)
    bare, close_bare = await bare_stream(ours.host, ours.port, commands)
    ways = {"store": lambda: ours.run(*commands), "redis-py": lambda: theirs.run(*commands),
            "bare": bare}
    runs: dict[str, list[float]] = {name: [] for name in ways}
    try:
        for way in ways.values():  # connections opened, code paths warm
            for _ in range(max(count // 10, 10)):
                await way()
        for _ in range(repeats):
            for name, way in ways.items():
                runs[name].append(await cpu_us(way, count))
            print("  ".join(f"{name} {runs[name][-1]:.1f} us" for name in ways))
    finally:
        await ours.run(("DEL", *(f"{prefix}:{key}" for key in ("session", "versions", "nodes"))))
        close_bare()
        await ours.aclose()
        await theirs.aclose()
    return runs


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--redis", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--round-trips", type=int, default=5000, help="round trips per run")
    parser.add_argument("--repeats", type=int, default=5, help="runs of each; figures are their medians")
    args = parse_args(parser, smoke={"round_trips": 200, "repeats": 2})
    print(f"{args.round_trips} round trips a run, {args.repeats} runs each, {args.redis}")
    runs = uvloop.run(measure(args.redis, args.round_trips, args.repeats))
    figures = [
        Figure.repeated("session store (hiredis): CPU per turn-read round trip", runs["store"],
                        "redis-py's asyncio pipeline, same commands", runs["redis-py"], "us"),
        Figure.repeated("session store (hiredis): CPU per turn-read round trip", runs["store"],
                        "the same bytes bare on an asyncio stream", runs["bare"], "us"),
    ]
    for figure in figures:
        print(f"{figure.what} against {figure.baseline_what}: {figure.value:.1f} / {figure.baseline:.1f} us "
              f"= {figure.ratio:.2f}")
    write_result(args.json, figures, [f"{args.round_trips} round trips a run, median of {args.repeats} runs"])


if __name__ == "__main__":
    main()

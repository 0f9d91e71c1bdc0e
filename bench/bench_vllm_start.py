"""vLLM's CPU build: a server's start and its decode rate with vLLM's compilation and with `--enforce-eager`.

Starts a server of the tiny model each way, alternately (`--rounds` times), with vLLM's compile cache warm
from a first compiled start as on any start after a machine's first; measures the seconds from the process's
start to /health answering, then the seconds 64 concurrent completions of 64 sampled tokens take. Prints the
medians and eager's ratio to compiled, measured in the same run. VllmServer passes `--enforce-eager` on the
CPU build: this is the measurement behind that choice.

    python bench/bench_vllm_start.py [--model models/tiny-llama] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from rollstream.cli.vllm_server import VllmServer, free_port

REQUESTS = 64
TOKENS = 64


async def decode_seconds(url: str) -> float:
    async with httpx.AsyncClient(timeout=300) as client:
        async def complete(index: int) -> None:
            response = await client.post(f"{url}/v1/completions", json={
                "model": "tiny", "prompt": f"{index} + {index} =", "max_tokens": TOKENS, "temperature": 1.0,
                "ignore_eos": True})
            response.raise_for_status()

        await complete(-1)  # the first request's one-off costs are no part of the rate
        started = time.perf_counter()
        await asyncio.gather(*(complete(index) for index in range(REQUESTS)))
        return time.perf_counter() - started


def measure(model: Path, log_dir: Path, compilation: tuple[str, ...]) -> tuple[float, float]:
    """(seconds to healthy, seconds for the decode load) of one server started with these arguments."""
    server = VllmServer(model, free_port(), log_path=log_dir / "vllm.log", extra_args=compilation)
    started = time.perf_counter()
    with server:
        server.wait_healthy()
        healthy = time.perf_counter() - started
        return healthy, asyncio.run(decode_seconds(server.url))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=Path("models/tiny-llama"))
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    ways = {"compiled": ("-O2",), "eager": ("--enforce-eager",)}
    with tempfile.TemporaryDirectory() as tmp:
        measure(args.model, Path(tmp), ways["compiled"])  # fills vLLM's compile cache
        seen: dict[str, list[tuple[float, float]]] = {way: [] for way in ways}
        for _ in range(args.rounds):
            for way, compilation in ways.items():
                seen[way].append(measure(args.model, Path(tmp), compilation))
    medians = {way: tuple(statistics.median(values) for values in zip(*runs)) for way, runs in seen.items()}
    for way, (healthy, decode) in medians.items():
        print(f"{way:9s} start to healthy {healthy:6.1f} s   {REQUESTS}x{TOKENS} tokens {decode:5.2f} s")
    (start_c, decode_c), (start_e, decode_e) = medians["compiled"], medians["eager"]
    print(f"eager / compiled: start {start_e / start_c:.2f}x, decode time {decode_e / decode_c:.2f}x")


if __name__ == "__main__":
    main()

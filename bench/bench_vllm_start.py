"""vLLM's CPU build: a server's start and its decode rate with vLLM's compilation and with `--enforce-eager`.

Starts a server of the tiny model each way, alternately (`--rounds` times), with vLLM's compile cache warm
from a first compiled start as on any start after a machine's first; measures the seconds from the process's
start to /health answering, then the seconds --requests (64) concurrent completions of --tokens (64) sampled
tokens take. Prints the medians and eager's ratio to compiled, measured in the same run. VllmServer passes
`--enforce-eager` on the CPU build: this is the measurement behind that choice.

    python bench/bench_vllm_start.py [--model models/tiny-llama] [--rounds 2] [--requests 64] [--tokens 64]
                                     [--no-cache-fill] [--smoke] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import httpx
from results import Figure, parse_args, write_result

from rollstream.cli.vllm_server import VllmServer, free_port


async def decode_seconds(url: str, requests: int, tokens: int) -> float:
    async with httpx.AsyncClient(timeout=300) as client:
        async def complete(index: int) -> None:
            response = await client.post(f"{url}/v1/completions", json={
                "model": "tiny", "prompt": f"{index} + {index} =", "max_tokens": tokens, "temperature": 1.0,
                "ignore_eos": True})
            response.raise_for_status()

        await complete(-1)  # the first request's one-off costs are no part of the rate
        started = time.perf_counter()
        await asyncio.gather(*(complete(index) for index in range(requests)))
        return time.perf_counter() - started


def measure(model: Path, log_dir: Path, compilation: tuple[str, ...],
            load: tuple[int, int]) -> tuple[float, float]:
    """(seconds to healthy, seconds for the decode load) of one server started with these arguments."""
    server = VllmServer(model, free_port(), log_path=log_dir / "vllm.log", extra_args=compilation)
    started = time.perf_counter()
    with server:
        server.wait_healthy()
        healthy = time.perf_counter() - started
        return healthy, asyncio.run(decode_seconds(server.url, *load))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=Path("models/tiny-llama"))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--requests", type=int, default=64, help="concurrent completions of the decode load")
    parser.add_argument("--tokens", type=int, default=64, help="sampled tokens of each")
    parser.add_argument("--no-cache-fill", dest="cache_fill", action="store_false",
                        help="no untimed compiled start first (the first timed one fills the cache)")
    args = parse_args(parser, smoke={"rounds": 1, "requests": 4, "tokens": 8, "cache_fill": False})
    ways = {"compiled": ("-O2",), "eager": ("--enforce-eager",)}
    load = (args.requests, args.tokens)
    with tempfile.TemporaryDirectory() as tmp:
        if args.cache_fill:
            measure(args.model, Path(tmp), ways["compiled"], load)  # fills vLLM's compile cache
        seen: dict[str, list[tuple[float, float]]] = {way: [] for way in ways}
        for _ in range(args.rounds):
            for way, compilation in ways.items():
                seen[way].append(measure(args.model, Path(tmp), compilation, load))
    medians = {way: tuple(statistics.median(values) for values in zip(*runs)) for way, runs in seen.items()}
    for way, (healthy, decode) in medians.items():
        print(f"{way:9s} start to healthy {healthy:6.1f} s   {args.requests}x{args.tokens} tokens "
              f"{decode:5.2f} s")
    (start_c, decode_c), (start_e, decode_e) = medians["compiled"], medians["eager"]
    print(f"eager / compiled: start {start_e / start_c:.2f}x, decode time {decode_e / decode_c:.2f}x")
    write_result(args.json, [
        Figure("--enforce-eager: start to healthy", start_e, "compiled (-O2)", start_c, "s"),
        Figure(f"--enforce-eager: {args.requests} concurrent completions of {args.tokens} tokens", decode_e,
               "compiled (-O2)", decode_c, "s")],
        [f"medians of {args.rounds} alternating starts each"
         + (", vLLM's compile cache filled by an untimed compiled start first" if args.cache_fill else "")])


if __name__ == "__main__":
    main()

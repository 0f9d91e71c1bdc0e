"""A weight sync of the whole fleet: every server reloads a checkpoint and is probed for logprob parity, a
bounded number at once.

Each server is paused only while it loads (FleetClient.reload_weights keeps its in-flight requests and
resumes it), so the fleet goes on generating on the servers not loading right now; with every server synced
one after another, a sync took N times one server's reload and probe (bench/bench_weight_sync.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from rollstream.shared.inference.fleet import FleetClient


async def sync_weights(fleet: FleetClient, weights_dir: str, probe: Sequence[int], expected: Sequence[float],
                       concurrency: int) -> dict[str, float]:
    """Reload `weights_dir` on every server of the fleet, `concurrency` at a time, and probe each: its prompt
    logprobs of `probe` against `expected`. Returns each server's largest absolute difference. The first
    server's failure (WeightSyncError, FleetRequestError) is raised once every server's sync has ended."""
    at_once = asyncio.Semaphore(concurrency)

    async def sync_server(url: str) -> float:
        async with at_once:
            await fleet.reload_weights(url, weights_dir)
            served = await fleet.prompt_logprobs(url, list(probe))
        return max(abs(a - b) for a, b in zip(served, expected, strict=True))

    results = await asyncio.gather(*(sync_server(url) for url in fleet.urls), return_exceptions=True)
    failed = next((result for result in results if isinstance(result, BaseException)), None)
    if failed is not None:
        raise failed
    return dict(zip(fleet.urls, results, strict=True))

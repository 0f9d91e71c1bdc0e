"""A weight sync of the whole fleet: every server made to serve a new version by the run's transport
(weight_transport.py: a disk reload, a bounded number at once, or a collective broadcast to all at once), then
probed for logprob parity.

With the disk transport each server is paused only while it loads (FleetClient.reload_weights keeps its
in-flight requests and resumes it), so the fleet goes on generating on the servers not loading right now; a
collective broadcast pauses every server for the one transfer (bench/bench_weight_transport.py measures both).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from rollstream.shared.inference.fleet import FleetClient
from rollstream.shared.inference.weight_transport import PushReport, WeightTransport, WeightUpdate


async def sync_weights(fleet: FleetClient, transport: WeightTransport, update: WeightUpdate,
                       probe: Sequence[int], expected: Sequence[float],
                       urls: Sequence[str] | None = None) -> tuple[dict[str, float], PushReport]:
    """Push `update` to every server of the fleet (or `urls`) and probe each that loaded it: its prompt
    logprobs of `probe` against `expected`. Returns the largest absolute difference of each server that
    loaded it and was probed, and what the push did; a server that failed either is in the report's failures
    (WeightSyncError, FleetRequestError), not in the differences."""
    urls = list(fleet.urls if urls is None else urls)
    report = await transport.push(fleet, urls, update)

    async def probe_server(url: str) -> float:
        served = await fleet.prompt_logprobs(url, list(probe))
        return max(abs(a - b) for a, b in zip(served, expected, strict=True))

    loaded = report.loaded
    results = await asyncio.gather(*(probe_server(url) for url in loaded), return_exceptions=True)
    diffs = {}
    for url, result in zip(loaded, results, strict=True):
        if isinstance(result, BaseException):
            report.failures[url] = result
        else:
            diffs[url] = result
    return diffs, report

"""The fleet as the leading trainer rank syncs it (services/trainer/training.py): every policy server made
to serve a new checkpoint, and checked to serve the trainer's logprobs.

FleetSync.sync waits for every server to answer (one restarting is waited for, up to FLEET_WAIT_S), tries
a failed sync again for SYNC_RETRY_S (a server shutting down refuses /pause before it stops answering),
reloads every server, train.sync_concurrency at a time, and raises ParityError (a StopConsuming for
main.py) when one serves other logprobs of the probe than the trainer computed. One event loop serves the
fleet client for the trainer's life: its connections belong to it.

Tests: tests/integration/test_trainer_restart.py runs the trainer service against real vLLM servers.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

from rollstream.shared.contract.bus import StopConsuming
from rollstream.shared.errors import RollstreamError
from rollstream.shared.runtime.config import Settings

log = logging.getLogger("trainer")

SYNC_RETRY_S = 120.0
"""How long a weight sync that fails is tried again (with back-off) before the trainer stops: long
enough to outlast a vLLM server's graceful shutdown (it answers /health but refuses /pause for up to its
grace period, then stops answering and is waited for as restarting)."""
SYNC_BACKOFF_MAX_S = 10.0
FLEET_WAIT_S = 600.0
FLEET_RECHECK_S = 2.0


class ParityError(RollstreamError, RuntimeError):
    """A server's logprobs after a weight sync do not match the trainer's."""


class FleetSync:
    """The run's policy servers (settings.policy_servers()), synced by the leading rank alone."""

    def __init__(self, settings: Settings) -> None:
        from rollstream.shared.inference.fleet import FleetClient

        self.settings = settings
        self.loop = asyncio.Runner()
        self.fleet = FleetClient.for_run(settings)

    @property
    def urls(self) -> list[str]:
        return self.fleet.urls

    def sync(self, version: int, checkpoint: Path, probe: list[int], expected: list[float]) -> float:
        """Make every server serve the checkpoint of `version`; returns the worst logprob difference. The
        fleet must serve a policy before the next one is trained, so a sync that keeps failing stops the
        trainer (the batch stays pending)."""
        from rollstream.shared.inference.fleet import FleetRequestError, WeightSyncError

        deadline, attempt = time.monotonic() + SYNC_RETRY_S, 0
        while True:
            attempt += 1
            self.wait_for_fleet()
            try:
                return self.loop.run(self.reload(checkpoint, probe, expected))
            except (WeightSyncError, FleetRequestError, OSError) as exc:
                if time.monotonic() >= deadline:
                    raise StopConsuming(f"weight sync of v{version} failed {attempt} times in "
                                        f"{SYNC_RETRY_S:.0f}s: {exc}") from exc
                log.warning("weight sync failed; retrying", extra={"attempt": attempt, "error": str(exc)})
                time.sleep(min(2 ** attempt, SYNC_BACKOFF_MAX_S))
            except ParityError as exc:
                raise StopConsuming(str(exc)) from exc

    def wait_for_fleet(self) -> None:
        """Until every server answers /health: a restarting vLLM server (a minute on the CPU) is waited for,
        not counted as a failed sync. StopConsuming when one has not answered for FLEET_WAIT_S."""
        deadline, waiting = time.monotonic() + FLEET_WAIT_S, False
        while True:
            answers = self.loop.run(self._health())
            down = [url for url, healthy in zip(self.fleet.urls, answers) if not healthy]
            if not down:
                if waiting:
                    log.info("every fleet server answers again")
                return
            if time.monotonic() > deadline:
                raise StopConsuming(f"fleet servers not answering for {FLEET_WAIT_S:.0f}s: {', '.join(down)}")
            if not waiting:
                log.warning("waiting for fleet servers to answer before the weight sync",
                            extra={"servers": down})
                waiting = True
            time.sleep(FLEET_RECHECK_S)

    async def _health(self) -> list[bool]:
        return list(await asyncio.gather(*(self.fleet.health(url) for url in self.fleet.urls)))

    async def reload(self, checkpoint: Path, probe: list[int], expected: list[float]) -> float:
        """Reload every server, train.sync_concurrency at a time, and check its probe logprobs; returns the
        worst difference. Servers off parity fail the sync with a ParityError naming each."""
        from rollstream.shared.inference.weight_sync import sync_weights

        diffs = await sync_weights(self.fleet, str(checkpoint), probe, expected,
                                   self.settings.train.sync_concurrency)
        tolerance = self.settings.train.parity_tolerance
        off = [f"{url}: {diff:.2e}" for url, diff in diffs.items() if diff > tolerance]
        if off:
            raise ParityError(f"prompt logprobs differ from the trainer's after loading {checkpoint} "
                              f"(tolerance {tolerance:g}): {'; '.join(off)}")
        return max(diffs.values(), default=0.0)

    def close(self) -> None:
        self.loop.run(self.fleet.aclose())
        self.loop.close()

"""The fleet as the leading trainer rank syncs it (services/trainer/training.py): every policy server made
to serve a new version, and checked to serve the trainer's logprobs.

FleetSync.sync waits for every server to answer (one restarting is waited for, up to FLEET_WAIT_S): the
servers of fleet.urls and the policy groups and, with fleet.registry, those registered at that moment
(shared/inference/fleet_registry.py), so that a server that joined since the last version takes this one (a
collective sync forms its group anew and sends it the whole model) and one that left is not waited for. It
tries a failed sync again for SYNC_RETRY_S (a server shutting down refuses /pause before it stops answering),
pushes the version with the run's transport (train.weight_transport: a collective broadcast, or every server
reloading the checkpoint, train.sync_concurrency at a time; shared/inference/weight_transport.py), or in a
LoRA run loads each role's adapter (sync_adapters: shared/inference/adapter_sync.py), and raises
ParityError (a StopConsuming for main.py) when one serves other logprobs of the probe than the trainer
computed. One event loop serves the fleet client and the transport for the trainer's life: its connections
belong to it.

Tests: tests/integration/test_trainer_restart.py runs the trainer service against real vLLM servers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING

from prometheus_client import Counter

from rollstream.shared.contract.bus import StopConsuming
from rollstream.shared.errors import RollstreamError
from rollstream.shared.runtime.config import Settings

if TYPE_CHECKING:
    from rollstream.shared.inference.adapter_sync import AdapterSyncReport, AdapterUpdate
    from rollstream.shared.inference.weight_transport import PushReport, WeightTransport, WeightUpdate

log = logging.getLogger("trainer")

SYNC_RETRY_S = 120.0
"""How long a weight sync that fails is tried again (with back-off) before the trainer stops: long
enough to outlast a vLLM server's graceful shutdown (it answers /health but refuses /pause for up to its
grace period, then stops answering and is waited for as restarting)."""
SYNC_BACKOFF_MAX_S = 10.0
FLEET_WAIT_S = 600.0
FLEET_RECHECK_S = 2.0


Synced = tuple[float, list[str]]
"""What a sync returns: the largest probe difference, and the servers that serve what it synced."""

DROPPED = Counter("rollstream_trainer_sync_servers_left_out_total",
                  "Policy servers a weight sync left out: not answering, or failing their part; each serves "
                  "the run's versions again from the next sync it takes.")


class ParityError(RollstreamError, RuntimeError):
    """A server's logprobs after a weight sync do not match the trainer's."""


class FleetSync:
    """The run's policy servers (listed in the settings, and with fleet.registry those registered), synced by
    the leading rank alone."""

    def __init__(self, settings: Settings) -> None:
        from rollstream.shared.inference.fleet import FleetClient

        self.settings = settings
        self.loop = asyncio.Runner()
        self.fleet = FleetClient.for_run(settings)
        self.transport = make_transport(settings)
        self.last_push: PushReport | None = None
        self.last_adapter_sync: AdapterSyncReport | None = None

    def resume_left_paused(self) -> None:
        """A trainer killed in the middle of a disk sync leaves servers paused: the one that takes over
        resumes them (they go on serving the version they hold, which FLEET_VERSIONS says; a reload that
        failed half way stopped its server)."""
        from rollstream.shared.inference.fleet import WeightSyncError

        async def resume() -> None:
            for url in self.fleet.urls:
                with contextlib.suppress(WeightSyncError):
                    await self.fleet.weight_step(url, "resume", "/resume")

        self.loop.run(resume())

    @property
    def urls(self) -> list[str]:
        return self.fleet.urls

    def sync(self, update: WeightUpdate, probe: list[int], expected: list[float]) -> tuple[float, list[str]]:
        """Make every answering server serve `update`; returns the worst logprob difference and the servers
        that serve it. A server that does not answer, or fails its part, is left out of this version (it
        rejoins at the next sync it answers); the fleet must serve a policy before the next one is trained, so
        a sync no server takes stops the trainer once it kept failing (the batch stays pending)."""
        return self.with_retries(f"v{update.version}",
                                 lambda answering: self.push(update, probe, expected, answering))

    def sync_adapters(self, updates: list[AdapterUpdate]) -> tuple[float, list[str]]:
        """Make every answering server serve each role's adapter at its version (a LoRA run: the base model
        never moves); as sync(), with the same retries and the same leaving out of servers that fail."""
        what = ", ".join(f"{u.role} v{u.version}" for u in updates)
        return self.with_retries(what, lambda answering: self.push_adapters(updates, answering))

    def with_retries(self, what: str, push: Callable[[list[str]], Awaitable[Synced]]) -> Synced:
        """`push` to the answering servers, tried again for SYNC_RETRY_S while it fails; StopConsuming once it
        kept failing, or at once for a ParityError."""
        from rollstream.shared.inference.fleet import FleetRequestError, WeightSyncError

        deadline, attempt = time.monotonic() + SYNC_RETRY_S, 0
        while True:
            attempt += 1
            answering = self.wait_for_fleet()
            try:
                return self.loop.run(push(answering))
            except (WeightSyncError, FleetRequestError, OSError) as exc:
                if time.monotonic() >= deadline:
                    raise StopConsuming(f"weight sync of {what} failed {attempt} times in "
                                        f"{SYNC_RETRY_S:.0f}s: {exc}") from exc
                log.warning("weight sync failed; retrying", extra={"attempt": attempt, "error": str(exc)})
                time.sleep(min(2 ** attempt, SYNC_BACKOFF_MAX_S))
            except ParityError as exc:
                raise StopConsuming(str(exc)) from exc

    def wait_for_fleet(self) -> list[str]:
        """The servers answering /health, once one does: a fleet that is all restarting (a minute on the CPU)
        is waited for, not counted as a failed sync. StopConsuming when none has answered for FLEET_WAIT_S."""
        deadline, waiting = time.monotonic() + FLEET_WAIT_S, False
        while True:
            up = self.loop.run(self._answering())
            if up:
                if waiting:
                    log.info("fleet servers answer again", extra={"servers": up})
                return up
            if time.monotonic() > deadline:
                raise StopConsuming(f"no fleet server has answered for {FLEET_WAIT_S:.0f}s: "
                                    f"{', '.join(self.fleet.urls) or 'none is listed or registered'}")
            if not waiting:
                log.warning("waiting for a fleet server to answer before the weight sync",
                            extra={"servers": self.fleet.urls})
                waiting = True
            time.sleep(FLEET_RECHECK_S)

    async def _answering(self) -> list[str]:
        """The fleet's servers that answer /health now; the registry is read first (refresh_members)."""
        urls = await self.fleet.refresh_members()
        answers = await asyncio.gather(*(self.fleet.health(url) for url in urls))
        return [url for url, healthy in zip(urls, answers, strict=True) if healthy]

    async def push(self, update: WeightUpdate, probe: list[int], expected: list[float],
                   urls: list[str]) -> tuple[float, list[str]]:
        """Push the version to `urls` and check their probe logprobs; returns the worst difference and the
        servers that serve it. Servers off parity fail the sync with a ParityError naming each; when no server
        took the version, the first one's failure is raised."""
        from rollstream.shared.inference.weight_sync import sync_weights

        diffs, self.last_push = await sync_weights(self.fleet, self.transport, update, probe, expected, urls)
        failures = {url: failure for url, failure in self.last_push.failures.items() if failure}
        if not diffs:
            raise next(iter(failures.values()))
        self.leave_out(f"v{update.version}", failures, urls)
        off = self.off_parity(diffs)
        if off:
            self.transport.close()  # what the servers hold is not what a delta would be made against
            tolerance = self.settings.train.parity_tolerance
            raise ParityError(f"prompt logprobs differ from the trainer's after v{update.version} "
                              f"({self.last_push.kind} sync, tolerance {tolerance:g}): {'; '.join(off)}")
        return max(diffs.values()), list(diffs)

    async def push_adapters(self, updates: list[AdapterUpdate], urls: list[str]) -> tuple[float, list[str]]:
        """Load the adapters each of `urls` does not serve at their version, and check their probes; returns
        the worst difference (0.0 when no server needed any) and the servers that serve every adapter."""
        from rollstream.shared.inference.adapter_sync import sync_adapters

        report = await sync_adapters(self.fleet, urls, updates, self.settings.train.sync_concurrency)
        self.last_adapter_sync = report
        if not report.serving:
            raise next(iter(report.failures.values()))
        what = ", ".join(f"{u.role} v{u.version}" for u in updates)
        self.leave_out(what, report.failures, urls)
        off = self.off_parity(report.diffs)
        if off:
            raise ParityError(f"prompt logprobs differ from the trainer's after loading the adapters {what} "
                              f"(tolerance {self.settings.train.parity_tolerance:g}): {'; '.join(off)}")
        return max(report.diffs.values(), default=0.0), report.serving

    def leave_out(self, what: str, failures: Mapping[str, BaseException], answering: list[str]) -> None:
        """Count and log the servers a sync of `what` left out: failed, or not answering."""
        left_out = {url: str(failure) for url, failure in failures.items()}
        left_out.update((url, "not answering") for url in self.fleet.urls if url not in answering)
        if left_out:
            DROPPED.inc(len(left_out))
            log.warning("servers left out of a weight sync: they serve the version once they answer a sync",
                        extra={"version": what, "servers": left_out})

    def off_parity(self, diffs: Mapping[str, float]) -> list[str]:
        """The servers whose probe differs from the trainer's by more than train.parity_tolerance."""
        tolerance = self.settings.train.parity_tolerance
        return [f"{url}: {diff:.2e}" for url, diff in diffs.items() if diff > tolerance]

    def close(self) -> None:
        self.transport.close()
        self.loop.run(self.fleet.aclose())
        self.loop.close()


def make_transport(settings: Settings) -> WeightTransport:
    """The run's weight transport (train.weight_transport)."""
    from rollstream.shared.inference.weight_transport import CollectiveTransport, DiskTransport
    from rollstream.shared.runtime.network import host_address

    train = settings.train
    if train.weight_transport == "disk":
        return DiskTransport(train.sync_concurrency)
    communication = train.sync_communication
    if communication == "auto":
        import torch

        communication = "nccl" if torch.cuda.is_available() else "gloo"
    return CollectiveTransport(communication, train.sync_address or host_address(),
                               delta=train.weight_delta, bucket_bytes=train.sync_bucket_mb << 20,
                               timeout_s=train.sync_timeout_s)

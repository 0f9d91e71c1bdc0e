"""A weight sync of LoRA adapters (train.lora_rank > 0): each server loads in place the adapters whose version
it does not serve yet, from the directories the trainer wrote (peft's adapter_config.json and
adapter_model.safetensors, megabytes where the model is gigabytes), then each adapter it loaded is probed for
logprob parity under its own name. The base model never moves: the servers started with it.

vLLM loads an adapter between two engine steps, without a pause: a turn under way goes on with the new adapter
from its next token, which its policy_version_end records (the agent loop reads the version after the turn).

Library module; the integration test runs it on real vLLM CPU servers holding two adapters:
    python -m pytest tests/integration/test_adapter_sync.py -q
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from rollstream.shared.inference.fleet import FleetClient

ADAPTER_WEIGHTS = "adapter_model.safetensors"


def adapter_dir(run_dir: Path, role: str, version: int) -> Path:
    """Where the trainer writes the role's adapter at a version of it, for the servers to load: a directory of
    its own per version (served_adapters tells a server's version by it)."""
    return run_dir / "adapters" / role / f"v{version:05d}"


def newest_adapters(run_dir: Path, roles: Sequence[str],
                    published: Mapping[str, int] | None = None) -> dict[str, tuple[Path, int]]:
    """Each role's newest adapter written to the run's storage, of a version no newer than `published`'s (the
    roles' versions the trainer published last; None: any): role -> (directory, version). A role with none
    yet (a run before its trainer started) is left out. The trainer writes a version before its sync, so the
    newest on disk may be one it never published."""
    found = {}
    for role in roles:
        newest = None if published is None else published.get(role, 0)
        versions = sorted((int(path.name[1:]), path) for path in (run_dir / "adapters" / role).glob("v*")
                          if path.name[1:].isdigit() and (path / ADAPTER_WEIGHTS).is_file()
                          and (newest is None or int(path.name[1:]) <= newest))
        if versions:
            version, path = versions[-1]
            found[role] = (path, version)
    return found


@dataclasses.dataclass(frozen=True)
class AdapterUpdate:
    """One role's adapter at one version, as the trainer hands it to the fleet."""

    role: str
    """The adapter's name on the servers (the role's)."""
    version: int
    path: Path
    """The adapter's directory (a path every server reads: the run's storage)."""
    probe: tuple[int, ...]
    """Token ids the server's logprobs under this adapter are checked on."""
    expected: tuple[float, ...]
    """The trainer's logprobs of the probe with this adapter."""

    @property
    def size(self) -> int:
        return (self.path / ADAPTER_WEIGHTS).stat().st_size


@dataclasses.dataclass
class AdapterSyncReport:
    """What a sync did: the servers that serve every update now, each server's failure, the largest probe
    difference of each server that loaded adapters (a server that needed none is not probed again), which it
    loaded, and the adapter bytes loaded."""

    serving: list[str]
    failures: dict[str, BaseException]
    diffs: dict[str, float]
    loaded: dict[str, list[str]]
    bytes_sent: int
    seconds: float


async def sync_adapters(fleet: FleetClient, urls: Sequence[str], updates: Sequence[AdapterUpdate],
                        concurrency: int = 16) -> AdapterSyncReport:
    """Make each of `urls` serve every update: a server loads those it does not serve from their directory
    (FleetClient.served_adapters), then each adapter it loaded is probed under its name. Never raises for one
    server's failure: it is reported."""
    started = time.monotonic()
    at_once = asyncio.Semaphore(concurrency)

    async def sync_server(url: str) -> tuple[list[AdapterUpdate], float]:
        async with at_once:
            served = await fleet.served_adapters(url)
            wanted = [u for u in updates if served.get(u.role) != str(u.path)]
            for update in wanted:
                await fleet.load_adapter(url, update.role, str(update.path))
        worst = 0.0
        for update in wanted:
            logprobs = await fleet.prompt_logprobs(url, list(update.probe), model=update.role)
            worst = max(worst, *(abs(a - b) for a, b in zip(logprobs, update.expected, strict=True)))
        return wanted, worst

    results = await asyncio.gather(*(sync_server(url) for url in urls), return_exceptions=True)
    report = AdapterSyncReport(serving=[], failures={}, diffs={}, loaded={}, bytes_sent=0, seconds=0.0)
    for url, result in zip(urls, results, strict=True):
        if isinstance(result, BaseException):
            report.failures[url] = result
            continue
        report.serving.append(url)
        wanted, worst = result
        if wanted:
            report.diffs[url] = worst
            report.loaded[url] = [u.role for u in wanted]
            report.bytes_sent += sum(u.size for u in wanted)
    report.seconds = time.monotonic() - started
    return report

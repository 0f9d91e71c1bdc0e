"""How the trainer of a LoRA run (train.lora_rank > 0) makes the fleet serve its roles' adapters
(services/trainer/training.py, whose Trainer this part is of).

Each version of a role's adapter is written, once trained, where the servers load it from
(services/trainer/role_versions.py: `<storage>/<run>/adapters/<role>/v<role version>/`); every role's current
one at the trainer's start too. After each step every adapter role goes to FleetSync.sync_adapters at its
current version, with its probe and the trainer's logprobs of it with that role's adapter: each server loads
those whose directory it does not serve (a role the step did not train keeps its directory, and the servers
their copy of it) and is checked for parity under each role's name. At the start the same sync of every
role's adapter makes the fleet serve them. FLEET_VERSIONS records, for each serving server, the trainer's
version under its URL and each adapter's version under `<role>@<url>`.

Tests: tests/unit/services/trainer/test_lora_trainer.py; tests/integration/test_lora_trainer.py (a real vLLM
server).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from rollstream.services.trainer.publishing import TrainedStep, record_fleet_versions
from rollstream.services.trainer.role_versions import AdapterStates, adapter_dir, publish_adapter

if TYPE_CHECKING:
    from rollstream.shared.inference.adapter_sync import AdapterUpdate


class AdapterFleet:
    """The LoRA part of the Trainer: its adapters written for the servers, and synced to them."""

    def start_adapters(self) -> None:
        """Every role's current adapter written for the servers and, with a fleet, served by it (every rank
        takes part: ZeRO-3 gathers the adapters)."""
        from rollstream.services.trainer.fleet_sync import FleetSync
        from rollstream.shared.contract.run_facts import FLEET_VERSIONS

        with_fleet = self.settings.fleet.has_policy_servers
        expected = self.adapters_logprobs() if with_fleet else {}
        self.write_adapters(self.adapter_states(self.roles.adapters), self.role_versions)
        if not (with_fleet and self.ranks.leader):
            return
        bus = self.bus
        assert bus is not None, "the leading rank publishes: it needs the bus"
        self.fleet = FleetSync(self.settings)
        for url in self.fleet.urls:
            bus.redis.hsetnx(FLEET_VERSIONS.key(bus.keys), url, self.version)
        _, servers = self.fleet.sync_adapters(self.adapter_updates(self.role_versions, self.probes, expected))
        record_fleet_versions(bus.redis, bus, servers, self.version, self.role_versions, self.roles.adapters)

    def adapters_logprobs(self) -> dict[str, list[float]]:
        """The trainer's logprobs of each role's probe with the role's adapter (every rank takes part)."""
        expected = {}
        for role in self.roles.adapters:
            self.backend.use_role(role)
            expected[role] = self.trainer_logprobs(self.probes[role])
        return expected

    def adapter_states(self, roles) -> AdapterStates:
        """The roles' adapter tensors, on the leading rank (every rank takes part)."""
        states = {role: self.backend.adapter_state(role) for role in roles}
        return {role: state for role, state in states.items() if state is not None}

    def write_adapters(self, states: AdapterStates, role_versions: dict[str, int]) -> None:
        """Write each adapter of `states` at its role's version where the servers load it (the leader)."""
        from rollstream.services.trainer.backends.lora import write_adapter

        if not self.ranks.leader:
            return
        model = self.backend.adapters.model
        for role, state in states.items():
            def write(directory, role=role, state=state) -> None:
                write_adapter(model, role, state, directory)

            publish_adapter(self.storage, self.settings.run_id, role, role_versions[role], write)

    def adapter_updates(self, role_versions: dict[str, int], probes: dict[str, list[int]],
                        expected: dict[str, list[float]]) -> list[AdapterUpdate]:
        from rollstream.shared.inference.adapter_sync import AdapterUpdate

        return [AdapterUpdate(role, role_versions[role],
                              adapter_dir(self.storage, self.settings.run_id, role, role_versions[role]),
                              tuple(probes[role]), tuple(expected[role]))
                for role in self.roles.adapters]

    def sync_adapters(self, step: TrainedStep) -> None:
        """Every server serving every role's adapter at the step's versions; the sync's figures in the
        metrics."""
        started = time.monotonic()
        parity = 0.0
        if self.fleet is not None:  # a fleet-less run only writes the adapters
            updates = self.adapter_updates(step.role_versions, step.probes, step.role_expected)
            parity, step.servers = self.fleet.sync_adapters(updates)
            report = self.fleet.last_adapter_sync
            if report is not None:
                step.metrics["sync/bytes"] = report.bytes_sent
        step.metrics["sync/seconds"] = time.monotonic() - started
        step.metrics["sync/parity_max_abs_diff"] = parity

"""What services tell each other outside the streams: a counter or a hash in Redis that some write and others
read, for its current value rather than a history. Each such fact is named here with its key (a template of
`Keys`), what it holds, who writes it and who reads it, as consumers.py names who reads each stream. Writers
and readers take its key from its record (`FILTERED_SAMPLES.key(bus.keys)`); a test finds every module that
touches a fact and checks that it is the code of one of them, and that the deployment's Redis users let its
writers, and no other service, write it.

    python -m pytest tests/unit/shared/contract/test_run_facts.py -q
"""

from __future__ import annotations

from dataclasses import dataclass

from rollstream.shared.contract.keys import Keys


@dataclass(frozen=True)
class RunFact:
    name: str
    """The `Keys` property that renders its key."""
    holds: str
    """What its key holds."""
    writers: tuple[str, ...]
    """Who writes it: services by name, `rollstream run` for the local run's supervisor."""
    readers: tuple[str, ...]
    """Who reads it."""
    through: str | None = None
    """The library module its writers and readers reach it through, when they never touch its key themselves
    (the module that alone renders it); None: they touch it in their own code."""

    def __post_init__(self) -> None:
        if not isinstance(getattr(Keys, self.name, None), property):
            raise ValueError(f"run fact {self.name!r} names no key of Keys")
        if not self.writers or not self.readers:
            raise ValueError(f"run fact {self.name!r} needs its writers and its readers")

    def key(self, keys: Keys) -> str:
        """Its key in the run `keys` names."""
        return getattr(keys, self.name)


FILTERED_SAMPLES = RunFact(
    "filtered", "counter: admitted samples given back to the dispatcher, left out of training (a filtered "
    "group, a dropped rollout) or trained beyond a batch's B (whole groups overshoot it)",
    writers=("reward",), readers=("dispatcher",))
"""The reward service adds to it as it scores and batches groups; the dispatcher's staleness gate admits as
many samples again (services/dispatcher/gate.py)."""
FLEET_VERSIONS = RunFact(
    "fleet_versions", "hash: each policy server's url -> the policy version it serves",
    writers=("trainer", "rollstream run", "vllm"), readers=("agent-runner", "gateway", "console"))
"""The trainer records a server's version as it syncs it (a server it meets at its start, at the version it
starts from); `rollstream run` records the version of a vLLM server it restarted on the newest policy; a
policy server that registers in the fleet (fleet.registry; `vllm`: rollstream's plugin in the vLLM server,
shared/inference/vllm_fleet_member.py) records the version it loaded before it registers. The agent-runner
and the gateway tag each sampled turn with its server's version; the console shows them."""
FLEET_MEMBERS = RunFact(
    "fleet_members", "set: the url of each policy server that registered in the run's fleet, a member while "
    "its registration (Keys.fleet_member, with a time to live) is renewed",
    writers=("vllm",), readers=("agent-runner", "gateway", "trainer"),
    through="rollstream.shared.inference.fleet_registry")
"""With fleet.registry, each policy server registers itself once it answers /health and renews that by a
heartbeat (rollstream's plugin in the vLLM server); the fleet clients of the agent-runner, the gateway and the
trainer add the members to the servers they route to and sync, and drop those whose registration lapsed."""

RUN_FACTS: dict[str, RunFact] = {fact.name: fact
                                  for fact in (FILTERED_SAMPLES, FLEET_VERSIONS, FLEET_MEMBERS)}
"""Every fact of a run that travels outside the streams, by its Keys name."""

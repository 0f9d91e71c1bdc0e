"""Who reads which stream: each consuming service's consumer group and the streams it reads through it.

This map is the one place where stream names meet service names. A service takes its group from here
(`consumer_group("reward")`) and passes it to `run_consumer`; the local run's backlog and drain checks and
the chaos audit walk `stream_groups()`. A group is named after its service, and its replicas share it, so
each entry is handled by one replica.

Readers outside any group take nothing away from a stream and are not listed: the dispatcher watches
`policy` for new versions (XREAD), the recorder archives every stream (XRANGE) and trims each behind its
slowest group (`unconsumed_streams()`, which no group reads, right behind its archive), and `rollstream
inspect`, `replay` and the audits read whole histories (`rewards` is there for them).

    python -m pytest tests/unit/shared/contract/test_consumers.py -q
"""

from __future__ import annotations

from dataclasses import dataclass

from rollstream.shared.contract.events import STREAMS, StreamName


@dataclass(frozen=True)
class ConsumerGroup:
    name: str
    """The group's name on each of its streams; a service's group is named after the service."""
    streams: tuple[StreamName, ...]
    """The streams it reads, in the order it polls them."""
    reads_for: str = ""
    """What the service does with what it reads."""

    def __post_init__(self) -> None:
        unknown = [stream for stream in self.streams if stream not in STREAMS]
        if not self.streams or unknown:
            raise ValueError(f"consumer group {self.name!r} must read streams among {', '.join(STREAMS)}, "
                             f"got {self.streams!r}")


CONSUMER_GROUPS: dict[str, ConsumerGroup] = {group.name: group for group in (
    ConsumerGroup("agent-runner", ("prompts",),
                  "runs each admitted sample's episode (PromptIssued); a replica that dies leaves its "
                  "prompts to be reclaimed by the others"),
    ConsumerGroup("sandbox-grader", ("trajectories",),
                  "queues a sandbox grading job for each TrajectoryFinished whose task is graded "
                  "in a sandbox"),
    ConsumerGroup("reward", ("grades", "trajectories", "dead"),
                  "joins each rollout's segments and finish with its grade, or drops it for a grading "
                  "failure or a dead-lettered event of it; scores complete groups and writes batches"),
    ConsumerGroup("trainer", ("batches",), "trains each BatchReady once, in order, and publishes the policy"),
)}
"""Every consumer group of the pipeline, by service."""


def consumer_group(service: str) -> ConsumerGroup:
    """The consumer group `service` reads through."""
    try:
        return CONSUMER_GROUPS[service]
    except KeyError:
        raise ValueError(f"{service!r} reads no stream through a consumer group; those that do: "
                         f"{', '.join(CONSUMER_GROUPS)}") from None


def stream_groups() -> tuple[tuple[StreamName, str], ...]:
    """Every (stream, group) pair: where an entry waits until each group that reads it has handled it."""
    return tuple((stream, group.name) for group in CONSUMER_GROUPS.values() for stream in group.streams)


def groups_reading(stream: StreamName) -> tuple[str, ...]:
    """The consumer groups that read `stream` (none for `policy`: it is watched, not consumed)."""
    return tuple(group.name for group in CONSUMER_GROUPS.values() if stream in group.streams)


def unconsumed_streams() -> tuple[StreamName, ...]:
    """The streams no consumer group reads, in STREAMS order: `rewards` and `policy`, kept for people and
    audits."""
    return tuple(stream for stream in STREAMS if not groups_reading(stream))

"""Agent-runner: turns admitted prompts into trajectories, token-in/token-out against the fleet.

Consumes `prompts` through the `agent-runner` consumer group (replicas share the work) and runs up
to `rollout.concurrency` episodes at once, each with its row's agent loop and tools
(shared/agent: the built-in `tool_agent` generates, calls tools, appends observations, repeats).
It publishes on `trajectories`: TrajectoryStarted, a TrajectoryTurn per generation, a
TrajectoryTool per tool call, the trainable TrajectorySegments and TrajectoryFinished, in one
transaction (shared/contract/rollouts.py, as the gateway does for a finished session). Model tokens
are exactly the ids vLLM sampled (loss_mask 1); prompt, template glue and observations are tokenized
once (loss_mask 0). A prompt is acknowledged only after its trajectory is
published, so a replica that dies leaves it to be reclaimed by another. When no vLLM server answers
(FleetUnavailable), the replica keeps its episodes' prompts and runs them again once one does, takes no
new prompt meanwhile, and /healthz says why: a fleet restart costs time, not prompts.

A prompt whose agent is `command` is a black-box episode instead (blackbox.py): an unmodified agent, run
as a command in the task's sandbox (agent_sandbox.py), talks to the fleet through the gateway, which
records its turns and publishes the trajectory when the agent-runner finishes the session. A gateway that
does not answer is waited for like the fleet: the prompt is kept and run again once it answers. When
black-box agents run under docker, the agent-runner first removes the containers that agent-runners
killed on this host left behind.

An episode samples as its prompt's role (none named: roles.default) unless its loop chooses others
(shared/agent/loop.py: the loop is given the run's roles); each segment is published under its role's name,
the episode's where the loop named none.

One entry's failure is that entry's: an entry on `prompts` that is no PromptIssued is dead-lettered by the
bus as it is read, and one without the rollout and group ids a sample needs is dead-lettered here, each at
once with the reason; so is an episode that names a role the run does not have (its prompt's, or one its
loop asked for or gave a segment), which every try would refuse the same: the reward service then leaves its
rollout out of its group, with the reason, and gives its slot back (no reward is made up for it). An episode
that raises anything else leaves its prompt pending, to be retried and dead-lettered after
bus.max_deliveries.

    rollstream-agent-runner      # configured by RS_* variables or RS_CONFIG_FILE
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Awaitable, Callable

from prometheus_client import Counter, Gauge, Histogram

from rollstream.services.agent_runner.agent_sandbox import remove_orphaned_containers
from rollstream.services.agent_runner.blackbox import COMMAND_AGENT, BlackBoxRunner, GatewayUnavailable
from rollstream.shared.agent.environments import (
    calculator,  # noqa: F401  (registers the calculator tool)
    coding,  # noqa: F401  (registers the coding tools)
)
from rollstream.shared.agent.loop import AgentContext, Limits, Task, resolve_agent
from rollstream.shared.agent.tool_calls import get_format
from rollstream.shared.agent.tools import (
    Episode,
    ToolSet,
    load_tools_yaml,
    resolve_tools,
)
from rollstream.shared.contract.bus import ENVELOPE_IDS, Bus, Delivery, consumer_name
from rollstream.shared.contract.consumers import consumer_group
from rollstream.shared.contract.events import PromptIssued, SampleGrading, encode
from rollstream.shared.contract.roles import RunRoles
from rollstream.shared.contract.rollouts import RolloutFinish, Segment, publish_rollout
from rollstream.shared.errors import FleetUnavailable, UnknownRole
from rollstream.shared.runtime.config import Settings
from rollstream.shared.runtime.metrics import watch_consumer_group
from rollstream.shared.runtime.service import ServiceRuntime

GROUP = consumer_group("agent-runner")
(PROMPTS,) = GROUP.streams
DRAIN_TIMEOUT_S = 60.0
FLEET_RECHECK_S = 2.0
REQUIRED_IDS = ("rollout_id", "group_id")
"""Without these a trajectory belongs to no sample: the reward service could never place it."""

EPISODES = Counter("rollstream_agent_runner_episodes_total",
                   "Episodes whose trajectory was published, by agent and status (completed, truncated, "
                   "aborted, failed: the episode's own outcome, not the machinery's).", ["agent", "status"])
EPISODE_SECONDS = Histogram("rollstream_agent_runner_episode_seconds",
                            "Wall time of a published episode, from its prompt to its trajectory.", ["agent"],
                            buckets=(0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600, 1800, 3600))
TURNS = Counter("rollstream_agent_runner_turns_total", "Model turns of published built-in-agent episodes.")
TOKENS = Counter("rollstream_agent_runner_tokens_total",
                 "Tokens of published built-in-agent samples: sampled (the model's, trained on) or context "
                 "(prompt, template glue and tool output).", ["kind"])
IN_FLIGHT = Gauge("rollstream_agent_runner_episodes_in_flight", "Episodes this replica is running now.")


def rejection(delivery: Delivery) -> str | None:
    """Why the prompt cannot become an episode whatever replica runs it, or None."""
    missing = [name for name in REQUIRED_IDS if not getattr(delivery.envelope, name)]
    if missing:
        return f"PromptIssued without {' and '.join(missing)}"
    return None


class EpisodeRunner:
    """Runs one prompt's episode with its agent loop and publishes the trajectory."""

    def __init__(self, settings: Settings, bus: Bus, fleet, tokenizer) -> None:
        self.settings = settings
        self.bus = bus
        self.fleet = fleet
        self.tokenizer = tokenizer
        self.tool_format = get_format(settings.agent.tool_format)
        self.extra_tools = load_tools_yaml(settings.agent.tools_yaml) if settings.agent.tools_yaml else []
        self.limits = Limits(max_turns=settings.agent.max_turns,
                             max_tokens_per_turn=settings.rollout.max_tokens,
                             max_total_tokens=settings.agent.max_total_tokens)
        self.blackbox = BlackBoxRunner(settings)
        self.roles = RunRoles.of(settings)

    async def fleet_versions(self) -> dict[str, int]:
        return await asyncio.to_thread(self.bus.fleet_versions)

    async def run(self, delivery: Delivery) -> None:
        prompt: PromptIssued = delivery.event  # type: ignore[assignment]  (nothing else is delivered from PROMPTS)
        ids = {name: getattr(delivery.envelope, name) for name in ENVELOPE_IDS}
        agent_name = prompt.agent or self.settings.agent.default
        started = time.monotonic()
        self.roles.resolve(prompt.role)  # a role the run does not have: refused before anything runs
        if agent_name == COMMAND_AGENT:  # the gateway publishes its trajectory, and counts its turns
            status = await self.blackbox.run(prompt, ids)
            EPISODES.labels(agent_name, status).inc()
            EPISODE_SECONDS.labels(agent_name).observe(time.monotonic() - started)
            return
        segments = await self.episode(prompt, agent_name, ids["rollout_id"], ids["session_id"])
        final = segments[-1]
        finish = RolloutFinish(status=final.status, response_text=final.response_text,
                               artifacts=dict(final.metadata.get("artifacts", {})),
                               error=final.metadata.get("error"))
        pipe = self.bus.redis.pipeline(transaction=True)
        publish_rollout(self.bus, pipe, ids, SampleGrading.of(prompt), segments, finish,
                        metadata=prompt.metadata,
                        server_url=final.turns[0].server_url if final.turns else None)
        await asyncio.to_thread(pipe.execute)
        EPISODES.labels(agent_name, final.status).inc()
        EPISODE_SECONDS.labels(agent_name).observe(time.monotonic() - started)
        for segment in segments:
            TURNS.inc(len(segment.turns))
            sampled = sum(segment.loss_mask)
            TOKENS.labels("sampled").inc(sampled)
            TOKENS.labels("context").inc(len(segment.tokens) - sampled)

    async def episode(self, prompt: PromptIssued, agent_name: str, rollout_id: str, session_id: str | None
                      ) -> list[Segment]:
        """The segments the prompt's agent loop returns: at least one."""
        agent = resolve_agent(agent_name)
        tools = ToolSet([*resolve_tools(prompt.tools), *self.extra_tools],
                        max_concurrency=self.settings.agent.tool_concurrency,
                        max_output_chars=self.settings.agent.max_tool_output_chars,
                        timeout_s=self.settings.agent.tool_timeout_s)
        episode = Episode(episode_id=rollout_id, run_id=self.settings.run_id, metadata=dict(prompt.metadata),
                          storage_uri=self.settings.storage_uri)
        ctx = AgentContext(fleet=self.fleet, tokenizer=self.tokenizer, tools=tools,
                           tool_format=self.tool_format, limits=self.limits, episode=episode,
                           session_id=session_id, temperature=self.settings.rollout.temperature,
                           policy_versions=self.fleet_versions, roles=self.roles, role=prompt.role)
        task = Task(messages=prompt.messages, label=prompt.label, metadata=dict(prompt.metadata))
        result = await agent(task, ctx)
        segments = result if isinstance(result, list) else [result]
        if not segments:
            raise ValueError(f"agent {agent_name} returned no segment")
        # a segment that names no role is the episode's; each is published under its role's name
        return [dataclasses.replace(segment, role=self.roles.resolve(
            segment.role if segment.role is not None else prompt.role)) for segment in segments]


class Replica:
    """One agent-runner process at work: up to rollout.concurrency episodes at once, each acknowledged once
    its trajectory is published. While the fleet or the gateway does not answer, /healthz says why, the
    episodes that need it wait, and no new prompt is taken."""

    def __init__(self, settings: Settings, runtime: ServiceRuntime, bus: Bus, fleet,
                 runner: EpisodeRunner) -> None:
        self.settings = settings
        self.runtime = runtime
        self.bus = bus
        self.fleet = fleet
        self.runner = runner
        self.consumer = consumer_name(GROUP.name)
        self.in_flight: dict[asyncio.Task, str] = {}
        """Running episodes, by their prompt's entry id."""
        self.done = 0

    async def keep_claims_fresh(self) -> None:
        # Episodes can outlast reclaim_idle_ms; a live replica keeps its prompts from being reclaimed.
        while True:
            await asyncio.sleep(self.settings.bus.reclaim_idle_ms / 3000)
            await asyncio.to_thread(self.bus.keep_alive, PROMPTS, GROUP.name, self.consumer,
                                    list(self.in_flight.values()))

    async def take_prompts(self) -> None:
        """Until the service stops: start an episode for each prompt read, as many as there is room for."""
        while not self.runtime.stopping:
            free = self.settings.rollout.concurrency - len(self.in_flight)
            if self.runtime.not_ready is not None:  # no server answers: new prompts would only wait here
                await asyncio.sleep(FLEET_RECHECK_S)
                continue
            if free <= 0:
                await asyncio.wait(self.in_flight, return_when=asyncio.FIRST_COMPLETED)
                continue
            deliveries = await asyncio.to_thread(self.bus.consume, PROMPTS, GROUP.name, self.consumer, free,
                                                 held=set(self.in_flight.values()))
            for delivery in deliveries:
                await self.start(delivery)
            self.runtime.status["in_flight"] = len(self.in_flight)

    async def start(self, delivery: Delivery) -> None:
        """The prompt's episode, running; or its dead letter when no replica could run it."""
        reason = rejection(delivery)
        if reason is not None:
            await asyncio.to_thread(self.bus.dead_letter, PROMPTS, GROUP.name, delivery.entry_id,
                                    encode(delivery.envelope), 1, reason)
            return
        task = asyncio.create_task(self.handle(delivery))
        self.in_flight[task] = delivery.entry_id
        IN_FLIGHT.inc()
        task.add_done_callback(self.finished)

    def finished(self, task: asyncio.Task) -> None:
        self.in_flight.pop(task, None)
        IN_FLIGHT.dec()

    async def handle(self, delivery: Delivery) -> None:
        """The prompt's episode; the prompt is acknowledged once its trajectory is published."""
        if not await self.publish_episode(delivery):
            return
        await asyncio.to_thread(self.bus.ack, delivery, GROUP.name)
        self.done += 1
        self.runtime.status["episodes_done"] = self.done

    async def publish_episode(self, delivery: Delivery) -> bool:
        """Run the episode until its trajectory is published (True); False when it failed, leaving its prompt
        pending for retry, or when the service stops while it waits."""
        while True:
            try:
                await self.runner.run(delivery)
                return True
            except FleetUnavailable as exc:
                # The machinery's failure, not the prompt's: run it again here once a server answers (its
                # claim is kept fresh meanwhile) instead of spending its deliveries towards the dead letter.
                await self.wait_until(self.fleet_answers, "the vLLM fleet", str(exc))
            except GatewayUnavailable as exc:  # the machinery's failure too
                await self.wait_until(self.runner.blackbox.gateway_answers, "the gateway", str(exc))
            except UnknownRole as exc:
                # The prompt's or its loop's error, the same on every replica and every try: no sample of it
                # could be trained, so its rollout leaves its group now, with the reason (not a reward of 0).
                await asyncio.to_thread(self.bus.dead_letter, PROMPTS, GROUP.name, delivery.entry_id,
                                        encode(delivery.envelope), 1, f"{type(exc).__name__}: {exc}")
                self.runtime.log.error("episode refused: it names a role the run does not have",
                                       extra={"rollout_id": delivery.envelope.rollout_id, "error": str(exc)})
                return False
            except Exception as exc:
                self.bus.record_failure(delivery, GROUP.name, f"{type(exc).__name__}: {exc}")
                self.runtime.log.exception("episode failed; prompt stays pending for retry",
                                           extra={"rollout_id": delivery.envelope.rollout_id})
                return False
            if self.runtime.stopping:
                return False

    async def fleet_answers(self) -> bool:
        """Whether a server answers /health (those that do are routed to again)."""
        answers = await asyncio.gather(*(self.fleet.health(url) for url in self.fleet.urls))
        for url, healthy in zip(self.fleet.urls, answers):
            if healthy:
                self.fleet.mark_healthy(url)
        return any(answers)

    async def wait_until(self, answers: Callable[[], Awaitable[bool]], what: str, why: str) -> None:
        """Until `answers()` (`what` answers again); meanwhile /healthz says why and no new prompt is
        taken."""
        runtime = self.runtime
        if runtime.not_ready is None:
            runtime.log.warning(f"{what} does not answer; episodes wait for it", extra={"error": why})
        runtime.not_ready = f"{what} does not answer: {why}"
        while not runtime.stopping:
            if await answers():
                if runtime.not_ready is not None:
                    runtime.log.info(f"{what} answers again; episodes go on")
                runtime.not_ready = None
                return
            await asyncio.sleep(FLEET_RECHECK_S)

    async def drain(self) -> None:
        """Give the running episodes DRAIN_TIMEOUT_S to publish; a prompt still running then stays pending."""
        if self.in_flight:
            self.runtime.log.info("draining in-flight episodes", extra={"count": len(self.in_flight)})
            await asyncio.wait(self.in_flight, timeout=DRAIN_TIMEOUT_S)


async def serve(settings: Settings, runtime: ServiceRuntime) -> None:
    from transformers import AutoTokenizer

    from rollstream.shared.inference.fleet import FleetClient

    bus = Bus.connect(settings.redis, settings.run_id, settings.bus)
    bus.ensure_group(PROMPTS, GROUP.name)
    watch_consumer_group(bus, GROUP.name, GROUP.streams)
    # a container of an agent-runner that was killed (this one, restarted) may still hold a black-box agent
    await asyncio.to_thread(remove_orphaned_containers, settings)
    tokenizer = AutoTokenizer.from_pretrained(settings.model.path)
    fleet = FleetClient.for_run(settings)
    # a setting that disagrees with a server (its /v1/models) stops the replica here, not at its first episode
    not_met = await fleet.meet_servers()
    runtime.log.info("the vLLM servers say what they serve",
                     extra={"contexts": fleet.contexts, "not_answering": sorted(not_met)})
    replica = Replica(settings, runtime, bus, fleet, EpisodeRunner(settings, bus, fleet, tokenizer))
    heartbeat = asyncio.create_task(replica.keep_claims_fresh())
    await replica.take_prompts()
    await replica.drain()
    heartbeat.cancel()
    await fleet.aclose()


def main() -> None:
    settings = Settings()
    runtime = ServiceRuntime("agent-runner", settings)
    asyncio.run(serve(settings, runtime))
    runtime.close()


if __name__ == "__main__":
    main()

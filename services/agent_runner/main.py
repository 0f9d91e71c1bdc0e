"""Agent-runner: turns admitted prompts into trajectories, token-in/token-out against the fleet.

Consumes `prompts` through the `agent-runner` consumer group (replicas share the work) and runs up
to `rollout.concurrency` episodes at once, each with its row's agent loop and tools
(shared/agent: the built-in `tool_agent` generates, calls tools, appends observations, repeats).
It publishes on `trajectories`: TrajectoryStarted, a TrajectoryTurn per generation, a
TrajectoryTool per tool call, the trainable TrajectorySegments and TrajectoryFinished, in one
transaction. Model tokens are exactly the ids vLLM sampled (loss_mask 1); prompt, template glue and
observations are tokenized once (loss_mask 0). A prompt is acknowledged only after its trajectory is
published, so a replica that dies leaves it to be reclaimed by another. When no vLLM server answers
(FleetUnavailable), the replica keeps its episodes' prompts and runs them again once one does, takes no
new prompt meanwhile, and /healthz says why: a fleet restart costs time, not prompts.

A prompt whose agent is `command` is a black-box episode instead (blackbox.py): an unmodified agent, run
as a command in the task's sandbox (agent_sandbox.py), talks to the fleet through the gateway, which
records its turns and publishes the trajectory when the agent-runner finishes the session. A gateway that
does not answer is waited for like the fleet: the prompt is kept and run again once it answers. When
black-box agents run under docker, the agent-runner first removes the containers that agent-runners
killed on this host left behind.

One entry's failure is that entry's: an entry on `prompts` that is no PromptIssued, or one without
the rollout and group ids a sample needs, is dead-lettered at once with the reason; an episode that
raises leaves its prompt pending, to be retried and dead-lettered after bus.max_deliveries.

    rollstream-agent-runner      # configured by RS_* variables or RS_CONFIG_FILE
"""

from __future__ import annotations

import asyncio
import functools
import uuid

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
from rollstream.shared.contract.bus import Bus, Delivery, consumer_name
from rollstream.shared.contract.events import (
    PromptIssued,
    TrajectoryFinished,
    TrajectorySegment,
    TrajectoryStarted,
    TrajectoryTool,
    TrajectoryTurn,
    encode,
)
from rollstream.shared.errors import FleetUnavailable
from rollstream.shared.runtime.config import Settings
from rollstream.shared.runtime.service import ServiceRuntime

GROUP = "agent-runner"
DRAIN_TIMEOUT_S = 60.0
FLEET_RECHECK_S = 2.0
REQUIRED_IDS = ("rollout_id", "group_id")
"""Without these a trajectory belongs to no sample: the reward service could never place it."""


def rejection(delivery: Delivery) -> str | None:
    """Why the prompt cannot become an episode whatever replica runs it, or None."""
    if not isinstance(delivery.event, PromptIssued):
        return f"agent-runner does not handle {delivery.envelope.type} on prompts"
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
        self.limits = Limits(max_turns=settings.agent.max_turns, max_tokens_per_turn=settings.rollout.max_tokens,
                             max_total_tokens=settings.agent.max_total_tokens)
        self.blackbox = BlackBoxRunner(settings)

    async def fleet_versions(self) -> dict[str, int]:
        return await asyncio.to_thread(self.bus.fleet_versions)

    async def run(self, delivery: Delivery) -> None:
        prompt: PromptIssued = delivery.event  # type: ignore[assignment]
        ids = {k: getattr(delivery.envelope, k) for k in ("trajectory_id", "rollout_id", "group_id", "session_id")}
        rollout = ids["rollout_id"]
        agent_name = prompt.agent or self.settings.agent.default
        if agent_name == COMMAND_AGENT:  # the gateway publishes its trajectory
            await self.blackbox.run(prompt, ids)
            return
        agent = resolve_agent(agent_name)
        tools = ToolSet([*resolve_tools(prompt.tools), *self.extra_tools],
                        max_concurrency=self.settings.agent.tool_concurrency,
                        max_output_chars=self.settings.agent.max_tool_output_chars,
                        timeout_s=self.settings.agent.tool_timeout_s)
        episode = Episode(episode_id=rollout, run_id=self.settings.run_id, metadata=dict(prompt.metadata),
                          storage_uri=self.settings.storage_uri)
        ctx = AgentContext(fleet=self.fleet, tokenizer=self.tokenizer, tools=tools, tool_format=self.tool_format,
                           limits=self.limits, episode=episode, session_id=ids["session_id"],
                           temperature=self.settings.rollout.temperature, policy_versions=self.fleet_versions)
        result = await agent(Task(messages=prompt.messages, label=prompt.label, metadata=dict(prompt.metadata)), ctx)
        segments = result if isinstance(result, list) else [result]
        if not segments:
            raise ValueError(f"agent {agent_name} returned no segment")
        final = segments[-1]
        attempt = uuid.uuid4().hex[:12]

        pipe = self.bus.redis.pipeline(transaction=True)
        publish = functools.partial(self.bus.publish, "trajectories", pipe=pipe, **ids)
        server = final.turns[0].server_url if final.turns else None
        publish(TrajectoryStarted(sample_index=prompt.sample_index, server_url=server), event_id=f"{rollout}:{attempt}:started")
        for index, segment in enumerate(segments):
            for number, turn in enumerate(segment.turns):
                publish(TrajectoryTurn(turn=number, segment_index=index, offset=turn.offset,
                                       appended_ids=turn.appended_ids, response_ids=turn.response_ids,
                                       logprobs=turn.logprobs, policy_version=turn.policy_version,
                                       policy_version_end=turn.policy_version_end, finish_reason=turn.finish_reason,
                                       server_url=turn.server_url), event_id=f"{rollout}:{attempt}:turn:{index}:{number}")
            for call in segment.tools:
                publish(TrajectoryTool(turn=call.turn, call_id=call.call_id, name=call.name, arguments=call.arguments,
                                       ok=call.ok, error_kind=call.error_kind, content=call.content),
                        event_id=f"{rollout}:{attempt}:tool:{index}:{call.call_id}")
            publish(TrajectorySegment(segment_index=index, attempt=attempt, tokens=segment.tokens,
                                      response_length=segment.response_length, loss_mask=segment.loss_mask,
                                      rollout_logprobs=segment.rollout_logprobs,
                                      turn_policy_versions=segment.turn_policy_versions, status=segment.status,
                                      response_text=segment.response_text, sample_index=prompt.sample_index,
                                      group_size=prompt.group_size, metadata={**prompt.metadata, **segment.metadata}),
                    event_id=f"{rollout}:{attempt}:segment:{index}")
        publish(TrajectoryFinished(status=final.status, attempt=attempt, segment_count=len(segments), group_size=prompt.group_size,
                                   sample_index=prompt.sample_index, sandbox_check=prompt.sandbox_check,
                                   grader=dict(prompt.metadata.get("grader") or {}),
                                   response_text=final.response_text, label=prompt.label, reward_fn=prompt.reward_fn,
                                   artifacts=dict(final.metadata.get("artifacts", {})), error=final.metadata.get("error")),
                event_id=f"{rollout}:{attempt}:finished")
        await asyncio.to_thread(pipe.execute)


async def serve(settings: Settings, runtime: ServiceRuntime) -> None:
    from transformers import AutoTokenizer

    from rollstream.shared.inference.fleet import FleetClient

    bus = Bus.connect(settings.redis, settings.run_id, settings.bus)
    bus.ensure_group("prompts", GROUP)
    # a container of an agent-runner that was killed (this one, restarted) may still hold a black-box agent
    await asyncio.to_thread(remove_orphaned_containers, settings)
    consumer = consumer_name(GROUP)
    tokenizer = AutoTokenizer.from_pretrained(settings.model.path)
    fleet = FleetClient(settings.fleet.urls, model=settings.model.served_name,
                        timeout_s=settings.fleet.request_timeout_s)
    runner = EpisodeRunner(settings, bus, fleet, tokenizer)
    in_flight: dict[asyncio.Task, str] = {}
    done = 0

    async def keep_claims_fresh() -> None:
        # Episodes can outlast reclaim_idle_ms; a live replica keeps its prompts from being reclaimed.
        while True:
            await asyncio.sleep(settings.bus.reclaim_idle_ms / 3000)
            await asyncio.to_thread(bus.keep_alive, "prompts", GROUP, consumer, list(in_flight.values()))

    async def fleet_answers() -> bool:
        """Whether a server answers /health (those that do are routed to again)."""
        answers = await asyncio.gather(*(fleet.health(url) for url in fleet.urls))
        for url, healthy in zip(fleet.urls, answers):
            if healthy:
                fleet.mark_healthy(url)
        return any(answers)

    async def wait_until(answers, what: str, why: str) -> None:
        """Until `answers()` (`what` answers again); meanwhile /healthz says why and no new prompt is taken."""
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

    async def handle(delivery: Delivery) -> None:
        nonlocal done
        while True:
            try:
                await runner.run(delivery)
                break
            except FleetUnavailable as exc:
                # The machinery's failure, not the prompt's: run it again here once a server answers (its
                # claim is kept fresh meanwhile) instead of spending its deliveries towards the dead letter.
                await wait_until(fleet_answers, "the vLLM fleet", str(exc))
                if runtime.stopping:
                    return
            except GatewayUnavailable as exc:  # the machinery's failure too
                await wait_until(runner.blackbox.gateway_answers, "the gateway", str(exc))
                if runtime.stopping:
                    return
            except Exception as exc:
                bus.record_failure(delivery, GROUP, f"{type(exc).__name__}: {exc}")
                runtime.log.exception("episode failed; prompt stays pending for retry",
                                      extra={"rollout_id": delivery.envelope.rollout_id})
                return
        await asyncio.to_thread(bus.ack, delivery, GROUP)
        done += 1
        runtime.status["episodes_done"] = done

    heartbeat = asyncio.create_task(keep_claims_fresh())
    while not runtime.stopping:
        free = settings.rollout.concurrency - len(in_flight)
        if runtime.not_ready is not None:  # no server answers: new prompts would only wait here
            await asyncio.sleep(FLEET_RECHECK_S)
            continue
        if free <= 0:
            await asyncio.wait(in_flight, return_when=asyncio.FIRST_COMPLETED)
            continue
        deliveries = await asyncio.to_thread(bus.consume, "prompts", GROUP, consumer, free)
        for delivery in deliveries:
            reason = rejection(delivery)
            if reason is not None:
                await asyncio.to_thread(bus.dead_letter, "prompts", GROUP, delivery.entry_id,
                                        encode(delivery.envelope), 1, reason)
                continue
            task = asyncio.create_task(handle(delivery))
            in_flight[task] = delivery.entry_id
            task.add_done_callback(lambda done_task: in_flight.pop(done_task, None))
        runtime.status["in_flight"] = len(in_flight)

    if in_flight:
        runtime.log.info("draining in-flight episodes", extra={"count": len(in_flight)})
        await asyncio.wait(in_flight, timeout=DRAIN_TIMEOUT_S)
    heartbeat.cancel()
    await fleet.aclose()


def main() -> None:
    settings = Settings()
    runtime = ServiceRuntime("agent-runner", settings)
    asyncio.run(serve(settings, runtime))
    runtime.close()


if __name__ == "__main__":
    main()

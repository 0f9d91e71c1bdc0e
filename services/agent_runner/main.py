"""Agent-runner: turns admitted prompts into trajectories, token-in/token-out against the fleet.

Consumes `prompts` through the `agent-runner` consumer group (replicas share the work), runs up to
`rollout.concurrency` episodes at once, and publishes on `trajectories`: TrajectoryStarted, one
TrajectoryTurn per generation, the trainable TrajectorySegment and TrajectoryFinished. The prompt is
tokenized once with the chat template (loss_mask 0); the response is exactly the ids vLLM sampled,
with vLLM's logprobs (loss_mask 1), never re-tokenized from text. A prompt is acknowledged only
after its trajectory is published, so a replica that dies leaves it to be reclaimed by another.

    rollstream-agent-runner      # configured by RS_* variables or RS_CONFIG_FILE
"""

from __future__ import annotations

import asyncio

from shared.bus import Bus, Delivery, consumer_name
from shared.config import Settings
from shared.events import PromptIssued, TrajectoryFinished, TrajectorySegment, TrajectoryStarted, TrajectoryTurn
from shared.service import ServiceRuntime

GROUP = "agent-runner"
DRAIN_TIMEOUT_S = 60.0


class EpisodeRunner:
    """One generation per sample (multi-turn episodes build on this)."""

    def __init__(self, settings: Settings, bus: Bus, fleet, tokenizer) -> None:
        self.settings = settings
        self.bus = bus
        self.fleet = fleet
        self.tokenizer = tokenizer

    def fleet_versions(self) -> dict[str, int]:
        raw = self.bus.redis.hgetall(self.bus.keys.fleet_versions)
        return {k.decode(): int(v) for k, v in raw.items()}

    async def run(self, delivery: Delivery) -> None:
        prompt: PromptIssued = delivery.event  # type: ignore[assignment]
        ids = {k: getattr(delivery.envelope, k) for k in ("trajectory_id", "rollout_id", "group_id", "session_id")}
        rollout = ids["rollout_id"]
        prompt_ids = list(self.tokenizer.apply_chat_template(prompt.messages, add_generation_prompt=True,
                                                             tokenize=True, return_dict=False))
        versions_before = await asyncio.to_thread(self.fleet_versions)
        completion = await self.fleet.complete(prompt_ids, max_tokens=self.settings.rollout.max_tokens,
                                               temperature=self.settings.rollout.temperature,
                                               session_id=ids["session_id"])
        versions_after = await asyncio.to_thread(self.fleet_versions)
        server = completion.server_url
        version = versions_before.get(server, 0)
        response = list(completion.token_ids)
        status = "truncated" if completion.finish_reason == "length" else "completed"
        text = self.tokenizer.decode(response, skip_special_tokens=True)

        turn = TrajectoryTurn(turn=0, prompt_ids=prompt_ids, response_ids=response,
                              logprobs=list(completion.logprobs), policy_version=version,
                              policy_version_end=versions_after.get(server, version),
                              finish_reason=completion.finish_reason, server_url=server)
        segment = TrajectorySegment(
            segment_index=0,
            tokens=prompt_ids + response,
            response_length=len(response),
            loss_mask=[0] * len(prompt_ids) + [1] * len(response),
            rollout_logprobs=[0.0] * len(prompt_ids) + list(completion.logprobs),
            turn_policy_versions=[version],
            status=status,
            response_text=text,
            sample_index=prompt.sample_index,
            group_size=prompt.group_size,
            metadata={**prompt.metadata, "finish_reason": completion.finish_reason, "server_url": server},
        )
        finished = TrajectoryFinished(status=status, segment_count=1, group_size=prompt.group_size,
                                      sample_index=prompt.sample_index, sandbox_check=prompt.sandbox_check,
                                      response_text=text, label=prompt.label, reward_fn=prompt.reward_fn)
        pipe = self.bus.redis.pipeline(transaction=True)
        self.bus.publish("trajectories", TrajectoryStarted(sample_index=prompt.sample_index, server_url=server),
                         pipe=pipe, event_id=f"{rollout}:started", **ids)
        self.bus.publish("trajectories", turn, pipe=pipe, event_id=f"{rollout}:turn:0", **ids)
        self.bus.publish("trajectories", segment, pipe=pipe, event_id=f"{rollout}:segment:0", **ids)
        self.bus.publish("trajectories", finished, pipe=pipe, event_id=f"{rollout}:finished", **ids)
        await asyncio.to_thread(pipe.execute)


async def serve(settings: Settings, runtime: ServiceRuntime) -> None:
    from transformers import AutoTokenizer

    from shared.fleet import FleetClient

    bus = Bus.connect(settings.redis, settings.run_id, settings.bus)
    bus.ensure_group("prompts", GROUP)
    consumer = consumer_name(GROUP)
    tokenizer = AutoTokenizer.from_pretrained(settings.model.path)
    fleet = FleetClient(settings.fleet.urls, model=settings.model.served_name,
                        timeout_s=settings.fleet.request_timeout_s)
    runner = EpisodeRunner(settings, bus, fleet, tokenizer)
    in_flight: set[asyncio.Task] = set()
    done = 0

    async def handle(delivery: Delivery) -> None:
        nonlocal done
        try:
            await runner.run(delivery)
        except Exception as exc:
            bus.record_failure(delivery, GROUP, f"{type(exc).__name__}: {exc}")
            runtime.log.exception("episode failed; prompt stays pending for retry",
                                  extra={"rollout_id": delivery.envelope.rollout_id})
            return
        await asyncio.to_thread(bus.ack, delivery, GROUP)
        done += 1
        runtime.status["episodes_done"] = done

    while not runtime.stopping:
        free = settings.rollout.concurrency - len(in_flight)
        if free <= 0:
            await asyncio.wait(in_flight, return_when=asyncio.FIRST_COMPLETED)
            continue
        deliveries = await asyncio.to_thread(bus.consume, "prompts", GROUP, consumer, free)
        for delivery in deliveries:
            if not isinstance(delivery.event, PromptIssued):
                bus.dead_letter("prompts", GROUP, delivery.entry_id, {"type": delivery.envelope.type}, 1,
                                f"agent-runner does not handle {delivery.envelope.type} on prompts")
                continue
            task = asyncio.create_task(handle(delivery))
            in_flight.add(task)
            task.add_done_callback(in_flight.discard)
        runtime.status["in_flight"] = len(in_flight)

    if in_flight:
        runtime.log.info("draining in-flight episodes", extra={"count": len(in_flight)})
        await asyncio.wait(in_flight, timeout=DRAIN_TIMEOUT_S)
    await fleet.aclose()


def main() -> None:
    settings = Settings()
    runtime = ServiceRuntime("agent-runner", settings)
    asyncio.run(serve(settings, runtime))
    runtime.close()


if __name__ == "__main__":
    main()

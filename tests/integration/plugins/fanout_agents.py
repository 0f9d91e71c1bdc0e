"""An agent plug-in loaded by import path (`fanout_agents:slow_branches`) in the fault test.

Each rollout runs one or two branches of the built-in tool agent (by its sample's parity), slowly,
so that a replica killed mid-run holds episodes in flight. The final answer is right exactly when
there were two branches, so rewards differ within every group.
"""

import asyncio

from rollstream.shared.agent.loop import AgentContext, Segment, Task, tool_agent

BRANCH_SECONDS = 1.5


async def slow_branches(task: Task, ctx: AgentContext) -> list[Segment]:
    branches = 1 + int(ctx.episode.episode_id[-1]) % 2
    segments = []
    for index in range(branches):
        await asyncio.sleep(BRANCH_SECONDS)
        segments.append(await tool_agent(task, ctx, segment_index=index))
    segments[-1].response_text = task.label if branches == 2 else "I do not know"
    return segments

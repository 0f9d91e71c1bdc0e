"""The gateway's settings (`gateway.*`, RS_GATEWAY__*): where black-box agents reach it, how long a session
lives, and what a turn may ask.

    python -m pytest tests/unit/shared/runtime/test_config.py -q
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from rollstream.shared.runtime.sections import Section


class GatewaySettings(Section):
    url: str = "http://127.0.0.1:8300"
    """Where agents and the black-box agent-runner reach the gateway (its sessions API and the per-session
    OpenAI / Anthropic endpoints under /s/{session}/)."""
    port: int = Field(8300, ge=0, le=65535)
    """Port the gateway serves its APIs on; 0: any free port."""
    session_ttl_s: int = Field(86_400, ge=60)
    """How long a session's state stays in Redis after its last request (a session with a time budget: no
    longer than finish_grace_s past its deadline); a finished session's turns are deleted once its samples are
    published."""
    finish_grace_s: float = Field(300.0, gt=0)
    """How long a session with a time budget can still be finished after its deadline (turns are refused from
    the deadline on): the agent-runner finishes it once the budget has killed the agent, its log is stored and
    its diff taken. Then the session ends, finished or not (its agent-runner may have died): its state expires
    and nothing of it is published."""
    max_prompt_tokens: int = Field(32_768, ge=16)
    """Longest prompt a turn may send (history plus new messages); longer gets 400, never a truncation."""
    max_tokens_per_turn: int | None = Field(None, ge=1)
    """The most tokens one turn samples, whatever the agent asks for (coding agents ask 32000 a turn): the
    run's cap on a response, as rollout.max_tokens is for rollstream's own agents; a turn it cuts ends as the
    API's max-tokens stop. None: what the agent asks, up to the room the context leaves."""
    strict_tools: bool = False
    """Refuse (400) a request with tools the model cannot be shown as functions (hosted tools such as web
    search or code execution, which the API provider would run); False: leave them out, say so in the log and
    in the response's x-rollstream-ignored-tools header."""
    on_rewritten_history: Literal["continue", "fork"] = "continue"
    """When the chat template renders a session's answered history differently once more follows (Qwen3-style
    templates drop earlier turns' reasoning): "continue" keeps the recorded ids, exactly what the model saw
    and sampled, and says so in the sample's metadata (history_rewritten_turns); "fork" starts a new
    conversation rendered as the template now renders it (one more sample of the rollout)."""

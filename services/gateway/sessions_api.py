"""The sessions API, for whoever runs the agent: create a session, read it, finish it (its samples are then
published: samples.py) or delete it. Every route asks for security.http_token when it is set.

A session is created for a role of the run (`role`; none: roles.default): its turns are sampled as that
role and train it. A role the run does not have is a 400 that names the run's roles.

    python -m pytest tests/unit/services/gateway/test_gateway_app.py -q
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

from fastapi import APIRouter, Depends, Header
from fastapi.responses import Response
from prometheus_client import Counter
from pydantic import BaseModel, ConfigDict, Field

from rollstream.services.gateway.apis.errors import RequestError
from rollstream.services.gateway.app_state import AppState, app_state
from rollstream.services.gateway.samples import publish_samples
from rollstream.services.gateway.sessions import SessionGrading, SessionSpec
from rollstream.shared.errors import UnknownRole
from rollstream.shared.runtime.health_api import auth_failure

SESSIONS_CREATED = Counter("rollstream_gateway_sessions_created_total", "Sessions this replica created")

router = APIRouter()


class SamplingDefaults(BaseModel):
    """A session's defaults for every turn; a request's own values win."""

    model_config = ConfigDict(extra="forbid")
    temperature: float | None = Field(None, ge=0, le=10)
    max_tokens: int | None = Field(None, ge=1)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = None
    min_tokens: int | None = Field(None, ge=0)
    """Sample at least this many tokens before a stop (vLLM's min_tokens)."""
    ignore_eos: bool | None = None
    """Sample past end-of-sequence until max_tokens (benchmarks, long streams)."""


class SessionCreate(SessionGrading):
    rollout_id: str = Field(min_length=1, max_length=256)
    group_id: str = Field(min_length=1, max_length=256)
    trajectory_id: str | None = Field(None, min_length=1, max_length=256)
    session_id: str | None = Field(None, min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._-]+$")
    metadata: dict[str, Any] = {}
    sampling: SamplingDefaults = SamplingDefaults()
    time_budget_s: float | None = Field(None, gt=0)
    role: str | None = Field(None, min_length=1, max_length=64)
    """The role of the run its turns are sampled as and train (roles.names); None: roles.default."""


class SessionFinish(BaseModel):
    status: str = Field("completed", pattern=r"^(completed|truncated|aborted|failed)$")
    reward: float | None = Field(None, allow_inf_nan=False)
    response_text: str | None = None
    artifacts: dict[str, str] = {}
    error: str | None = Field(None, max_length=65536)


def check_admin(state: AppState, authorization: str | None) -> None:
    denied = auth_failure(authorization, state.settings.security.http_token)
    if denied:
        raise RequestError(denied, "bearer token required" if denied == 401 else "wrong token",
                           kind="authentication_error" if denied == 401 else "permission_error")


@router.post("/v1/sessions", status_code=201)
async def create_session(body: SessionCreate, authorization: str | None = Header(None),
                         state: AppState = Depends(app_state)) -> dict[str, Any]:
    check_admin(state, authorization)
    session_id = body.session_id or uuid.uuid4().hex
    try:
        role = state.gateway.roles.resolve(body.role)
    except UnknownRole as exc:
        raise RequestError(400, str(exc), param="role") from exc
    spec = SessionSpec(rollout_id=body.rollout_id, group_id=body.group_id,
                       trajectory_id=body.trajectory_id or body.rollout_id, session_id=session_id,
                       sample_index=body.sample_index, group_size=body.group_size, label=body.label,
                       reward_fn=body.reward_fn, sandbox_check=body.sandbox_check, grader=body.grader,
                       metadata=body.metadata, sampling=body.sampling.model_dump(exclude_none=True),
                       time_budget_s=body.time_budget_s, role=role)
    created = await state.store.create(spec)
    if created is None:
        raise RequestError(409, f"session {session_id} exists already", kind="invalid_request_error")
    session, api_key = created
    SESSIONS_CREATED.inc()
    base = state.settings.gateway.url.rstrip("/") + f"/s/{session_id}"
    return {**session.describe(), "api_key": api_key, "openai_base_url": f"{base}/v1",
            "anthropic_base_url": base}


@router.get("/v1/sessions/{session_id}")
async def read_session(session_id: str, authorization: str | None = Header(None),
                       state: AppState = Depends(app_state)) -> dict[str, Any]:
    check_admin(state, authorization)
    session = await state.store.get(session_id)
    if session is None:
        raise RequestError(404, f"no session {session_id!r}", kind="not_found_error")
    return session.describe()


@router.post("/v1/sessions/{session_id}/finish")
async def finish_session(session_id: str, body: SessionFinish, authorization: str | None = Header(None),
                         state: AppState = Depends(app_state)) -> dict[str, Any]:
    check_admin(state, authorization)
    session = await state.store.get(session_id)
    if session is None:
        raise RequestError(404, f"no session {session_id!r} (never created, deleted, or ended: a session "
                                "with a time budget ends gateway.finish_grace_s after its deadline)",
                           kind="not_found_error")
    if session.status != "open":
        raise RequestError(409, f"session {session_id} is finished already", kind="invalid_request_error")
    counted: list[int] = []

    def publish(pipe, samples) -> None:
        if not samples:
            raise RequestError(422, f"session {session_id} has no model turn: nothing to train on; "
                                    "delete it instead", kind="invalid_request_error")
        counted.append(len(samples))
        publish_samples(state.store.bus, pipe, session, samples, status=body.status, reward=body.reward,
                        response_text=body.response_text, artifacts=body.artifacts, error=body.error)

    if not await asyncio.to_thread(state.store.finish, session_id, publish):
        raise RequestError(409, f"session {session_id} was finished, or ended, meanwhile",
                           kind="invalid_request_error")
    state.log.info("session finished", extra={"session_id": session_id, "samples": counted[0],
                                              "rollout_id": session.spec.rollout_id})
    return {"session_id": session_id, "status": "finished", "samples": counted[0]}


@router.delete("/v1/sessions/{session_id}", status_code=204)
async def delete_session(session_id: str, authorization: str | None = Header(None),
                         state: AppState = Depends(app_state)) -> Response:
    check_admin(state, authorization)
    if not await state.store.delete(session_id):
        raise RequestError(404, f"no session {session_id!r}", kind="not_found_error")
    return Response(status_code=204)

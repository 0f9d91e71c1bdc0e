"""Gateway sessions opened for a role, over the scripted fleet and real Redis: a session's turns are sampled
under its role's served model (its adapter, or the base model for a frozen role), recorded with the versions
of that role's policy and published as segments of that role; a request naming another role as its model (a
sub-agent's) is sampled as that role in conversations of its own; a role the run does not have is a 400.

    python -m pytest tests/unit/services/gateway/test_session_roles.py -q
"""

from __future__ import annotations

from typing import Any

import pytest

from rollstream.shared.contract.events import TrajectorySegment, TrajectoryTurn
from rollstream.shared.contract.roles import version_field
from rollstream.shared.contract.run_facts import FLEET_VERSIONS

SERVER = "http://vllm"
ROLES = {"roles": {"names": {"planner": {}, "solver": {}, "judge": {"trained": False}}},
         "train": {"lora_rank": 8}}


@pytest.fixture
def roles_app(bus, gateway_app):
    """The app of a run with two adapters and a frozen role; the fleet's record holds each one's version."""
    bus.redis.hset(FLEET_VERSIONS.key(bus.keys), mapping={
        SERVER: 11, version_field(SERVER, "planner"): 2, version_field(SERVER, "solver"): 5})
    return gateway_app(**ROLES)


def create(client, **fields: Any) -> dict[str, Any]:
    return client.post("/v1/sessions", json={"rollout_id": "r1", "group_id": "g1", **fields})


def turn(client, session: dict[str, Any], messages: list[dict[str, str]], model: str = "tiny") -> str:
    response = client.post(f"/s/{session['session_id']}/v1/chat/completions",
                           headers={"authorization": f"Bearer {session['api_key']}"},
                           json={"model": model, "max_tokens": 16, "messages": messages})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]["content"]


def finish(bus, client, session: dict[str, Any]) -> tuple[list[TrajectorySegment], list[TrajectoryTurn]]:
    finished = client.post(f"/v1/sessions/{session['session_id']}/finish", json={"status": "completed"})
    assert finished.status_code == 200, finished.text
    events = [d.event for d in bus.read_all("trajectories")]
    return ([e for e in events if isinstance(e, TrajectorySegment)],
            [e for e in events if isinstance(e, TrajectoryTurn)])


def test_a_solver_session_samples_the_solver_adapter_and_records_its_role_and_version(bus, roles_app):
    client, fleet, _ = roles_app
    created = create(client, role="solver")
    assert created.status_code == 201, created.text
    session = created.json()
    assert session["role"] == "solver"
    assert client.get(f"/v1/sessions/{session['session_id']}").json()["role"] == "solver"
    fleet.texts = ["x = 5"]
    # the solver's adapter is synced while the turn is sampled: its end version says so
    fleet.during = lambda: bus.redis.hset(FLEET_VERSIONS.key(bus.keys), version_field(SERVER, "solver"), 6)
    turn(client, session, [{"role": "user", "content": "solve it"}])
    assert [asked["model"] for asked in fleet.asked] == ["solver"]
    (segment,), (sampled,) = finish(bus, client, session)
    assert (segment.role, segment.turn_policy_versions) == ("solver", [5])
    assert (sampled.policy_version, sampled.policy_version_end) == (5, 6)


def test_a_session_without_a_role_is_the_run_defaults(bus, roles_app):
    client, fleet, _ = roles_app
    session = create(client).json()
    assert session["role"] == "planner"
    fleet.texts = ["a plan"]
    turn(client, session, [{"role": "user", "content": "plan it"}])
    (segment,), _ = finish(bus, client, session)
    assert (fleet.asked[0]["model"], segment.role, segment.turn_policy_versions) == (
        "planner", "planner", [2])


def test_a_frozen_roles_session_samples_the_base_model_at_version_0(bus, roles_app):
    client, fleet, _ = roles_app
    session = create(client, role="judge").json()
    fleet.texts = ["fine"]
    # a version recorded for the server's whole policy is not the frozen role's: the base is never synced
    fleet.during = lambda: bus.redis.hset(FLEET_VERSIONS.key(bus.keys), SERVER, 12)
    turn(client, session, [{"role": "user", "content": "judge it"}])
    (segment,), (sampled,) = finish(bus, client, session)
    assert (fleet.asked[0]["model"], segment.role) == ("tiny", "judge")
    assert (sampled.policy_version, sampled.policy_version_end) == (0, 0)


def test_a_session_for_a_role_the_run_does_not_have_is_a_400_naming_the_runs_roles(bus, roles_app):
    client, _, _ = roles_app
    refused = create(client, role="coder")
    assert refused.status_code == 400
    error = refused.json()["error"]
    assert error["param"] == "role"
    assert error["message"] == ("role 'coder' is not one of this run's roles (planner, solver, judge; "
                                "roles.names)")
    assert bus.read_all("trajectories") == []


def test_a_request_naming_another_role_is_a_sub_agent_of_that_role_in_conversations_of_its_own(bus,
                                                                                               roles_app):
    client, fleet, _ = roles_app
    session = create(client, role="planner").json()
    fleet.texts = ["step 1: add", "5", "done"]
    task = [{"role": "user", "content": "what is 2 + 3?"}]
    plan = turn(client, session, task)
    # the sub-agent's history continues the planner's conversation, but as the solver it starts its own
    carried_on = [*task, {"role": "assistant", "content": plan}, {"role": "user", "content": "go on"}]
    turn(client, session, carried_on, model="solver")
    turn(client, session, carried_on)  # the planner's conversation goes on from its own turn
    assert [asked["model"] for asked in fleet.asked] == ["planner", "solver", "planner"]
    segments, _ = finish(bus, client, session)
    # the solver's one turn is a sample of its own; the planner's two turns are one conversation
    assert [(s.role, s.turn_policy_versions) for s in segments] == [("solver", [5]), ("planner", [2, 2])]


def test_the_model_list_names_the_served_model_and_each_role(roles_app):
    client, _, _ = roles_app
    session = create(client).json()
    listed = client.get(f"/s/{session['session_id']}/v1/models",
                        headers={"authorization": f"Bearer {session['api_key']}"}).json()
    assert [model["id"] for model in listed["data"]] == ["tiny", "planner", "solver", "judge"]

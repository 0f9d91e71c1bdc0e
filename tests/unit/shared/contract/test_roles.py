"""The run's roles as the contract uses them: a sample's role resolved (None: the default), an unknown one
refused by name, the model a role's turns are sampled under and where its served version is recorded."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from rollstream.shared.contract.roles import RunRoles, split_version_field, version_field
from rollstream.shared.errors import UnknownRole
from rollstream.shared.runtime.config import Settings


def two_adapters_and_a_frozen_role() -> RunRoles:
    return RunRoles.of(Settings(roles={"names": {"planner": {}, "solver": {}, "critic": {"trained": False}}},
                                train={"lora_rank": 8}))


def test_a_sample_without_a_role_belongs_to_the_default_role():
    assert RunRoles.of(Settings()).resolve(None) == "policy"
    roles = two_adapters_and_a_frozen_role()
    assert roles.resolve(None) == "planner"
    assert RunRoles.of(Settings(roles={"names": {"a": {}, "b": {}}, "default": "b"},
                                train={"lora_rank": 4})).resolve(None) == "b"


def test_a_role_the_run_does_not_have_is_refused_with_the_runs_roles():
    with pytest.raises(UnknownRole, match=r"role 'coder' is not one of this run's roles \(planner, solver, "
                                          r"critic"):
        two_adapters_and_a_frozen_role().resolve("coder")


def test_trained_roles_of_a_lora_run_are_adapters_and_a_frozen_role_is_the_base_model():
    roles = two_adapters_and_a_frozen_role()
    assert roles.adapters == ("planner", "solver")
    assert [roles.served_model(r) for r in ("planner", "solver", "critic")] == ["planner", "solver", "tiny"]
    assert RunRoles.of(Settings()).served_model(None) == "tiny"  # a full fine-tune: the model itself


def test_each_adapters_version_is_recorded_apart_from_the_servers():
    roles = two_adapters_and_a_frozen_role()
    versions = {"http://a:1": 0, version_field("http://a:1", "planner"): 4,
                version_field("http://a:1", "solver"): 7}
    assert roles.served_version(versions, "http://a:1", "planner") == 4
    assert roles.served_version(versions, "http://a:1", "solver") == 7
    assert roles.served_version(versions, "http://a:1", "critic") == 0  # frozen: never synced
    assert roles.served_version(versions, "http://b:1", "solver") == 0
    full = RunRoles.of(Settings())
    assert full.served_version({"http://a:1": 3}, "http://a:1", None) == 3
    assert split_version_field("solver@http://a:1") == ("http://a:1", "solver")
    assert split_version_field("http://user@a:1") == ("http://user@a:1", None)


@pytest.mark.parametrize(("settings", "error"), [
    ({"roles": {"names": {"a": {}, "b": {}}}}, "a full fine-tune trains one policy: set train.lora_rank"),
    ({"roles": {"names": {"a": {}, "judge": {"trained": False}}}},
     "frozen role 'judge' is served by the base"),
    ({"roles": {"names": {"Planner": {}}}}, "role name 'Planner'"),
    ({"roles": {"names": {"a": {"trained": False}}}, "train": {"lora_rank": 8}}, "has no trained role"),
    ({"roles": {"names": {"a": {}}, "default": "b"}}, "roles.default 'b' is not one of roles.names"),
    ({"roles": {"names": {"tiny": {}}}}, "has the name the base model is served under"),
])
def test_roles_the_model_cannot_serve_are_refused_when_the_settings_are_read(settings, error):
    with pytest.raises(ValidationError, match=error):
        Settings(**settings)

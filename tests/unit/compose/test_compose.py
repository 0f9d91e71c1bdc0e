"""docker-compose.yml (no Docker engine runs here): every service runs a real entry point."""

import importlib
import tomllib

import yaml

from tests.support import REPO

SERVICES = {"dispatcher", "agent-runner", "sandbox-grader", "reward", "trainer", "recorder"}


def compose():
    return yaml.safe_load((REPO / "docker-compose.yml").read_text())["services"]


def scripts():
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]


def resolve(target: str):
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


def test_every_service_is_in_compose_and_runs_its_own_entry_point():
    services = compose()
    assert SERVICES <= set(services)
    for name in SERVICES:
        command = services[name]["command"]
        assert command == [f"rollstream-{name}"]
        assert callable(resolve(scripts()[command[0]]))


def test_every_project_command_in_compose_exists():
    for name, service in compose().items():
        command = service.get("command") or []
        if command and command[0].startswith("rollstream"):
            assert command[0] in scripts(), f"{name}: {command[0]} is not a console script"
            assert callable(resolve(scripts()[command[0]]))


def test_redis_persists_and_services_wait_for_it():
    services = compose()
    config_path = services["redis"]["command"][-1]
    mounted = {volume.split(":")[1]: volume.split(":")[0] for volume in services["redis"]["volumes"]}
    redis_conf = (REPO / mounted[config_path]).read_text()
    assert "appendonly yes" in redis_conf.splitlines() and "maxmemory-policy noeviction" in redis_conf.splitlines()
    for name in SERVICES:
        assert services[name]["depends_on"]["redis"]["condition"] == "service_healthy"
        assert services[name]["environment"]["RS_REDIS_URL"].startswith("redis://redis:")


def test_trainer_and_vllm_see_checkpoints_at_the_same_path():
    services = compose()
    for vllm in ("vllm-cpu", "vllm-gpu"):
        assert set(services["trainer"]["volumes"]) <= set(services[vllm]["volumes"])

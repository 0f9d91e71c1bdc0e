"""docker-compose.yml, statically: every service runs a real entry point, and what `docker compose up` needs
on a real engine is in the file (tests/e2e/test_compose.py runs it where an engine answers)."""

import importlib
import json
import shutil
import subprocess
import tomllib

import pytest
import yaml

from tests.support import REPO, redis_passwords

SERVICES = {"dispatcher", "gateway", "agent-runner", "sandbox-grader", "reward", "trainer",
            "recorder", "console"}


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
    assert "appendonly yes" in redis_conf.splitlines()
    assert "maxmemory-policy noeviction" in redis_conf.splitlines()
    for name in SERVICES:
        assert services[name]["depends_on"]["redis"]["condition"] == "service_healthy"
        assert services[name]["environment"]["RS_REDIS_URL"].startswith("redis://redis:")


def test_trainer_and_vllm_see_checkpoints_at_the_same_path():
    services = compose()
    for vllm in ("vllm-cpu", "vllm-gpu"):
        assert set(services["trainer"]["volumes"]) <= set(services[vllm]["volumes"])


# ------------------------------------------------------------------------------------------------------------
# What `docker compose up` needs on a real engine (tests/e2e/test_compose.py runs it where one answers).
LONG_RUNNING = SERVICES | {"redis", "vllm-cpu", "vllm-gpu"}
DOCKERFILES = {name: (REPO / "compose" / name).read_text()
               for name in ("Dockerfile.slim", "Dockerfile.torch")}


def raw_compose():
    return yaml.safe_load((REPO / "docker-compose.yml").read_text())


def test_every_long_running_service_has_a_healthcheck_and_restarts():
    services = compose()
    for name in LONG_RUNNING:
        assert services[name]["restart"] == "unless-stopped", name
        health = services[name]["healthcheck"]
        assert not health.get("disable") and health["test"][0] == "CMD", name
    for name in SERVICES:
        # every service serves /healthz on RS_HEALTH_PORT: 200 ready, 503 (urlopen raises) otherwise
        assert services[name]["environment"]["RS_HEALTH_PORT"] == "8080"
        assert "http://127.0.0.1:8080/healthz" in " ".join(services[name]["healthcheck"]["test"])
    assert services["model"]["restart"] == "no" and "healthcheck" not in services["model"]


def test_dependencies_wait_for_health_or_completion():
    services = compose()
    for name, service in services.items():
        for dependency, spec in (service.get("depends_on") or {}).items():
            expected = "service_completed_successfully" if dependency == "model" else "service_healthy"
            assert spec["condition"] == expected, (name, dependency)
    for name in ("agent-runner", "trainer"):  # they talk to vLLM: whichever server the profile started
        deps = services[name]["depends_on"]
        assert deps["vllm-cpu"]["required"] is False and deps["vllm-gpu"]["required"] is False


def test_scalable_services_have_no_fixed_names_or_host_ports():
    for name, service in compose().items():
        assert "container_name" not in service, name
        if service.get("profiles") == ["monitoring"]:  # Grafana and Prometheus, on loopback only
            assert all(port.startswith("127.0.0.1:") for port in service["ports"]), name
            continue
        assert "ports" not in service, name  # nothing is published; `docker compose port` needs an override


def test_volumes_are_named_and_declared():
    raw = raw_compose()
    declared = set(raw["volumes"])
    assert {"redis", "runs", "models"} <= declared
    for name, service in raw["services"].items():
        for volume in service.get("volumes") or []:
            source = volume.split(":")[0]
            assert source in declared or source.startswith("./infra/"), (name, volume)


def test_vllm_cpu_has_the_shared_memory_it_needs_and_serves_dev_endpoints():
    service = compose()["vllm-cpu"]
    size = service["shm_size"].lower().rstrip("b")
    megabytes = float(size[:-1]) * {"k": 1 / 1024, "m": 1, "g": 1024}[size[-1]]
    assert megabytes >= 256
    assert service["environment"]["VLLM_SERVER_DEV_MODE"] == "1"
    assert service["profiles"] == ["cpu"] and compose()["vllm-gpu"]["profiles"] == ["gpu"]
    for vllm in ("vllm-cpu", "vllm-gpu"):
        assert compose()[vllm]["networks"]["default"]["aliases"] == ["vllm"]


# tests; coding tools and black-box agents
@pytest.mark.parametrize("name", ["sandbox-grader", "agent-runner"])
def test_the_services_that_make_sandboxes_get_what_bubblewrap_needs_and_no_more(name):
    service = compose()[name]
    assert {"seccomp=unconfined", "systempaths=unconfined"} <= set(service["security_opt"])
    assert "cap_add" not in service and not service.get("privileged")


def test_each_image_is_built_by_one_service_and_named_by_the_others():
    services = compose()
    builders: dict[str, list[str]] = {}
    for name, service in services.items():
        if "build" in service:
            builders.setdefault(service["image"], []).append(name)
            assert service["build"]["dockerfile"] in {f"compose/{f}" for f in DOCKERFILES}
            assert service["build"]["args"]["PYTHON_IMAGE"] == "${PYTHON_IMAGE:-python:3.11-slim}"
    assert all(len(names) == 1 for names in builders.values()), builders
    for name, service in services.items():
        if service["image"].startswith("rollstream-"):
            assert service["image"] in builders, name
    slim = {name for name, service in services.items() if service["image"].startswith("rollstream-slim:")}
    assert slim == SERVICES - {"trainer"}


def test_dockerfiles_default_to_the_public_base_and_keep_the_pins():
    for name, text in DOCKERFILES.items():
        assert "ARG PYTHON_IMAGE=python:3.11-slim" in text, name
        assert "-c constraints.txt" in text, name
        assert "PIP_CERT" in text and "useradd --uid 10001" in text and "USER rollstream" in text, name
        assert (REPO / "compose" / f"{name}.dockerignore").exists(), name
    # torch's CPU build only: the local wheel or PyTorch's CPU index, never an unpinned `torch`
    assert "torch==2.13.0+cpu" in DOCKERFILES["Dockerfile.torch"]
    assert "download.pytorch.org/whl/cpu" in DOCKERFILES["Dockerfile.torch"]
    instructions = [line for line in DOCKERFILES["Dockerfile.slim"].splitlines() if not line.startswith("#")]
    assert not [line for line in instructions if "torch" in line or "[train" in line]


def test_the_slim_image_installs_no_torch():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    heavy = ("torch", "deepspeed", "vllm", "tensorboard")
    assert not [d for d in project["dependencies"] if d.startswith(heavy)]
    assert any(d.startswith("torch==") for d in project["optional-dependencies"]["train"])


def test_the_offline_base_builds_the_images_compose_and_the_dockerfiles_name():
    script = (REPO / "compose" / "build-offline-base.sh").read_text()
    assert "build_base python:3.11-slim " in script
    redis_image = raw_compose()["services"]["redis"]["image"]
    assert redis_image == "${REDIS_IMAGE:-redis:7.0}" and "build_base redis:7.0 " in script
    assert "debootstrap --variant=minbase bookworm" in script and "docker import" in script


def test_the_scripts_parse():
    import subprocess

    for script in ("compose/build-offline-base.sh", "infra/docker-engine.sh"):
        result = subprocess.run(["bash", "-n", str(REPO / script)], capture_output=True, text=True,
                                check=False)
        assert result.returncode == 0, (script, result.stderr)


def test_services_in_containers_listen_on_their_networks_interface():
    # everywhere else they listen on loopback alone (Settings.listen_host's default)
    services = compose()
    for name in SERVICES:
        assert services[name]["environment"]["RS_LISTEN_HOST"] == "0.0.0.0", name


def test_the_console_asks_every_other_service_for_its_health_and_only_reads():
    console = compose()["console"]
    urls = json.loads(console["environment"]["RS_CONSOLE__HEALTH_URLS"])
    assert urls == {name: f"http://{name}:8080" for name in sorted(SERVICES - {"console"})}
    assert all(volume.endswith(":ro") for volume in console["volumes"])


def test_agent_runners_open_black_box_sessions_on_the_gateway_service():
    # the default, 127.0.0.1:8300, is the agent-runner's own container: no gateway there
    services = compose()
    assert services["agent-runner"]["environment"]["RS_GATEWAY__URL"] == "http://gateway:8300"
    assert services["gateway"]["environment"]["RS_GATEWAY__URL"] == "http://gateway:8300"


def test_the_cpu_vllm_server_starts_on_the_runs_newest_policy():
    # rollstream serve-policy reads the newest PolicyUpdated of the run the services work on, from its Redis,
    # and loads its checkpoint from the runs volume at the trainer's path
    # (tests/integration/test_serve_policy.py)
    services = compose()
    vllm, trainer = services["vllm-cpu"], services["trainer"]
    assert vllm["command"][:2] == ["rollstream", "serve-policy"]
    assert callable(resolve(scripts()["rollstream"]))
    for variable in ("RS_RUN_ID", "RS_REDIS_URL", "RS_STORAGE_URI", "RS_MODEL__PATH", "RS_LISTEN_HOST"):
        assert vllm["environment"][variable] == trainer["environment"][variable], variable
    assert vllm["depends_on"]["redis"]["condition"] == "service_healthy"
    assert vllm["env_file"] == trainer["env_file"]


def gpu_compose_config() -> dict:
    """docker-compose.yml with compose/gpu.yml, as `docker compose config` merges them (2 trainer GPUs)."""
    if shutil.which("docker") is None:
        pytest.skip("the docker CLI with Compose v2 merges the files (infra/docker-engine.sh installs it)")
    result = subprocess.run(
        ["docker", "compose", "-f", "docker-compose.yml", "-f", "compose/gpu.yml", "--profile", "gpu",
         "config", "--format", "json"], cwd=REPO, capture_output=True, text=True, timeout=60,
        env={**redis_passwords(), "PATH": "/usr/local/bin:/usr/bin:/bin", "RS_TRAINER_GPUS": "2"})
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)["services"]


def test_on_gpus_the_trainer_gets_torchs_cuda_build_its_gpus_and_a_rank_on_each():
    services = gpu_compose_config()
    trainer = services["trainer"]
    assert trainer["image"].startswith("rollstream-trainer-cuda:")
    assert trainer["build"]["target"] == "trainer" and trainer["build"]["args"]["TORCH_VARIANT"] == "cuda"
    (gpus,) = trainer["deploy"]["resources"]["reservations"]["devices"]
    assert gpus["capabilities"] == ["gpu"] and int(gpus["count"]) == 2
    assert trainer["environment"]["RS_TRAIN__RANKS"] == "2"
    assert trainer["environment"]["RS_TRAIN__BACKEND"] == "deepspeed"
    (vllm_gpus,) = services["vllm-gpu"]["deploy"]["resources"]["reservations"]["devices"]
    assert vllm_gpus["capabilities"] == ["gpu"]
    # the CPU trainer image stays what the model job and the CPU deployment run
    assert services["model"]["image"].startswith("rollstream-trainer:")


def test_the_cuda_variant_pins_pypis_torch_and_vllms_cuda_build():
    def pinned(name: str) -> dict[str, str]:
        return dict(line.split("==", 1) for line in (REPO / name).read_text().splitlines() if "==" in line)

    pins, cpu = pinned("constraints-cuda.txt"), pinned("constraints.txt")
    assert pins["torch"] == cpu["torch"].removesuffix("+cpu")  # the same torch, its CUDA build
    assert pins["vllm"] == cpu["vllm-cpu"] and "vllm-cpu" not in pins
    assert pins["deepspeed"] == cpu["deepspeed"]
    assert any(name.startswith("nvidia-nccl") for name in pins)
    assert 'TORCH_VARIANT" = cuda' in DOCKERFILES["Dockerfile.torch"]
    assert "!constraints-cuda.txt" in (REPO / "compose" / "Dockerfile.torch.dockerignore").read_text()

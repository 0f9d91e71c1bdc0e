"""infra/k8s, offline: the base and every overlay render (`kubectl kustomize`), every object they render is
valid (Kubernetes' JSON schemas from kubernetes-validate, KEDA's CRDs as the models of cloudcoil-models-keda,
the scalers' metadata against KEDA_TRIGGER_METADATA below), each workload is its docker-compose.yml service on
Kubernetes (image, command, settings, Redis user, secrets, volumes, health checks, sandbox options), the
settings' URLs reach the Services that serve them, and KEDA reads the streams, groups and queue the services
use (shared/contract). setup.sh runs against a stand-in kubectl.

    python -m pytest tests/unit/infra/test_kubernetes.py -q
"""

from __future__ import annotations

import functools
import os
import posixpath
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml
from rq import Queue

from rollstream.shared.contract.bus import Keys
from rollstream.shared.contract.consumers import consumer_group
from rollstream.shared.runtime.config import Settings
from tests.support import REPO, skip_does_not_apply

K8S = REPO / "infra" / "k8s"
TARGETS = ["base", *sorted(f"overlays/{kustomization.parent.name}"
                           for kustomization in K8S.glob("overlays/*/kustomization.yaml"))]
REDIS_PASSWORDS = "rollstream-redis-passwords"
"""The secret of the Redis users' passwords (compose: .env), keys RS_REDIS_PASSWORD_<USER>."""
RUN_ENV = "rollstream-run-env"
"""The secret of compose/run.env's variables (the HTTP tokens among them)."""
REDIS_FILES = "rollstream-redis"
"""The ConfigMap of the files compose mounts into Redis (setup.sh makes it from infra/)."""
WORKLOADS = ("Deployment", "StatefulSet", "Job")
COMPOSE_ONLY = {"ops", "prometheus", "grafana"}
"""Not deployed: people's commands (`rollstream inspect`, `replay`) run in a pod of their own; a cluster's own
monitoring scrapes the services' /metrics (their `health` ports), so compose's monitoring profile has no
counterpart here."""
HOST_SPECIFIC = {"RS_FLEET__URLS", "RS_CONSOLE__HEALTH_URLS"}
"""Compose lists no server (they register) unless RS_FLEET_URLS names vLLM's GPU image by its network alias;
here the GPU overlay lists each pod of the vllm StatefulSet by its URL
(test_the_settings_urls_reach_what_serves_them). The console asks compose's services by their names, which
resolve to every replica; here no Service stands for those pods (Kubernetes probes them itself)."""
OVERLAY_SETTINGS = {"overlays/external-redis": {"RS_REDIS_URL"}}
"""Settings an overlay sets to its own value."""
OVERLAY_ENV = {("overlays/gpu", "trainer"): {"RS_TRAIN__RANKS", "RS_TRAIN__BACKEND",
                                             "RS_TRAIN__WEIGHT_TRANSPORT"}}
"""Variables an overlay adds to a workload that its compose service has not."""
OVERLAY_LEAVES_OUT = {"overlays/external-redis": {"redis"}}
VLLM_SERVICE = {"overlays/gpu": "vllm-gpu"}
"""The compose service a target's vllm StatefulSet is (vllm-cpu elsewhere)."""


@dataclass(frozen=True)
class SecretKey:
    """A variable's value that is a secret's key."""
    secret: str
    key: str


@functools.cache
def _render(target: str) -> tuple[dict, ...]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed (Debian: apt-get install kubernetes-client, as .ci/run does)")
    done = subprocess.run([kubectl, "kustomize", str(K8S / target)], check=False, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, f"kubectl kustomize {target} failed:\n{done.stderr}"
    return tuple(doc for doc in yaml.safe_load_all(done.stdout) if doc)


class Rendered:
    """The objects of one target, by kind and name."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.objects = list(_render(target))
        self.by_kind: dict[str, dict[str, dict]] = {}
        for obj in self.objects:
            self.by_kind.setdefault(obj["kind"], {})[obj["metadata"]["name"]] = obj

    def of(self, kind: str) -> dict[str, dict]:
        return self.by_kind.get(kind, {})

    def workloads(self) -> dict[str, dict]:
        return {name: obj for kind in WORKLOADS for name, obj in self.of(kind).items()}

    def settings(self) -> dict[str, str]:
        [data] = [obj["data"] for name, obj in self.of("ConfigMap").items()
                  if name.startswith("rollstream-settings")]
        return data

    def env(self, container: dict) -> tuple[dict[str, str | SecretKey], list[tuple[str, bool]]]:
        """A container's variables (ConfigMaps resolved, secrets' keys as SecretKey; `env` wins over
        `envFrom`, a later envFrom over an earlier one) and the secrets it takes whole (name, optional)."""
        values: dict[str, str | SecretKey] = {}
        whole: list[tuple[str, bool]] = []
        for source in container.get("envFrom", []):
            if "configMapRef" in source:
                values.update(self.of("ConfigMap")[source["configMapRef"]["name"]]["data"])
            else:
                whole.append((source["secretRef"]["name"], source["secretRef"].get("optional", False)))
        for var in container.get("env", []):
            ref = var.get("valueFrom", {}).get("secretKeyRef")
            values[var["name"]] = SecretKey(ref["name"], ref["key"]) if ref else var["value"]
        return values, whole


def pod(workload: dict) -> dict:
    return workload["spec"]["template"]["spec"]


def main_container(name: str, workload: dict) -> dict:
    """The container named as its workload: the compose service's own."""
    [container] = [c for c in pod(workload)["containers"] if c["name"] == name]
    return container


def compose_services() -> dict[str, dict]:
    return yaml.safe_load((REPO / "docker-compose.yml").read_text())["services"]


def compose_value(value) -> str | SecretKey:
    """A compose value with its variables' defaults; `${NAME:?...}` (a password from .env) as the key NAME
    of the passwords' secret."""
    value = str(value)
    required = re.fullmatch(r"\$\{(\w+):\?[^}]*\}", value)
    if required:
        return SecretKey(REDIS_PASSWORDS, required[1])
    value = re.sub(r"\$\{\w+:-([^}]*)\}", lambda match: match[1], value)
    assert "${" not in value, value
    return value


def seconds(duration: str) -> int:
    return int(re.fullmatch(r"(\d+)s", duration)[1])


def mebibytes(size: str) -> float:
    """Compose's 1gb / Kubernetes' 1Gi in MiB."""
    number, unit = re.fullmatch(r"(\d+)([a-zA-Z]*)", size).groups()
    return int(number) * {"k": 1 / 1024, "m": 1, "g": 1024}[unit[:1].lower()] if unit else int(number) / 2**20


def acl_users() -> set[str]:
    lines = (REPO / "infra" / "redis-users.acl").read_text().splitlines()
    return {line.split()[0] for line in lines if line.strip() and not line.startswith("#")}


def password_key(user: str) -> str:
    """infra/redis-passwords.sh's variable for a user's password."""
    return "RS_REDIS_PASSWORD_" + user.upper().replace("-", "_")


def overlay_image(target: str, image: str) -> str:
    """A compose image as the target's kustomization renames it (`images:`)."""
    name, _, tag = image.rpartition(":")
    kustomization = yaml.safe_load((K8S / target / "kustomization.yaml").read_text())
    for entry in kustomization.get("images", []):
        if entry["name"] == name:
            name, tag = entry.get("newName", name), entry.get("newTag", tag)
    return f"{name}:{tag}"


@pytest.fixture(params=TARGETS)
def rendered(request) -> Rendered:
    return Rendered(request.param)


def settings_of(env: dict[str, str | SecretKey], monkeypatch) -> Settings:
    """The Settings a container's variables make (a secret's value stands in for its key)."""
    for name in list(os.environ):
        if name.startswith("RS_"):
            monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, "a-secret-from-the-cluster" if isinstance(value, SecretKey) else value)
    return Settings()


# ------------------------------------------------------------------------------------------------------------
# Every object is valid.

def test_every_object_lives_in_the_namespace(rendered):
    namespaces = {obj["metadata"].get("namespace") for obj in rendered.objects if obj["kind"] != "Namespace"}
    assert namespaces == {"rollstream"} and set(rendered.of("Namespace")) == {"rollstream"}


def test_kubernetes_objects_match_the_api_schemas(rendered):
    """Strict schemas (no field Kubernetes does not know) of the oldest and the newest release that
    kubernetes-validate carries: what the manifests use is in every release between."""
    kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate")
    from kubernetes_validate.utils import all_versions

    problems = []
    for version in (all_versions()[0], all_versions()[-1]):
        for obj in rendered.objects:
            if obj["apiVersion"].startswith("keda.sh/"):
                continue
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                problems.append(f"{obj['kind']}/{obj['metadata']['name']} (Kubernetes {version}) "
                                f"{'.'.join(map(str, exc.absolute_path))}: {exc.message}")
            except kubernetes_validate.SchemaNotFoundError as exc:
                problems.append(exc.message)
    assert not problems, "\n".join(problems)


EXTERNAL = {"ConfigMap": {REDIS_FILES}, "Secret": {REDIS_PASSWORDS, RUN_ENV}}
"""What the manifests name that setup.sh makes (test_setup_makes_redis_files_and_secrets_...)."""


def pod_problems(rendered: Rendered, name: str, workload: dict) -> list[str]:
    """What the API server or the kubelet would refuse, or find missing, and no schema says."""
    spec, labels = pod(workload), workload["spec"]["template"]["metadata"]["labels"]
    selector = workload["spec"].get("selector", {}).get("matchLabels", {})  # a Job makes its own
    problems = [] if selector.items() <= labels.items() else [f"{name}: its selector misses its pods"]
    volumes = {v["name"] for v in spec.get("volumes", [])}
    volumes |= {claim["metadata"]["name"] for claim in workload["spec"].get("volumeClaimTemplates", [])}
    config_maps = set(rendered.of("ConfigMap")) | EXTERNAL["ConfigMap"]
    for container in spec.get("initContainers", []) + spec["containers"]:
        where = f"{name}/{container['name']}"
        problems += [f"{where}: mounts no volume {m['name']}" for m in container.get("volumeMounts", [])
                     if m["name"] not in volumes]
        names = [var["name"] for var in container.get("env", [])]
        problems += [f"{where}: {var} twice" for var in set(names) if names.count(var) > 1]
        refs = [(kind, ref["name"]) for source in container.get("envFrom", []) for kind, ref in
                (("ConfigMap", source.get("configMapRef")), ("Secret", source.get("secretRef"))) if ref]
        refs += [("Secret", var["valueFrom"]["secretKeyRef"]["name"]) for var in container.get("env", [])
                 if "secretKeyRef" in var.get("valueFrom", {})]
        problems += [f"{where}: no {kind} {ref}" for kind, ref in refs
                     if ref not in (config_maps if kind == "ConfigMap" else EXTERNAL["Secret"])]
    problems += [f"{name}: no ConfigMap {v['configMap']['name']}" for v in spec.get("volumes", [])
                 if "configMap" in v and v["configMap"]["name"] not in config_maps]
    if workload["kind"] == "StatefulSet" and workload["spec"]["serviceName"] not in rendered.of("Service"):
        problems.append(f"{name}: no Service {workload['spec']['serviceName']} governs it")
    return problems


def test_pods_name_only_what_exists(rendered):
    problems = [problem for name, workload in rendered.workloads().items()
                for problem in pod_problems(rendered, name, workload)]
    problems += [f"TriggerAuthentication/{name}: no Secret {ref['name']}"
                 for name, auth in rendered.of("TriggerAuthentication").items()
                 for ref in auth["spec"].get("secretTargetRef", []) if ref["name"] not in EXTERNAL["Secret"]]
    assert not problems, "\n".join(problems)


COUNT = {"type": "string", "pattern": "^[1-9][0-9]*$"}
REDIS_CONNECTION = {"address": {"type": "string", "pattern": r"^[a-z0-9.-]+:[0-9]+$"},
                    "usernameFromEnv": {"type": "string"}, "passwordFromEnv": {"type": "string"},
                    "databaseIndex": {"type": "string", "pattern": "^[0-9]+$"},
                    "enableTLS": {"enum": ["true", "false"]}}
KEDA_TRIGGER_METADATA = {
    # KEDA's CRD leaves a trigger's metadata free (strings); its scalers read these keys (KEDA's docs,
    # scalers redis-streams and redis-lists), and a misspelt one would be ignored where it runs.
    "redis-streams": {
        "type": "object", "additionalProperties": False, "required": ["address", "stream"],
        "properties": {**REDIS_CONNECTION, "stream": {"type": "string", "minLength": 1},
                       "consumerGroup": {"type": "string", "minLength": 1}, "pendingEntriesCount": COUNT,
                       "lagCount": COUNT, "activationLagCount": COUNT, "streamLength": COUNT},
        # one measure per trigger; pending entries and lag are a consumer group's
        "oneOf": [{"required": [measure]} for measure in ("pendingEntriesCount", "lagCount", "streamLength")],
        "dependentRequired": {"pendingEntriesCount": ["consumerGroup"], "lagCount": ["consumerGroup"]},
    },
    "redis": {
        "type": "object", "additionalProperties": False, "required": ["address", "listName", "listLength"],
        "properties": {**REDIS_CONNECTION, "listName": {"type": "string", "minLength": 1},
                       "listLength": COUNT, "activationListLength": COUNT},
    },
}
"""The metadata of the scalers the manifests use; written here, since no package ships KEDA's scalers'."""


def unknown_fields(given, parsed, path: str = "") -> list[str]:
    """Where `given` has what the model did not keep (a field KEDA's CRD lacks) or a value it changed."""
    if isinstance(given, dict) and isinstance(parsed, dict):
        return [problem for key, value in given.items()
                for problem in (unknown_fields(value, parsed[key], f"{path}.{key}") if key in parsed
                                else [f"{path}.{key}: not in KEDA's CRD"])]
    if isinstance(given, list) and isinstance(parsed, list) and len(given) == len(parsed):
        return [problem for i, (a, b) in enumerate(zip(given, parsed))
                for problem in unknown_fields(a, b, f"{path}[{i}]")]
    return [] if given == parsed else [f"{path}: {given!r} read as {parsed!r}"]


def test_keda_objects_match_kedas_crds(rendered):
    objects = [obj for obj in rendered.objects if obj["apiVersion"].startswith("keda.sh/")]
    if not objects:
        skip_does_not_apply("this target deploys no KEDA objects")
    keda = pytest.importorskip("cloudcoil.models.keda.v1alpha1", reason="pip install cloudcoil-models-keda")
    import jsonschema
    import pydantic

    problems = []
    for obj in objects:
        name = f"{obj['kind']}/{obj['metadata']['name']}"
        try:
            parsed = getattr(keda, obj["kind"]).model_validate(obj)
        except pydantic.ValidationError as exc:
            problems.append(f"{name}: {exc}")
            continue
        kept = parsed.model_dump(mode="json", by_alias=True, exclude_unset=True)
        problems += [name + problem for problem in unknown_fields(obj, kept)]
        for i, trigger in enumerate(obj.get("spec", {}).get("triggers", [])):
            schema = KEDA_TRIGGER_METADATA.get(trigger["type"], {"not": {}})
            validator = jsonschema.Draft202012Validator(schema)
            problems += [f"{name} trigger {i} ({trigger['type']}): {error.message}"
                         for error in validator.iter_errors(trigger["metadata"])]
        for ref in obj.get("spec", {}).get("secretTargetRef", []):
            if ref["parameter"] not in ("username", "password"):
                problems.append(f"{name}: a redis scaler takes no parameter {ref['parameter']!r}")
    assert not problems, "\n".join(problems)


# ------------------------------------------------------------------------------------------------------------
# Each workload is its compose service.

def compose_service_of(target: str, workload: str) -> str:
    return VLLM_SERVICE.get(target, "vllm-cpu") if workload == "vllm" else workload


def test_every_compose_service_is_deployed_and_nothing_else(rendered):
    services = compose_services()
    vllm = compose_service_of(rendered.target, "vllm")
    expected = set(services) - COMPOSE_ONLY - ({"vllm-cpu", "vllm-gpu"} - {vllm})
    expected -= OVERLAY_LEAVES_OUT.get(rendered.target, set())
    deployed = {compose_service_of(rendered.target, name) for name in rendered.workloads()}
    assert deployed == expected
    for name, workload in rendered.workloads().items():
        # compose's long-running services restart unless stopped; its one-shot (`restart: "no"`) is a Job
        one_shot = services[compose_service_of(rendered.target, name)].get("restart") == "no"
        assert (workload["kind"] == "Job") == one_shot, name


def env_problems(rendered: Rendered, name: str, service: dict, container: dict) -> list[str]:
    """Same variables with the same values (but the host-specific and an overlay's own), the Redis password
    from the same key of the passwords' secret, compose/run.env as the optional secret that every explicit
    variable overrides, as compose's environment overrides its env_file."""
    expected = {var: compose_value(value) for var, value in (service.get("environment") or {}).items()}
    actual, whole = rendered.env(container)
    problems = []
    for var, want in expected.items():
        if isinstance(want, SecretKey) and want.key == var and (want.secret, False) in whole:
            continue  # the whole secret, every key under its own name (Redis takes each user's password)
        if var not in actual:
            problems.append(f"{name}: no {var}")
        elif var not in HOST_SPECIFIC | OVERLAY_SETTINGS.get(rendered.target, set()) and actual[var] != want:
            problems.append(f"{name}: {var}={actual[var]!r}, compose has {want!r}")
    extra = set(actual) - set(expected) - OVERLAY_ENV.get((rendered.target, name), set())
    problems += [f"{name}: {var} is not in compose's environment" for var in sorted(extra)]
    run_env = [i for i, source in enumerate(container.get("envFrom", []))
               if source.get("secretRef", {}).get("name") == RUN_ENV]
    if service.get("env_file"):
        [env_file] = service["env_file"]
        settings_at = [i for i, source in enumerate(container["envFrom"]) if "configMapRef" in source]
        if not (run_env == [0] and (RUN_ENV, not env_file["required"]) in whole and settings_at > run_env):
            problems.append(f"{name}: compose's env_file should be the first envFrom, secret {RUN_ENV}, "
                            f"optional as it is not required")
    elif run_env:
        problems.append(f"{name}: compose gives it no env_file")
    return problems


def test_workloads_run_their_compose_services_image_command_and_settings(rendered):
    services = compose_services()
    problems = []
    for name, workload in rendered.workloads().items():
        service = services[compose_service_of(rendered.target, name)]
        container = main_container(name, workload)
        image = overlay_image(rendered.target, compose_value(service["image"]))
        if container["image"] != image:
            problems.append(f"{name}: image {container['image']}, compose's is {image}")
        # compose's command replaces the image's CMD: Kubernetes' args (its command would replace ENTRYPOINT)
        if "command" in container or container.get("args") != service["command"]:
            problems.append(f"{name}: args {container.get('args')}, compose's command {service['command']}")
        problems += env_problems(rendered, name, service, container)
    assert not problems, "\n".join(problems)


def test_each_service_is_its_own_redis_user_with_its_own_password(rendered):
    problems = []
    for name, workload in rendered.workloads().items():
        env, _ = rendered.env(main_container(name, workload))
        if "RS_REDIS_USERNAME" not in env and "RS_REDIS_PASSWORD" not in env:
            continue
        user, password = env.get("RS_REDIS_USERNAME"), env.get("RS_REDIS_PASSWORD")
        if user not in acl_users() or password != SecretKey(REDIS_PASSWORDS, password_key(user)):
            problems.append(f"{name}: user {user!r} (infra/redis-users.acl) with password {password}")
    assert not problems, "\n".join(problems)


def volume_problems(name: str, service: dict, workload: dict, container: dict) -> list[str]:
    """Compose's volumes at the same paths, read-only where compose's are: its named volumes as the claims
    of the same names, its files of infra/ as keys of the ConfigMap setup.sh makes of them."""
    mounts = {mount["mountPath"]: mount for mount in container.get("volumeMounts", [])}
    volumes = {volume["name"]: volume for volume in pod(workload).get("volumes", [])}
    templates = {claim["metadata"]["name"] for claim in workload["spec"].get("volumeClaimTemplates", [])}
    problems, used = [], {"/dev/shm"}  # shared memory: test_shared_memory_and_process_reaping_as_compose
    for entry in service.get("volumes") or []:
        source, path, *mode = entry.split(":")
        if source.startswith("./"):  # the key of the same name, the ConfigMap mounted in the file's folder
            if posixpath.basename(source) != posixpath.basename(path):
                problems.append(f"{name}: {entry}: a ConfigMap key keeps the file's name")
            path, wanted = posixpath.dirname(path), {"configMap": {"name": REDIS_FILES}}
        else:
            wanted = {"persistentVolumeClaim": {"claimName": source}}
        mount = mounts.get(path)
        used.add(path)
        volume = volumes.get(mount["name"], {}) if mount else {}
        in_volume = {key: value for key, value in volume.items() if key != "name"}
        from_template = mount is not None and mount["name"] == source and source in templates
        if mount is None or not (in_volume == wanted or from_template):
            problems.append(f"{name}: {entry} is not mounted from {wanted}")
        elif bool(mount.get("readOnly")) != (mode == ["ro"]):
            problems.append(f"{name}: {entry}: readOnly {mount.get('readOnly')}")
    problems += [f"{name}: mounts {path}, which compose does not" for path in sorted(set(mounts) - used)]
    return problems


def test_workloads_mount_what_compose_mounts_where_compose_mounts_it(rendered):
    services = compose_services()
    problems = [problem for name, workload in rendered.workloads().items()
                for problem in volume_problems(name, services[compose_service_of(rendered.target, name)],
                                               workload, main_container(name, workload))]
    assert not problems, "\n".join(problems)


def probe_problems(name: str, health: dict, container: dict) -> list[str]:
    """Readiness asks what compose's healthcheck asks, as often, as patiently; liveness asks the same, from
    the end of compose's start period."""
    test = health["test"][1:]
    url = re.search(r"http://127\.0\.0\.1:(\d+)(/\w+)", " ".join(test))
    action = {"httpGet": {"path": url[2], "port": int(url[1])}} if url else {"exec": {"command": test}}
    readiness, liveness = container.get("readinessProbe", {}), container.get("livenessProbe", {})
    problems = [f"{name}: {kind} should be {action}" for kind, probe in (("readiness", readiness),
                                                                          ("liveness", liveness))
                if {key: probe.get(key) for key in action} != action]
    timing = {"periodSeconds": seconds(health["interval"]), "timeoutSeconds": seconds(health["timeout"]),
              "failureThreshold": health["retries"]}
    if {key: readiness.get(key) for key in timing} != timing:
        problems.append(f"{name}: readiness should be {timing}")
    if "start_period" in health and liveness.get("initialDelaySeconds") != seconds(health["start_period"]):
        problems.append(f"{name}: liveness should wait compose's start period {health['start_period']}")
    return problems


def test_probes_ask_what_compose_healthchecks_ask(rendered):
    services = compose_services()
    problems = []
    for name, workload in rendered.workloads().items():
        health = services[compose_service_of(rendered.target, name)].get("healthcheck")
        if health is None:
            assert workload["kind"] == "Job", f"{name}: compose has no healthcheck for it"
            continue
        problems += probe_problems(name, health, main_container(name, workload))
    assert not problems, "\n".join(problems)


def test_sandboxes_get_what_compose_gives_them_and_no_more(rendered):
    """seccomp=unconfined as the Unconfined profile, systempaths=unconfined as procMount Unmasked (what
    bubblewrap needs to make its namespaces and its /proc); no privileged or added capability anywhere."""
    services = compose_services()
    problems = []
    for name, workload in rendered.workloads().items():
        options = set(services[compose_service_of(rendered.target, name)].get("security_opt", []))
        context = main_container(name, workload).get("securityContext", {})
        profile = {**pod(workload).get("securityContext", {}), **context}.get("seccompProfile", {})
        profile = profile.get("type")
        if ("seccomp=unconfined" in options) != (profile == "Unconfined"):
            problems.append(f"{name}: seccomp profile {profile}, compose's security_opt {sorted(options)}")
        if ("systempaths=unconfined" in options) != (context.get("procMount") == "Unmasked"):
            problems.append(f"{name}: procMount {context.get('procMount')}, compose's {sorted(options)}")
        if context.get("privileged") or context.get("capabilities", {}).get("add"):
            problems.append(f"{name}: privileged or with added capabilities")
    assert not problems, "\n".join(problems)


def test_shared_memory_and_process_reaping_as_compose(rendered):
    """shm_size (or ipc: host) as a memory-backed /dev/shm at least as large; `init: true` as a shared
    process namespace, whose PID 1 (the pod's pause container) reaps the sandboxes' orphans."""
    services = compose_services()
    problems = []
    for name, workload in rendered.workloads().items():
        service = services[compose_service_of(rendered.target, name)]
        shm = [mount["name"] for mount in main_container(name, workload).get("volumeMounts", [])
               if mount["mountPath"] == "/dev/shm"]
        volume = next((v for v in pod(workload).get("volumes", []) if shm and v["name"] == shm[0]), {})
        memory = volume.get("emptyDir", {})
        if ("shm_size" in service or service.get("ipc") == "host") and memory.get("medium") != "Memory":
            problems.append(f"{name}: compose gives it shared memory; no memory-backed /dev/shm here")
        if "shm_size" in service and mebibytes(memory.get("sizeLimit", "0")) < mebibytes(service["shm_size"]):
            problems.append(f"{name}: /dev/shm {memory.get('sizeLimit')} < compose's {service['shm_size']}")
        if service.get("init") and not pod(workload).get("shareProcessNamespace"):
            problems.append(f"{name}: compose runs it with init: true")
    assert not problems, "\n".join(problems)


# ------------------------------------------------------------------------------------------------------------
# The settings: valid, and their URLs reach what serves them.

def test_every_services_settings_are_valid(rendered, monkeypatch):
    """Every rollstream container's variables make Settings (no misspelt or unknown RS_ name: extra is
    forbidden; several trainer ranks with DeepSpeed)."""
    for name, workload in rendered.workloads().items():
        env, _ = rendered.env(main_container(name, workload))
        if any(var.startswith("RS_") for var in env):
            settings_of(env, monkeypatch)


def serves(rendered: Rendered, service: dict, port: int) -> list[str]:
    """The names of the workloads whose pods a Service selects on that port (its target port declared)."""
    [service_port] = [p for p in service["spec"]["ports"] if p["port"] == port] or [None]
    if service_port is None:
        return []
    selector = service["spec"]["selector"].items()
    return [name for name, workload in rendered.workloads().items()
            if selector <= workload["spec"]["template"]["metadata"]["labels"].items()
            and service_port["targetPort"] in {port["containerPort"]
                                               for port in main_container(name, workload).get("ports", [])}]


def test_the_settings_urls_reach_what_serves_them(rendered, monkeypatch):
    """RS_REDIS_URL and RS_GATEWAY__URL name Services in front of Redis and the gateway (on the port the
    gateway serves); rollstream's vLLM servers register in the fleet, and RS_FLEET__URLS names every server of
    vLLM's own image by its pod: a headless Service governs the StatefulSet, one URL per replica."""
    settings = settings_of(rendered.settings(), monkeypatch)
    services = rendered.of("Service")
    redis = urlsplit(settings.redis_url)
    if "RS_REDIS_URL" not in OVERLAY_SETTINGS.get(rendered.target, set()):  # else a Redis of the overlay's
        assert serves(rendered, services[redis.hostname], redis.port) == ["redis"]
    gateway = urlsplit(settings.gateway.url)
    assert gateway.port == settings.gateway.port
    assert serves(rendered, services[gateway.hostname], gateway.port) == ["gateway"]
    vllm = rendered.of("StatefulSet")["vllm"]
    args = main_container("vllm", vllm)["args"]
    port, governing = int(args[args.index("--port") + 1]), services[vllm["spec"]["serviceName"]]
    assert governing["spec"]["clusterIP"] == "None" and serves(rendered, governing, port) == ["vllm"]
    # the servers register themselves (fleet.registry), or are listed where they cannot (vLLM's own image)
    listed = [] if main_container("vllm", vllm)["image"].startswith("rollstream-") else [
        f"http://vllm-{i}.{vllm['spec']['serviceName']}:{port}" for i in range(vllm["spec"]["replicas"])]
    assert settings.fleet.registry and settings.fleet.urls == listed
    for name, workload in rendered.workloads().items():  # /healthz where the probes and scrapers look
        ports = {p["containerPort"] for p in main_container(name, workload).get("ports", [])}
        if workload["kind"] != "Job" and name not in ("redis", "vllm"):
            assert settings.health_port in ports, name


def test_claims_and_gpus_are_as_the_workloads_need(rendered):
    """Every claim a pod mounts exists, those several pods share are ReadWriteMany (ReadWriteOnce where one
    node runs everything); a service that compose gives GPUs gets some; a trainer with GPUs runs a rank per
    GPU; GPU requests equal limits."""
    claims = rendered.of("PersistentVolumeClaim")
    one_node = rendered.target == "overlays/cpu-dev"
    services = compose_services()
    for name, workload in rendered.workloads().items():
        reserved = services[compose_service_of(rendered.target, name)].get("deploy", {}).get("resources", {})
        wants_gpus = any("gpu" in device["capabilities"]
                         for device in reserved.get("reservations", {}).get("devices", []))
        for volume in pod(workload).get("volumes", []):
            if "persistentVolumeClaim" in volume:
                claim = claims[volume["persistentVolumeClaim"]["claimName"]]
                assert claim["spec"]["accessModes"] == ["ReadWriteOnce" if one_node else "ReadWriteMany"]
        resources = main_container(name, workload).get("resources", {})
        gpus = resources.get("limits", {}).get("nvidia.com/gpu")
        assert resources.get("requests", {}).get("nvidia.com/gpu") == gpus, name
        assert not wants_gpus or gpus, f"{name}: compose reserves GPUs for it"
        if name == "trainer" and gpus:
            env, _ = rendered.env(main_container(name, workload))
            assert int(env["RS_TRAIN__RANKS"]) == gpus and env["RS_TRAIN__BACKEND"] == "deepspeed"


# ------------------------------------------------------------------------------------------------------------
# KEDA reads what the services use.

def keda_problems(rendered: Rendered, scaled: dict, monkeypatch) -> list[str]:
    """One ScaledObject's triggers: the run's stream and the service's consumer group (or its RQ queue), on
    the Redis of RS_REDIS_URL, as the service's own user with its own password; targets a replica's worth."""
    target, namespace = scaled["spec"]["scaleTargetRef"]["name"], scaled["metadata"]["namespace"]
    workload = rendered.of("Deployment")[target]
    env, _ = rendered.env(main_container(target, workload))
    settings = settings_of(env, monkeypatch)
    keys, group = Keys(settings.run_id), consumer_group(target)
    redis = urlsplit(settings.redis_url)
    # KEDA's operator runs in its own namespace: a Service of this one by its full name
    host = redis.hostname if "." in redis.hostname else f"{redis.hostname}.{namespace}.svc.cluster.local"
    address = f"{host}:{redis.port}"
    auths = rendered.of("TriggerAuthentication")
    queue = Queue.redis_queue_namespace_prefix + keys.job_queue(settings.grader.queue)
    # a replica's worth: the episodes it runs at once; the entries its enqueuer reads at once
    targets = {"agent-runner": str(settings.rollout.concurrency),
               "sandbox-grader": str(settings.bus.read_count)}
    problems = []
    if "replicas" in workload["spec"]:
        problems.append(f"{target}: the Deployment sets replicas, which KEDA owns (each apply resets them)")
    for i, trigger in enumerate(scaled["spec"]["triggers"]):
        meta, where = trigger["metadata"], f"{target} trigger {i}"
        auth = auths.get(trigger.get("authenticationRef", {}).get("name"), {"spec": {}})
        password = {ref["parameter"]: SecretKey(ref["name"], ref["key"])
                    for ref in auth["spec"].get("secretTargetRef", [])}.get("password")
        if meta["address"] != address or meta.get("databaseIndex", "0") != redis.path.strip("/"):
            problems.append(f"{where}: address {meta['address']}, RS_REDIS_URL is {settings.redis_url}")
        user = env.get(meta.get("usernameFromEnv"))
        if user != settings.redis_username or password != env["RS_REDIS_PASSWORD"]:
            problems.append(f"{where}: not {target}'s Redis user and password")
        if trigger["type"] == "redis":
            if meta["listName"] != queue:
                problems.append(f"{where}: list {meta['listName']}, the RQ queue is {queue}")
            continue
        if meta["stream"] not in {keys.stream(stream) for stream in group.streams}:
            problems.append(f"{where}: {meta['stream']} is none of {group.streams} of run {settings.run_id}")
        if meta["consumerGroup"] != group.name:
            problems.append(f"{where}: group {meta['consumerGroup']}, the service's is {group.name}")
        for measure in ("lagCount", "pendingEntriesCount"):
            if measure in meta and meta[measure] != targets[target]:
                problems.append(f"{where}: {measure} {meta[measure]}, a replica's worth is {targets[target]}")
    return problems


def test_keda_scales_on_the_services_own_streams_and_queue(rendered, monkeypatch):
    scaled = rendered.of("ScaledObject")
    if not scaled:
        skip_does_not_apply("this target deploys no KEDA objects")
    assert set(scaled) == {"agent-runner", "sandbox-grader"}
    problems = [problem for obj in scaled.values() for problem in keda_problems(rendered, obj, monkeypatch)]
    assert not problems, "\n".join(problems)


def test_some_target_deploys_keda():
    assert any("ScaledObject" in Rendered(target).by_kind for target in TARGETS)


# ------------------------------------------------------------------------------------------------------------
# setup.sh, against a kubectl that records what it is asked.

FAKE_KUBECTL = r"""#!/bin/sh
# records its calls and the env files it is given; nothing exists but with FAKE_EXISTING, and then every
# password but FAKE_MISSING's
echo "$*" >> "$FAKE_KUBECTL/calls"
for arg; do
  case $arg in --from-env-file=*) cp "${arg#*=}" "$FAKE_KUBECTL/" ;; esac
done
case " $* " in
  *" jsonpath={.data.$FAKE_MISSING} "*) ;;
  *" jsonpath="*) echo c2VjcmV0 ;;
  *" get "*) [ -n "$FAKE_EXISTING" ] ;;
  *" apply -f - "*) cat > /dev/null ;;
esac
"""


def run_setup(tmp_path: Path, existing: bool = False, missing: str = "") -> Path:
    bin_dir, log = tmp_path / "bin", tmp_path / "log"
    bin_dir.mkdir()
    log.mkdir()
    (bin_dir / "kubectl").write_text(FAKE_KUBECTL)
    (bin_dir / "kubectl").chmod(0o755)
    (tmp_path / "run.env").write_text("RS_TRAIN__TOTAL_VERSIONS=8\n")
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "RS_ENV_FILE": str(tmp_path / "run.env"),
           "FAKE_KUBECTL": str(log), "FAKE_EXISTING": "1" if existing else "", "FAKE_MISSING": missing}
    done = subprocess.run(["sh", str(K8S / "setup.sh")], check=False, env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    return log


def env_file(path: Path) -> dict[str, str]:
    return dict(line.split("=", 1) for line in path.read_text().splitlines())


def test_setup_makes_redis_files_and_secrets_from_the_files_compose_uses(tmp_path):
    log = run_setup(tmp_path)
    calls = (log / "calls").read_text().splitlines()
    assert "create namespace rollstream" in calls
    made = {" ".join(call.split()[2:6]) for call in calls if call.split()[2:3] == ["create"]}
    assert made >= {f"create secret generic {name}" for name in EXTERNAL["Secret"]}
    # the files compose mounts into Redis, each under its own name
    [configmap] = [call.split() for call in calls
                   if call.startswith(f"-n rollstream create configmap {REDIS_FILES} ")]
    mounted = {(REPO / entry.split(":")[0]).resolve() for entry in compose_services()["redis"]["volumes"]
               if entry.startswith("./")}
    files = {Path(arg.split("=", 1)[1]).resolve() for arg in configmap if arg.startswith("--from-file=")}
    assert files == mounted
    passwords = env_file(log / "passwords.env")
    assert set(passwords) == {password_key(user) for user in acl_users()} and all(passwords.values())
    run_env = env_file(log / "run.env")
    assert run_env["RS_TRAIN__TOTAL_VERSIONS"] == "8"
    assert len(run_env["RS_SECURITY__HTTP_TOKEN"]) >= 16  # SecuritySettings' shortest token


def test_setup_keeps_what_it_made_and_adds_a_password_for_a_new_user(tmp_path):
    log = run_setup(tmp_path, existing=True, missing=password_key("recorder"))
    calls = (log / "calls").read_text().splitlines()
    patches = [call for call in calls if " patch secret " in call]
    assert len(patches) == 1 and password_key("recorder") in patches[0]
    assert not any(" create secret " in call or "create namespace" in call for call in calls)

"""`docker compose --profile cpu up` on a real Docker engine, the way users run it: images built offline
(compose/build-offline-base.sh, then `docker compose build`), Redis, vLLM on the CPU, the one-shot model
service and every service as containers, three agent-runner replicas. Skipped, with the reason, when no
engine answers (DOCKER_HOST is honoured; CI starts one with infra/docker-engine.sh). The `models` volume
holds the models `make setup` built, as on a deployment's second `up`: the model service builds nothing.

One run of a unique compose project: the test waits until every replica has finished episodes, then
takes down two replicas while they hold prompts: one with `docker kill` (Docker counts that as a manual
stop: the restart policy leaves it down) and one whose process dies by SIGKILL (a crash: the restart
policy, unless-stopped, brings it back). The prompts both held are reclaimed (XAUTOCLAIM). Once a policy
version is out, the vLLM server crashes too: restarted, it must serve the newest published version, not the
starting model. The run goes on to its last policy version with nothing lost, no batch trained twice and no
other container restarted; `docker compose down -v` leaves nothing behind.

Two of the run's prompt groups are black-box episodes of the Harbor task fix-add (the dataset, written by the
test, mixes them among the synthetic arithmetic rows): the tests' own small agent (tests/fixtures/
agent-runtime) run by the agent-runner containers in bubblewrap, its requests through the gateway container,
its diff graded by the sandbox-grader container, its samples trained like the others.

Redis is published on a random localhost port by a test-only override file (which also mounts the dataset,
the agent's runtime and the task), so the test watches the run as it goes, as Redis's admin user (every
service has a user of its own; the passwords are new for each stack). The final accounting is the chaos
audit's (streams' whole history, archive included, and the batch Parquet files in the `runs` volume), run
in the stack's `ops` container (tests/e2e/run_report.py).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import uuid

import pytest

from rollstream.cli.chaos.audit import BATCHED_DROP_CAUSES
from rollstream.shared.tasks.datasets import arithmetic_dataset
from rollstream.shared.tasks.harbor import load_harbor_task
from rollstream.shared.tasks.prompts import task_prompt_row
from tests.support import FIXTURES, MODELS, REPO, docker_client, redis_passwords

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1800)]

VERSIONS = 8
BATCH = 16
GROUP = 4
REPLICAS = 3
SETTINGS = {
    "RS_TRAIN__TOTAL_VERSIONS": VERSIONS,
    "RS_TRAIN__BATCH_SIZE": BATCH,
    "RS_DATA__SAMPLES_PER_PROMPT": GROUP,
    # few episodes per replica at once, so all three take prompts from the start
    "RS_ROLLOUT__CONCURRENCY": 4,
    # a dead replica's prompts are reclaimed after this long (live ones refresh theirs every third of it)
    "RS_BUS__RECLAIM_IDLE_MS": 6000,
    # the dataset and the black-box agent, mounted by the override file (Stack)
    "RS_DATA__PATH": "/e2e/dataset.jsonl",
    "RS_AGENT__COMMAND": "chat-agent",
    "RS_AGENT__COMMAND_RUNTIME_DIR": "/e2e/agent-runtime",
}
ARITHMETIC_ROWS = 15
BLACKBOX_ROW = 1
"""The dataset: the Harbor task's row at this index among the arithmetic rows; the dispatcher issues the rows
in order, one group each, round and round: groups 1 and 17 of the run's 32 are black-box episodes."""
BLACKBOX_BUDGET_S = 120
HEALTHZ = ("import urllib.request; "
           "print(urllib.request.urlopen('http://127.0.0.1:8080/healthz', timeout=3).read().decode())")
VLLM_MODELS = ("import urllib.request; "
               "print(urllib.request.urlopen('http://127.0.0.1:8000/v1/models', timeout=3).read().decode())")
AGENT_PROCESSES = """
import json, os, pathlib
lines = []
for cmdline in pathlib.Path("/proc").glob("[0-9]*/cmdline"):
    try:
        line = cmdline.read_bytes().replace(b"\\0", b" ").decode(errors="replace")
    except OSError:  # gone since the listing
        continue
    if cmdline.parent.name != str(os.getpid()) and ("bwrap" in line or "chat-agent" in line):
        lines.append(line)
print(json.dumps(lines))
"""
CRASH = ["python", "-c", "import os, signal; os.kill(-1, signal.SIGKILL)"]
"""Every process of the container's user dies (its init, tini, then exits with them): a crash."""


def engine():
    """The docker SDK's client for the engine DOCKER_HOST names, or skip with why."""
    client = docker_client()
    if shutil.which("docker") is None:
        pytest.skip("a Docker engine answers but there is no docker CLI on PATH")
    version = subprocess.run(["docker", "compose", "version"], capture_output=True, text=True, check=False)
    if version.returncode != 0:
        pytest.skip(f"no Compose v2 plugin (`docker compose version`: {version.stderr.strip()}); "
                    "infra/docker-engine.sh installs it")
    return client


class Stack:
    """One compose project of the repository's docker-compose.yml plus the test's override file."""

    def __init__(self, client, tmp_path):
        self.client = client
        self.project = f"rse2e{uuid.uuid4().hex[:8]}"
        self.run_id = f"e2e-{uuid.uuid4().hex[:6]}"
        env_file = tmp_path / "run.env"
        env_file.write_text("".join(f"{key}={value}\n" for key, value in SETTINGS.items()))
        data = write_mounted_data(tmp_path / "e2e")
        harbor = FIXTURES / "harbor"
        override = tmp_path / "override.yml"
        override.write_text(json.dumps({  # YAML is a superset of JSON
            "services": {
                "redis": {"ports": ["127.0.0.1::6379"]},
                "dispatcher": {"volumes": [f"{data}:/e2e:ro"]},
                "agent-runner": {"volumes": [f"{data}:/e2e:ro", f"{harbor}:/tasks/harbor:ro"]},
                "sandbox-grader": {"volumes": [f"{harbor}:/tasks/harbor:ro"]},
            },
            "volumes": {"models": {"driver": "local", "driver_opts": {
                "type": "none", "o": "bind", "device": str(copy_built_models(tmp_path / "models"))}}},
        }))
        self.passwords = redis_passwords()
        self.env = {**os.environ, "COMPOSE_BAKE": "false", "RS_ENV_FILE": str(env_file),
                    "RS_RUN_ID": self.run_id, **self.passwords}
        self.base = ["docker", "compose", "-p", self.project, "-f", str(REPO / "docker-compose.yml"),
                     "-f", str(override), "--profile", "cpu"]

    def compose(self, *args: str, timeout: float = 900, check: bool = True,
                **kwargs) -> subprocess.CompletedProcess:
        result = subprocess.run([*self.base, *args], cwd=REPO, env=self.env, capture_output=True, text=True,
                                timeout=timeout, check=False, **kwargs)
        if check and result.returncode != 0:
            raise AssertionError(f"docker compose {' '.join(args)} exited {result.returncode}:\n"
                                 f"{result.stdout[-4000:]}\n{result.stderr[-4000:]}")
        return result

    def containers(self, service: str | None = None, all: bool = False):
        labels = [f"com.docker.compose.project={self.project}"]
        if service:
            labels.append(f"com.docker.compose.service={service}")
        return self.client.containers.list(all=all, filters={"label": labels})

    def bus(self):
        from rollstream.shared.contract.bus import Bus

        host_port = self.compose("port", "redis", "6379").stdout.strip()
        return Bus.connect(f"redis://admin:{self.passwords['RS_REDIS_PASSWORD_ADMIN']}@{host_port}/0",
                           self.run_id)

    def report(self) -> dict:
        script = (REPO / "tests" / "e2e" / "run_report.py").read_text()
        out = self.compose("run", "--rm", "-T", "ops", "python", "-", input=script, timeout=300).stdout
        return json.loads(out.strip().splitlines()[-1])

    def logs(self) -> str:
        return self.compose("logs", "--no-color", "--tail", "40", check=False, timeout=120).stdout


def copy_built_models(folder):
    """The models `make setup` built (tiny-llama, its warm-up), copied for the stack's `models` volume: the
    `model` service finds them there and builds nothing, as on a deployment's second `up` (the build and the
    warm-up are the same code, tested on their own in tests/unit/cli/model). A copy: nothing in the stack
    writes the repository's."""
    for name in ("tiny-llama", "tiny-llama-warm"):
        shutil.copytree(MODELS / name, folder / name)
    for path in (folder, *folder.rglob("*")):  # the containers' user reads them, whatever the umask
        path.chmod(0o755 if path.is_dir() else 0o644)
    return folder


def write_mounted_data(folder):
    """The dataset (arithmetic rows, every 4th graded in the sandbox as the synthetic default is, and the
    Harbor task's row for the black-box agent, its paths as the containers see the task) and the agent's
    runtime, in a folder the containers' user can read."""
    folder.mkdir(mode=0o755)
    rows = [{"prompt": row.messages, "label": row.label, "sandbox_check": row.sandbox_check,
             "tools": row.tools, "metadata": row.metadata}
            for row in arithmetic_dataset(ARITHMETIC_ROWS, seed=0, sandbox_every=4)]
    task = load_harbor_task(FIXTURES / "harbor" / "fix-add")
    row = task_prompt_row(task)
    metadata = json.loads(json.dumps(row.metadata).replace(str(task.path.parent), "/tasks/harbor"))
    rows.insert(BLACKBOX_ROW, {"prompt": row.messages, "agent": "command",
                               "metadata": {**metadata, "time_budget_s": BLACKBOX_BUDGET_S}})
    (folder / "dataset.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    runtime = folder / "agent-runtime" / "bin"
    runtime.mkdir(mode=0o755, parents=True)
    shutil.copy(REPO / "tests" / "fixtures" / "agent-runtime" / "bin" / "chat-agent", runtime)
    for path in (folder, runtime.parent, runtime):  # whatever the umask
        path.chmod(0o755)
    return folder


def agent_processes(container) -> list[str]:
    """Command lines of the black-box episodes' processes (bubblewrap, the agent) still in a container."""
    code, out = container.exec_run(["python", "-c", AGENT_PROCESSES])
    assert code == 0, out
    return json.loads(out)


def healthz(container) -> dict:
    code, out = container.exec_run(["python", "-c", HEALTHZ])
    return json.loads(out) if code == 0 else {}


def consumers_by_host(bus) -> dict[str, str]:
    """The prompts group's consumers (agent-runner-<hostname>-<pid>) by the replica's hostname."""
    names = [c["name"] for c in bus.redis.xinfo_consumers(bus.keys.stream("prompts"), "agent-runner")]
    return {name.split("-")[2]: name for name in (n.decode() if isinstance(n, bytes) else n for n in names)}


def newest_version(bus) -> int:
    last = bus.last("policy")
    return getattr(last.event, "version", 0) if last is not None else 0


def crash_vllm_after_a_version(s: Stack, bus) -> dict:
    """Crash the vLLM server once version 2 is out and wait until Compose has it answering again: what it
    said it loaded at each start (rollstream serve-policy's line) and what it serves now."""
    deadline = time.monotonic() + 300
    while newest_version(bus) < 2:
        assert time.monotonic() < deadline, f"no policy version 2 to restart vLLM on\n{s.logs()}"
        time.sleep(1)
    (vllm,) = s.containers("vllm-cpu")
    crash = {"container": vllm.name, "version": newest_version(bus)}
    vllm.exec_run(CRASH)
    deadline = time.monotonic() + 400
    while True:
        vllm.reload()
        if vllm.attrs["RestartCount"] >= 1 and vllm.status == "running":
            code, out = vllm.exec_run(["python", "-c", VLLM_MODELS])
            if code == 0:  # answers once its weights are loaded, as its healthcheck does
                break
        assert time.monotonic() < deadline, f"vLLM does not answer again after its crash\n{s.logs()}"
        time.sleep(2)
    crash["served"] = json.loads(out)["data"][0]["root"]
    crash["starts"] = [record for record in map(_json_or_none,
                                                vllm.logs().decode(errors="replace").splitlines())
                       if record and record.get("message") == "serving the newest policy"]
    return crash


def _json_or_none(line: str) -> dict | None:
    try:
        record = json.loads(line)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    client = engine()
    timings: dict[str, float] = {}
    started = time.monotonic()
    subprocess.run(["bash", str(REPO / "compose" / "build-offline-base.sh")], check=True, timeout=900)
    timings["offline base"] = time.monotonic() - started
    s = Stack(client, tmp_path_factory.mktemp("compose"))
    started = time.monotonic()
    s.compose("build", timeout=1500)
    timings["build"] = time.monotonic() - started
    result = {"stack": s, "timings": timings}
    try:
        up_wall = time.time()
        started = time.monotonic()
        s.compose("up", "-d", "--scale", f"agent-runner={REPLICAS}", timeout=900)
        timings["up -d (healthy)"] = time.monotonic() - started
        bus = s.bus()
        runners = s.containers("agent-runner")
        assert len(runners) == REPLICAS

        # every replica has finished episodes before any is taken down
        done: dict[str, int] = {}
        deadline = time.monotonic() + 300
        while len([n for n in done.values() if n > 0]) < REPLICAS:
            assert time.monotonic() < deadline, f"replicas' finished episodes: {done}\n{s.logs()}"
            for c in runners:
                done[c.id] = max(done.get(c.id, 0), healthz(c).get("episodes_done", 0))
            time.sleep(0.5)
        result["episodes_before_faults"] = dict(done)
        by_host = consumers_by_host(bus)
        result["consumers"] = {c.id: by_host[c.attrs["Config"]["Hostname"]] for c in runners}

        # two replicas holding prompts: one `docker kill`ed, one crashing (its process SIGKILLed)
        key = bus.keys.stream("prompts")
        held: dict[str, list[str]] = {}
        victims = []
        deadline = time.monotonic() + 120
        while len(victims) < 2:
            assert time.monotonic() < deadline, f"no replica held prompts; victims: {victims}\n{s.logs()}"
            for c in runners:
                if c in victims:
                    continue
                pending = bus.redis.xpending_range(key, "agent-runner", "-", "+", 100,
                                                   consumername=result["consumers"][c.id])
                if pending:
                    held[c.id] = [row["message_id"].decode() for row in pending]
                    if not victims:
                        c.kill()  # SIGKILL through the engine
                    else:
                        c.exec_run(CRASH)
                    victims.append(c)
                    break
            time.sleep(0.05)
        result["killed"], result["crashed"] = victims
        result["held"] = held
        result["vllm_crash"] = crash_vllm_after_a_version(s, bus)

        # the run goes on to its last version
        deadline = time.monotonic() + 600
        while True:
            last = bus.last("policy")
            if last is not None and getattr(last.event, "version", 0) >= VERSIONS:
                break
            assert time.monotonic() < deadline, f"the run did not reach version {VERSIONS}\n{s.logs()}"
            time.sleep(1)
        time.sleep(2)  # the recorder's next flush
        result["report"] = s.report()
        timings["up to policy version 1"] = result["report"]["version_times"]["1"] - up_wall
        timings["up to the last version"] = result["report"]["version_times"][str(VERSIONS)] - up_wall
        for victim in victims:
            victim.reload()
        result["states"] = {c.id: (c.status, c.attrs["RestartCount"]) for c in victims}
        result["episodes_after"] = {c.id: healthz(c).get("episodes_done", 0)
                                    for c in s.containers("agent-runner")}
        result["agent_processes_left"] = {c.name: agent_processes(c) for c in s.containers("agent-runner")}
        result["services"] = {c.name: c.status for c in s.containers(all=True)}
        result["restart_counts"] = {c.name: c.attrs["RestartCount"] for c in s.containers(all=True)}
    except BaseException:
        print(s.logs())
        raise
    finally:
        started = time.monotonic()
        down = s.compose("down", "-v", "--remove-orphans", "--timeout", "20", check=False, timeout=300)
        timings["down -v"] = time.monotonic() - started
        result["down"] = down
        mine = {"label": f"com.docker.compose.project={s.project}"}
        result["left"] = {
            "containers": [c.name for c in s.containers(all=True)],
            "networks": [n.name for n in client.networks.list(filters=mine)],
            "volumes": [v.name for v in client.volumes.list(filters=mine)],
        }
        print("compose e2e timings (s): " + ", ".join(f"{k} {v:.0f}" for k, v in timings.items()))
    yield result


def test_every_replica_ran_episodes(stack):
    assert len(stack["episodes_before_faults"]) == REPLICAS
    assert all(n > 0 for n in stack["episodes_before_faults"].values()), stack["episodes_before_faults"]
    hostnames = {name.split("-")[2] for name in stack["report"]["consumers"]}
    assert {name.split("-")[2] for name in stack["consumers"].values()} <= hostnames


def test_the_run_reached_its_last_version(stack):
    assert stack["report"]["versions"] == list(range(1, VERSIONS + 1))
    assert stack["report"]["audit"]["batches_announced"] == VERSIONS


def test_every_admitted_sample_reached_exactly_one_batch(stack):
    report, audit = stack["report"], stack["report"]["audit"]
    assert audit["admitted"] == VERSIONS * BATCH
    # nothing lost, duplicated or left pending, every batch trained once, the archive as Redis had it
    assert report["problems"] == []
    # a row too old to train is in its batch all the same: the faults may hold a rollout back that long
    assert set(audit["dropped"]) <= set(BATCHED_DROP_CAUSES), audit["drop_reasons"]
    assert audit["trained"] + sum(audit["dropped"].values()) == audit["admitted"]
    assert report["grading_failed"] == 0 and report["dead_lettered"] == 0


def test_the_sandbox_grader_ran_bubblewrap_in_its_container(stack):
    # every 4th synthetic prompt is graded by a shell check in the sandbox (data.synthetic_sandbox_every)
    assert stack["report"]["graded_in_sandbox"] > 0
    assert stack["report"]["grading_failed"] == 0


def test_black_box_agents_ran_in_their_sandboxes_through_the_gateway_and_were_graded_and_trained(stack):
    episodes = stack["report"]["blackbox"]
    assert len(episodes) == 2 * GROUP, episodes  # groups 1 and 17
    for rollout, episode in episodes.items():
        assert episode["status"] == "completed", (rollout, episode)
        # the agent's three requests, each a turn its gateway session recorded
        assert episode["session_turns"] >= 3, (rollout, episode)
        # what the agent wrote at the task's WORKDIR in its sandbox is the diff the task's tests graded
        assert episode["diff_has_answers"] and episode["log"], (rollout, episode)
        assert episode["grader"] == "harbor" and episode["grade_scores"], (rollout, episode)
        assert episode["batched"], (rollout, episode)


def test_no_black_box_agent_process_is_left_in_an_agent_runner(stack):
    assert stack["agent_processes_left"] and not any(stack["agent_processes_left"].values()), \
        stack["agent_processes_left"]


def test_prompts_held_by_killed_and_crashed_replicas_were_finished_by_others(stack):
    report, audit = stack["report"], stack["report"]["audit"]
    not_finished = {problem.split(" ")[0] for problem in audit["lost"] + audit["duplicated"]}
    for entries in stack["held"].values():
        held = {report["rollout_of_entry"][e] for e in entries}
        assert held and not held & not_finished, (held, not_finished)
    assert audit["trained"] + sum(audit["dropped"].values()) == audit["admitted"]
    assert all(pending == 0 for pending in report["consumers"].values()), report["consumers"]


def test_a_crashed_replica_is_restarted_and_a_docker_killed_one_is_not(stack):
    killed, crashed = stack["killed"], stack["crashed"]
    status, restarts = stack["states"][crashed.id]
    assert status == "running" and restarts >= 1  # restart: unless-stopped
    # Docker treats `docker kill` as a manual stop: no restart policy revives it
    assert stack["states"][killed.id][0] == "exited"


def test_a_restarted_vllm_server_serves_the_newest_published_policy_not_the_starting_model(stack):
    crash = stack["vllm_crash"]
    first, *_, restarted = crash["starts"]
    assert first["version"] == 0 and first["model"] == "/models/tiny-llama-warm"
    assert restarted["version"] >= crash["version"] >= 2
    run_id = stack["report"]["run_id"]
    assert restarted["model"] == f"/data/runs/{run_id}/checkpoints/v{restarted['version']:05d}"
    assert crash["served"] == restarted["model"]


def test_no_policy_version_trained_a_batch_twice(stack):
    batch_ids = stack["report"]["policy_batch_ids"]
    assert len(batch_ids) == VERSIONS and len(set(batch_ids)) == len(batch_ids), batch_ids


def test_no_container_the_test_did_not_crash_was_restarted(stack):
    crashed = {stack["crashed"].name, stack["vllm_crash"]["container"]}
    counts = stack["restart_counts"]
    assert all(counts[name] >= 1 for name in crashed), counts
    others = {name: n for name, n in counts.items() if name not in crashed | {stack["killed"].name}}
    assert len(others) >= 9 and set(others.values()) == {0}, others


def test_no_service_died(stack):
    expected = {"redis", "vllm-cpu", "dispatcher", "gateway", "sandbox-grader", "reward",
                "trainer", "recorder", "console"}
    statuses = {name.split("-", 1)[1].rsplit("-", 1)[0]: status for name, status in stack["services"].items()
                if not name.split("-", 1)[1].startswith(("agent-runner", "model"))}
    assert set(statuses) == expected and set(statuses.values()) == {"running"}, statuses


def test_down_removes_every_container_network_and_volume(stack):
    assert stack["down"].returncode == 0, stack["down"].stderr
    assert stack["left"] == {"containers": [], "networks": [], "volumes": []}

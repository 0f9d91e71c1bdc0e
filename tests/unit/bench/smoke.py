"""Runs a benchmark of bench/ in its smoke mode (`--smoke`: seconds, tiny sizes) in a process group of its
own, and reads the figures it wrote with `--json`: what the smoke tests of tests/unit/bench check. Ratios are
read, never compared with a threshold: a smoke run measures nothing worth reading.

    from tests.unit.bench.smoke import run_smoke
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from tests.support import REPO, stop_process_group

TIMEOUT_S = 300
"""Far above a smoke run's time: only a hang reaches it."""


@dataclass
class SmokeRun:
    output: str
    """stdout and stderr together."""
    figures: list[dict]
    notes: list[str]


def run_command(command: list[str], timeout_s: float = TIMEOUT_S) -> tuple[int, str]:
    """(exit code, output) of a command run at the repository's root; stopped, with what it started, on a
    timeout."""
    process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               errors="replace", start_new_session=True)
    try:
        output, _ = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        stop_process_group(process)
        raise
    return process.returncode, output


def run_smoke(script: str, tmp_path: Path, *args: str) -> SmokeRun:
    """bench/<script> --smoke: it must end with exit code 0 and write figures, each a ratio > 0."""
    result = tmp_path / f"{Path(script).stem}.json"
    code, output = run_command([sys.executable, f"bench/{script}", "--smoke", "--json", str(result), *args])
    assert code == 0, output[-6000:]
    body = json.loads(result.read_text())
    assert body["figures"], output[-6000:]
    for figure in body["figures"]:
        assert figure["ratio"] > 0, figure
    return SmokeRun(output, body["figures"], body["notes"])

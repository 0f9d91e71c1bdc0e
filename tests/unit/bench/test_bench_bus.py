"""bench/bench_bus.py in a short smoke mode: it ends, every case moves all its events through the bus, and it
prints the bus/raw ratios (it once published PromptIssued on `trajectories`, which the bus dead-letters, and
waited forever for events it would never hand back).

    python -m pytest tests/unit/bench/test_bench_bus.py -q
"""

from __future__ import annotations

import re
import subprocess
import sys

from tests.support import REPO


def test_the_bus_benchmark_ends_and_prints_a_ratio_for_each_case(machine_redis_url):
    command = [sys.executable, "bench/bench_bus.py", "--redis", machine_redis_url, "--events", "200",
               "--batch", "50"]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    ratio = r"^(PromptIssued|Segment 512 tokens) bus/raw\s+([0-9.]+)\s+([0-9.]+)$"
    ratios = re.findall(ratio, done.stdout, re.M)
    assert [case for case, *_ in ratios] == ["PromptIssued", "Segment 512 tokens"], done.stdout
    assert all(float(value) > 0 for _, *values in ratios for value in values)
    assert "dead-lettered" not in done.stdout + done.stderr

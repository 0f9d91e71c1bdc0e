"""bench/bench_bus.py in its smoke mode: it ends, every case moves all its events through the bus, and it
prints and writes the bus/raw ratios (it once published PromptIssued on `trajectories`, which the bus
dead-letters, and waited forever for events it would never hand back).

    python -m pytest tests/unit/bench/test_bench_bus.py -q
"""

from __future__ import annotations

import re

from tests.unit.bench.smoke import run_smoke


def test_the_bus_benchmark_ends_and_prints_a_ratio_for_each_case(machine_redis_url, tmp_path):
    done = run_smoke("bench_bus.py", tmp_path, "--redis", machine_redis_url)
    ratio = r"^(PromptIssued|Segment 512 tokens) (Bus.publish|Bus.consume \+ ack): bus/raw ([0-9.]+) \(runs "
    ratios = re.findall(ratio, done.output, re.M)
    # once with hiredis parsing redis-py's replies, once with its Python parser
    cases = ["PromptIssued"] * 2 + ["Segment 512 tokens"] * 2
    assert [case for case, *_ in ratios] == cases * 2, done.output
    assert all(float(value) > 0 for *_, value in ratios)
    assert [f["unit"] for f in done.figures] == ["events/s"] * 8
    assert [f["what"].endswith("(hiredis)") for f in done.figures] == [True] * 4 + [False] * 4
    # each case ran twice in its smoke mode: the figures are the medians of the runs
    assert all(len(f["runs"]) == len(f["baseline_runs"]) == 2 for f in done.figures)
    assert "dead-lettered" not in done.output

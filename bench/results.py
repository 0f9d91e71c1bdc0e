"""What every benchmark hands back: figures, each measured next to its baseline in the same run, written as
JSON with `--json PATH`; and the `--smoke` switch, which runs a benchmark for seconds at tiny sizes (it checks
that the benchmark works; its figures mean nothing). bench/run_all.py runs the benchmarks and reads the files.

    from results import Figure, parse_args, write_result   # benchmarks run as scripts: bench/ is on sys.path
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import statistics
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class Figure:
    """One measurement and its baseline; ratio = value / baseline, so below 1 is less (time: faster).

    Measured over repeated runs (`Figure.repeated`), value and baseline are the medians and `runs` /
    `baseline_runs` hold every run's figure, in the order they ran (run i's baseline beside run i)."""

    what: str
    value: float
    baseline_what: str
    baseline: float
    unit: str
    runs: tuple[float, ...] = ()
    baseline_runs: tuple[float, ...] = ()

    @classmethod
    def repeated(cls, what: str, runs: Sequence[float], baseline_what: str, baseline_runs: Sequence[float],
                 unit: str) -> Figure:
        return cls(what, median(runs), baseline_what, median(baseline_runs), unit, tuple(runs),
                   tuple(baseline_runs))

    @property
    def ratio(self) -> float:
        return self.value / self.baseline if self.baseline else math.nan

    @property
    def run_ratios(self) -> list[float]:
        """Each run's figure against its own run's baseline."""
        return [value / base if base else math.nan for value, base in zip(self.runs, self.baseline_runs)]

    def as_dict(self) -> dict:
        return {**asdict(self), "ratio": self.ratio, "run_ratios": self.run_ratios}


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else math.nan


def parse_args(parser: argparse.ArgumentParser, smoke: dict) -> argparse.Namespace:
    """Adds --json and --smoke; with --smoke the `smoke` values replace the defaults (arguments given
    explicitly still win). From here on SIGTERM unwinds like Ctrl-C: the servers and services a benchmark
    started run in sessions of their own, and only its `finally` blocks stop them when bench/run_all.py stops
    a benchmark past its timeout."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    parser.add_argument("--json", metavar="PATH", default=None,
                        help="also write the figures to this file (bench/run_all.py reads it)")
    parser.add_argument("--smoke", action="store_true",
                        help="seconds, tiny sizes: checks that the benchmark runs; its figures mean nothing")
    if parser.parse_known_args()[0].smoke:
        parser.set_defaults(**smoke)
    return parser.parse_args()


def write_result(path: str | None, figures: Sequence[Figure], notes: Sequence[str] = ()) -> None:
    """The figures, and notes (what was left out and why, the settings), to `path` when given."""
    if path is None:
        return
    body = {"figures": [figure.as_dict() for figure in figures], "notes": list(notes)}
    target = Path(path)
    temp = target.with_name(target.name + ".tmp")
    temp.write_text(json.dumps(body, indent=2, allow_nan=True))
    os.replace(temp, target)  # a reader never sees half a file


def stop_group(process: subprocess.Popen | None, grace_s: float = 15) -> None:
    """SIGTERM to a process started in a session of its own and to what it started, then SIGKILL."""
    if process is None:
        return
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue

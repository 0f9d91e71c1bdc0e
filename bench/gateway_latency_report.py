"""What bench/gateway_latency.py makes of its turns: every round of one endpoint at one number of sessions
pooled (`Measured`), its percentiles and the metrics read before and after, the two tables it prints (each
endpoint against the upstream called directly; the gateway beside LiteLLM), and the figures it writes with
--json.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

try:  # run as a script: bench/ is first on sys.path
    from results import Figure
except ImportError:  # imported as bench.gateway_latency_report (the tests of the tables)
    from bench.results import Figure

DIRECT, GATEWAY, LITELLM = "direct", "gateway", "litellm"
"""The endpoints, as the tables name them."""


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100), interpolated linearly between the closest ranks (numpy's default)."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def metric_totals(text: str) -> dict[str, float]:
    """Prometheus text -> {sample name: value summed over its label sets} (`x_sum`, `x_count` apart)."""
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    return totals


def mean_of_histogram(before: dict[str, float], after: dict[str, float], name: str) -> float | None:
    """Mean observation of histogram `name` between two readings; None when nothing was observed."""
    count = after.get(f"{name}_count", 0.0) - before.get(f"{name}_count", 0.0)
    if count <= 0:
        return None
    return (after.get(f"{name}_sum", 0.0) - before.get(f"{name}_sum", 0.0)) / count


@dataclass
class Measured:
    """Every round of one endpoint at one concurrency, pooled."""

    seconds: list[float] = field(default_factory=list)
    """Per turn, client wall time."""
    tokens: list[int] = field(default_factory=list)
    """Per turn, completion tokens."""
    wall_s: float = 0.0
    failed: int = 0
    errors: list[str] = field(default_factory=list)
    vllm_requests: float = 0.0
    vllm_request_s: float = 0.0
    """Sum of vLLM's own request times (vllm:e2e_request_latency_seconds)."""
    cpu_s: float | None = None
    """CPU time of the endpoint's own process (the gateway's, LiteLLM's); None: not a process of its own."""

    def fail(self, error: str) -> None:
        self.failed += 1
        self.errors.append(error)

    def add(self, other: Measured) -> None:
        self.seconds += other.seconds
        self.tokens += other.tokens
        self.wall_s += other.wall_s
        self.failed += other.failed
        self.errors += other.errors
        self.vllm_requests += other.vllm_requests
        self.vllm_request_s += other.vllm_request_s
        if other.cpu_s is not None:
            self.cpu_s = (self.cpu_s or 0.0) + other.cpu_s


TABLE_HEADER = ["endpoint", "sessions", "turns", "p50 ms", "p99 ms", "+p50 ms", "x p50", "+p99 ms", "x p99",
                "turns/s", "tok/turn", "failed", "vLLM e2e ms", "CPU ms/turn", "turns/s/core"]
COMPARE_HEADER = ["sessions", "gateway +p50 ms", "+p99 ms", "CPU ms/turn", "litellm +p50 ms", "+p99 ms",
                  "CPU ms/turn", "CPU gateway/litellm"]


def table_row(name: str, sessions: int, measured: Measured, baseline: Measured | None) -> list[str]:
    """One line of the table: percentiles in ms, added latency and ratio against the baseline, per-turn
    means of vLLM's request time and of the endpoint process's CPU time."""
    turns = len(measured.seconds)
    if not turns:
        return [name, str(sessions), "0", *["-"] * 8, str(measured.failed), "-", "-", "-"]
    p50, p99 = percentile(measured.seconds, 50), percentile(measured.seconds, 99)
    added = ["-"] * 4
    if baseline is not None and baseline.seconds and baseline is not measured:
        b50, b99 = percentile(baseline.seconds, 50), percentile(baseline.seconds, 99)
        added = [f"{(p50 - b50) * 1e3:+.1f}", f"{p50 / b50:.2f}", f"{(p99 - b99) * 1e3:+.1f}",
                 f"{p99 / b99:.2f}"]
    e2e = f"{measured.vllm_request_s / measured.vllm_requests * 1e3:.1f}" if measured.vllm_requests else "-"
    cpu = "-" if measured.cpu_s is None else f"{measured.cpu_s / turns * 1e3:.2f}"
    per_core = f"{turns / measured.cpu_s:.0f}" if measured.cpu_s else "-"
    return [name, str(sessions), str(turns), f"{p50 * 1e3:.1f}", f"{p99 * 1e3:.1f}", *added,
            f"{turns / measured.wall_s:.1f}" if measured.wall_s > 0 else "-",
            f"{sum(measured.tokens) / turns:.1f}", str(measured.failed), e2e, cpu, per_core]


def added_ms(measured: Measured, baseline: Measured, q: float) -> float:
    """Latency `measured` adds to `baseline` at percentile q, in ms."""
    return (percentile(measured.seconds, q) - percentile(baseline.seconds, q)) * 1e3


def cpu_ms_per_turn(measured: Measured) -> float | None:
    if measured.cpu_s is None or not measured.seconds:
        return None
    return measured.cpu_s / len(measured.seconds) * 1e3


def compare_row(sessions: int, pooled: dict[str, Measured]) -> list[str]:
    """The gateway beside LiteLLM at one level: added latency at p50 and p99, CPU per turn, and the ratio of
    the CPU times ("-" for what was not measured)."""
    direct = pooled.get(DIRECT)
    cells = [str(sessions)]
    cpu = {}
    for name in (GATEWAY, LITELLM):
        measured = pooled.get(name)
        if measured is None or not measured.seconds or direct is None or not direct.seconds:
            cells += ["-"] * 3
            continue
        cpu[name] = cpu_ms_per_turn(measured)
        cells += [f"{added_ms(measured, direct, 50):+.1f}", f"{added_ms(measured, direct, 99):+.1f}",
                  "-" if cpu[name] is None else f"{cpu[name]:.2f}"]
    ratio = (cpu[GATEWAY] / cpu[LITELLM] if cpu.get(GATEWAY) is not None and cpu.get(LITELLM) else None)
    return [*cells, "-" if ratio is None else f"{ratio:.2f}"]


def figures_of(levels: dict[int, dict[str, Measured]]) -> list[Figure]:
    """Per level: each endpoint's p50 and p99 against direct's, and the gateway's CPU time per turn against
    LiteLLM's, where both were measured."""
    figures = []
    for sessions, pooled in levels.items():
        direct = pooled.get(DIRECT)
        if direct is None or not direct.seconds:
            continue
        for name, measured in pooled.items():
            if name == DIRECT or not measured.seconds:
                continue
            for q in (50, 99):
                figures.append(Figure(f"{name}, {sessions} sessions: p{q} of a turn",
                                      percentile(measured.seconds, q) * 1e3, "the upstream called directly",
                                      percentile(direct.seconds, q) * 1e3, "ms"))
        gateway, litellm = (cpu_ms_per_turn(pooled[n]) if n in pooled else None for n in (GATEWAY, LITELLM))
        if gateway is not None and litellm:
            figures.append(Figure(f"gateway, {sessions} sessions: CPU time per turn", gateway,
                                  "LiteLLM's proxy, same turns", litellm, "ms"))
    return figures


def format_table(header: list[str], rows: list[list[str]]) -> str:
    """Columns as wide as their widest cell; the first left-aligned, the others right-aligned."""
    widths = [max(len(cell) for cell in column) for column in zip(header, *rows)]

    def line(cells: list[str]) -> str:
        return "  ".join(cell.ljust(width) if i == 0 else cell.rjust(width)
                         for i, (cell, width) in enumerate(zip(cells, widths)))

    return "\n".join([line(header), *(line(row) for row in rows)])

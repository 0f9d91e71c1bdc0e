"""Every benchmark of bench/ in its smoke mode, each in a subprocess: it ends, and writes its figures, each
with a ratio > 0 (bench_bus.py's test is test_bench_bus.py). The benchmarks that can use a running vLLM
server share one (a module fixture, so it starts once); bench_vllm_start.py and gateway_latency.py start their
own, as that is what they measure or how they are written. gateway_latency.py has no --json: it runs through
bench/run_all.py, which reads its table.

    python -m pytest tests/unit/bench/test_benchmarks_smoke.py -q
"""

from __future__ import annotations

import re
import sys

import pytest

from tests.support import MODELS, REAL_BWRAP, reload_weights, vllm_servers
from tests.unit.bench.smoke import run_command, run_smoke


@pytest.fixture(scope="module")
def vllm_url(tiny_model, tmp_path_factory):
    with vllm_servers(tiny_model, tmp_path_factory.mktemp("vllm"), count=1) as servers:
        yield servers[0].url


def test_encoding(tmp_path):
    done = run_smoke("bench_encoding.py", tmp_path)
    assert [f["unit"] for f in done.figures] == ["bytes", "us", "us", "us"]
    assert "ratio json/packed" in done.output


def test_redis_round_trips_against_redis_pys_pipeline_and_a_bare_stream(machine_redis_url, tmp_path):
    done = run_smoke("bench_redis_round_trips.py", tmp_path, "--redis", machine_redis_url)
    assert [(f["baseline_what"], f["unit"]) for f in done.figures] == [
        ("redis-py's asyncio pipeline, same commands", "us"),
        ("the same bytes bare on an asyncio stream", "us")]
    assert "against redis-py's asyncio pipeline" in done.output


def test_data_path_packs_with_less_padding_than_one_sample_per_row(tiny_model, tmp_path):
    done = run_smoke("bench_data_path.py", tmp_path, "--model", str(tiny_model))
    share, padding = done.figures
    assert share["unit"] == "s" and "data path / step" in done.output
    # token counts of a seeded batch, not times: the packing leaves fewer padded tokens
    assert padding["unit"] == "padded / real tokens" and padding["value"] < padding["baseline"]


def test_weight_sync_against_one_server_at_a_time(tiny_model, tmp_path):
    done = run_smoke("bench_weight_sync.py", tmp_path, "--model", str(tiny_model))
    assert [f["what"] for f in done.figures] == ["sync of 4 servers, 4 at once"]


def test_checkpoint_sync_on_a_running_server(vllm_url, tiny_model, tmp_path):
    done = run_smoke("bench_checkpoint_sync.py", tmp_path, "--fleet-url", vllm_url, "--model",
                     str(tiny_model))
    [figure] = done.figures
    assert figure["what"].startswith("weight sync, 1.6 MiB checkpoint") and figure["unit"] == "s"


def test_weight_transport_against_disk_on_a_running_server(vllm_url, tiny_model, tmp_path):
    done = run_smoke("bench_weight_transport.py", tmp_path, "--fleet-url", vllm_url, "--model",
                     str(tiny_model))
    assert [(f["what"], f["baseline_what"]) for f in done.figures] == [
        ("collective full, 1.6 MiB (served), 1 server(s): s per version",
         "disk: checkpoint write + every server's reload"),
        ("collective delta (1% of elements changed), 1.6 MiB (served), 1 server(s): s per version",
         "disk: checkpoint write + every server's reload")]
    # the bench checked every version's parity on the server (else it fails); its delta changed about 1%
    changed = re.search(r"^served .* collective delta .* ([0-9.]+)% ", done.output, re.M)
    assert changed is not None and 0.5 < float(changed.group(1)) < 2, done.output[-3000:]


def test_adapter_sync_against_a_full_sync(tmp_path):
    """Starts its own server: a LoRA run's, with adapters enabled. Every version's parity is checked (else it
    fails); an adapter moves less than the model."""
    done = run_smoke("bench_adapter_sync.py", tmp_path)
    moved = [f for f in done.figures if f["unit"] == "MiB"]
    assert moved and all(f["value"] < f["baseline"] for f in moved), done.figures


def test_grading_per_backend(tmp_path):
    if REAL_BWRAP is None:
        pytest.skip("bubblewrap (bwrap) is not installed: make setup installs it")
    done = run_smoke("bench_grading.py", tmp_path)
    measured = [f["what"] for f in done.figures]
    assert measured[0] == "bubblewrap, 2 replicas"
    # docker is measured where an engine answers (DOCKER_HOST), and said not to be where none does
    assert "docker, 1 replica" in measured or any(n.startswith("docker: NOT MEASURED") for n in done.notes)


def test_agent_runner_against_vllm_called_directly(vllm_url, tiny_model, tmp_path):
    done = run_smoke("bench_agent_runner.py", tmp_path, "--fleet-url", vllm_url, "--model", str(tiny_model))
    assert [f["unit"] for f in done.figures] == ["episodes/s", "tokens/s"]


def test_async_against_sync_on_vllm_and_simulated_servers(vllm_url, tiny_model, machine_redis_url, tmp_path):
    done = run_smoke("bench_async.py", tmp_path, "--fleet-url", vllm_url, "--model", str(tiny_model),
                     "--redis-url", machine_redis_url)
    assert [f["what"] for f in done.figures] == [
        "real vLLM (CPU), eta=1: samples trained per minute over the run",
        "real vLLM (CPU), eta=1: fleet busy",
        "4 simulated servers, eta=1: samples trained per minute over the run",
        "4 simulated servers, eta=1: fleet busy"]
    # each mode ran twice, the modes in turn: the figures are medians, each run's figure and ratio beside
    for figure in done.figures:
        assert len(figure["runs"]) == len(figure["baseline_runs"]) == len(figure["run_ratios"]) == 2
        assert min(figure["runs"]) <= figure["value"] <= max(figure["runs"])
    modes = [note for note in done.notes if note.startswith(("real eta=", "sim eta="))]
    assert len(modes) == 4 and all("samples trained per minute median" in note and "dropped" in note
                                   for note in modes), done.notes
    assert sum(note.startswith("async/sync ") for note in done.notes) == 2, done.notes


def test_learning_against_its_control(vllm_url, tiny_model, tmp_path):
    warm = MODELS / "tiny-llama-warm"
    if not (warm / "config.json").exists():
        pytest.skip("the warm-started tiny model is built by make setup")
    try:
        done = run_smoke("bench_learning.py", tmp_path, "--fleet-url", vllm_url, "--model", str(warm))
    finally:
        reload_weights([vllm_url], tiny_model)  # the other tests' server serves the tiny model
    assert [f["unit"] for f in done.figures] == ["reward"]


def test_roles_learning_against_a_frozen_planner(tmp_path):
    """Starts its own servers: two relay runs, each with a LoRA server. Each role is scored in every
    run and window, and the control's planner never trained (else the bench fails)."""
    warm = MODELS / "tiny-llama-warm"
    if not (warm / "config.json").exists():
        pytest.skip("the warm-started tiny model is built by make setup")
    done = run_smoke("bench_roles_learning.py", tmp_path, "--model", str(warm))
    assert [(f["what"].split(":")[0], f["baseline_what"]) for f in done.figures] == [
        ("planner trained", "control (planner frozen), same versions"),
        ("solver beside a trained planner", "control (solver beside the frozen planner), same versions")]
    control = re.search(r"^\[control\] 3 versions in .*; the roles' versions at the end: (.*)$", done.output,
                        re.M)
    assert control is not None and "solver" in control.group(1) and "planner" not in control.group(1)
    table = [line.split() for line in done.notes[0].splitlines()[2:6]]
    assert [row[:2] for row in table] == [["planner", "both"], ["planner", "control"], ["solver", "both"],
                                          ["solver", "control"]]
    assert all(0 <= float(value) <= 1 for row in table for value in row[2:4]), done.notes


def test_vllm_start_compiled_against_eager(tiny_model, tmp_path):
    done = run_smoke("bench_vllm_start.py", tmp_path, "--model", str(tiny_model))
    assert [f["baseline_what"] for f in done.figures] == ["compiled (-O2)", "compiled (-O2)"]


def test_gateway_latency_through_run_all(machine_redis_url, tmp_path):
    report = tmp_path / "BENCHMARKS.md"
    code, output = run_command([sys.executable, "bench/run_all.py", "--only", "gateway", "--smoke", "--out",
                                str(report), "--redis", machine_redis_url])
    assert code == 0, output[-6000:]
    rows = [line.split(" | ") for line in report.read_text().splitlines()
            if line.startswith("| gateway, 1 sessions: p")]
    assert [row[0] for row in rows] == ["| gateway, 1 sessions: p50 of a turn",
                                        "| gateway, 1 sessions: p99 of a turn"]
    assert all(float(row[-1].rstrip(" |")) > 0 for row in rows)

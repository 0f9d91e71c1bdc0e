"""The latency model of a simulated vLLM server (bench/sim_latency.py): the work a request costs, and busy
time accounted exactly (the engine takes the time from its caller).

    python -m pytest tests/unit/bench/test_sim_latency.py -q
"""

from __future__ import annotations

import pytest

from bench.sim_latency import Engine, LatencyModel


def test_work_is_overhead_plus_prefill_plus_decode():
    model = LatencyModel(prefill_s_per_token=0.001, decode_s_per_token=0.01, overhead_s=0.5, batch_size=4)
    assert model.work(100, 20) == pytest.approx(0.5 + 0.1 + 0.2)
    assert model.rate(1) == model.rate(4) == 1.0
    assert model.rate(8) == pytest.approx(0.5)


def test_requests_within_the_batch_size_run_at_full_speed():
    engine = Engine(LatencyModel(batch_size=2))
    a, _ = engine.submit(1.0, now=0.0)
    b, _ = engine.submit(3.0, now=0.0)
    assert engine.next_completion() == pytest.approx(1.0)
    assert engine.advance(1.0) == [a]
    assert engine.next_completion() == pytest.approx(3.0)
    assert engine.advance(3.0) == [b]
    assert engine.busy_s == pytest.approx(3.0)
    assert engine.running_s == pytest.approx(2 * 1.0 + 1 * 2.0)


def test_an_overloaded_server_shares_its_throughput():
    engine = Engine(LatencyModel(batch_size=2))
    jobs = [engine.submit(1.0, now=0.0)[0] for _ in range(4)]
    # four requests on a batch of two: each gets half speed, all finish at t=2
    assert engine.next_completion() == pytest.approx(2.0)
    assert engine.advance(1.999) == []
    assert set(engine.advance(2.0)) == set(jobs)
    assert engine.busy_s == pytest.approx(2.0)
    assert engine.running_s == pytest.approx(8.0)


def test_a_late_arrival_slows_the_running_request_down():
    engine = Engine(LatencyModel(batch_size=1))
    a, _ = engine.submit(2.0, now=0.0)
    b, done = engine.submit(1.0, now=1.0)
    assert done == []
    # from t=1 both share one slot: a has 1.0 left, b 1.0, each at rate 0.5
    assert engine.next_completion() == pytest.approx(3.0)
    assert set(engine.advance(3.0)) == {a, b}
    assert engine.busy_s == pytest.approx(3.0)
    assert engine.running_s == pytest.approx(1.0 + 2 * 2.0)


def test_idle_and_paused_time_is_not_busy():
    engine = Engine(LatencyModel(batch_size=4), now=0.0)
    engine.advance(5.0)  # idle
    job, _ = engine.submit(1.0, now=5.0)
    engine.pause(5.5)
    assert engine.next_completion() is None
    assert engine.advance(100.0) == []  # frozen: no progress however long the pause
    engine.resume(100.0)
    assert engine.next_completion() == pytest.approx(100.5)
    assert engine.advance(100.5) == [job]
    engine.advance(200.0)
    assert engine.busy_s == pytest.approx(1.0)

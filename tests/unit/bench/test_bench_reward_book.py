"""bench/bench_reward_book.py in its smoke mode: it ends, with the reward service's CPU per arriving segment
for each group size, against the smallest size's and against decode() of one segment.

    python -m pytest tests/unit/bench/test_bench_reward_book.py -q
"""

from __future__ import annotations

from tests.unit.bench.smoke import run_smoke


def test_the_reward_book_benchmark_measures_each_group_size_against_the_smallest(machine_redis_url, tmp_path):
    done = run_smoke("bench_reward_book.py", tmp_path, "--redis", machine_redis_url)
    what = "reward service: CPU per arriving 512-token segment, groups of"
    decoded = "decode() of one 512-token segment's stream entry"
    assert [(f["what"], f["baseline_what"]) for f in done.figures] == [
        (f"{what} 2", decoded), (f"{what} 4", "the same, groups of 2"), (f"{what} 4", decoded)]
    # the smoke mode runs each size twice: a figure is the median of its runs
    assert all(len(f["runs"]) == 2 and f["unit"] == "us" for f in done.figures)
    assert any(note.startswith(f"{decoded}: ") and "with str keys" in note for note in done.notes)

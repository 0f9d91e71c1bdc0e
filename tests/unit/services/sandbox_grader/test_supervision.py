"""A sandbox-grader whose enqueuer thread dies must not go on looking healthy: it exits non-zero (its
supervisor, the local run or Compose, restarts it)."""

from __future__ import annotations

import shutil

import pytest

from rollstream.services.sandbox_grader import main as grader


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")
def test_the_grader_exits_non_zero_when_its_enqueuer_dies(monkeypatch, redis_url, run_id, tmp_path):
    def broken_consumer(*_args, **_kwargs):
        raise RuntimeError("enqueuer broke")

    monkeypatch.setattr(grader, "run_consumer", broken_consumer)
    for name, value in {"RS_REDIS_URL": redis_url, "RS_RUN_ID": run_id, "RS_STORAGE_URI": str(tmp_path),
                        "RS_HEALTH_PORT": "0"}.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as exit_info:
        grader.main()
    assert exit_info.value.code == 1

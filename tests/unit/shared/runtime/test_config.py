import json

import pytest
from pydantic import ValidationError

from rollstream.shared.runtime.config import Settings, reference_markdown
from tests.support import REPO


def test_environment_overrides_nested_sections(monkeypatch):
    monkeypatch.setenv("RS_TRAIN__BATCH_SIZE", "32")
    monkeypatch.setenv("RS_FLEET__URLS", '["http://a:1", "http://b:2"]')
    settings = Settings()
    assert settings.train.batch_size == 32
    assert settings.fleet.urls == ["http://a:1", "http://b:2"]


def test_config_file_is_read_and_environment_wins(tmp_path, monkeypatch):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"run_id": "from-file", "train": {"max_staleness": 0}}))
    monkeypatch.setenv("RS_CONFIG_FILE", str(path))
    monkeypatch.setenv("RS_RUN_ID", "from-env")
    settings = Settings()
    assert settings.run_id == "from-env" and settings.train.max_staleness == 0


def test_batches_must_hold_whole_groups(monkeypatch):
    monkeypatch.setenv("RS_TRAIN__BATCH_SIZE", "10")
    monkeypatch.setenv("RS_DATA__SAMPLES_PER_PROMPT", "4")
    with pytest.raises(ValidationError, match="multiple of data.samples_per_prompt"):
        Settings()


def test_unknown_keys_are_errors(tmp_path, monkeypatch):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"trian": {}}))
    monkeypatch.setenv("RS_CONFIG_FILE", str(path))
    with pytest.raises(ValidationError, match="trian"):
        Settings()


def test_missing_redis_is_a_clear_error():
    with pytest.raises(RuntimeError, match="set RS_REDIS_URL"):
        Settings().redis


def test_reference_lists_every_field_with_its_doc():
    table = reference_markdown()
    assert "| `RS_TRAIN__MAX_STALENESS` | `1` | eta: samples may be this many policy versions old" in table
    assert "`RS_BUS__RECLAIM_IDLE_MS`" in table


def test_readme_configuration_reference_is_current():

    readme = (REPO / "README.md").read_text()
    assert reference_markdown() in readme, "regenerate it: rollstream config --markdown"

import json

import pytest
from pydantic import ValidationError

from rollstream.shared.runtime.config import Settings, reference_markdown
from rollstream.shared.runtime.sections import Section
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
        _ = Settings().redis


def test_each_section_of_the_settings_is_the_module_of_its_name():
    """sections/ holds one module per section of Settings, named as its field is: `bus.*` in
    sections/bus.py."""
    modules = {path.stem for path in (REPO / "shared" / "runtime" / "sections").glob("*.py")} - {"__init__"}
    sections = {name: field.annotation for name, field in Settings.model_fields.items()
                if isinstance(field.annotation, type) and issubclass(field.annotation, Section)}
    assert modules == set(sections)
    assert {name: cls.__module__ for name, cls in sections.items()} == {
        name: f"rollstream.shared.runtime.sections.{name}" for name in sections}


def test_reference_lists_every_field_with_its_doc():
    table = reference_markdown()
    assert "| `RS_TRAIN__MAX_STALENESS` | `1` | eta: samples may be this many policy versions old" in table
    assert "`RS_BUS__RECLAIM_IDLE_MS`" in table


def test_every_row_of_the_reference_is_three_cells_whatever_its_description_holds():
    """Unescaped, a `|` in a description would end its cell, `<run_id>` would vanish as an HTML tag and
    `WANDB_*` would start emphasis."""
    import re

    rows = reference_markdown().splitlines()[2:]
    unescaped_bar = re.compile(r"(?<!\\)\|")
    assert all(len(unescaped_bar.findall(row)) == 4 for row in rows)
    parity = next(row for row in rows if "RS_TRAIN__PARITY_TOLERANCE" in row)
    assert r"Max \|vLLM - trainer\| prompt logprob" in parity
    run_id = next(row for row in rows if row.startswith("| `RS_RUN_ID`"))
    assert "rs:{&lt;run_id&gt;}:\\*" in run_id
    bus_cluster = next(row for row in rows if "RS_BUS__CLUSTER" in row)
    assert "`rs:{<run_id>}:...`" in bus_cluster, "a code span is kept as written"


def test_the_configuration_pages_reference_is_current():
    page = (REPO / "docs" / "configuration.md").read_text()
    assert reference_markdown() in page, "regenerate its table: rollstream config --markdown"


# ------------------------------------------------------------------------------------------------- secrets
PASSWORD = "pa:ss@word/with-odd-chars"
TOKEN = "an-http-token-of-some-length"


def test_credentials_in_the_url_move_to_their_fields_and_the_url_keeps_where_redis_is():
    from urllib.parse import quote

    settings = Settings(redis_url=f"redis://reward:{quote(PASSWORD, safe='')}@redis:6379/0")
    assert settings.redis_url == "redis://redis:6379/0"
    assert settings.redis_username == "reward" and settings.redis_password.get_secret_value() == PASSWORD
    # the connection URL carries them again, quoted so that redis-py reads them back as they were
    from redis.connection import parse_url
    assert parse_url(settings.redis) == {"username": "reward", "password": PASSWORD, "host": "redis",
                                         "port": 6379, "db": 0}


def test_credentials_set_twice_are_an_error():
    with pytest.raises(ValidationError, match="redis_password is set twice"):
        Settings(redis_url="redis://:one@redis:6379/0", redis_password="two")


def test_secrets_are_masked_in_every_dump_and_repr(monkeypatch):
    monkeypatch.setenv("RS_REDIS_PASSWORD", PASSWORD)
    monkeypatch.setenv("RS_SECURITY__HTTP_TOKEN", TOKEN)
    settings = Settings(redis_url="redis://redis:6379/0")
    for shown in (settings.model_dump_json(), str(settings.model_dump(mode="json")), repr(settings),
                  str(settings)):
        assert PASSWORD not in shown and TOKEN not in shown


def test_a_rejected_secret_is_not_echoed_by_the_validation_error():
    with pytest.raises(ValidationError) as error:
        Settings(security={"http_token": "too-short-token"})
    assert "too-short-token" not in str(error.value)


def test_a_dump_read_back_with_its_masks_is_refused_not_used_as_the_password(tmp_path, monkeypatch):
    path = tmp_path / "config.json"
    path.write_text(Settings(redis_url="redis://r:6379/0", redis_password=PASSWORD).model_dump_json())
    monkeypatch.setenv("RS_CONFIG_FILE", str(path))
    with pytest.raises(ValidationError, match="masked form of a secret"):
        Settings()


def test_an_empty_secret_is_none():
    settings = Settings(redis_password="", security={"http_token": ""})
    assert settings.redis_password is None and settings.security.http_token is None


def test_a_config_file_without_secrets_and_the_secret_environment_give_back_the_settings(
        tmp_path, monkeypatch):
    from rollstream.shared.runtime.config import secret_environment, settings_json_without_secrets

    settings = Settings(redis_url="redis://redis:6379/0", redis_username="reward", redis_password=PASSWORD,
                        security={"http_token": TOKEN, "metrics_token": TOKEN + "-metrics"})
    text = settings_json_without_secrets(settings)
    assert PASSWORD not in text and TOKEN not in text and "**" not in text
    path = tmp_path / "config.json"
    path.write_text(text)
    monkeypatch.setenv("RS_CONFIG_FILE", str(path))
    for name, value in secret_environment(settings).items():
        monkeypatch.setenv(name, value)
    again = Settings()
    assert again.redis == settings.redis and again.security == settings.security


def test_redacted_urls_keep_the_user_and_lose_the_password():
    from rollstream.shared.runtime.config import redact_url

    assert redact_url("redis://reward:secret@redis:6379/0") == "redis://reward:***@redis:6379/0"
    assert redact_url("redis://:secret@redis:6379/0") == "redis://:***@redis:6379/0"
    assert redact_url("redis://redis:6379/0") == "redis://redis:6379/0"


# ------------------------------------------------------------------------------------------------ listening
def test_services_listen_on_loopback_unless_told_otherwise_and_only_on_an_ip_address(monkeypatch):
    assert Settings().listen_host == "127.0.0.1"
    monkeypatch.setenv("RS_LISTEN_HOST", "0.0.0.0")
    assert Settings().listen_host == "0.0.0.0" and Settings().url_host == "127.0.0.1"
    assert Settings(listen_host="::").url_host == "[::1]"
    assert Settings(listen_host="10.1.2.3").url_host == "10.1.2.3"
    for wrong in ("localhost", "", "0.0.0.0:80", "*"):
        with pytest.raises(ValidationError, match="is not an IP address"):
            Settings(listen_host=wrong)


def test_model_groups_come_from_json_in_the_environment_and_bad_ones_are_clear_errors(monkeypatch):
    monkeypatch.setenv("RS_FLEET__GROUPS",
                       '{"judge": {"urls": ["http://judge:8000"], "served_name": "qwen-judge"}}')
    (judge,) = Settings().fleet.groups.items()
    assert (judge[0], judge[1].urls, judge[1].served_name) == ("judge", ["http://judge:8000"], "qwen-judge")
    monkeypatch.delenv("RS_FLEET__GROUPS")
    for groups, error in [({"judge": {}}, "needs its servers' urls, or the path of a model"),
                          ({"judge": {"path": "m", "vllm_args": ["--port=9"]}},
                           "--port is set by rollstream"),
                          ({"a judge": {"urls": ["http://j"]}}, "server group name 'a judge': use letters")]:
        with pytest.raises(ValidationError, match=error):
            Settings(fleet={"groups": groups})


def test_a_policy_group_adds_policy_servers_with_their_own_context():
    settings = Settings(fleet={"urls": ["http://a:8000"], "groups": {
        "long": {"policy": True, "urls": ["http://long:8000"], "max_model_len": 32768},
        "judge": {"urls": ["http://judge:8000"], "max_model_len": 65536}}}, model={"max_model_len": 4096})
    assert settings.policy_servers() == {"http://a:8000": 4096, "http://long:8000": 32768}  # not the judge's
    with pytest.raises(ValidationError, match="a policy group serves the run's model"):
        Settings(fleet={"groups": {"long": {"policy": True, "path": "other-model"}}})


def test_the_job_queue_redis_takes_the_bus_credentials_not_its_own():
    assert Settings(bus={"job_queue_url": "redis://jobs:6379/0"}).bus.job_queue_url == "redis://jobs:6379/0"
    for url in ("redis://user:secret@jobs:6379/0", "http://jobs:6379"):
        with pytest.raises(ValidationError, match="a redis:// URL without credentials"):
            Settings(bus={"job_queue_url": url})

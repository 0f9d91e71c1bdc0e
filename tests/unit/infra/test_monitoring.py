"""infra/prometheus and infra/grafana, offline: Prometheus's own checker takes both configurations and every
query of the dashboard; the dashboard asks only for series the services serve; compose's monitoring profile
mounts what the files name. (tests/integration/test_metrics.py asks the dashboard's queries of a Prometheus
scraping a real run.)"""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest
import yaml
from prometheus_client import REGISTRY

# each service module registers its series
import rollstream.services.agent_runner.main
import rollstream.services.dispatcher.main
import rollstream.services.gateway.main
import rollstream.services.recorder.main
import rollstream.services.reward.main
import rollstream.services.sandbox_grader.main
import rollstream.services.trainer.training  # noqa: F401
from tests.support import REPO

PROMETHEUS = REPO / "infra" / "prometheus"
GRAFANA = REPO / "infra" / "grafana"
DASHBOARD = json.loads((GRAFANA / "dashboards" / "rollstream.json").read_text())


def promtool() -> str:
    tool = shutil.which("promtool")
    if tool is None:
        pytest.skip("promtool (apt-get install prometheus) checks the configurations and queries offline")
    return tool


def queries() -> list[str]:
    return [target["expr"] for panel in DASHBOARD["panels"] for target in panel["targets"]]


@pytest.mark.parametrize("config", ["local.yml", "compose.yml"])
def test_prometheus_takes_each_configuration(config, tmp_path):
    text = (PROMETHEUS / config).read_text()
    # the token file exists only inside compose's Prometheus container
    token = tmp_path / "metrics-token"
    token.write_text("t" * 16)
    checked = tmp_path / config
    checked.write_text(text.replace("/prometheus/metrics-token", str(token)))
    result = subprocess.run([promtool(), "check", "config", "--syntax-only", str(checked)],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_prometheus_parses_every_query_of_the_dashboard(tmp_path):
    rules = {"groups": [{"name": "dashboard", "rules": [{"record": f"dashboard:query_{index}", "expr": query}
                                                         for index, query in enumerate(queries())]}]}
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump(rules))
    result = subprocess.run([promtool(), "check", "rules", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_dashboard_asks_only_for_series_the_services_serve():
    served = {name for family in REGISTRY.collect() for name in
              {family.name, *(sample.name for sample in family.samples)}}
    # a histogram's or counter's series, even those with no sample yet (labelled ones have none until used)
    served |= {f"{name}{suffix}" for name in list(served)
               for suffix in ("_total", "_bucket", "_sum", "_count")}
    asked = {name for query in queries() for name in re.findall(r"\b(rollstream_[a-z_]+)", query)}
    assert asked and asked <= served, asked - served
    vllm = {name for query in queries() for name in re.findall(r"\b(vllm:[a-z_]+)", query)}
    assert vllm <= {"vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"}


def test_compose_monitoring_mounts_the_configuration_and_the_dashboard():
    services = yaml.safe_load((REPO / "docker-compose.yml").read_text())["services"]
    prometheus, grafana = services["prometheus"], services["grafana"]
    assert prometheus["profiles"] == grafana["profiles"] == ["monitoring"]
    assert "./infra/prometheus/compose.yml:/etc/prometheus/prometheus.yml:ro" in prometheus["volumes"]
    assert "/prometheus/metrics-token" in " ".join(prometheus["command"])
    scrape = yaml.safe_load((PROMETHEUS / "compose.yml").read_text())["scrape_configs"][0]
    assert scrape["authorization"]["credentials_file"] == "/prometheus/metrics-token"
    pipeline = {name for name, service in services.items()
                if service.get("command", [""])[0].startswith("rollstream-")}
    assert set(scrape["dns_sd_configs"][0]["names"]) == pipeline
    provisioned = yaml.safe_load((GRAFANA / "provisioning" / "dashboards" / "rollstream.yml").read_text())
    mounted = {volume.split(":")[1] for volume in grafana["volumes"]}
    assert provisioned["providers"][0]["options"]["path"] in mounted
    datasource = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "prometheus.yml").read_text())
    assert datasource["datasources"][0]["url"] == "http://prometheus:9090"


def test_the_dashboard_is_one_grafana_can_load():
    assert DASHBOARD["uid"] and DASHBOARD["title"] and isinstance(DASHBOARD["schemaVersion"], int)
    [variable] = DASHBOARD["templating"]["list"]
    assert variable == {**variable, "name": "datasource", "type": "datasource", "query": "prometheus"}
    panels = DASHBOARD["panels"]
    assert len({panel["id"] for panel in panels}) == len(panels)
    cells = set()
    for panel in panels:
        assert panel["type"] == "timeseries" and panel["title"] and panel["description"], panel.get("title")
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        position = panel["gridPos"]
        assert position["x"] + position["w"] <= 24, panel["title"]  # Grafana's grid is 24 columns wide
        covered = {(x, y) for x in range(position["x"], position["x"] + position["w"])
                   for y in range(position["y"], position["y"] + position["h"])}
        assert not covered & cells, f"{panel['title']} overlaps another panel"
        cells |= covered
        refs = [target["refId"] for target in panel["targets"]]
        assert refs and len(set(refs)) == len(refs), panel["title"]
        assert all(target["expr"].strip() and target["datasource"]["uid"] == "${datasource}"
                   for target in panel["targets"]), panel["title"]

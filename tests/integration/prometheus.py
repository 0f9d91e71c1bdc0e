"""A real Prometheus (the `prometheus` Debian package's server) scraping a local run with the scrape job of
infra/prometheus/local.yml, and the Grafana dashboard's queries (infra/grafana/dashboards/rollstream.json)
asked of it: what a user watching the run in Grafana would see in each panel."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import yaml

from rollstream.cli.local_run import LocalRun
from rollstream.cli.vllm_server import free_port
from tests.support import REPO

PROMETHEUS = shutil.which("prometheus")
DASHBOARD = REPO / "infra" / "grafana" / "dashboards" / "rollstream.json"
LOCAL_CONFIG = REPO / "infra" / "prometheus" / "local.yml"


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL) of every query of the dashboard."""
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [(panel["title"], target["expr"]) for panel in panels for target in panel["targets"]]


@contextmanager
def prometheus_scraping(local: LocalRun, workdir: Path, metrics_token: str) -> Iterator[str | None]:
    """Prometheus's URL while it scrapes the run every second (None where no prometheus is installed): the
    shipped scrape job, pointed at this run's targets file, with the run's metrics token."""
    if PROMETHEUS is None:
        yield None
        return
    workdir.mkdir(parents=True, exist_ok=True)
    config = yaml.safe_load(LOCAL_CONFIG.read_text())
    config["global"]["scrape_interval"] = "1s"
    [job] = config["scrape_configs"]
    job["file_sd_configs"][0].update(files=[str(local.scrape_targets_file)], refresh_interval="1s")
    token_file = workdir / "metrics-token"
    token_file.write_text(metrics_token)
    job["authorization"] = {"credentials_file": str(token_file)}
    config_file = workdir / "prometheus.yml"
    config_file.write_text(yaml.safe_dump(config))
    url = f"http://127.0.0.1:{free_port()}"
    with open(workdir / "prometheus.log", "wb") as log:
        process = subprocess.Popen([PROMETHEUS, f"--config.file={config_file}",
                                    f"--storage.tsdb.path={workdir / 'data'}",
                                    f"--web.listen-address={url.removeprefix('http://')}"],
                                   stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_ready(url, process, workdir / "prometheus.log")
        yield url
    finally:
        process.terminate()
        process.wait(timeout=30)


def wait_ready(url: str, process: subprocess.Popen, log: Path, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"prometheus exited with {process.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/-/ready", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"prometheus not ready after {timeout_s:.0f}s:\n{log.read_text()[-3000:]}")


def ask(url: str, query: str) -> list[dict]:
    """The instant query's result; an error for a query Prometheus refuses."""
    body = httpx.get(f"{url}/api/v1/query", params={"query": query}, timeout=10).json()
    if body.get("status") != "success":
        raise ValueError(f"prometheus refused {query!r}: {body}")
    return body["data"]["result"]


def scrape_health(url: str) -> dict[str, str]:
    """Each scraped target's health as Prometheus saw it at its last scrape: process label -> up / down."""
    targets = httpx.get(f"{url}/api/v1/targets", timeout=10).json()["data"]["activeTargets"]
    return {target["labels"].get("process", target["scrapeUrl"]): target["health"] for target in targets}

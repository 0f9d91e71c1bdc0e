"""Watching a run: what each service's /metrics said at the end of the deployed run
(tests/integration/conftest.py deployed_run: 3 policy versions, sandbox grading, two malformed entries
dead-lettered), and what a real Prometheus scraping it with infra/prometheus/local.yml's job gave each panel
of the Grafana dashboard."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.deployed import DEPLOYED_BATCH, DEPLOYED_VERSIONS

pytestmark = pytest.mark.integration

PANELS_EMPTY_IN_A_HEALTHY_RUN = {
    "Gateway turns per second, by API": "the deployed run has no black-box agent, so no gateway",
    "Rollouts dropped (5 min), by cause": "no rollout may be dropped: grading does not fail here",
}
QUERIES_EMPTY_IN_A_HEALTHY_RUN = ('outcome="failed"', "grading_failed_total", 'outcome!="ok"',
                                  "rollstream_gateway_")
"""Parts of the queries that may find nothing in a run where nothing fails and no gateway runs."""


@pytest.fixture(scope="module")
def run(deployed_run):
    return deployed_run


def series(text: str) -> dict[tuple[str, frozenset], float]:
    return {(sample.name, frozenset(sample.labels.items())): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def total(text: str, name: str, **labels: str) -> float:
    return sum(value for (sample, sample_labels), value in series(text).items()
               if sample == name and set(labels.items()) <= sample_labels)


def test_each_service_counts_its_own_work(run):
    shown = run["exposition"]
    samples = DEPLOYED_VERSIONS * DEPLOYED_BATCH
    assert total(shown["dispatcher"], "rollstream_dispatcher_samples_admitted_total") >= samples
    assert total(shown["agent-runner"], "rollstream_agent_runner_episodes_total", status="completed") > 0
    assert total(shown["agent-runner"], "rollstream_agent_runner_tokens_total", kind="sampled") > 0
    assert total(shown["agent-runner"], "rollstream_fleet_requests_total", outcome="ok") > 0
    assert total(shown["sandbox-grader"], "rollstream_sandbox_grader_jobs_total", outcome="graded") > 0
    assert total(shown["sandbox-grader"], "rollstream_sandbox_grader_job_seconds_count") > 0
    assert total(shown["reward"], "rollstream_reward_value_count") >= samples
    assert total(shown["reward"], "rollstream_reward_batch_samples_count") >= DEPLOYED_VERSIONS
    assert total(shown["trainer"], "rollstream_trainer_policy_version") == DEPLOYED_VERSIONS
    assert total(shown["trainer"], "rollstream_trainer_samples_total", outcome="trained") > 0
    syncs = total(shown["trainer"], "rollstream_trainer_phase_seconds_count", phase="sync")
    assert syncs == DEPLOYED_VERSIONS
    # the last version's collective broadcast: the whole model, or a delta of it
    assert total(shown["trainer"], "rollstream_trainer_sync_stat", stat="bytes") > 0
    assert total(shown["recorder"], "rollstream_recorder_entries_total", outcome="archived") > 0


def test_the_consuming_services_show_their_groups_work_and_dead_letters(run):
    shown = run["exposition"]
    for service, stream in (("agent-runner", "prompts"), ("sandbox-grader", "trajectories"),
                            ("reward", "trajectories"), ("trainer", "batches")):
        assert total(shown[service], "rollstream_bus_events_handled_total", stream=stream, group=service,
                     outcome="ok") > 0, service
        lag = [name for name, labels in series(shown[service])
               if name == "rollstream_bus_consumer_lag" and ("group", service) in labels]
        assert lag, f"{service} shows no lag of its group"
    # the run's two malformed entries, each dead-lettered by the group that read it
    assert total(shown["agent-runner"], "rollstream_bus_dead_letters_total", stream="prompts") == 1
    assert total(shown["trainer"], "rollstream_bus_dead_letters_total", stream="batches") == 1


def test_prometheus_scrapes_every_process_and_every_dashboard_panel_shows_the_run(run):
    scraped = run["prometheus"]
    if scraped is None:
        pytest.skip("no prometheus server here (apt-get install prometheus): the dashboard's queries are not "
                    "asked")
    local = run["local"]
    moved = {what: float(result[0]["value"][1]) if result else 0.0
             for what, result in scraped["moved"].items()}
    assert all(value > 0 for value in moved.values()), moved
    assert set(scraped["targets"]) >= set(local.health_ports), scraped["targets"]
    assert set(scraped["targets"].values()) == {"up"}, scraped["targets"]
    empty_panels = {title for (title, _), result in scraped["panels"].items()} - {
        title for (title, _), result in scraped["panels"].items() if result}
    assert empty_panels <= set(PANELS_EMPTY_IN_A_HEALTHY_RUN), empty_panels
    empty_queries = [query for (title, query), result in scraped["panels"].items()
                     if not result and title not in PANELS_EMPTY_IN_A_HEALTHY_RUN]
    unexplained = [query for query in empty_queries
                   if not any(part in query for part in QUERIES_EMPTY_IN_A_HEALTHY_RUN)]
    assert unexplained == []

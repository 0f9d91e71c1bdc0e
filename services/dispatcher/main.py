"""Dispatcher: admits prompt samples into the run under the staleness rule.

Reads the dataset (a row naming a role the run does not have stops it, with the row named), and emits one
PromptIssued per sample, n per prompt group, on `prompts`, with the row's role. A new
group is admitted only while admitted - filtered + n <= (eta + v + 1) x B (v: policy version, B:
batch size, eta: max staleness), so generation runs at most eta versions ahead of training. Samples
the reward service filtered out (zero-variance groups, train.filter_zero_variance) never reach a
batch, so their slots are given back. One dispatcher is active per run (a Redis lock); it stops
admitting once B x total_versions samples that were not filtered out have been admitted. The gate
is services/dispatcher/gate.py.

    rollstream-dispatcher        # configured by RS_* variables or RS_CONFIG_FILE
"""

from __future__ import annotations

import time

from prometheus_client import Counter, Gauge

from rollstream.services.dispatcher.gate import (
    StalenessGate,
    admit_group,
    current_policy_version,
    filtered_samples,
    next_step,
)
from rollstream.shared.contract.bus import Bus
from rollstream.shared.contract.roles import RunRoles
from rollstream.shared.contract.run_lock import RunLock
from rollstream.shared.errors import DatasetError
from rollstream.shared.runtime.config import Settings
from rollstream.shared.runtime.service import ServiceRuntime
from rollstream.shared.tasks.datasets import arithmetic_dataset, load_dataset
from rollstream.shared.tasks.rows import PromptRow, check_roles

LOCK_TTL_MS = 15_000

ADMITTED = Counter("rollstream_dispatcher_samples_admitted_total",
                   "Samples this dispatcher admitted onto `prompts` (samples_per_prompt per prompt group).")
CAPACITY = Gauge("rollstream_dispatcher_admission_capacity",
                 "Samples the staleness gate allows admitted at the current policy version: (eta + v + 1) "
                 "x B.")
ADMITTED_IN_RUN = Gauge("rollstream_dispatcher_run_samples_admitted",
                        "Samples admitted in the whole run so far, filtered ones given back not subtracted.")


def prompt_rows(settings: Settings) -> list[PromptRow]:
    """The dataset's rows; DatasetError for one the run cannot issue (a role it does not have among them)."""
    if settings.data.path is None:
        return arithmetic_dataset(settings.data.synthetic_prompts, settings.data.seed,
                                  settings.data.synthetic_sandbox_every)
    rows = load_dataset(settings.data.path)
    check_roles(rows, RunRoles.of(settings), str(settings.data.path))
    return rows


def main() -> None:
    settings = Settings()
    runtime = ServiceRuntime("dispatcher", settings)
    bus = Bus.connect(settings.redis, settings.run_id, settings.bus)
    log = runtime.log

    try:
        rows = prompt_rows(settings)
    except DatasetError as exc:
        log.critical("dataset rejected", extra={"error": str(exc)})
        runtime.close()
        raise SystemExit(2) from exc
    n = settings.data.samples_per_prompt
    total = settings.train.batch_size * settings.train.total_versions
    gate = StalenessGate(settings.train.max_staleness, settings.train.batch_size)
    log.info("dataset loaded", extra={"rows": len(rows), "samples_to_admit": total})

    lock = RunLock(bus, "dispatcher", LOCK_TTL_MS)
    standby = "standby: another dispatcher is active"
    lock.acquire(runtime.should_stop, lambda: runtime.status.update(state=standby))

    admitted = int(bus.redis.get(bus.keys.admitted) or 0)
    while not runtime.stopping:
        lock.renew_when_due()
        version = current_policy_version(bus)
        filtered = filtered_samples(bus)
        runtime.status.update(admitted=admitted, filtered=filtered, policy_version=version,
                              capacity=gate.capacity(version))
        CAPACITY.set(gate.capacity(version))
        ADMITTED_IN_RUN.set(admitted)
        step = next_step(gate, admitted=admitted, filtered=filtered, group_size=n, policy_version=version,
                         total=total)
        if step == "done":
            # Not final: samples still in flight may yet be filtered out and need replacing.
            runtime.status["state"] = "done"
            time.sleep(0.5)
            continue
        if step == "wait":
            runtime.status["state"] = "waiting for a new policy version or filtered samples"
            bus.redis.xread({bus.keys.stream("policy"): "$"}, block=500)
            continue
        runtime.status["state"] = "admitting"
        group_index = admitted // n
        admit_group(bus, rows[group_index % len(rows)], group_index, admitted, n, version)
        admitted += n
        ADMITTED.inc(n)
        log.debug("admitted group", extra={"group_index": group_index, "policy_version": version})

    lock.release()
    runtime.close()


if __name__ == "__main__":
    main()

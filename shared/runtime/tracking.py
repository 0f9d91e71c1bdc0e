"""Experiment tracking: the trainer's metrics, one point per policy version, to TensorBoard and, when
configured, to Weights & Biases or MLflow.

    tensorboard  event files in <storage>/<run>/tensorboard (`tensorboard --logdir runs`)
    wandb        project from WANDB_PROJECT (default "rollstream"), the run id as the W&B run id, so a
                 restarted trainer continues the same W&B run; WANDB_MODE=offline works without network
    mlflow       MLFLOW_TRACKING_URI (default ./mlruns), experiment from MLFLOW_EXPERIMENT_NAME

The packages of wandb and mlflow are optional: asking for one that is not installed fails at start,
not at the first metric.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from typing import Any

from rollstream.shared.errors import TrackingError


def _require(package: str, tracker: str):
    try:
        return importlib.import_module(package)
    except ImportError as exc:
        raise TrackingError(f"train.trackers includes {tracker!r} but the {package} package is not installed "
                            f"(pip install {package}): {exc}") from exc


def flatten(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, f"{name}."))
        else:
            flat[name] = value if isinstance(value, (int, float, str, bool)) or value is None else str(value)
    return flat


class Tracker:
    def __init__(self, trackers: list[str], run_id: str, run_dir: Path, config: dict[str, Any]) -> None:
        self.sinks: list[tuple[str, Any]] = []
        for name in trackers:
            if name == "tensorboard":
                from torch.utils.tensorboard import SummaryWriter

                writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))
                writer.add_text("config", "\n".join(f"    {k} = {v}"
                                                    for k, v in sorted(flatten(config).items())))
                self.sinks.append((name, writer))
            elif name == "wandb":
                wandb = _require("wandb", name)
                run = wandb.init(project=os.environ.get("WANDB_PROJECT", "rollstream"), id=run_id,
                                 name=run_id, resume="allow", config=config, dir=str(run_dir))
                self.sinks.append((name, run))
            elif name == "mlflow":
                mlflow = _require("mlflow", name)
                mlflow.start_run(run_name=run_id)
                mlflow.log_params({k: str(v)[:500] for k, v in flatten(config).items()})
                self.sinks.append((name, mlflow))
            else:
                raise TrackingError(f"unknown tracker {name!r}: use tensorboard, wandb or mlflow")

    def log(self, metrics: dict[str, float], step: int) -> None:
        for name, sink in self.sinks:
            if name == "tensorboard":
                for key, value in metrics.items():
                    sink.add_scalar(key, value, step)
                sink.flush()
            elif name == "wandb":
                sink.log(metrics, step=step, commit=True)
            else:
                sink.log_metrics({k.replace("/", "_"): v for k, v in metrics.items()}, step=step)

    def close(self) -> None:
        for name, sink in self.sinks:
            if name == "tensorboard":
                sink.close()
            elif name == "wandb":
                sink.finish()
            else:
                sink.end_run()
        self.sinks.clear()

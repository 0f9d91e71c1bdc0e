"""The trainer's settings (`train.*`, RS_TRAIN__*): batches and staleness, the loss and its optimizer, the
backend and its ranks, where metrics go, and the weight sync's parity check.

    python -m pytest tests/unit/shared/runtime/test_config.py -q
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from rollstream.shared.runtime.sections import Section


class TrainSettings(Section):
    batch_size: int = Field(32, ge=1)
    """Samples per train batch (B); a multiple of data.samples_per_prompt."""
    max_staleness: int = Field(1, ge=0)
    """eta: samples may be this many policy versions old; 0 is synchronous on-policy training."""
    total_versions: int = Field(30, ge=1)
    """Policy versions (train steps) in the run; the dispatcher admits batch_size x this samples."""
    learning_rate: float = Field(3e-4, ge=0)
    """Adam learning rate; 0 leaves the weights as they are (a control run: same pipeline, no learning)."""
    clip_eps: float = Field(0.2, gt=0)
    """PPO clip range."""
    loss_aggregation: Literal["token", "rollout"] = "token"
    """token: every sampled token weighs the same; rollout: every rollout (all its segments) weighs the
    same."""
    decoupled: bool = True
    """Decoupled PPO (AReaL): clip against the trainer's policy before the step (proximal), correct for the
    rollout policy with an importance weight; off: clip against the rollout logprobs (plain PPO)."""
    importance_weight_cap: float | None = Field(5.0, gt=0)
    """Truncation of the proximal/behaviour importance weight; None: no cap."""
    minibatches: int = Field(1, ge=1)
    """Optimizer steps per batch: the batch's rollouts are split into this many minibatches."""
    micro_batch_tokens: int = Field(4096, ge=16)
    """Token budget of one packed micro-batch; gradients accumulate over a minibatch's micro-batches."""
    kl_coef: float = Field(0.0, ge=0)
    """Weight of the KL penalty to the reference (starting) model; 0: no reference model is loaded."""
    advantage_estimator: Literal["grpo", "dr_grpo"] = "grpo"
    """grpo: (r - mean) / std over a group's rollouts; dr_grpo: r - mean (no std scaling)."""
    filter_zero_variance: bool = False
    """Leave out groups whose rollouts all got the same reward (no signal); their samples are re-admitted."""
    grad_clip: float = Field(1.0, gt=0)
    """Gradient norm clip."""
    backend: Literal["torch", "deepspeed"] = "torch"
    """Trainer backend: plain torch (CPU or one GPU) or DeepSpeed ZeRO."""
    zero_stage: Literal[2, 3] = 2
    """DeepSpeed ZeRO stage when backend is deepspeed."""
    ranks: int = Field(1, ge=1)
    """Data-parallel trainer processes on this node (one per GPU): rollstream-trainer starts them under
    torchrun, which starts them all again when one fails. Several need backend deepspeed. Under a launcher of
    your own (torchrun or deepspeed over several nodes) its WORLD_SIZE counts instead."""
    trackers: list[Literal["tensorboard", "wandb", "mlflow"]] = ["tensorboard"]
    """Where training metrics go; TensorBoard logs to <storage>/<run>/tensorboard. wandb and mlflow need their
    package installed and are configured by their own environment variables (WANDB_*, MLFLOW_*)."""
    parity_tolerance: float = Field(1e-3, gt=0)
    """Max |vLLM - trainer| prompt logprob on the probe after a weight sync."""
    weight_transport: Literal["collective", "disk"] = "collective"
    """How a new version reaches the fleet (shared/inference/weight_transport.py). collective: the trainer
    broadcasts the weights to every server at once over a process group (NCCL on GPUs, gloo on CPUs); the
    servers must run rollstream's weight-transfer engine (`--weight-transfer-config '{"backend":
    "rollstream"}'`, which rollstream's launchers add) and reach the trainer at sync_address. disk: every
    server reloads the checkpoint from storage it shares with the trainer; works with any vLLM server."""
    checkpoint_every: int = Field(1, ge=1)
    """Write the training state (weights the servers and `serve-policy` load, optimizer, RNG) every this many
    versions, and at a clean stop, once the version is published: off the fleet's way. A restarted trainer
    trains the batches published since the newest checkpoint again, to the same state. The disk transport
    checkpoints every version, before its sync."""
    weight_delta: bool = True
    """collective: send only the elements that changed since the version every server holds (whole when that
    would not be smaller). Costs a host copy of the model on the trainer and on each server."""
    sync_communication: Literal["auto", "gloo", "nccl"] = "auto"
    """The collective's library: auto is nccl where the trainer has a GPU, else gloo."""
    sync_address: str | None = None
    """The address the servers reach the trainer's leading rank at for a collective sync; None: the address
    its host name resolves to (its own in Compose and Kubernetes)."""
    sync_bucket_mb: int = Field(256, ge=1)
    """A collective sync's broadcast size: tensors are packed into buckets of at most this many MiB."""
    sync_timeout_s: float = Field(120.0, gt=0)
    """How long a collective sync waits for a server to join or receive before it drops it from the sync."""
    sync_concurrency: int = Field(16, ge=1)
    """disk: servers a weight sync reloads and probes at once (each paused only while it loads); 1: one by
    one."""
    lora_rank: int = Field(0, ge=0, le=256)
    """0: train the whole model (a full fine-tune). Above 0: train a LoRA adapter of this rank per trained
    role (roles.names) over the frozen base model; the fleet serves the base and every adapter (vLLM's
    --enable-lora, which rollstream's launchers add) and a weight sync moves only the adapters."""
    lora_alpha: float = Field(16.0, gt=0)
    """LoRA's scaling numerator: an adapter's update is scaled by lora_alpha / lora_rank."""
    lora_dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the adapters' inputs while training (the servers apply none: above 0 the trainer's
    logprobs of a batch are not the fleet's)."""
    lora_target_modules: list[str] = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                      "down_proj"]
    """The modules each adapter wraps, by name (as peft's target_modules: the attention and MLP projections of
    Llama-, Qwen- and Mistral-shaped models by default)."""
    seed: int = 0
    """Seed of the trainer."""

    @model_validator(mode="after")
    def _several_ranks_need_deepspeed(self) -> TrainSettings:
        if self.ranks > 1 and self.backend != "deepspeed":
            raise ValueError(f"train.ranks={self.ranks} needs train.backend='deepspeed': the torch backend "
                             "trains on one process")
        return self

    @property
    def lora(self) -> bool:
        """Whether the trained roles are LoRA adapters (lora_rank > 0), not the whole model."""
        return self.lora_rank > 0

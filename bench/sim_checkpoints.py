"""Real prompt logprobs for simulated servers (bench/sim_fleet.py) and the simulated trainer
(bench/sim_trainer.py): a float32 transformers forward pass of the checkpoint a server was last told to
load, so that the trainer's parity check after a weight sync holds. Models and results are cached by path,
so 64 servers share one copy.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any


class Checkpoints:
    """Models by checkpoint path and prompt logprobs by (path, ids): one copy for every server."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.load_lock = threading.Lock()
        self.models: OrderedDict[str, Any] = OrderedDict()
        self.results: OrderedDict[tuple[str, tuple[int, ...]], list[tuple[float, int]]] = OrderedDict()

    def model(self, path: str):
        # one loader at a time: concurrent first imports of transformers fail half-initialised, and a
        # checkpoint asked for by 64 servers at once is loaded once
        with self.load_lock:
            with self.lock:
                if path in self.models:
                    self.models.move_to_end(path)
                    return self.models[path]
            import torch
            from transformers import AutoModelForCausalLM
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()
            if not (Path(path) / "config.json").exists():
                raise FileNotFoundError(f"no HF checkpoint at {path}")
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            with self.lock:
                self.models[path] = model
                while len(self.models) > 3:  # the trainer moves on; old versions are never asked again
                    self.models.popitem(last=False)
            return model

    def prompt_logprobs(self, path: str, ids: list[int]) -> list[tuple[float, int]]:
        """(logprob, rank) of ids[i] given ids[:i], i = 1..n-1, as the trainer computes them."""
        key = (path, tuple(ids))
        with self.lock:
            if key in self.results:
                return self.results[key]
        import torch

        model = self.model(path)
        tokens = torch.tensor([ids])
        with torch.no_grad():
            logits = model(input_ids=tokens).logits.float()
        logp = torch.log_softmax(logits[0, :-1], dim=-1)
        chosen = logp.gather(-1, tokens[0, 1:, None])
        ranks = (logp > chosen).sum(dim=-1) + 1
        result = list(zip(chosen[:, 0].tolist(), ranks.tolist()))
        with self.lock:
            self.results[key] = result
            while len(self.results) > 256:
                self.results.popitem(last=False)
        return result

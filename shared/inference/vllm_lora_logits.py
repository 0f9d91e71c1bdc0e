"""A fix inside vLLM's CPU build for a LoRA server's prompt logprobs, which the weight sync's parity probe
asks for while the server generates for other sessions (vLLM issues #16668 and #29955).

With LoRA enabled, vLLM wraps the output head in a LoRA layer that adds each request's adapter's share of the
logits, indexed by one entry per request being sampled (its "sampler indices"). The prompt logprobs of a
request go through the same head with one row per prompt token, so the rows and the indices disagree: alone,
the one index is broadcast over the rows; beside other requests, vLLM 0.32's CPU kernels fail on the shapes
(`einsum(): subscript b has size 27 ... 15`) and the engine dies, taking every request of the server with it.

An adapter that does not train the output head (rollstream's adapters target the attention and MLP
projections: train.lora_target_modules) adds nothing to the logits: its lm_head LoRA weights are zeros. So
when the rows and the indices disagree and every loaded adapter's lm_head share is zero, the head's LoRA share
is left out, which is exactly what it would have added; the prompt logprobs are then the adapter's own (its
projections' LoRA runs per token, with indices of its own, and is right). When an adapter does train the
head, the mismatch is refused with an error that says so, instead of logits of the wrong adapter.

vLLM runs `register` in each of its processes (the `vllm.general_plugins` entry point rollstream_lora_logits
in pyproject.toml); it changes nothing outside the CPU build's LoRA wrapper.

    python -m pytest tests/integration/test_adapter_sync.py -q
"""

from __future__ import annotations

import functools


def register() -> None:
    """vLLM's general-plugin hook (every vLLM process): patch the CPU build's LoRA logits, once."""
    try:
        from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU
    except ImportError:  # not vLLM's CPU build, or no LoRA support in it: nothing to fix
        return
    if getattr(PunicaWrapperCPU.add_lora_logits, "rows_checked", False):
        return
    PunicaWrapperCPU.add_lora_logits = logits_with_rows_checked(PunicaWrapperCPU.add_lora_logits)


def logits_with_rows_checked(add_lora_logits):
    """`add_lora_logits`, that leaves out a head's LoRA share of zeros where its rows are not one per sampled
    request (prompt logprobs), and refuses a share it cannot index."""

    @functools.wraps(add_lora_logits)
    def checked(self, y, x, lora_a_stacked, lora_b_stacked, scale, **kwargs):
        rows = x.reshape(-1, x.shape[-1]).size(0)
        if rows == self.sampler_indices.size(0):
            return add_lora_logits(self, y, x, lora_a_stacked, lora_b_stacked, scale, **kwargs)
        if not bool(lora_b_stacked.any()):
            return None  # every adapter's share of the logits is zero: leaving it out adds what it would
        raise RuntimeError(
            f"an adapter trains the output head (lm_head), and vLLM's CPU build cannot index its share of "
            f"{rows} prompt-logprob rows by {self.sampler_indices.size(0)} sampled requests: leave lm_head "
            "out of train.lora_target_modules")

    checked.rows_checked = True
    return checked

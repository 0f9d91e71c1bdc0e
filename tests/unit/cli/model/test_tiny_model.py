"""The project's tiny Llama: built offline, byte-for-byte deterministic, loadable by transformers."""

from __future__ import annotations

import hashlib
import json

import pytest

from rollstream.cli.model.tiny_model import CALCULATOR_TOOL, build_tiny_model


def _hashes(directory):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


@pytest.fixture(scope="module")
def tokenizer(tiny_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_dir)


def test_build_is_deterministic_and_seed_changes_only_weights(tiny_dir, tmp_path):
    again = _hashes(build_tiny_model(tmp_path / "again", seed=0))
    assert again == _hashes(tiny_dir)
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json"} <= set(again)
    other = _hashes(build_tiny_model(tmp_path / "seed1", seed=1))
    assert other["model.safetensors"] != again["model.safetensors"]
    assert other["tokenizer.json"] == again["tokenizer.json"]


def test_loads_with_transformers_and_has_the_vllm_friendly_shape(tiny_dir, tokenizer):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    config = model.config
    assert type(model).__name__ == "LlamaForCausalLM"
    assert config.tie_word_embeddings is False
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads,
            config.head_dim) == (128, 2, 2, 64)
    assert config.max_position_embeddings == 1024
    assert model.dtype == torch.float32
    assert 300 <= config.vocab_size <= 400 and config.vocab_size == len(tokenizer)
    assert 300_000 < sum(p.numel() for p in model.parameters()) < 500_000

    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    pad = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert tokenizer.eos_token_id == config.eos_token_id == im_end
    assert tokenizer.pad_token_id == config.pad_token_id == pad
    generation = json.loads((tiny_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == im_end
    on_disk = json.loads((tiny_dir / "config.json").read_text())
    assert on_disk["eos_token_id"] == im_end and on_disk["tie_word_embeddings"] is False

    with torch.no_grad():
        logits = model(torch.tensor([tokenizer.encode("What is 1 + 2?")])).logits
    assert logits.shape[-1] == config.vocab_size and torch.isfinite(logits).all()


def test_digits_are_one_token_each_and_text_round_trips(tokenizer):
    ids = tokenizer.encode("1234567890")
    assert [tokenizer.decode([i]) for i in ids] == list("1234567890")
    for text in [
        "What is 12 + 7?",
        'The answer is -4051. {"name": "calculator", "arguments": {"expression": "3 * 9"}}',
        "Ünïcödé, emoji 🙂 and\ttabs\nnew lines",
        "<|im_start|>user\nhi<|im_end|>\n<tool_call>{}</tool_call>",
    ]:
        assert tokenizer.decode(tokenizer.encode(text)) == text
    for marker in ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<tool_call>", "</tool_call>",
                   "<tool_response>", "</tool_response>"]:
        assert len(tokenizer.encode(marker)) == 1, marker
    # tool markers survive skip_special_tokens (the hermes parser needs them); chat markers do not
    text = tokenizer.decode(tokenizer.encode("<tool_call>x</tool_call><|im_end|>"), skip_special_tokens=True)
    assert text == "<tool_call>x</tool_call>"


def test_chat_template_renders_tools_tool_calls_tool_responses_and_generation_prompt(tokenizer):
    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is 12 + 7?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"type": "function",
                            "function": {"name": "calculator", "arguments": {"expression": "12 + 7"}}}],
        },
        {"role": "tool", "content": "19"},
    ]
    text = tokenizer.apply_chat_template(messages, tools=[CALCULATOR_TOOL], tokenize=False,
                                         add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nYou are a helpful assistant.\n\n# Tools\n")
    assert json.dumps(CALCULATOR_TOOL) in text
    assert "<|im_start|>user\nWhat is 12 + 7?<|im_end|>\n" in text
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "12 + 7"}}</tool_call>'
    assert f"<|im_start|>assistant\n{call}<|im_end|>\n" in text
    assert "<|im_start|>tool\n<tool_response>19</tool_response><|im_end|>\n" in text
    assert text.endswith("<|im_end|>\n<|im_start|>assistant\n")

    # arguments given as a JSON string (OpenAI wire format) render the same
    call_as_string = {"function": {"name": "calculator", "arguments": '{"expression": "12 + 7"}'}}
    as_string = [dict(messages[2], tool_calls=[call_as_string])]
    assert call in tokenizer.apply_chat_template(as_string, tokenize=False)

    # prefix-stable: a shorter conversation renders to a prefix, so only appended text needs tokenizing
    full = tokenizer.apply_chat_template(messages + [{"role": "assistant", "content": "19"}],
                                         tools=[CALCULATOR_TOOL], tokenize=False)
    assert full == text + "19<|im_end|>\n"
    no_tools = tokenizer.apply_chat_template(messages[1:2], tokenize=False, add_generation_prompt=False)
    assert no_tools == "<|im_start|>user\nWhat is 12 + 7?<|im_end|>\n"


def test_tied_variant_shares_the_embedding_with_the_head_and_keeps_the_tokenizer(tiny_dir, tmp_path):
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    tied_dir = build_tiny_model(tmp_path / "tied", seed=0, tie_embeddings=True)
    again = build_tiny_model(tmp_path / "tied-again", seed=0, tie_embeddings=True)
    assert _hashes(again) == _hashes(tied_dir)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (tied_dir / name).read_bytes() == (tiny_dir / name).read_bytes()

    on_disk = json.loads((tied_dir / "config.json").read_text())
    untied_config = json.loads((tiny_dir / "config.json").read_text())
    assert on_disk["tie_word_embeddings"] is True
    assert {k: v for k, v in on_disk.items() if k != "tie_word_embeddings"} == {
        k: v for k, v in untied_config.items() if k != "tie_word_embeddings"
    }
    with safe_open(tied_dir / "model.safetensors", framework="pt") as handle:
        keys = set(handle.keys())
    assert "model.embed_tokens.weight" in keys and "lm_head.weight" not in keys

    model = AutoModelForCausalLM.from_pretrained(tied_dir)
    assert model.config.tie_word_embeddings is True
    assert model.lm_head.weight is model.model.embed_tokens.weight
    untied = AutoModelForCausalLM.from_pretrained(tiny_dir)
    n_params = sum(p.numel() for p in model.parameters())
    head_params = model.config.vocab_size * model.config.hidden_size
    assert n_params == sum(p.numel() for p in untied.parameters()) - head_params
    with torch.no_grad():
        assert torch.isfinite(model(torch.tensor([[1, 2, 3]])).logits).all()

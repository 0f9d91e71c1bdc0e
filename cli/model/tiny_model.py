"""Build the project's own tiny Llama checkpoint, offline and byte-for-byte deterministic.

Nothing is downloaded: a byte-level BPE tokenizer is trained on a synthetic corpus (arithmetic
questions and answers, calculator tool calls in JSON, chat-template words, a little English) and a
randomly initialised LlamaForCausalLM (hidden 128, 2 layers, 2 heads of 64, untied embeddings unless
tie_embeddings=True) is saved next to it in Hugging Face format (config.json, generation_config.json,
model.safetensors, tokenizer.json, tokenizer_config.json). vLLM on the CPU serves it; the trainer trains it.

The same seed gives the same bytes in every file. The seed only changes the weights: the tokenizer
and chat template are the same for every seed, so checkpoints built with different seeds share ids.

Facts measured on vLLM 0.32's CPU build that shaped it: head_dim 16 is rejected by vLLM's CPU attention
kernel, so 64; tied embeddings leave vLLM's output head stale after a weight reload of a plain
save_pretrained checkpoint, so the default is untied. tie_embeddings=True builds the tied variant real
models use (small Qwen etc.), to exercise shared/inference/serving_weights.py, which makes reloads of tied
models exact.

Run it through the CLI (`rollstream build-model --out DIR`) or directly, from Python:
    from rollstream.cli.model.tiny_model import build_tiny_model; build_tiny_model(Path("tiny"))
"""

from __future__ import annotations

import json
import random
from pathlib import Path

# Chat markers. <|endoftext|> doubles as pad and bos (never added automatically).
PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
# Tool markers stay in decoded text (special=False, like Qwen) so a hermes tool parser can see them.
TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
SPECIAL_TOKENS = [PAD_TOKEN, IM_START, IM_END, *TOOL_TOKENS]

VOCAB_SIZE = 352
HIDDEN_SIZE = 128
INTERMEDIATE_SIZE = 256
NUM_LAYERS = 2
NUM_HEADS = 2
HEAD_DIM = 64
MAX_POSITIONS = 1024
CORPUS_SEED = 1234  # fixed, independent of the weight seed: every checkpoint shares one tokenizer

# ChatML with hermes-style tool calls. Prefix-stable: rendering messages[:k] gives a prefix of
# rendering messages, so an agent can tokenize only the text it appends (one turn per tool result;
# unlike Qwen, consecutive tool results are not merged into one turn).
CHAT_TEMPLATE = r"""{%- macro turn(role, content) -%}
    {{- '<|im_start|>' + role + '\n' + content + '<|im_end|>\n' -}}
{%- endmacro -%}
{%- if tools -%}
    {%- set ns = namespace(text='') -%}
    {%- if messages and messages[0].role == 'system' -%}
        {%- set ns.text = messages[0].content + '\n\n' -%}
    {%- endif -%}
    {%- set ns.text = ns.text + '# Tools\nYou may call these functions. Signatures:\n<tools>' -%}
    {%- for tool in tools -%}
        {%- set ns.text = ns.text + '\n' + (tool | tojson) -%}
    {%- endfor -%}
    {%- set ns.text = ns.text + '\n</tools>\nTo call one, write '
        + '<tool_call>{"name": <name>, "arguments": <json object>}</tool_call>' -%}
    {{- turn('system', ns.text) -}}
{%- elif messages and messages[0].role == 'system' -%}
    {{- turn('system', messages[0].content) -}}
{%- endif -%}
{%- for message in messages -%}
    {%- if message.role == 'system' -%}
        {%- if not loop.first -%}{{- turn('system', message.content) -}}{%- endif -%}
    {%- elif message.role == 'tool' -%}
        {{- turn('tool', '<tool_response>' + message.content + '</tool_response>') -}}
    {%- elif message.role == 'assistant' -%}
        {%- set ns2 = namespace(text=message.content or '') -%}
        {%- for tool_call in (message.tool_calls or []) -%}
            {%- if tool_call.function is defined -%}{%- set tool_call = tool_call.function -%}{%- endif -%}
            {%- if loop.first and ns2.text -%}{%- set ns2.text = ns2.text + '\n' -%}{%- endif -%}
            {%- if tool_call.arguments is string -%}
                {%- set args = tool_call.arguments -%}
            {%- else -%}
                {%- set args = tool_call.arguments | tojson -%}
            {%- endif -%}
            {%- set ns2.text = ns2.text + '<tool_call>{"name": ' + (tool_call.name | tojson)
                + ', "arguments": ' + args + '}</tool_call>' -%}
        {%- endfor -%}
        {{- turn('assistant', ns2.text) -}}
    {%- else -%}
        {{- turn(message.role, message.content) -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\n' -}}
{%- endif -%}
"""

CALCULATOR_TOOL = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    },
}

_ENGLISH = [
    "You are a helpful assistant.",
    "You are a careful assistant that uses tools when they help.",
    "Answer with the number only.",
    "The answer is",
    "Let me use the calculator.",
    "Please compute the result and reply with a single number.",
    "Think step by step, then give the final answer.",
    "The quick brown fox jumps over the lazy dog.",
    "Sorry, I cannot help with that.",
    "Thank you! The result of the calculation is shown below.",
]


def _synthetic_corpus() -> list[str]:
    """Deterministic training text for the tokenizer (special tokens removed: they are added tokens)."""
    rng = random.Random(CORPUS_SEED)
    texts = list(_ENGLISH)
    texts.append(json.dumps(CALCULATOR_TOOL))
    texts.append("# Tools\nYou may call these functions. Signatures:\n<tools>\n</tools>\nTo call one, write")
    texts.append('{"name": <name>, "arguments": <json object>}')
    for _ in range(2000):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        op = rng.choice(["+", "-", "*"])
        result = {"+": a + b, "-": a - b, "*": a * b}[op]
        expr = f"{a} {op} {b}"
        texts.append(f"system\n{rng.choice(_ENGLISH)}\nuser\nWhat is {expr}?\nassistant\n")
        texts.append(json.dumps({"name": "calculator", "arguments": {"expression": expr}}))
        texts.append(f"tool\n{result}\nassistant\n{result}\n")
        texts.append(f"The answer is {result}.")
    return texts


def _build_tokenizer(max_positions: int = MAX_POSITIONS):
    from tokenizers import (
        AddedToken,
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        trainers,
    )
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_synthetic_corpus(), trainer=trainer)
    # Mark the tool markers non-special, so skip_special_tokens keeps them in decoded text.
    spec = json.loads(tok.to_str())
    for added in spec["added_tokens"]:
        if added["content"] in TOOL_TOKENS:
            added["special"] = False
    tok = Tokenizer.from_str(json.dumps(spec))

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=PAD_TOKEN,
        eos_token=IM_END,
        pad_token=PAD_TOKEN,
        model_max_length=max_positions,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_tiny_model(out_dir: Path, seed: int = 0, tie_embeddings: bool = False,
                     max_positions: int = MAX_POSITIONS) -> Path:
    """Write the tokenizer and a freshly initialised tiny Llama (weights from `seed`) to out_dir.

    tie_embeddings=True shares one matrix between the input embeddings and the output head; the
    checkpoint then holds no lm_head.weight (save_pretrained drops tied copies).

    max_positions above 1024 builds the long-context variant the coding-agent tests serve: real agents'
    system prompts and tools are tens of thousands of tokens (Claude Code's first request is about 59k
    with this tokenizer). RoPE has no learned positions, so the same weights serve any length; the answers
    are noise either way, what such a test checks is the protocol. vLLM serves 60k tokens of prompt in
    about 15 s on two cores, and a later turn's shared prefix comes from its prefix cache.
    """
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = _build_tokenizer(max_positions)
    pad_id = tokenizer.convert_tokens_to_ids(PAD_TOKEN)
    eos_id = tokenizer.convert_tokens_to_ids(IM_END)

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=HIDDEN_SIZE,
        intermediate_size=INTERMEDIATE_SIZE,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=NUM_HEADS,
        num_key_value_heads=NUM_HEADS,
        head_dim=HEAD_DIM,
        max_position_embeddings=max_positions,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tie_embeddings,
        bos_token_id=pad_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        dtype="float32",
    )
    gen = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).to(torch.float32)
    # Re-draw every weight from our own generator: independent of transformers' init order and defaults.
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.copy_(torch.randn(param.shape, generator=gen, dtype=torch.float32) * 0.02)
    model.generation_config = GenerationConfig(bos_token_id=pad_id, eos_token_id=eos_id, pad_token_id=pad_id)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    _portable_tokenizer_config(out_dir)
    for path in out_dir.iterdir():
        path.chmod(0o644)  # safetensors is written 0600; readers may run as another user
    return out_dir


def _portable_tokenizer_config(out_dir: Path) -> None:
    """Name the generic fast-tokenizer class and embed the chat template in tokenizer_config.json.

    transformers 5 writes its own class name (TokenizersBackend) and keeps the template only in
    chat_template.jinja; older transformers (4.x, as in GPU vLLM images) know neither.
    """
    path = out_dir / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config["chat_template"] = CHAT_TEMPLATE
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")

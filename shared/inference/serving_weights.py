"""Write the checkpoints that vLLM servers reload during weight sync, tied output heads included.

A model with tied word embeddings (Llama/Qwen configs with `tie_word_embeddings: true`, as most small
real models have) is saved by transformers without `lm_head.weight`: the head is the embedding matrix.
vLLM's in-place `reload_weights` cannot cope with such a checkpoint on every platform:

- vLLM 0.32, vllm/model_executor/model_loader/reload/layerwise.py `initialize_layerwise_reload`: every
  layer's parameters are swapped for separate meta tensors, so during a reload `lm_head` and
  `embed_tokens` are no longer one parameter, and a checkpoint without `lm_head.weight` loads nothing
  into the head. `finalize_layerwise_processing` then only puts the head's old parameter back
  ("ParallelLMHead: Failed to load weights" in the server log) and never re-runs its
  `process_weights_after_loading`.
- That parameter shares storage with the embeddings, so it does hold the new values, but the logits
  are not computed from it on the CPU: vllm/model_executor/layers/vocab_parallel_embedding.py
  `UnquantizedEmbeddingMethod.process_weights_after_loading` calls
  vllm/model_executor/layers/utils.py `dispatch_cpu_unquantized_gemm`, which packs a private copy of the
  weight (oneDNN `create_onednn_mm` handle, or the AMX sgl-kernel packed weight) into `layer.cpu_linear`,
  and the head's matmul uses that copy. The copy is only rebuilt when the head itself loads a weight.
- So the served model runs the new body and embeddings with the old head: its logprobs match neither
  checkpoint. Any other platform or quantisation that derives kernel tensors from the head in
  process_weights_after_loading (zentorch prepacking, a quantised lm_head) would go stale the same way.

The fix: serving checkpoints of tied models carry an explicit `lm_head.weight`, a copy of the embedding
matrix, while config.json stays tied. During a reload the head then loads its own weight and is
re-packed; at start-up vLLM's loader sees the two names alias one parameter and skips the copy, and
transformers loads the checkpoint back as the same tied model. Untied models are written exactly as
save_pretrained writes them.

Library module; the trainer calls `write_serving_checkpoint`, and the real-vLLM test runs it:
    python -m pytest tests/integration/test_tied_weights.py -q
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from rollstream.shared.errors import ServingCheckpointError

TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
)
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def write_serving_checkpoint(model: Any, directory: Path, tokenizer_source: Path | None = None) -> Path:
    """Save `model` (a transformers PreTrainedModel) as an HF safetensors checkpoint vLLM can reload.

    Tokenizer files found in tokenizer_source are copied next to the weights. For a tied model the
    checkpoint also gets an explicit copy of the head (see the module docstring). The directory is
    written in place: write to a temporary name and rename it if readers must never see it half done.
    """
    if not hasattr(model, "save_pretrained") and hasattr(model, "module"):
        model = model.module  # a DeepSpeed engine or DDP wrapper around the transformers model
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True)
    head = tied_head_names(model)
    if head is not None:
        embed_name, head_name = head
        add_tensor_copy(directory, source=embed_name, target=head_name)
    if tokenizer_source is not None:
        copy_tokenizer_files(Path(tokenizer_source), directory)
    for path in directory.iterdir():
        if path.is_file():
            path.chmod(0o644)  # safetensors are written 0600; vLLM may run as another user
    return directory


def copy_tokenizer_files(source: Path, directory: Path) -> None:
    """Copy the tokenizer files `source` has next to the weights, so the checkpoint serves and trains
    like its source."""
    for name in TOKENIZER_FILES:
        if (source / name).exists():
            shutil.copy(source / name, directory / name)


def tied_head_names(model: Any) -> tuple[str, str] | None:
    """(embedding name, head name) as saved in the checkpoint when the output head is tied, else None.

    Tied means the head and the input embeddings are one parameter, or the config says so (transformers
    re-ties such a checkpoint on load, so the embeddings are the head the trainer will resume with).
    """
    embeddings = model.get_input_embeddings()
    head = model.get_output_embeddings()
    if embeddings is None or head is None:
        return None
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    if head.weight is not embeddings.weight and not getattr(config, "tie_word_embeddings", False):
        return None
    names = {id(module): name for name, module in model.named_modules(remove_duplicate=False)}
    return f"{names[id(embeddings)]}.weight", f"{names[id(head)]}.weight"


def add_tensor_copy(directory: Path, source: str, target: str) -> None:
    """Store a copy of tensor `source` under the name `target` in the safetensors checkpoint at directory.

    The copy goes into the file that holds `source` (model.safetensors, or the shard the index names),
    and the index, when there is one, is updated. Nothing changes when `target` is already there.
    """
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    directory = Path(directory)
    index_path = directory / INDEX_FILE
    index = json.loads(index_path.read_text()) if index_path.exists() else None
    if index is not None:
        if target in index["weight_map"]:
            return
        if source not in index["weight_map"]:
            raise ServingCheckpointError(f"{index_path} names no shard for {source!r}")
        shard = directory / index["weight_map"][source]
    else:
        shard = directory / SINGLE_FILE
        if not shard.exists():
            raise ServingCheckpointError(f"{directory} has neither {SINGLE_FILE} nor {INDEX_FILE}")

    with safe_open(shard, framework="pt") as handle:
        metadata = handle.metadata() or {}
        if target in handle.keys():
            return
        if source not in handle.keys():
            raise ServingCheckpointError(f"{shard} holds no tensor {source!r}")
    tensors = load_file(shard)
    # clone: safetensors refuses to write two names over one storage
    tensors[target] = tensors[source].clone()
    metadata.setdefault("format", "pt")
    partial = shard.with_name(shard.name + ".partial")
    save_file(tensors, partial, metadata=metadata)
    os.replace(partial, shard)

    if index is not None:
        index["weight_map"][target] = shard.name
        index["weight_map"] = dict(sorted(index["weight_map"].items()))
        meta = index.setdefault("metadata", {})
        if "total_size" in meta:
            added = tensors[target].numel() * tensors[target].element_size()
            meta["total_size"] = int(meta["total_size"]) + added
        partial_index = index_path.with_name(index_path.name + ".partial")
        partial_index.write_text(json.dumps(index, indent=2) + "\n")
        os.replace(partial_index, index_path)

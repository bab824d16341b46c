"""Models of real shapes with random weights (`python -m bench --shape NAME`): speed depends on a model's
shape, not on its values, so a benchmark of a 1B or 8B model needs no download.

Each shape is built once per dtype into an ordinary Hugging Face folder in the cache
(SWARM_CACHE_DIR/bench-shapes/NAME-DTYPE: config.json, safetensors, tokenizer), which block servers, the
gateway and the local baseline load like any model folder. The weights are random in the target dtype
(initialised on the run's device: seconds on a GPU even for 8B); the tokenizer is the default model's, cut
down to the shape's vocabulary when that is smaller, so that every id it produces is one the model has.

Two rows of the LM head are zeroed: the end-of-sequence token's, and those past the tokenizer's vocabulary.
Random logits are then never highest there, so greedy replies run their full length, as a benchmark wants,
and every token the model picks decodes.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Optional

import torch

from bench.workload import MODEL

# transformers' LlamaConfig fields; "tiny" is tests/tiny_model.py's block shape (its decode rounds are the target)
SHAPES = {
    "tiny": dict(num_hidden_layers=4, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512, max_position_embeddings=2048),
    # tiny's blocks, eight of them: chains of up to eight one-block hops (bench/flowing.py)
    "tiny-8": dict(num_hidden_layers=8, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=512, max_position_embeddings=2048),
    "tinyllama-1.1b": dict(num_hidden_layers=22, hidden_size=2048, intermediate_size=5632, num_attention_heads=32,
                           num_key_value_heads=4, vocab_size=32000, max_position_embeddings=2048,
                           rope_theta=10000.0, rms_norm_eps=1e-5),
    "llama-3-8b": dict(num_hidden_layers=32, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                       num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192,
                       rope_theta=500000.0, rms_norm_eps=1e-5),
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


def model_folder(shape: Optional[str], dtype: str, cache_dir: Path, device: str = "cpu") -> tuple[str, Path]:
    """The benchmarked model's name and folder: shape `shape` in `dtype`, or the default model (None)."""
    if shape is None:
        from swarm.weights import resolve_model

        return MODEL, resolve_model(MODEL, cache_dir)
    return shape, shape_folder(shape, dtype, cache_dir, device)


def shape_folder(name: str, dtype: str, cache_dir: Path, device: str = "cpu",
                 tokenizer_source: Optional[Path] = None) -> Path:
    """The folder of shape `name` in `dtype`, built on first use (weights initialised on `device`).
    `tokenizer_source`: a folder whose tokenizer to reuse (default: the default model's)."""
    if name not in SHAPES:
        raise ValueError(f"unknown shape {name!r}; known: {', '.join(SHAPES)}")
    folder = Path(cache_dir) / "bench-shapes" / f"{name}-{dtype}"
    if (folder / "config.json").is_file():
        return folder
    if tokenizer_source is None:
        from swarm.weights import resolve_model

        tokenizer_source = resolve_model(MODEL, cache_dir)
    partial = folder.with_name(folder.name + ".partial")  # a build cut short is never taken for a model
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    tokenizer = copy_tokenizer(tokenizer_source, partial, SHAPES[name]["vocab_size"])
    build_weights(SHAPES[name], tokenizer, partial, getattr(torch, dtype), device)
    partial.rename(folder)
    return folder


def copy_tokenizer(source: Path, destination: Path, vocab_size: int):
    """The source's tokenizer files in `destination`, cut down to ids below vocab_size if it has more."""
    import transformers

    for filename in TOKENIZER_FILES:
        if (source / filename).is_file():
            shutil.copy(source / filename, destination / filename)
    tokenizer = transformers.AutoTokenizer.from_pretrained(destination)
    if len(tokenizer) > vocab_size:
        spec = json.loads((destination / "tokenizer.json").read_text())
        (destination / "tokenizer.json").write_text(json.dumps(shrink_bpe(spec, vocab_size)))
        tokenizer = transformers.AutoTokenizer.from_pretrained(destination)
    return tokenizer


def shrink_bpe(spec: dict, vocab_size: int) -> dict:
    """A byte-level BPE tokenizer (tokenizer.json's contents) with only the ids below vocab_size. A merge's
    result always has a higher id than its parts, so dropping the highest ids and the merges that made them
    leaves a tokenizer that still encodes any text, in more tokens."""
    model = spec["model"]
    if model.get("type") != "BPE" or model.get("continuing_subword_prefix"):
        raise ValueError("only a byte-level BPE tokenizer can be cut down to a smaller vocabulary")
    vocab = {token: index for token, index in model["vocab"].items() if index < vocab_size}
    pairs = [merge.split(" ") if isinstance(merge, str) else merge for merge in model["merges"]]
    merges = [merge for merge, pair in zip(model["merges"], pairs) if "".join(pair) in vocab]
    added = [token for token in spec["added_tokens"] if token["id"] < vocab_size]
    return {**spec, "added_tokens": added, "model": {**model, "vocab": vocab, "merges": merges}}


@torch.no_grad()
def build_weights(shape: dict, tokenizer, folder: Path, dtype: torch.dtype, device: str) -> None:
    """A Llama of `shape` with random weights in `dtype`, saved as safetensors into `folder`."""
    import transformers

    rope_theta = shape.get("rope_theta", 10000.0)
    fields = {key: value for key, value in shape.items() if key != "rope_theta"}
    config = transformers.LlamaConfig(
        **fields, rope_parameters={"rope_type": "default", "rope_theta": rope_theta}, tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    with torch.device(device):  # the init's random numbers on the GPU when there is one
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    head = model.get_output_embeddings().weight  # (vocab, hidden)
    head[len(tokenizer):] = 0  # ids the tokenizer has no text for: never picked
    head[tokenizer.eos_token_id] = 0  # greedy replies run their full length
    model.save_pretrained(folder)
    del model
    if device != "cpu":
        torch.cuda.empty_cache()

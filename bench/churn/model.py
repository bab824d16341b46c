"""The churn harness's model and what it should answer: a tiny deep Llama with random weights (enough blocks for
chains of many shapes), built once into the cache, and the local transformers model's greedy reply to each prompt.

The tokenizer is the default model's, cut down to 512 ids (bench/shapes.py). The LM head's rows are zeroed for
every id whose text is not whole on its own (a lone byte of a multi-byte character), for special tokens and the
end of sequence: greedy replies then run their full length, and a streamed reply's pieces join into exactly the
text of its tokens decoded at once, so the gateway's text can be compared with the local tokens' text.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.shapes import copy_tokenizer

CHURN_SHAPE = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                   vocab_size=512, max_position_embeddings=2048)
WEIGHT_SCALE = 0.2  # larger than the default init (as tests/tiny_model.py): greedy tokens vary along a reply
PROMPTS = [
    "Hello, world! How are you today?",
    "The quick brown fox jumps over the lazy dog.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9, and then?",
    "A swarm of block servers answers every step of a session.",
    "Write a short story about a robot who learns to paint.",
    "What is the capital of France?",
    "List three colours.",
    "Why is the sea salty?",
]


@dataclass(frozen=True)
class ReferenceReply:
    messages: list[dict]  # the chat sent to the gateways
    prompt_ids: list[int]  # its rendering, encoded as the gateway encodes it
    text: str  # the local model's greedy reply, decoded


def churn_model(cache_dir: Path, num_blocks: int, tokenizer_source: Path) -> Path:
    """The folder of the tiny deep model with `num_blocks` blocks, built on first use."""
    folder = Path(cache_dir) / "bench-shapes" / f"churn-{num_blocks}"
    if (folder / "config.json").is_file():
        return folder
    partial = folder.with_name(folder.name + ".partial")  # a build cut short is never taken for a model
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    tokenizer = copy_tokenizer(tokenizer_source, partial, CHURN_SHAPE["vocab_size"])
    _build_weights(num_blocks, tokenizer, partial)
    partial.rename(folder)
    return folder


@torch.no_grad()
def _build_weights(num_blocks: int, tokenizer, folder: Path) -> None:
    import transformers

    config = transformers.LlamaConfig(
        **CHURN_SHAPE, num_hidden_layers=num_blocks, tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    for parameter in model.parameters():
        if parameter.ndim == 2:
            parameter.normal_(0.0, WEIGHT_SCALE)
    head = model.get_output_embeddings().weight  # (vocab, hidden)
    for token_id in unpickable_ids(tokenizer, head.shape[0]):
        head[token_id] = 0
    model.save_pretrained(folder)


def unpickable_ids(tokenizer, vocab_size: int) -> list[int]:
    """Ids a greedy reply must never take: added tokens (special ones, which a decoder may skip), ids the tokenizer
    lacks, pieces of characters and control characters (but for newlines and tabs)."""
    added = set(tokenizer.all_special_ids) | set(tokenizer.added_tokens_decoder)
    return [token_id for token_id in range(vocab_size)
            if token_id in added or token_id >= len(tokenizer) or not _whole_text(tokenizer.decode([token_id]))]


def _whole_text(text: str) -> bool:
    return "\ufffd" not in text and all(character.isprintable() or character in "\n\t" for character in text)


def reference_replies(folder: Path, tokens: int) -> list[ReferenceReply]:
    """The local transformers model's greedy reply of `tokens` tokens to each prompt, as a one-turn chat."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    replies = []
    for prompt in PROMPTS:
        messages = [{"role": "user", "content": prompt}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        with torch.inference_mode():  # greedy, stopping at the end of sequence as the gateway does (a real model)
            output = model.generate(torch.tensor([ids]), max_new_tokens=tokens, do_sample=False)[0, len(ids):]
        replies.append(ReferenceReply(messages, ids, tokenizer.decode(output, skip_special_tokens=True)))
    return replies

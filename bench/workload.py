"""What every measurement feeds the model: the chat prompt, the long prompt, and the lengths they need.

Prompts are built once, as text and as token ids, with the model's own tokenizer: the gateway encodes the
text it is sent with that same tokenizer, so the local baseline and the remote runs see the same tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

MODEL = "SmolLM2-135M-Instruct"
# the prompt of the first benchmark (bench/generate_speed.py); in the model's chat template: 42 tokens
CHAT_PROMPT = "Write a short story about a robot who learns to paint."
LONG_PROMPT_TOKENS = 512
# ordinary prose, repeated until the prompt is long enough: its tokens split the same way wherever it is cut
FILLER = (
    " A swarm of small machines can run a model that none of them could hold alone. Each machine keeps a few"
    " of the model's blocks, passes the hidden states on to the next one, and remembers what it has seen."
)


@dataclass(frozen=True)
class Prompt:
    text: str  # what the gateway is sent
    ids: list[int]  # the same text encoded: what the local model and the Python client are fed
    messages: list[dict]  # the chat turns it renders (OpenAI's chat API renders them itself); [] for plain text


def chat_prompt(tokenizer) -> Prompt:
    messages = [{"role": "user", "content": CHAT_PROMPT}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return Prompt(text, _encode(tokenizer, text), messages)


def long_prompt(tokenizer, tokens: int = LONG_PROMPT_TOKENS) -> Prompt:
    """Plain text of exactly `tokens` tokens (as the gateway encodes it)."""
    ids = _encode(tokenizer, FILLER * (tokens // 20 + 1))  # well over `tokens`: each repeat is ~40 tokens
    # cutting may leave a piece of a word that encodes differently on its own: try the next few cuts
    for cut in range(tokens, tokens + 8):
        text = tokenizer.decode(ids[:cut])
        if len(_encode(tokenizer, text)) == tokens:
            return Prompt(text, _encode(tokenizer, text), [])
    raise ValueError(f"no text of exactly {tokens} tokens found in the filler")


def session_length(prompt: Prompt, new_tokens: int) -> int:
    """max_length for a session that takes the prompt and generates new_tokens: the prompt, then every new
    token but the last is fed back; one position spare."""
    return len(prompt.ids) + new_tokens


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text)["input_ids"]  # as the gateway encodes a session's first inputs

"""Chat templates that think, as Qwen3's and DeepSeek-R1 distills' do, and a tiny model that says something known
through one of them: trained in seconds (on the CPU) to reply REPLY to PROMPT when thinking, and ANSWER when the
template's switch turns thinking off. A random-weight model would never close its think block by itself."""

from __future__ import annotations

from pathlib import Path

from tiny_model import build_tokenizer

_TURNS = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{% set content = message['content'] %}"
          "{% if message['role'] == 'assistant' and '</think>' in content %}"
          "{% set content = content.split('</think>')[-1].lstrip() %}{% endif %}{{ content }}<|im_end|>\n"
          "{% endfor %}")
# Qwen3's: the reply opens its think block; enable_thinking=False closes an empty one in the generation prompt
QWEN3_TEMPLATE = _TURNS + ("{% if add_generation_prompt %}<|im_start|>assistant\n"
                           "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
                           "{% endif %}{% endif %}")
# DeepSeek-R1 distills': the generation prompt opens the think block, and nothing closes it
R1_TEMPLATE = _TURNS + "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"

PROMPT = "Hello, how are you?"
REASONING, ANSWER = "the user greets", "Hello there"
REPLY = f"<think>\n{REASONING}\n</think>\n\n{ANSWER}"  # thinking: what the model says after the generation prompt
TRAINING_STEPS = 120


def thinking_tokenizer(template: str = QWEN3_TEMPLATE):
    """The suite's tiny tokenizer with <think> and </think> as added tokens (not special: decoding keeps them, as
    Qwen3's tokenizer does), and a thinking chat template."""
    tokenizer = build_tokenizer()
    tokenizer.add_tokens(["<think>", "</think>"])
    tokenizer.chat_template = template
    return tokenizer


def _examples(tokenizer) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, reply ids): a reply that thinks, and the answer alone after the switch turned thinking off."""
    messages = [{"role": "user", "content": PROMPT}]
    examples = []
    for enable_thinking, reply in ((True, REPLY), (False, ANSWER)):
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                               enable_thinking=enable_thinking)
        reply_ids = tokenizer.encode(reply, add_special_tokens=False) + [tokenizer.eos_token_id]
        examples.append((tokenizer.encode(prompt, add_special_tokens=False), reply_ids))
    return examples


def build_thinking_model(folder: Path, num_layers: int = 2, seed: int = 0) -> Path:
    """A tiny Llama with the Qwen3-style template, overfit on the two examples until its greedy replies are them."""
    import torch
    import transformers

    tokenizer = thinking_tokenizer()
    config = transformers.LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=512, bos_token_id=tokenizer.bos_token_id,
                                      eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                                      tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    examples = _examples(tokenizer)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(TRAINING_STEPS):
        for prompt_ids, reply_ids in examples:
            ids = torch.tensor([prompt_ids + reply_ids])
            labels = torch.tensor([[-100] * len(prompt_ids) + reply_ids])  # only the reply is learned
            loss = model(input_ids=ids, labels=labels).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    model.eval()
    for prompt_ids, reply_ids in examples:
        assert greedy_reply(model, prompt_ids, len(reply_ids)) == reply_ids, "the tiny model did not learn its reply"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def greedy_reply(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """The local transformers model's greedy reply: what the swarm must say too."""
    import torch

    with torch.no_grad():
        output = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False)
    return output[0, len(prompt_ids):].tolist()

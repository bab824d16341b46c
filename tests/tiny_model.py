"""Tiny random-weight models built from a config (no download), with a small trained tokenizer."""

from __future__ import annotations

from pathlib import Path

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "A swarm of block servers answers every step of a session.",
    "Hello, world! How are you today? I am fine, thank you.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 and symbols: {} [] () <> + - * / = ; : ' \"",
    "Привет, мир! 你好，世界！ Emoji: 🙂🚀",
] * 20


def build_tokenizer(vocab_size: int = 512):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
    )


def build_tiny_model(
    folder: Path, model_type: str = "llama", num_layers: int = 4, seed: int = 0, perturb_vectors: bool | None = None,
    max_shard_size: str | None = None, **overrides,
) -> Path:
    """Save a random-weight causal LM of `model_type` with `num_layers` blocks, and a tokenizer, into folder.

    `perturb_vectors` also randomizes the 1-D parameters (norm weights, biases), which the default init leaves at
    ones and zeros, so that a test exercises them; by default only for GPT-2 and BLOOM (Llama stays as it was).
    `max_shard_size` ("200KB"): the weights in several safetensors files and their index, as large models are."""
    import torch
    import transformers

    tokenizer = build_tokenizer()
    config = transformers.AutoConfig.for_model(
        model_type,
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **{**_shape_arguments(model_type, num_layers), **_tying_arguments(model_type), **overrides},
    )
    if perturb_vectors is None:  # the newer families' norms (QK-norm, Gemma's 1 + weight) matter: exercise them
        perturb_vectors = model_type not in ("llama", "mistral", "qwen2")
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # larger weights than the default init, so that greedy choices are not all alike
        for parameter in model.parameters():
            if parameter.ndim >= 2:  # matrices, and the experts' stacked ones (experts, out, in)
                parameter.normal_(0.0, 0.2)
            elif perturb_vectors:
                parameter.add_(torch.randn_like(parameter), alpha=0.1)
    model.save_pretrained(folder, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    tokenizer.save_pretrained(folder)
    return folder


def _shape_arguments(model_type: str, num_layers: int) -> dict:
    """The tiny shape in each family's own argument names (hidden 64, 4 heads; 2 KV heads where there are any)."""
    if model_type == "gpt2":  # learned absolute positions: n_positions rows of them
        return dict(n_embd=64, n_inner=128, n_layer=num_layers, n_head=4, n_positions=2048)
    if model_type == "bloom":  # ALiBi: no position limit, no KV-head grouping, a 4x MLP
        return dict(hidden_size=64, n_layer=num_layers, n_head=4)
    return dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        **NEWER_SHAPES.get(model_type, {}),
    )


# Qwen3 and Gemma default to heads of 128 or 256 dimensions (Gemma scales by query_pre_attn_scalar, left at its
# 256 so that it differs from head_dim); Qwen3-MoE: 4 experts of which 2 per token, the last layer a dense MLP
NEWER_SHAPES = {
    "qwen3": dict(head_dim=16),
    "qwen3_moe": dict(head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, mlp_only_layers=[3]),
    "gemma2": dict(head_dim=16),
    "gemma3_text": dict(head_dim=16),
}

# What makes each newer family's quirks show in a 4-block model with prompts of 5 to 12 tokens: windows of 4
# tokens on the sliding layers, soft caps low enough to bite, half-rotary heads
FAMILY_QUIRKS = {
    "qwen3": dict(use_sliding_window=True, sliding_window=4, max_window_layers=1),  # layers 1.. slide
    "qwen3_moe": dict(use_sliding_window=True, sliding_window=4),  # every layer slides
    "phi3": dict(partial_rotary_factor=0.5, sliding_window=4),
    "gemma2": dict(sliding_window=4, attn_logit_softcapping=2.0, final_logit_softcapping=8.0),  # sliding, full, ...
    "gemma3_text": dict(
        sliding_window=4,
        final_logit_softcapping=8.0,
        layer_types=["sliding_attention", "full_attention", "full_attention", "sliding_attention"],
    ),  # local and global layers rotate with their own bases (10k, 1M), both in each half of the blocks
}


def _tying_arguments(model_type: str) -> dict:
    """GPT-2, BLOOM and Gemma checkpoints tie the LM head to the token embeddings; the others here do not."""
    return {"tie_word_embeddings": model_type in ("gpt2", "bloom", "gemma2", "gemma3_text")}


def build_lora_adapter(base: Path, folder: Path, target_modules: list[str], rank: int = 4, alpha: int = 8,
                       seed: int = 0, std: float = 0.15, **lora_settings) -> Path:
    """Save a PEFT LoRA adapter of the model in `base` with random (non-zero) A and B into folder, whose name is
    the adapter's name on servers; large enough that the adapted model's greedy choices differ from the base's."""
    import peft
    import torch
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=target_modules, init_lora_weights=False,
                             **lora_settings)
    adapted = peft.get_peft_model(model, config)
    with torch.no_grad():
        for name, parameter in adapted.named_parameters():
            if "lora_" in name:
                parameter.normal_(0.0, std)
    adapted.save_pretrained(folder)
    return folder

"""The strongest check in the field, shared by the swarm tests: remote token-by-token inference equals the
local transformers model (logits allclose, identical greedy tokens)."""

from __future__ import annotations

import torch

ATOL = 1e-4


def local_logits(local_model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return local_model(torch.tensor([ids])).logits[0]  # (length, vocab)


def assert_interleaved_sessions_match(remote, local_model, prompt_lengths, new_tokens: int, seed: int = 1) -> None:
    """One session per prompt, all open at once and stepped in turn (the servers juggle their caches)."""
    generator = torch.Generator().manual_seed(seed)
    vocab = local_model.config.vocab_size
    prompts = [torch.randint(3, vocab, (length,), generator=generator).tolist() for length in prompt_lengths]
    sessions = [remote.session(max_length=len(prompt) + new_tokens) for prompt in prompts]
    try:
        sequences = [list(prompt) for prompt in prompts]
        remote_logits = [[session.step([prompt])[0]] for session, prompt in zip(sessions, prompts)]
        for _ in range(new_tokens - 1):
            for index, session in enumerate(sessions):
                token = int(remote_logits[index][-1].argmax())
                sequences[index].append(token)
                remote_logits[index].append(session.step([[token]])[0])
    finally:
        for session in sessions:
            session.close()

    for prompt, sequence, logits in zip(prompts, sequences, remote_logits):
        reference = local_logits(local_model, sequence)[len(prompt) - 1 :]
        torch.testing.assert_close(torch.stack(logits), reference, atol=ATOL, rtol=0)
        with torch.no_grad():
            greedy = local_model.generate(
                torch.tensor([prompt]), max_new_tokens=new_tokens - 1, min_new_tokens=new_tokens - 1, do_sample=False
            )[0].tolist()
        assert sequence == greedy


def assert_chat_reply_is_the_local_greedy_token(reply, folder, model_name: str, messages, tools) -> None:
    """A one-token greedy chat reply of the gateway (an OpenAI ChatCompletion) counts the tokens of the gateway's
    own rendering of the chat (tools included) and equals the local model's greedy next token after them."""
    import transformers

    from gateway.chat.params import offered_tools
    from gateway.chat.prompts import render_chat
    from gateway.openai.schemas import ChatCompletionRequest

    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    fields = ChatCompletionRequest(model=model_name, messages=messages, tools=tools)
    ids = tokenizer(render_chat(tokenizer, fields.messages, offered_tools(fields.tool_choice, fields.tools).tools), add_special_tokens=False)
    assert len(ids["input_ids"]) == reply.usage.prompt_tokens
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    expected = int(local_logits(model, ids["input_ids"])[-1].argmax())
    assert reply.choices[0].message.content == tokenizer.decode([expected])

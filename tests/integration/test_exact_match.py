"""The strongest check in the field: remote token-by-token inference equals the local transformers model."""

import pytest
import torch
import transformers

from exact_match import ATOL, assert_interleaved_sessions_match


@pytest.fixture(scope="module")
def local_model(tiny_llama):
    return transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()


def test_chain_splits_the_blocks_over_both_servers(tiny_remote):
    chain = tiny_remote.client.chain(tiny_remote.prefix, tiny_remote.num_blocks, tiny_remote.name)
    assert [(link.start, link.end) for link in chain] == [(0, 2), (2, 4)]
    assert len({link.peer_id for link in chain}) == 2


def test_token_by_token_logits_and_greedy_tokens_match(tiny_remote, local_model):
    """Three sessions open at once, interleaved, with prompts of 1, 7 and 23 tokens."""
    assert_interleaved_sessions_match(tiny_remote, local_model, (1, 7, 23), new_tokens=12)


def test_cacheless_forward_matches(tiny_remote, local_model):
    ids = torch.randint(3, local_model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        reference = local_model(ids).logits
    torch.testing.assert_close(tiny_remote.forward(ids), reference, atol=ATOL, rtol=0)


def test_batched_session_and_chunked_prompt(tiny_remote, local_model):
    ids = torch.randint(3, local_model.config.vocab_size, (2, 10), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        reference = local_model(ids).logits
    with tiny_remote.session(max_length=10, batch_size=2) as session:
        first = session.step(ids[:, :6])
        rest = [session.step(ids[:, position : position + 1]) for position in range(6, 10)]
    torch.testing.assert_close(torch.stack([first, *rest], 1), reference[:, 5:], atol=ATOL, rtol=0)


def test_rewinding_a_session_recomputes_from_there(tiny_remote, local_model):
    ids = torch.randint(3, local_model.config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(4))
    other = ids.clone()
    other[0, 5:] = (other[0, 5:] + 1) % local_model.config.vocab_size
    with torch.no_grad():
        reference = local_model(other).logits[0, -1]
    with tiny_remote.session(max_length=8) as session:
        session.step(ids)
        logits = session.step(other[:, 5:], position=5)  # regenerate from position 5
    assert session.position == 8
    torch.testing.assert_close(logits[0], reference, atol=ATOL, rtol=0)

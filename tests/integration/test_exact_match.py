"""The strongest check in the field: remote token-by-token inference equals the local transformers model."""

import threading

import pytest
import torch
import transformers

from shared_swarm import TINY_PREFIX
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
    second = tiny_remote.client.chain(tiny_remote.prefix, tiny_remote.num_blocks, tiny_remote.name)[1].peer_id
    pushed = tiny_remote.client.server_info(second)["steps_pushed"]
    assert_interleaved_sessions_match(tiny_remote, local_model, (1, 7, 23), new_tokens=12)
    # the first server pushed its outputs straight to the second, which started before the client's copy came
    assert tiny_remote.client.server_info(second)["steps_pushed"] > pushed


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


def test_concurrent_sessions_batched_on_the_servers_match(tiny_remote, local_model):
    """Sessions stepping at once from four threads: the servers run their steps in shared forwards and the LM
    head runs on merged rows, and each session still equals the local model."""
    errors = []

    def check(seed):
        try:
            assert_interleaved_sessions_match(tiny_remote, local_model, (2 + seed, 11 + 3 * seed), new_tokens=10,
                                              seed=seed)
        except BaseException as error:  # reported by the main thread
            errors.append(error)

    threads = [threading.Thread(target=check, args=(seed,)) for seed in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not errors, errors[0]


@pytest.mark.parametrize("wire_dtype", [torch.bfloat16, torch.float16])
def test_a_16_bit_wire_halves_the_bytes_and_stays_close(tiny_swarm, tiny_llama, settings, local_model, wire_dtype):
    from swarm.client.remote_model import RemoteModel
    from swarm.wire import pack

    hidden = torch.randn(1, 4, local_model.config.hidden_size)
    assert len(pack((hidden.to(wire_dtype),)).SerializeToString()) < 0.6 * len(pack((hidden,)).SerializeToString())

    ids = torch.randint(3, local_model.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        reference = local_model(ids).logits[0, -1]
    remote = RemoteModel.from_pretrained(str(tiny_llama), tiny_swarm.initial_peers, settings.cache_dir, TINY_PREFIX,
                                         wire_dtype=wire_dtype)
    try:
        with remote.session(max_length=9) as session:
            logits = session.step(ids)[0]
    finally:
        remote.close()
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, reference, atol=0.05 * float(reference.abs().max()), rtol=0)

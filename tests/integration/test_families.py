"""Every supported family, served by a real swarm, equals the local transformers model token by token.

One swarm for the module: a bootstrap peer and, per family, under the family's own DHT prefix, one block server
holding its tiny model's four blocks, or two splitting them (0:2 and 2:4) for BLOOM (ALiBi over the absolute
positions of a second server's cache) and Gemma 3 (layer types, windows and rotary bases by the block's index in
the model). Every family's spans starting mid-model are checked in process too (tests/unit/test_blocks.py), and
the wire between two servers is the same for every family (tests/integration/test_exact_match.py): one server per
family keeps this module's processes, and the suite's time, down. The quirks each family brings: BLOOM (ALiBi bias over
cached keys, word_embeddings_layernorm at the client, fused head-interleaved qkv, tied head), GPT-2 (learned
absolute positions added at the client from the session's position, Conv1D projections, tied head), Qwen2
(attention biases), Mistral (a sliding window shorter than the prompts), and the newer ones with the configs of
tiny_model.FAMILY_QUIRKS: Qwen3 (QK-norm, sliding layers by layer_types), Qwen3-MoE (QK-norm, experts batched
over the round), Phi-3 (fused qkv and gate_up, half-rotary heads), Gemma 2 (soft-capped attention and logits,
alternating sliding layers, scaled embeddings, norms around attention and MLP) and Gemma 3 (QK-norm, sliding
layers with their own rotary base, scaled embeddings, soft-capped logits).
"""

import pytest
import torch
import transformers

from exact_match import ATOL, assert_interleaved_sessions_match
from tiny_model import FAMILY_QUIRKS, build_tiny_model

BLOCKS = 4
SPLIT = [(0, 2), (2, 4)]
SPLIT_FAMILIES = ("bloom", "gemma3_text")  # the others: one server of blocks 0:4
FAMILIES = {
    "bloom": {},
    "gpt2": {},
    "qwen2": {"perturb_vectors": True},  # non-zero q/k/v biases
    "mistral": {"sliding_window": 4},  # every prompt below is longer than the window
    **FAMILY_QUIRKS,  # windows of 4 tokens too
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict:
    return {
        family: build_tiny_model(tmp_path_factory.mktemp(f"tiny-{family}"), family, BLOCKS, seed=7, **overrides)
        for family, overrides in FAMILIES.items()
    }


def spans(family: str) -> list[tuple[int, int]]:
    return SPLIT if family in SPLIT_FAMILIES else [(0, BLOCKS)]


@pytest.fixture(scope="module")
def family_swarm(folders, tmp_path_factory):
    """One bootstrap peer; the block servers of every family (spans), each family under its own prefix, started at
    once."""
    from swarm.local import READY_TIMEOUT, LocalSwarm

    swarm = LocalSwarm(str(folders["bloom"]), [], log_dir=tmp_path_factory.mktemp("family-swarm-logs"))
    with swarm:  # starts the bootstrap peer only: no spans of its own
        for family, folder in folders.items():
            for start, end in spans(family):
                swarm.add_server(["--model", str(folder), "--blocks", f"{start}:{end}", "--dht-prefix", family,
                                  "--threads", "1"], wait=False)
        for server in swarm.servers:
            server.ready_line = server.wait_for_line(lambda line: line.startswith("ready:"), READY_TIMEOUT)
        yield swarm


@pytest.fixture(scope="module")
def swarm_client(family_swarm):
    from swarm.client import SwarmClient

    client = SwarmClient(family_swarm.initial_peers)
    yield client
    client.shutdown()


@pytest.fixture(scope="module", params=list(FAMILIES))
def pair(request, folders, swarm_client):
    """(remote model, local transformers model) of one family."""
    from swarm.client.remote_model import RemoteModel

    folder = folders[request.param]
    remote = RemoteModel(folder, swarm_client, request.param, prefix=request.param)
    local = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return remote, local


def test_chain_goes_through_the_familys_servers(pair):
    remote, _ = pair
    chain = remote.client.chain(remote.prefix, remote.num_blocks, remote.name)
    assert [(link.start, link.end) for link in chain] == spans(remote.prefix)
    assert len({link.peer_id for link in chain}) == len(spans(remote.prefix))


def test_token_by_token_logits_and_greedy_tokens_match(pair):
    """Two sessions open at once, interleaved, with prompts of 5 and 11 tokens (both past Mistral's window)."""
    remote, local = pair
    assert_interleaved_sessions_match(remote, local, (5, 11), new_tokens=8)


def test_chunked_prompt_and_rewind(pair):
    """A prompt in chunks, then a rewind to position 6 with other tokens: positions (wpe, ALiBi, rotary, window)
    follow the session's absolute position."""
    remote, local = pair
    ids = torch.randint(3, local.config.vocab_size, (2, 10), generator=torch.Generator().manual_seed(3))
    other = ids.clone()
    other[:, 6:] = (other[:, 6:] + 1) % local.config.vocab_size
    with torch.no_grad():
        reference, rewound = local(ids).logits, local(other).logits[:, -1]
    with remote.session(max_length=10, batch_size=2) as session:
        first = session.step(ids[:, :6])
        rest = [session.step(ids[:, position : position + 2]) for position in (6, 8)]
        again = session.step(other[:, 6:], position=6)
    torch.testing.assert_close(torch.stack([first, *rest], 1), reference[:, [5, 7, 9]], atol=ATOL, rtol=0)
    torch.testing.assert_close(again, rewound, atol=ATOL, rtol=0)


def test_cacheless_forward_and_hidden_states_match(pair):
    remote, local = pair
    ids = torch.randint(3, local.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        output = local(ids, output_hidden_states=True)
    torch.testing.assert_close(remote.forward(ids), output.logits, atol=ATOL, rtol=0)
    for layer in (0, 2, BLOCKS):  # BLOCKS: after the final norm, as transformers' hidden_states[-1]
        torch.testing.assert_close(remote.hidden_states(ids, layer), output.hidden_states[layer], atol=ATOL, rtol=0)

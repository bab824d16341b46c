"""Cache-less forwards over hivemind's 4 MiB unary messages stream, and equal the local model; nobody is banned.

A tiny Llama of hidden size 4096 (narrow attention and MLP, so it stays small) makes a forward of 320 tokens
5 MiB of hidden states: the embeddings, /v1/chooses and prompt logprobs of a long input, or the spot check of a
long session, on the default model (hidden size 576) from about 1,800 tokens. Two servers hold both of its
blocks, so that a spot check has a second opinion to ask.
"""

import pytest
import torch
import transformers

from exact_match import ATOL
from gunicorn_gateway import add_other_model
from swarm.client import SwarmClient
from swarm.client.remote_model import RemoteModel
from tiny_model import build_tiny_model

PREFIX = "wide"
BLOCKS = 2
LONG = 320  # tokens: 320 x 4096 x 4 bytes = 5 MiB, over hivemind's 4 MiB unary message


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("wide"), "llama", BLOCKS, seed=3, hidden_size=4096, head_dim=16,
                            intermediate_size=64)


@pytest.fixture(scope="module")
def wide_servers(tiny_swarm, wide_model):
    started = [add_other_model(tiny_swarm, wide_model, PREFIX, f"0:{BLOCKS}", wait=False) for _ in range(2)]
    for server in started:
        server.ready_line = server.wait_for_line(lambda line: line.startswith("ready:"), 120)
    return started


@pytest.fixture(scope="module")
def local_model(wide_model):
    return transformers.AutoModelForCausalLM.from_pretrained(wide_model, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def wide_remote(wide_servers, wide_model, tiny_swarm, settings):
    client = SwarmClient(tiny_swarm.initial_peers, spot_check_rate=1.0)
    model = RemoteModel.on_client(client, str(wide_model), settings.cache_dir, PREFIX)
    yield model
    model.close()


def ids_of(length: int, vocab: int, seed: int) -> torch.Tensor:
    return torch.randint(3, vocab, (1, length), generator=torch.Generator().manual_seed(seed))


def test_a_forward_over_the_unary_limit_streams_and_equals_the_local_model(wide_remote, local_model):
    ids = ids_of(LONG, local_model.config.vocab_size, seed=1)
    assert LONG * local_model.config.hidden_size * 4 > 4 << 20
    with torch.no_grad():
        reference = local_model(ids).logits
    torch.testing.assert_close(wide_remote.forward(ids), reference, atol=ATOL, rtol=0)
    assert wide_remote.client.bans.current() == set()  # nobody was blamed for the size of the request


def test_a_long_sessions_spot_check_gets_its_second_opinion(wide_remote):
    from swarm.client import metrics

    agreed = metrics.SPOT_CHECKS.labels("agreed")._value.get()
    with wide_remote.session(max_length=LONG + 1) as session:  # every step is checked (spot_check_rate 1)
        session.step(ids_of(LONG, wide_remote.config.vocab_size, seed=2))
    assert metrics.SPOT_CHECKS.labels("agreed")._value.get() == agreed + 1  # not "unresolved": the other answered
    assert wide_remote.client.bans.current() == set()


def test_a_streamed_forward_declaring_too_much_is_refused_at_its_first_part(wide_remote, wide_servers):
    """A stranger's stream that declares more hidden states than the server's max_request_tokens allows gets a
    refusal before it sends (or the server holds) the rest."""
    from hivemind.p2p import PeerID

    from swarm.protocol import BadRequestError
    from swarm.wire import BlockRPC, pack, raise_if_error, split_parts, unpack

    client = wide_remote.client
    first = split_parts(pack((torch.zeros(1, 8, 4096),), {"start": 0, "end": BLOCKS}))[0]
    first.tensors[0].size[:] = [1, 1 << 20, 4096]  # a million tokens: far over the default 8,192

    async def refused():
        stub = BlockRPC.get_stub(client.node.p2p, PeerID.from_base58(wide_servers[0].peer_id))

        async def only_the_first_part():
            yield first

        replies = await stub.rpc_forward_stream(only_the_first_part())
        return [reply async for reply in replies]

    replies = client.loop.run(refused(), timeout=60)
    assert len(replies) == 1
    with pytest.raises(BadRequestError, match="over this server's limit of 33554432 elements"):
        raise_if_error(unpack(replies[0])[1])

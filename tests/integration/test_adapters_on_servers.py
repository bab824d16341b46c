"""LoRA adapters through real servers: the shared tiny swarm's two servers both apply two PEFT adapters
(--adapters); sessions of each adapter and of none, stepped at once, equal transformers + peft token by token;
routing never sends an adapter's session to a server without it; a server refuses an adapter it lacks."""

import threading

import pytest
import torch

from exact_match import ATOL, local_logits
from shared_swarm import TINY_ADAPTERS, TINY_PREFIX
from swarm.protocol import BadRequestError, MissingBlocksError

NEW_TOKENS = 8


@pytest.fixture(scope="module")
def peft_model(tiny_peft_model):
    return tiny_peft_model


class Reference:
    """The local model through one adapter (None: the base model)."""

    def __init__(self, peft_model, adapter):
        self.peft_model, self.adapter = peft_model, adapter

    def logits(self, ids: list[int]) -> torch.Tensor:
        with self._active():
            return local_logits(self.peft_model, ids)

    def greedy(self, prompt: list[int], new_tokens: int) -> list[int]:
        with self._active(), torch.no_grad():
            return self.peft_model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=new_tokens,
                                            min_new_tokens=new_tokens, do_sample=False)[0].tolist()

    def _active(self):
        if self.adapter is None:
            return self.peft_model.disable_adapter()
        self.peft_model.set_adapter(self.adapter)
        return torch.no_grad()


def run_session(remote, prompt: list[int], results: dict, key) -> None:
    sequence, logits = list(prompt), []
    with remote.session(max_length=len(prompt) + NEW_TOKENS) as session:
        logits.append(session.step([prompt])[0])
        for _ in range(NEW_TOKENS - 1):
            sequence.append(int(logits[-1].argmax()))
            logits.append(session.step([[sequence[-1]]])[0])
    results[key] = (sequence, torch.stack(logits))


def test_sessions_of_two_adapters_and_none_at_once_equal_local_peft(tiny_remote, peft_model):
    adapters = [TINY_ADAPTERS[0], None, TINY_ADAPTERS[1], TINY_ADAPTERS[0]]
    generator = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, peft_model.config.vocab_size, (length,), generator=generator).tolist()
               for length in (3, 9, 6, 12)]
    results: dict = {}
    threads = [threading.Thread(target=run_session, args=(
        tiny_remote if adapter is None else tiny_remote.with_adapter(adapter), prompt, results, index))
        for index, (adapter, prompt) in enumerate(zip(adapters, prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    outputs = []
    for index, (adapter, prompt) in enumerate(zip(adapters, prompts)):
        sequence, logits = results[index]
        reference = Reference(peft_model, adapter)
        torch.testing.assert_close(logits, reference.logits(sequence)[len(prompt) - 1 :], atol=ATOL, rtol=0)
        assert sequence == reference.greedy(prompt, NEW_TOKENS - 1)
        outputs.append(logits)
    assert not torch.allclose(outputs[0][0], Reference(peft_model, None).logits(prompts[0])[-1], atol=1e-2)


def test_a_cacheless_forward_through_an_adapter_equals_local_peft(tiny_remote, peft_model):
    ids = torch.randint(3, peft_model.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(6))
    adapter = TINY_ADAPTERS[1]
    peft_model.set_adapter(adapter)
    with torch.no_grad():
        reference = peft_model(input_ids=ids).logits
    torch.testing.assert_close(tiny_remote.with_adapter(adapter).forward(ids), reference, atol=ATOL, rtol=0)


def test_routing_picks_only_servers_holding_the_adapter(tiny_swarm, tiny_remote, client):
    plain = tiny_swarm.add_server(["--blocks", "0:4", "--adapters"])  # the whole model, no adapter
    plain_peer = plain.ready_line.split(" as peer ")[1].split(",")[0]
    assert {TINY_ADAPTERS[0], TINY_ADAPTERS[1]} == client.adapters(TINY_PREFIX, tiny_remote.num_blocks)
    for _ in range(5):  # whichever server is least loaded, an adapter's chain never goes through the plain one
        chain = client.chain(TINY_PREFIX, tiny_remote.num_blocks, "tiny:lora", adapter=TINY_ADAPTERS[0])
        assert plain_peer not in {link.peer_id for link in chain}
    assert plain_peer in {server.peer_id for server in client.servers(TINY_PREFIX, tiny_remote.num_blocks)}
    with pytest.raises(MissingBlocksError, match="tiny:nope"):
        client.chain(TINY_PREFIX, tiny_remote.num_blocks, "tiny:nope", adapter="nope")


def test_the_catalogue_names_each_models_adapters(client):
    from swarm.client.catalogue import catalogue

    [(_, _, adapters)] = [row for row in catalogue(client) if row[0].prefix == TINY_PREFIX]
    assert adapters == sorted(TINY_ADAPTERS)


def test_a_server_refuses_an_adapter_it_lacks(tiny_remote, client):
    from swarm.client.stubs import InferenceStream

    link = client.chain(TINY_PREFIX, tiny_remote.num_blocks, "tiny")[0]
    stream = InferenceStream(client.node.p2p, link.peer_id, link.start, link.end, 10.0, client.step_channels)
    try:
        with pytest.raises(BadRequestError, match="no adapter 'nope'"):
            client.loop.run(stream.open(8, 1, adapter="nope"))
    finally:
        client.loop.run(stream.close())

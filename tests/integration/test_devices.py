"""Block servers with quantized weights, and on a GPU where this machine has one, answering through the swarm."""

import pytest
import torch
import transformers

from exact_match import assert_interleaved_sessions_match
from swarm.client.remote_model import RemoteModel

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")


@pytest.fixture(scope="module")
def local_model(tiny_llama):
    return transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()


@pytest.fixture
def remote_on(tiny_swarm, tiny_llama, settings):
    """A RemoteModel of the tiny model served by one extra server started with these arguments."""
    models = []

    def make(prefix: str, *server_args: str):
        server = tiny_swarm.add_server(["--blocks", "0:4", "--dht-prefix", prefix, *server_args])
        models.append(RemoteModel.from_pretrained(str(tiny_llama), tiny_swarm.initial_peers, settings.cache_dir, prefix))
        return server, models[-1]

    yield make
    for model in models:
        model.close()


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got - expected).norm() / expected.norm())


def test_an_int8_server_says_so_and_answers_close_to_the_local_model(remote_on, local_model):
    server, remote = remote_on("tiny-int8", "--quantize", "int8")
    assert "(int8 weights, " in server.ready_line
    assert remote.client.server_info(server.peer_id)["quantization"] == "int8"
    ids = torch.randint(3, local_model.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        expected = local_model(ids).logits[0, -1]
    with remote.session(max_length=12) as session:
        assert relative_error(session.step(ids)[0], expected) < 0.1


@pytest.mark.gpu
@needs_cuda
def test_a_gpu_server_equals_the_local_model(remote_on, local_model):
    server, remote = remote_on("tiny-cuda", "--device", "cuda")
    assert " on cuda" in server.ready_line
    assert_interleaved_sessions_match(remote, local_model, (1, 7, 23), new_tokens=12)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("quantization, max_error", [("int8", 0.1), ("nf4", 0.6)])
def test_quantized_gpu_servers_answer_close_to_the_local_model(remote_on, local_model, quantization, max_error):
    server, remote = remote_on(f"tiny-cuda-{quantization}", "--device", "cuda", "--dtype", "float16",
                               "--quantize", quantization)
    assert f"({quantization} weights, " in server.ready_line
    ids = torch.randint(3, local_model.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        expected = local_model(ids).logits[0, -1]
    with remote.session(max_length=12) as session:
        assert relative_error(session.step(ids)[0], expected) < max_error

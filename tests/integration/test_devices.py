"""Block servers with quantized weights, and on a GPU where this machine has one, answering through the swarm;
the gateway's half of the model (embeddings, final norm, LM head) in 16 bits and on a GPU."""

import pytest
import torch
import transformers

from config import GatewaySettings, ModelConfig, Settings, SwarmSettings
from processes import run_tool
from shared_swarm import TINY_PREFIX
from exact_match import assert_interleaved_sessions_match, local_logits
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


# --------------------------------------------------------------------------------- the gateway's half

# bfloat16 keeps 8 bits of mantissa: over 20 prompts of the tiny model its logits stayed within 1.5% of
# float32's (relative L2) and 3.8% of the largest logit (max abs); the bounds leave room for other prompts
BFLOAT16_RELATIVE_ERROR = 0.03
BFLOAT16_ABS_ERROR = 0.05  # times the largest |logit|


def gateway_engine(tiny_swarm, tiny_llama, settings, device: str, dtype: str):
    from gateway.engine.generation import Engine

    gateway = GatewaySettings(models=(ModelConfig("tiny", str(tiny_llama), dht_prefix=TINY_PREFIX),),
                              device=device, dtype=dtype)
    swarm = SwarmSettings(cache_dir=settings.cache_dir, initial_peers=tuple(tiny_swarm.initial_peers))
    return Engine(Settings(swarm=swarm, gateway=gateway))


def greedy_reply(engine, prompt: list[int], new_tokens: int) -> list[int]:
    """The engine's greedy reply, as token ids (each step's logprob names its token)."""
    from gateway.engine.generation import GenerationRequest
    from gateway.engine.sampling import SamplingParams

    session = engine.open_session("tiny", len(prompt) + new_tokens, expires=False)
    try:
        request = GenerationRequest(inputs=None, sampling=SamplingParams(), max_new_tokens=new_tokens,
                                    input_ids=tuple(prompt), logprobs=0)
        return [entry.token_id for delta in engine.generate(session, request) for entry in delta.logprobs]
    finally:
        engine.close_session(session)


def assert_near_greedy(local_model, prompt: list[int], reply: list[int], max_gap: float) -> None:
    """Each token of the reply is float32's best one, or within max_gap of its logit (a near tie that 16-bit
    arithmetic may break the other way)."""
    logits = local_logits(local_model, prompt + reply)[len(prompt) - 1 : -1]  # (reply, vocab), before each token
    assert reply
    for step, token in enumerate(reply):
        assert float(logits[step].max() - logits[step, token]) <= max_gap * float(logits[step].abs().max())


def test_a_bfloat16_gateway_half_stays_close_to_float32(tiny_swarm, tiny_llama, settings, local_model):
    """Embeddings, final norm and LM head in bfloat16 on the CPU, as GATEWAY_DTYPE=bfloat16 sets them: the
    hidden states still leave as float32 (sent in the wire dtype), logits reach sampling as float32, and
    greedy generation through the swarm and the gateway's engine still works."""
    engine = gateway_engine(tiny_swarm, tiny_llama, settings, "cpu", "bfloat16")
    try:
        remote = engine.model("tiny").remote
        assert remote.client_modules.lm_head.weight.dtype == torch.bfloat16
        ids = torch.randint(3, local_model.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(10))
        assert remote.embed(ids).dtype == torch.float32
        with remote.session(max_length=12) as session:
            logits = session.step(ids)[0]
        assert logits.dtype == torch.float32 and logits.device.type == "cpu"
        expected = local_logits(local_model, ids[0].tolist())[-1]
        assert relative_error(logits, expected) < BFLOAT16_RELATIVE_ERROR
        torch.testing.assert_close(logits, expected, atol=BFLOAT16_ABS_ERROR * float(expected.abs().max()), rtol=0)

        prompt = ids[0].tolist()
        assert_near_greedy(local_model, prompt, greedy_reply(engine, prompt, 10), 2 * BFLOAT16_ABS_ERROR)
    finally:
        engine.swarm_client().shutdown()  # the engine's one DHT node


def test_the_gateway_refuses_a_device_it_lacks_in_one_line():
    with pytest.raises(ValueError, match="GATEWAY_DEVICE must be cpu, cuda or cuda:N, got 'gpu'"):
        GatewaySettings.from_env({"GATEWAY_DEVICE": "gpu"})
    with pytest.raises(ValueError, match="GATEWAY_DTYPE must be one of float32, bfloat16, float16"):
        GatewaySettings.from_env({"GATEWAY_DTYPE": "int8"})
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: `--device cuda` is accepted")
    for args, env in ((("--device", "cuda"), {}), ((), {"GATEWAY_DEVICE": "cuda"})):
        result = run_tool("app.py", *args, env=env)
        assert result.returncode == 2
        assert result.stderr.strip().count("\n") == 0 and "CUDA is not available on this machine" in result.stderr
        assert "Traceback" not in result.stderr


@pytest.mark.gpu
@needs_cuda
def test_a_gpu_gateway_half_equals_the_local_model(tiny_swarm, tiny_llama, settings, local_model):
    """The gateway's half on the GPU in float32 (--device cuda): the same logits and greedy tokens as local
    transformers on the CPU; in bfloat16, within the CPU's bfloat16 bounds."""
    remote = RemoteModel.from_pretrained(str(tiny_llama), tiny_swarm.initial_peers, settings.cache_dir, TINY_PREFIX,
                                         device="cuda")
    try:
        assert remote.client_modules.lm_head.weight.is_cuda
        assert_interleaved_sessions_match(remote, local_model, (1, 7, 23), new_tokens=12)
    finally:
        remote.close()
    engine = gateway_engine(tiny_swarm, tiny_llama, settings, "cuda", "bfloat16")
    try:
        prompt = torch.randint(3, local_model.config.vocab_size, (12,), generator=torch.Generator().manual_seed(11))
        assert_near_greedy(local_model, prompt.tolist(), greedy_reply(engine, prompt.tolist(), 10),
                           2 * BFLOAT16_ABS_ERROR)
    finally:
        engine.swarm_client().shutdown()  # the engine's one DHT node


@pytest.mark.gpu
@needs_cuda
def test_a_graphed_round_on_a_gpu_never_waits_for_the_host(tiny_llama):
    """Decode, verify and mixed rounds replay graphs captured ahead, their inputs copied through pinned memory:
    torch's sync debug mode raises on any host synchronisation inside the round (the old round copied its
    inputs from pageable memory, and captured on the serving path, synchronising the device)."""
    from swarm.server.attention import Segment
    from swarm.server.span import load_span

    span = load_span(tiny_llama, 0, 4, device="cuda")
    span.new_pool(4096)
    span.use_graphs(capture=True)
    caches = [span.new_cache(1, 256) for _ in range(3)]
    for cache in caches:
        span(torch.randn(1, 40, span.config.hidden_size), 0, cache)
    assert span.capture_graphs_ahead(max_tokens=64, max_keys=256).rounds > 0
    for lengths in ([1, 1, 1], [9, 9, 9], [1, 5, 9]):
        segments = [Segment(1, length, 40, cache) for length, cache in zip(lengths, caches)]
        hidden = torch.randn(1, sum(lengths), span.config.hidden_size)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            output = span.forward_packed(hidden, segments)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert output.device.type == "cuda" and output.shape == (1, sum(lengths), span.config.hidden_size)

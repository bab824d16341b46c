"""The command-line tools as an operator runs them: bad input gives one line and a non-zero exit."""

import pytest

from processes import run_tool
from shared_swarm import TINY_PREFIX

BOGUS_PEER = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWRzzgPQQS3Z3gKbcainfUKGvvRv1vjhyvf9NVGzGidZAY"


def assert_one_line_error(result, *fragments):
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ") and "Traceback" not in result.stderr
    for fragment in fragments:
        assert fragment in lines[0]


@pytest.mark.parametrize(
    "args, fragments",
    [
        (["-m", "swarm.server", "--blocks", "0:1", "--bogus"], ["unrecognized arguments: --bogus"]),
        (["-m", "swarm.server", "--memory-budget", "nan", "--initial-peers", BOGUS_PEER],
         ["--memory-budget must be a positive, finite number of GiB"]),
        (["-m", "swarm.server", "--blocks", "0:2"], ["--initial-peers is required"]),
        (["-m", "swarm.server", "--blocks", "5:2", "--initial-peers", BOGUS_PEER], ["START < END"]),
        (["-m", "swarm.server", "--blocks", "x", "--initial-peers", BOGUS_PEER], ["START:END"]),
        (["-m", "swarm.server", "--blocks", "0:2", "--initial-peers", "not-an-address"], ["malformed multiaddr"]),
        (["-m", "swarm.server", "--blocks", "0:2", "--initial-peers", "/ip4/127.0.0.1/tcp/9"], ["/p2p/"]),
        (["-m", "swarm.server", "--model", "no-such-model", "--blocks", "0:2", "--initial-peers", BOGUS_PEER],
         ["unknown model 'no-such-model'"]),
        (["-m", "swarm.server", "--blocks", "0:1", "--device", "cuda", "--initial-peers", BOGUS_PEER],
         ["CUDA is not available"]),
        (["-m", "swarm.server", "--blocks", "0:1", "--prefill-chunk-tokens", "0", "--initial-peers", BOGUS_PEER],
         ["--prefill-chunk-tokens must be at least 1"]),
        (["-m", "swarm.server", "--blocks", "0:1", "--cache-wait", "-1", "--initial-peers", BOGUS_PEER],
         ["--cache-wait must not be negative"]),
        (["-m", "swarm.server", "--blocks", "0:1", "--quantize", "int4", "--initial-peers", BOGUS_PEER],
         ["--quantize: invalid choice"]),
        (["-m", "swarm.client.generate", "--prompt", "hi", "--initial-peers", BOGUS_PEER, "--wire-dtype", "float64"],
         ["--wire-dtype: invalid choice"]),
        (["-m", "swarm.client.generate", "--prompt", "hi", "--initial-peers", "nope"], ["malformed multiaddr"]),
        (["-m", "swarm.client.generate", "--prompt", "hi", "--initial-peers", BOGUS_PEER, "--top-p", "0"], ["--top-p"]),
        (["-m", "swarm.dht", "--port", "x"], ["--port"]),
        (["app.py", "--initial-peers", "garbage"], ["malformed multiaddr"]),
    ],
)
def test_bad_arguments(args, fragments):
    assert_one_line_error(run_tool(*args), *fragments)


@pytest.mark.parametrize(
    "args, env, fragment",
    [
        (["-m", "swarm.client.generate", "--prompt", "hi"], {"WIRE_DTYPE": "float64"}, "WIRE_DTYPE must be one of"),
        (["-m", "swarm.server", "--blocks", "0:1"], {"TORCH_THREADS": "many"}, "TORCH_THREADS must be a positive"),
        (["app.py"], {"MAX_SESSIONS": "lots"}, "MAX_SESSIONS: expected int"),
    ],
)
def test_bad_environment(args, env, fragment):
    assert_one_line_error(run_tool(*args, env={"INITIAL_PEERS": BOGUS_PEER, **env}), "bad environment", fragment)


def test_block_range_out_of_bounds(tiny_llama):
    result = run_tool("-m", "swarm.server", "--model", str(tiny_llama), "--blocks", "2:9", "--initial-peers", BOGUS_PEER)
    assert_one_line_error(result, "out of range", "blocks 0:4")


def test_a_server_whose_memory_fits_not_one_block_says_so(tiny_llama):
    result = run_tool("-m", "swarm.server", "--model", str(tiny_llama), "--memory-budget", "0.001",
                      "--initial-peers", BOGUS_PEER)
    assert_one_line_error(result, "not even one block of this model fits in memory: one needs ",
                          "1073741 bytes are available (--memory-budget, 1.02 MiB)")


def test_an_adapter_folder_a_server_cannot_serve_is_a_one_line_error(tiny_llama, tiny_adapters, tmp_path):
    server = ("-m", "swarm.server", "--model", str(tiny_llama), "--blocks", "0:2", "--initial-peers", BOGUS_PEER)
    assert_one_line_error(run_tool(*server, "--adapters", str(tmp_path)), "--adapters", "adapter_config.json")
    (tmp_path / "dora").mkdir()
    (tmp_path / "dora" / "adapter_config.json").write_text('{"peft_type": "LORA", "use_dora": true}')
    assert_one_line_error(run_tool(*server, "--adapters", str(tmp_path / "dora")), "only plain LoRA", "use_dora")


def test_generate_names_missing_blocks(tiny_swarm, tiny_llama):
    result = run_tool("-m", "swarm.client.generate", "--initial-peers", *tiny_swarm.initial_peers, "--model", str(tiny_llama),
                      "--dht-prefix", "nobody-serves-this", "--prompt", "Hello")
    assert_one_line_error(result, "no server holds blocks 0..3 of")


def test_generate_streams_through_the_swarm(tiny_swarm, tiny_llama):
    result = run_tool("-m", "swarm.client.generate", "--initial-peers", *tiny_swarm.initial_peers, "--model", str(tiny_llama),
                      "--dht-prefix", TINY_PREFIX, "--prompt", "Hello", "--chat", "--max-new-tokens", "5")
    assert result.returncode == 0, result.stderr
    assert "tokens/s" in result.stderr and result.stdout.strip()


def test_bootstrap_peer_keeps_its_identity(tmp_path):
    import subprocess
    import sys

    from processes import ROOT

    def peer_line():
        process = subprocess.Popen([sys.executable, "-m", "swarm.dht", "--identity", str(tmp_path / "id.key")],
                                   stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=ROOT)
        try:
            return process.stdout.readline().strip()
        finally:
            process.terminate()
            process.wait(10)

    first, second = peer_line(), peer_line()
    assert first.startswith("/ip4/127.0.0.1/tcp/") and "/p2p/" in first
    assert first.split("/p2p/")[1] == second.split("/p2p/")[1]


@pytest.mark.parametrize("tool", ["swarm.server", "swarm.client.generate"])
def test_a_wrong_flag_is_told_before_torch_loads(tool):
    """The flags are checked first: a typo costs a blink, not the seconds torch and transformers take to load."""
    result = run_tool("-X", "importtime", "-m", tool, "--bogus")
    imported = {line.rsplit("|", 1)[-1].strip() for line in result.stderr.splitlines() if line.startswith("import time:")}
    assert result.returncode == 2 and "error: " in result.stderr
    assert "json" in imported  # the listing works: it names what loaded
    assert not imported & {"torch", "transformers", "hivemind"}

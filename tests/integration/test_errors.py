"""Errors a user can act on, raised by real servers in the tiny swarm."""

import pytest
import torch

from leak_checks import wait_for_free_cache
from swarm.protocol import PAGE_TOKENS
from swarm.client.remote_model import RemoteModel
from swarm.protocol import BadRequestError, CacheFullError, MissingBlocksError, SessionLengthError


@pytest.fixture(scope="module")
def remote_for(tiny_swarm, tiny_llama, settings):
    """RemoteModels of the tiny model under other DHT prefixes, served by extra servers of the tiny swarm."""
    models = []

    def make(prefix):
        model = RemoteModel.from_pretrained(str(tiny_llama), tiny_swarm.initial_peers, settings.cache_dir, prefix)
        models.append(model)
        return model

    yield make
    for model in models:
        model.close()


def test_missing_blocks_are_named(tiny_swarm, remote_for):
    tiny_swarm.add_server(["--blocks", "0:2", "--dht-prefix", "tiny-half"])
    model = remote_for("tiny-half")
    with pytest.raises(MissingBlocksError, match=r"^no server holds blocks 2\.\.3 of .*tiny-llama"):
        model.session(max_length=8)


def test_a_full_cache_says_so_and_is_routed_around(tiny_swarm, remote_for):
    tiny_swarm.add_server(["--blocks", "0:4", "--dht-prefix", "tiny-small", "--cache-tokens", str(PAGE_TOKENS // 2)])
    model = remote_for("tiny-small")
    with pytest.raises(CacheFullError, match="full cache"):
        model.session(max_length=32)  # its first page is more than the whole cache
    tiny_swarm.add_server(["--blocks", "0:4", "--dht-prefix", "tiny-small", "--cache-tokens", str(PAGE_TOKENS),
                           "--cache-wait", "0.5"])
    with model.session(max_length=16) as session:  # fits: one page
        with pytest.raises(CacheFullError):  # every server is now full, and stays full while it waits
            model.session(max_length=1)
        session.step([[1, 2, 3]])
    with model.session(max_length=16):  # the closed session's cache comes back (a new one waits for it)
        pass

    tiny_swarm.add_server(["--blocks", "0:4", "--dht-prefix", "tiny-small", "--cache-tokens", str(4 * PAGE_TOKENS)])
    with model.session(max_length=32) as session:  # the full servers are routed around
        assert session.step([[1, 2, 3]]).shape == (1, model.config.vocab_size)


def test_a_session_takes_cache_as_it_grows_and_is_refused_when_none_frees(tiny_swarm, remote_for):
    budget = 3 * PAGE_TOKENS + PAGE_TOKENS // 2  # three pages and a half
    server = tiny_swarm.add_server(["--blocks", "0:4", "--dht-prefix", "tiny-growing", "--cache-tokens", str(budget),
                                    "--cache-wait", "0.5"])
    model = remote_for("tiny-growing")
    prompt = 2 * PAGE_TOKENS + 4  # ends early in the third page
    ids = torch.randint(0, model.config.vocab_size, (1, prompt + PAGE_TOKENS))
    with model.session(max_length=256) as session:
        assert model.client.server_info(server.peer_id)["cache_tokens_free"] == budget - PAGE_TOKENS  # one page
        session.step(ids[:, :prompt])
        with pytest.raises(CacheFullError, match="full cache"):
            session.step(ids[:, prompt:])  # a fourth page does not fit, and no other server has one
        session.step(ids[:, prompt : prompt + 5])  # still within the third page: the session goes on
    with model.session(max_length=256):  # closing gives every page back (once the close reaches the server)
        pass
    wait_for_free_cache(model.client, server, budget, timeout=15)


def test_exceeding_max_length_says_so(tiny_remote):
    with tiny_remote.session(max_length=8) as session:
        session.step([[1, 2, 3, 4, 5, 6]])
        with pytest.raises(SessionLengthError, match="max_length=8"):
            session.step([[1, 2, 3]])
        session.step([[7, 8]])  # the session goes on after a refused step

        # the server enforces it too, for clients that don't check
        stream = session.blocks.hops[0].stream
        hidden = torch.zeros(1, 3, tiny_remote.config.hidden_size)
        with pytest.raises(SessionLengthError, match="max_length=8"):
            tiny_remote.client.loop.run(stream.step(hidden, 7))


def test_servers_refuse_malformed_steps(tiny_remote):
    with tiny_remote.session(max_length=8) as session:
        stream = session.blocks.hops[0].stream
        run = tiny_remote.client.loop.run
        with pytest.raises(BadRequestError, match="shape"):
            run(stream.step(torch.zeros(1, 2, 5), 0))
        with pytest.raises(BadRequestError, match="position"):
            run(stream.step(torch.zeros(1, 1, tiny_remote.config.hidden_size), 5))  # skips ahead of the cache
        with pytest.raises(BadRequestError, match="floating point"):
            run(stream.step(torch.zeros(1, 1, tiny_remote.config.hidden_size, dtype=torch.long), 0))
        assert session.step([[1, 2]]).shape == (1, tiny_remote.config.vocab_size)


def test_server_info_lists_only_its_blocks(tiny_remote):
    chain = tiny_remote.client.chain(tiny_remote.prefix, tiny_remote.num_blocks, tiny_remote.name)
    info = tiny_remote.client.server_info(chain[1].peer_id)
    assert (info["start"], info["end"]) == (2, 4)
    assert info["loaded_names"] and all(name.startswith(("model.layers.2.", "model.layers.3.")) for name in info["loaded_names"])


def test_num_blocks_picks_the_least_served_span(tiny_swarm):
    tiny_swarm.add_server(["--blocks", "0:2", "--dht-prefix", "tiny-auto"])
    server = tiny_swarm.add_server(["--num-blocks", "2", "--dht-prefix", "tiny-auto"], wait=False)
    ready = server.wait_for_line(lambda line: line.startswith("ready:"), 120)
    assert "blocks 2:4 of tiny-auto" in ready


def test_clean_shutdown_withdraws_the_server_at_once(tiny_swarm, remote_for):
    server = tiny_swarm.add_server(["--blocks", "0:4", "--dht-prefix", "tiny-leaving"])
    model = remote_for("tiny-leaving")
    assert len(model.client.servers("tiny-leaving", 4)) == 1
    server.stop()
    assert model.client.servers("tiny-leaving", 4) == []
    with pytest.raises(MissingBlocksError, match=r"blocks 0\.\.3"):
        model.session(max_length=4)


def test_a_ban_steers_away_but_never_strands_a_session(tiny_swarm, remote_for):
    only = tiny_swarm.add_server(["--blocks", "0:4", "--dht-prefix", "tiny-banned"])
    model = remote_for("tiny-banned")
    model.client.bans.ban(only.peer_id)  # say it was slow once: it is still the only server of these blocks
    with model.session(max_length=8) as session:
        assert session.blocks.chain[0].peer_id == only.peer_id
        assert session.step([[1, 2, 3]]).shape == (1, model.config.vocab_size)

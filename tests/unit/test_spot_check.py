import random
import time

import pytest
import torch

from swarm.protocol import RemoteServer, ServerInfo, ServerState
from swarm.client.routing import ChainLink
from swarm.client.spot_check import agree, find_liar, plan_check

HONEST = torch.randn(1, 3, 16)
CLOSE = HONEST * 1.01  # what another honest server computes: 1% off
WRONG = torch.randn(1, 3, 16)


def test_outputs_agree_within_a_relative_tolerance():
    assert agree(HONEST, CLOSE, 0.05) and agree(HONEST.bfloat16(), HONEST, 0.05)
    assert not agree(HONEST, WRONG, 0.05)
    assert not agree(HONEST, HONEST[:, :2], 0.05)
    assert not agree(HONEST.index_fill(1, torch.tensor([1]), float("nan")), HONEST, 0.05)


@pytest.mark.parametrize("hop_outputs, opinions, verdict", [
    (HONEST, [("v", CLOSE)], ("agreed", None)),
    (WRONG, [("v", HONEST), ("r", CLOSE)], ("caught", "hop")),  # the referee sides with the verifier
    (HONEST, [("v", WRONG), ("r", CLOSE)], ("caught", "v")),  # a lying verifier is caught, the hop stays
    (HONEST, [("v", None), ("r", CLOSE)], ("agreed", None)),  # the verifier failed: the next one verifies
    (WRONG, [("v", HONEST)], ("unresolved", None)),  # no referee
    (WRONG, [("v", HONEST), ("r", -HONEST), ("s", CLOSE)], ("caught", "hop")),  # a referee that agrees with none
    (HONEST, [], ("unresolved", None)),
])
def test_the_liar_is_the_one_a_referee_contradicts(hop_outputs, opinions, verdict):
    assert find_liar("hop", hop_outputs, iter(opinions), 0.05) == verdict


def test_a_referee_is_asked_only_after_a_disagreement():
    asked = []

    def opinions():
        for peer, outputs in [("v", CLOSE), ("r", CLOSE)]:
            asked.append(peer)
            yield peer, outputs

    assert find_liar("hop", HONEST, opinions(), 0.05) == ("agreed", None) and asked == ["v"]


def server(peer_id, start, end):
    return RemoteServer(peer_id, ServerInfo(ServerState.ONLINE, start, end, 1.0, 1000))


def test_a_check_picks_a_hop_that_another_server_holds_whole():
    chain = [ChainLink("a", 0, 2), ChainLink("b", 2, 4)]
    servers = [server("a", 0, 2), server("b", 2, 4), server("c", 1, 4), server("d", 0, 1), server("e", 2, 4)]
    rng = random.Random(0)
    checks = [plan_check(chain, servers, excluded={"e"}, rng=rng) for _ in range(20)]
    assert {(check.link.peer_id, tuple(check.others)) for check in checks} == {("b", ("c",))}
    assert plan_check(chain, servers, excluded={"c", "e"}, rng=rng) is None


def test_a_ban_is_never_shortened():
    from swarm.client.peers import Bans

    bans = Bans(base_seconds=0.01)
    bans.ban("liar", seconds=3600)
    bans.ban("liar")  # a failure after the lie: its short ban must not end the long one
    bans.ban("flaky")
    time.sleep(0.05)
    assert bans.current() == {"liar"}


def test_settings_read_the_allowlists_and_the_spot_check_rate():
    from config import SwarmSettings

    environ = {"ALLOWED_SERVERS": "QmA, QmB", "ALLOWED_CLIENTS": "QmC", "SPOT_CHECK_RATE": "0.1"}
    settings = SwarmSettings.from_env(environ)
    assert settings.allowed_servers == ("QmA", "QmB") and settings.allowed_clients == ("QmC",)
    assert settings.spot_check_rate == 0.1
    assert SwarmSettings.from_env({}).spot_check_rate == 0.0 and SwarmSettings.from_env({}).allowed_servers == ()
    with pytest.raises(ValueError, match="SPOT_CHECK_RATE"):
        SwarmSettings.from_env({"SPOT_CHECK_RATE": "2"})

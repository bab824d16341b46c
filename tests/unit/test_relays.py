"""Servers behind a NAT, without a network: the relayed field of records, how routing prices a relayed hop, the
relay settings a node's libp2p daemon gets, and the flags (the real thing: tests/integration/test_nat_relay.py)."""

import pytest

from swarm.client.routing import (
    DEFAULT_ROUND_TRIP,
    RELAYED_HOP_SECONDS,
    RELAYED_ROUND_TRIP_FACTOR,
    ChainLink,
    choose_chain,
    round_trip_estimates,
)
from swarm.protocol import RemoteServer, ServerInfo, ServerState
from swarm.relays import RESERVATION_MARGIN, RelayWait, circuit_address, relay_options

RELAY = "/ip4/203.0.113.7/tcp/31337/p2p/QmNnooDu7bfjPFoTZYxMNLWUQJyrVwtbZg5gBMjTezGAJN"
PEERS = ["--initial-peers", RELAY]


def server(peer_id, start, end, relayed=False, throughput=10.0):
    return RemoteServer(peer_id, ServerInfo(ServerState.ONLINE, start, end, throughput, 1000, relayed=relayed))


def test_a_record_says_relayed_only_when_it_is_and_older_records_parse_as_direct():
    direct = ServerInfo(ServerState.ONLINE, 0, 2, 10.0, 100)
    assert "relayed" not in direct.to_wire()  # a direct server's record is what it was before the field
    assert ServerInfo.from_wire(direct.to_wire()).relayed is False
    relayed = ServerInfo(ServerState.ONLINE, 0, 2, 10.0, 100, relayed=True)
    assert relayed.to_wire()["relayed"] is True
    assert ServerInfo.from_wire(relayed.to_wire()) == relayed
    for odd in (1, "yes", None, [True]):  # only a JSON boolean: anything else is a malformed record
        assert ServerInfo.from_wire({**relayed.to_wire(), "relayed": odd}) is None


def test_routing_prefers_a_direct_server_to_a_relayed_one_alike():
    servers = [server("head", 0, 2), server("relayed", 2, 4, relayed=True), server("direct", 2, 4)]
    assert choose_chain(servers, 4, "m")[-1] == ChainLink("direct", 2, 4)
    assert choose_chain(servers, 4, "m", exclude={"direct"})[-1] == ChainLink("relayed", 2, 4)  # it does serve
    # a relayed server much faster than the direct one is worth its detour
    faster = [server("head", 0, 2), server("relayed", 2, 4, relayed=True, throughput=1000.0), server("direct", 2, 4)]
    assert choose_chain(faster, 4, "m")[-1] == ChainLink("relayed", 2, 4)


def test_a_relayed_round_trip_is_priced_up_measured_or_not():
    servers = [server("direct", 0, 2), server("relayed", 0, 2, relayed=True)]
    unmeasured = round_trip_estimates(servers, {})
    assert unmeasured["direct"] == DEFAULT_ROUND_TRIP
    assert unmeasured["relayed"] == pytest.approx(DEFAULT_ROUND_TRIP * RELAYED_ROUND_TRIP_FACTOR + RELAYED_HOP_SECONDS)
    measured = round_trip_estimates(servers, {"direct": 0.01, "relayed": 0.03})
    assert measured == pytest.approx({"direct": 0.01, "relayed": 0.03 + RELAYED_HOP_SECONDS})


def test_relay_options_of_a_relayed_a_relaying_and_a_plain_node():
    relayed = relay_options([RELAY])
    assert relayed["use_relay"] and relayed["use_auto_relay"] and relayed["force_reachability"] == "private"
    assert relayed["trusted_relays"] == [RELAY]
    assert relayed["announce_maddrs"] == [f"{RELAY}/p2p-circuit"] == [circuit_address(RELAY + "/")]
    relaying = relay_options(serve_relay=True)
    assert relaying["use_relay"] and not relaying["use_auto_relay"] and relaying["force_reachability"] == "public"
    plain = relay_options()
    assert plain["use_relay"] and not plain["use_auto_relay"] and plain["force_reachability"] is None


def test_a_relayed_server_goes_online_once_its_relay_reservation_is_made_one_relay_or_four():
    assert RelayWait([], 100.0).ready_at == 100.0  # a direct server: at once
    four = [f"{RELAY[:-1]}{index}" for index in range(4)]
    assert RelayWait(four, 100.0).ready_at == 100.0 + RESERVATION_MARGIN
    assert RelayWait([RELAY], 100.0).ready_at == 100.0 + RESERVATION_MARGIN  # no discovery: no 3-minute wait


def test_the_relay_flags(capsys):
    from swarm.server.settings import parse_settings

    settings = parse_settings(["--blocks", "0:1", *PEERS, "--relay-through", RELAY])
    assert settings.relay_through == (RELAY,) and not settings.serve_as_relay
    assert parse_settings(["--blocks", "0:1", *PEERS]).relay_through == ()
    assert parse_settings(["--blocks", "0:1", *PEERS, "--serve-as-relay"]).serve_as_relay
    with pytest.raises(SystemExit):
        parse_settings(["--blocks", "0:1", *PEERS, "--relay-through", RELAY, "--serve-as-relay"])
    assert "--serve-as-relay is for a public server" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_settings(["--blocks", "0:1", *PEERS, "--relay-through", "/ip4/203.0.113.7/tcp/31337"])
    assert "lacks the peer id part" in capsys.readouterr().err


def test_only_a_relay_runs_p2pds_configurable_relay_service_and_within_the_limits_set():
    from swarm.relays import RelayLimits, relay_service_flags

    # p2pd runs it on any public node unless told; relay discovery is off everywhere (a relayed node takes its relays)
    assert relay_service_flags(False) == {"relayService": False, "relayDiscovery": False}
    flags = relay_service_flags(True, RelayLimits(max_reservations=8, max_circuits=2, data_limit=1 << 20,
                                                  time_limit=120.0))
    assert flags == {"relayService": True, "relayDiscovery": False, "relayMaxReservations": 8, "relayMaxCircuits": 2,
                     "relayDataLimit": 1 << 20, "relayTimeLimit": "120s", "relayBufferSize": 64 << 10}
    for odd in (0, -1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="max_circuits"):
            RelayLimits(max_circuits=odd)


@pytest.mark.parametrize("flag", ["--relay-max-reservations=0", "--relay-max-circuits=-3",
                                  "--relay-data-limit-mib=nan", "--relay-data-limit-mib=inf",
                                  "--relay-time-limit=0"])
def test_the_bootstrap_peer_refuses_relay_limits_that_are_no_limits(flag, capsys):
    from swarm.dht import main

    with pytest.raises(SystemExit) as exit_:
        main([flag])
    assert exit_.value.code == 2 and "--relay-* limits must be positive and finite" in capsys.readouterr().err

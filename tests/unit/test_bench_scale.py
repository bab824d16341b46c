"""The scale harness (bench/scale.py: real DHT nodes holding many simulated servers' signed records) and the
routing-quality simulation (bench/routing_quality.py), each run small; the pieces they stand on: records signed
for many keys through one node, the simulated world's best chain, the noise draws."""

import random

import pytest

from bench.quality_world import NOISE_QUANTILES, World, best_seconds, chain_seconds, noise
from bench.scale_population import link_rtt


def test_a_node_signs_for_the_simulated_servers_it_hosts_and_the_swarm_s_validator_checks_each_key():
    from hivemind.dht.validation import DHTRecord
    from hivemind.utils import MSGPackSerializer
    from hivemind.utils.crypto import RSAPrivateKey

    from bench.scale_hosts import owner_validator
    from swarm.trust import OwnerSignedRecords, owner_peer_id

    host, server, stranger = RSAPrivateKey(), RSAPrivateKey(), RSAPrivateKey()
    signing = owner_validator(host)
    marker = signing.add(server)
    checking = OwnerSignedRecords(RSAPrivateKey())  # another node's: it knows none of these keys

    def signed_by_host(owner: bytes) -> DHTRecord:
        record = DHTRecord(key=MSGPackSerializer.dumps("m.0"), subkey=MSGPackSerializer.dumps(owner),
                           value=MSGPackSerializer.dumps(b"record"), expiration_time=1e9)
        return DHTRecord(record.key, record.subkey, signing.sign_value(record), record.expiration_time)

    assert checking.validate(signed_by_host(marker))
    assert owner_peer_id(marker) == owner_peer_id(OwnerSignedRecords(server).local_public_key)
    # a marker of a key the node does not hold: signed as the node, which is no owner of it: refused
    assert not checking.validate(signed_by_host(OwnerSignedRecords(stranger).local_public_key))


def test_the_harness_announces_looks_up_and_routes_over_real_dht_nodes(tmp_path):
    from bench.scale import main

    [figures] = main(["--servers", "12", "--nodes", "2", "--blocks", "8", "--lookups", "1",
                      "--key-cache", str(tmp_path / "keys.pickle"), "--json", str(tmp_path / "scale.json")])
    announced = figures["announce"]
    assert announced["announced"] == 12 and announced["records_per_key"]
    assert sum(batch["sent"] for batch in announced["batches"]) > 12 * 500  # each record signed, stored
    [lookup] = figures["lookups"]
    assert lookup["found"] == 12  # every simulated server, under its own key's peer id
    assert lookup["received"] > 12 * 500 and lookup["calls"] >= 1
    assert figures["choose_chain_seconds"]["flowing"] > 0
    assert (tmp_path / "keys.pickle").exists() and (tmp_path / "scale.json").exists()


@pytest.mark.parametrize("seed", range(40))
def test_the_best_chain_is_the_exact_search_s_with_every_true_link_announced(seed):
    from swarm.client.flowing_routes import cheapest_flowing_chain
    from swarm.client.routing import ChainLink
    from swarm.protocol import RemoteServer, ServerInfo, ServerState

    rng = random.Random(seed)
    world = World(rng.randint(3, 10), rng.randint(2, 8), seed, 1.0, churn_every=1e9)
    truth = world.truth()
    load = {peer: rng.choice([1.0, 1.1, 1.3]) for peer in truth}
    remote = [RemoteServer(peer, ServerInfo(ServerState.ONLINE, server.start, server.end, 1.0, 1 << 20,
                                            round_trips=tuple(sorted((other, link_rtt(server, them))
                                                                     for other, them in truth.items()
                                                                     if other != peer))))
              for peer, server in truth.items()]
    cost = {peer: server.seconds_per_block * load[peer] for peer, server in truth.items()}
    hops = cheapest_flowing_chain(remote, cost, {peer: server.client_rtt for peer, server in truth.items()}, 0,
                                  world.blocks)
    assert chain_seconds([ChainLink(*hop) for hop in hops], truth, load) == pytest.approx(
        best_seconds(truth, world.blocks, load), rel=1e-9)


def test_noise_draws_follow_the_machine_s_quantiles_and_scale():
    rng = random.Random(0)
    draws = sorted(noise(rng, 1.0) for _ in range(4000))
    assert draws[0] >= 1.0 and draws[2000] == pytest.approx(dict(NOISE_QUANTILES)[0.5], abs=0.02)
    assert {noise(rng, 0.0) for _ in range(100)} == {1.0}


def test_the_world_drifts_churns_and_keeps_every_block_held():
    world = World(30, 12, 0, 1.0, churn_every=2.0)
    first = world.truth()
    for _ in range(20):
        world.advance(1.0)
    now = world.truth()
    assert len(now) == 30 and len(set(now) - set(first)) == 10  # a leave and a join every 2 s
    assert any(now[peer].seconds_per_block != first[peer].seconds_per_block for peer in set(now) & set(first))
    assert {server.peer_id for server in world.remote_servers()} == set(now)
    assert best_seconds(now, 12) < float("inf")


def test_the_routing_quality_simulation_judges_real_routing_choices(tmp_path):
    from bench.routing_quality import main

    results = main(["--servers", "40", "--blocks", "12", "--seconds", "6", "--warmup", "4", "--variants",
                    "today,exact", "--json", str(tmp_path / "quality.json")])
    for figures in results:
        assert figures["choices"] >= 12  # 2 sessions a second, and their failovers
        assert 1.0 - 1e-9 <= figures["median"] <= figures["max"]  # no chain beats the best
        assert 0 <= figures["within_10_percent"] <= 1
    assert results[1]["measured_share"] == 1.0  # `exact`: every server's truth given


def test_routing_cost_s_synthetic_servers_announce_links_to_their_next_block():
    from bench.routing_cost import choose_chain_seconds, synthetic_swarm

    remote, _, _ = synthetic_swarm(100, 24, 0.3, random.Random(0), links=16)
    spans = {server.peer_id: (server.info.start, server.info.end) for server in remote}
    for server in remote:
        assert len(server.info.round_trips) <= 16
        assert all(spans[peer][0] <= server.info.end < spans[peer][1] for peer, _ in server.info.round_trips)
    assert sum(len(server.info.round_trips) for server in remote) > 100 * 8
    assert choose_chain_seconds(100, 24, 0.3, repeats=1, flowing=True, links=16) > 0

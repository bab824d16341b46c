"""Which nodes relay for others (swarm/relays.py): the libp2p daemons of real nodes, as started, run p2pd's relay
service only on a relay, within the limits it was given (p2pd accepts the flags: the node starts and joins)."""

from swarm import dht
from swarm.relays import RelayLimits


def daemon_flags(node) -> set[str]:
    with open(f"/proc/{node.p2p._child.pid}/cmdline", "rb") as cmdline:
        return {argument.decode() for argument in cmdline.read().split(b"\0") if argument.startswith(b"-relay")}


def test_only_a_relay_relays_and_within_its_limits():
    loop = dht.EventLoop.get()
    limits = RelayLimits(max_reservations=8, max_circuits=2, data_limit=64 << 20, time_limit=600.0)
    relay = loop.run(dht.start_node(serve_relay=True, relay_limits=limits))
    plain = loop.run(dht.start_node([str(address) for address in loop.run(relay.get_visible_maddrs())]))
    try:
        # it dials relayed peers, and relays for nobody (-relayHopLimit: hivemind's, deprecated in p2pd)
        assert daemon_flags(plain) == {"-relay=1", "-relayHopLimit=0", "-relayService=0"}
        assert daemon_flags(relay) == {"-relay=1", "-relayHopLimit=0", "-relayService=1", "-relayMaxReservations=8",
                                       "-relayMaxCircuits=2", f"-relayDataLimit={64 << 20}", "-relayTimeLimit=600s",
                                       f"-relayBufferSize={16 << 20}"}
        assert loop.run(plain.find_nearest_nodes([relay.node_id]))  # the DHT works over them as before
    finally:
        loop.run(plain.shutdown())
        loop.run(relay.shutdown())

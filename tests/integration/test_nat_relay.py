"""A block server behind a NAT serves sessions through a libp2p circuit relay: for real, in network namespaces.

The server runs in a namespace that no packet from outside reaches (tests/netns.py); it dials out to a relay
peer (`python -m swarm.dht`, which relays by default) on the router between it and the outside, and joins the
swarm through it (`--relay-through`), online within seconds. A client outside, with a direct server of blocks 0:2, opens sessions
through it (blocks 2:4): greedy tokens equal the local model's. Then a direct server of blocks 2:4 joins, and the
step time through the relayed server is compared with the step time through the direct one (printed: -s).
Skipped where this machine cannot make namespaces (not root, no `ip netns`).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys

import pytest
import torch
import transformers

from netns import HOME_ADDRESS, OUTSIDE_ADDRESS, RELAY_ADDRESS, Network, NetnsUnavailable
from processes import ROOT

PREFIX = "nat-tiny"
HOME_PORT = 40123  # fixed, to try to reach it from outside
RELAYS = 1  # one is enough: the relayed server reserves on the relays it is given at once (swarm/relays.py)
PROMPT = [5, 17, 42, 99, 7, 250]
TOKENS = 12
READY = 180.0


class NatSwarm:
    """Relays on the router, a direct server outside, a relayed server at home; all stopped by `stop`."""

    def __init__(self, network: Network, folder, log_dir):
        self.network, self.folder, self.log_dir, self.children = network, str(folder), log_dir, []
        self.relays, self.initial_peers = [], []
        self.direct_first = self.relayed = None

    def start(self) -> None:
        network = self.network
        for index in range(RELAYS):
            relay = self._child(f"relay{index}", network.relay, ["-m", "swarm.dht", "--host", RELAY_ADDRESS])
            self.relays.append(relay.wait_for_line(lambda line: "/p2p/" in line, READY).split()[0])
        self.initial_peers = self.relays[:1]
        self.direct_first = self.server("direct-0-2", network.outside, "0:2", ["--host", OUTSIDE_ADDRESS])
        self.relayed = self.server("relayed-2-4", network.home, "2:4",
                                   ["--host", HOME_ADDRESS, "--port", str(HOME_PORT), "--relay-through", *self.relays])

    def _child(self, name: str, namespace: str, args: list[str]):
        from swarm.local import ChildProcess

        child = ChildProcess(name, args, self.log_dir, prefix=self.network.prefix(namespace))
        self.children.append(child)
        return child

    def server(self, name: str, namespace: str, blocks: str, args: list[str]):
        server = self._child(name, namespace, ["-m", "swarm.server", "--model", self.folder, "--blocks", blocks,
                                               "--dht-prefix", PREFIX, "--initial-peers", *self.initial_peers, *args])
        server.ready_line = server.wait_for_line(lambda line: line.startswith("ready:"), READY)
        return server

    def client(self, turns=("-",), sessions: int = 1, pings: int = 0) -> dict:
        """Sessions of a client in the outside namespace (tests/nat_client.py; `turns`: the servers each session
        avoids, in turn): its JSON report."""
        command = [*self.network.prefix(self.network.outside), sys.executable, str(ROOT / "tests" / "nat_client.py"),
                   "--model", self.folder, "--prefix", PREFIX, "--initial-peers", *self.initial_peers,
                   "--prompt", *map(str, PROMPT), "--tokens", str(TOKENS), "--sessions", str(sessions),
                   "--turns", *turns, "--pings", str(pings)]
        result = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT)
        assert result.returncode == 0, result.stderr[-3000:]
        return json.loads(result.stdout.strip().splitlines()[-1])

    def stop(self) -> None:
        for child in self.children:
            child.terminate()
        for child in self.children:
            child.stop()


@pytest.fixture(scope="module")
def network():
    try:
        network = Network.create()
    except NetnsUnavailable as reason:
        pytest.skip(f"cannot build network namespaces here: {reason}")
    yield network
    network.remove()


@pytest.fixture(scope="module")
def nat_swarm(network, tiny_llama, tmp_path_factory):
    swarm = NatSwarm(network, tiny_llama, tmp_path_factory.mktemp("nat-logs"))
    try:
        swarm.start()
        yield swarm
    finally:  # before the network goes: no process is left in a namespace being deleted
        swarm.stop()


@pytest.fixture(scope="module")
def local_greedy(tiny_llama) -> list[int]:
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([PROMPT]), max_new_tokens=TOKENS, min_new_tokens=TOKENS, do_sample=False)
    return out[0, len(PROMPT):].tolist()


def _connects(network: Network, namespace: str, address: str, port: int) -> bool:
    probe = (f"import socket\ntry:\n socket.create_connection(({address!r}, {port}), timeout=3).close()\n"
             f"except OSError:\n raise SystemExit(1)")
    return subprocess.run([*network.prefix(namespace), sys.executable, "-c", probe], timeout=30).returncode == 0


def test_the_home_server_accepts_no_connection_from_outside(nat_swarm):
    network = nat_swarm.network
    assert not _connects(network, network.outside, HOME_ADDRESS, HOME_PORT)
    # it does listen: the router next to it reaches it; only the way from outside is closed
    assert _connects(network, network.relay, HOME_ADDRESS, HOME_PORT)


def test_a_session_through_the_relayed_server_matches_the_local_model(nat_swarm, local_greedy):
    report = nat_swarm.client()
    relayed, direct = nat_swarm.relayed.peer_id, nat_swarm.direct_first.peer_id
    assert report["relayed"][relayed] is True and report["relayed"][direct] is False
    session = report["sessions"][0]
    assert session["chain"] == [direct, relayed]
    assert session["tokens"] == local_greedy
    # the direct server pushed its outputs to the relayed one, through the relay, as to any server
    assert report["pushed"][relayed] > 0


def test_relayed_step_time_against_a_direct_one(nat_swarm, local_greedy):
    """Free to choose, routing prices the relayed hop: the direct server wins. Then sessions through either take
    turns (the machine's other load weighs on both alike), in one client."""
    direct, relayed = nat_swarm.server("direct-2-4", nat_swarm.network.outside, "2:4", ["--host", OUTSIDE_ADDRESS]).peer_id, \
        nat_swarm.relayed.peer_id
    report = nat_swarm.client(turns=["-", *[direct, relayed] * 4], sessions=9, pings=50)
    free, *turns = report["sessions"]
    assert free["chain"][-1] == direct
    steps = {direct: [], relayed: []}
    for session in [free, *turns]:
        assert session["tokens"] == local_greedy
        steps[session["chain"][-1]] += session["step_seconds"]
    assert len(steps[relayed]) == 4 * TOKENS
    print()
    for name, peer in (("relayed", relayed), ("direct", direct)):
        print(f"{name} server of blocks 2:4: decode step (blocks 0:2 on a direct server) median "
              f"{statistics.median(steps[peer]) * 1000:.1f} ms, mean {statistics.mean(steps[peer]) * 1000:.1f} ms over "
              f"{len(steps[peer])} steps; an info request's round trip to it {report['pings'][peer] * 1000:.2f} ms "
              f"(median of 50)")


def test_a_relayed_first_hop_reaches_the_next_server_or_the_client_steps_in(nat_swarm, local_greedy):
    """A relayed server of blocks 0:2: its pushes to the next server go out from home, which reaches only its
    relays here (a relayed next server, through them; a direct one not at all: the client sends that server
    the inputs itself). Either way the tokens are the local model's."""
    first = nat_swarm.server("relayed-0-2", nat_swarm.network.home, "0:2",
                             ["--host", HOME_ADDRESS, "--relay-through", *nat_swarm.relays]).peer_id
    report = nat_swarm.client(turns=[nat_swarm.direct_first.peer_id], sessions=2)
    for session in report["sessions"]:
        assert session["chain"][0] == first and session["tokens"] == local_greedy
    assert report["relayed"][first] is True
    second = report["sessions"][0]["chain"][-1]
    steps = [seconds for session in report["sessions"] for seconds in session["step_seconds"]]
    print(f"\nrelayed server of blocks 0:2, then a {'relayed' if report['relayed'][second] else 'direct'} one: "
          f"decode step median {statistics.median(steps) * 1000:.1f} ms, mean {statistics.mean(steps) * 1000:.1f} ms")

"""Server-to-server pushes (swarm/server/pushes.py): only to peers that announce the block a step goes on at, as
the server's DHT node finds them (looked up once in a while, not per push), and a bounded number on their way."""

import asyncio
import time

import torch
from hivemind.p2p import PeerID

from swarm.server import pushes
from swarm.server.handler import COUNTERS
from swarm.wire import BlockRPC, reply

PEER = PeerID.from_base58("QmNLei78zWmzUdbeRB3CiUfAizWUrbeeZh5K1rhAQKCh51")
ENTRY = {"session_id": "s" * 32, "step_id": 1, "position": 0}


class Stalled:
    """Push targets whose lookup never ends: every push stays on its way."""

    async def announce(self, peer_id, block):
        await asyncio.Event().wait()


def test_pushes_on_their_way_are_capped_and_the_rest_skipped():
    async def scenario():
        pusher = pushes.Pusher(dict.fromkeys(COUNTERS, 0), Stalled())
        for index in range(pushes.PUSHES_IN_FLIGHT + 10):  # of many clients, each within its own slots
            pusher.push([(PEER, 2, ENTRY, torch.zeros(1, 1, 8))], f"client {index % 8}")
        on_their_way = len(pusher.tasks)
        for task in pusher.tasks:
            task.cancel()
        return on_their_way, pusher.counters

    on_their_way, counters = asyncio.run(scenario())
    assert on_their_way == pushes.PUSHES_IN_FLIGHT and counters["pushes_skipped"] == 10


def test_the_servers_of_a_block_are_looked_up_once_in_a_while(monkeypatch):
    lookups, now = [], [1000.0]
    announcing = {"QmNext"}

    async def servers_of_block(node, prefix, block, allowed):
        lookups.append(block)
        return set(announcing)

    from swarm import dht

    monkeypatch.setattr(dht, "servers_of_block", servers_of_block)
    monkeypatch.setattr(pushes.time, "monotonic", lambda: now[0])

    async def scenario():
        targets = pushes.PushTargets(node=None, prefix="model")
        answers = [await targets.announce("QmNext", 2), await targets.announce("QmStranger", 2),
                   await targets.announce("QmNext", 2)]
        now[0] += pushes.TARGETS_MISS_REFRESH + 1  # a peer not found may have joined since: looked up again
        announcing.add("QmJoined")
        answers += [await targets.announce("QmJoined", 2), await targets.announce("QmStranger", 2)]
        return answers

    assert asyncio.run(scenario()) == [True, False, True, True, False]
    assert lookups == [2, 2]


def test_a_push_toward_a_peer_that_does_not_announce_the_block_is_not_sent(monkeypatch):
    sent = []

    class Stub:
        async def rpc_push(self, message, timeout):
            sent.append(message)
            return reply(metadata={"results": [{}]})

    class Announcing:
        async def announce(self, peer_id, block):
            return block == 2

    monkeypatch.setattr(BlockRPC, "get_stub", classmethod(lambda cls, p2p, peer: Stub()))

    async def scenario():
        pusher = pushes.Pusher(dict.fromkeys(COUNTERS, 0), Announcing())
        pusher.push([(PEER, 2, ENTRY, torch.zeros(1, 1, 8)), (PEER, 3, ENTRY, torch.zeros(1, 1, 8))])
        await asyncio.gather(*pusher.tasks)
        return pusher.counters

    counters = asyncio.run(scenario())
    assert len(sent) == 1 and len(sent[0].tensors) == 1
    assert (counters["pushes_sent"], counters["pushes_skipped"]) == (1, 1)


def test_with_simulated_latency_a_push_leaves_and_its_reply_returns_half_a_round_trip_late(monkeypatch):
    from swarm.server.latency import SimulatedLatency

    sent_at = []

    class Stub:
        async def rpc_push(self, message, timeout):
            sent_at.append(time.monotonic())
            return reply(metadata={"results": [{}]})

    class Announcing:
        async def announce(self, peer_id, block):
            return True

    monkeypatch.setattr(BlockRPC, "get_stub", classmethod(lambda cls, p2p, peer: Stub()))
    others = [PeerID.from_base58(peer) for peer in ("QmNnooDu7bfjPFoTZYxMNLWUQJyrVwtbZg5gBMjTezGAJN",
                                                   "QmPChd2hVbrJ6bfo3WBcTW4iZnpHm8TEzWkLHmLpXhF68A")]

    async def scenario():
        pusher = pushes.Pusher(dict.fromkeys(COUNTERS, 0), Announcing(), SimulatedLatency(400))
        began = time.monotonic()
        pusher.push([(peer, 2, ENTRY, torch.zeros(1, 1, 8)) for peer in (PEER, *others)])  # three messages
        await asyncio.gather(*pusher.tasks)
        return began, time.monotonic()

    began, done = asyncio.run(scenario())
    assert len(sent_at) == 3 and all(at - began >= 0.2 for at in sent_at)  # left half a round trip late
    assert done - max(sent_at) >= 0.2  # and the reply took the other half
    assert done - began < 0.4 * 3  # the three overlapped: one after the other would take three round trips


class Announcing:
    """Push targets that every peer is one of."""

    async def announce(self, peer_id, block):
        return True


def test_a_long_prompts_pushes_stay_under_the_transports_cap(monkeypatch):
    """A 3,000-token prompt's outputs, and 64 sessions' decode steps: every push message stays under the cap on
    a unary call's size (read from hivemind), each as many pushes as fit; a step alone over it is not pushed (its
    client sends it). The old code sent them in one message, which the daemon refused ("Message size exceeds
    set limit 4194304")."""
    from hivemind.p2p.p2p_daemon_bindings.control import DEFAULT_MAX_MSG_SIZE

    sent = []

    class Stub:
        async def rpc_push(self, message, timeout):
            sent.append(message.ByteSize())
            return reply(metadata={"results": [{}] * 70})

    monkeypatch.setattr(BlockRPC, "get_stub", classmethod(lambda cls, p2p, peer: Stub()))
    hidden = 256

    async def scenario():
        pusher = pushes.Pusher(dict.fromkeys(COUNTERS, 0), Announcing())
        decode = [(PEER, 2, ENTRY, torch.zeros(1, 1, hidden)) for _ in range(64)]
        prompts = [(PEER, 2, ENTRY, torch.zeros(1, length, hidden)) for length in (3000, 1500, 1500, 1000)]
        pusher.push(decode + prompts)
        await asyncio.gather(*pusher.tasks)
        return pusher.counters

    counters = asyncio.run(scenario())
    assert len(sent) == 2 and max(sent) < DEFAULT_MAX_MSG_SIZE  # 3,000 x 256 float32: 3 MiB, with the decode steps
    assert counters["pushes_sent"] == 68 and counters["pushes_skipped"] == 0
    monkeypatch.setattr(pushes, "unary_payload_bytes", lambda: 1 << 20)  # a smaller cap: the prompt is over it
    sent.clear()
    counters = asyncio.run(scenario())
    assert max(sent) < 1 << 20 and counters["pushes_skipped"] == 3  # the 3,000 and the 1,500s: over 1 MiB


def test_a_client_whose_chain_names_a_stalling_server_fills_only_its_own_push_slots(monkeypatch):
    """Two clients: one's steps name a next server that never answers, the other's a live one. The first holds at
    most its share of the slots (it held all 64, and 90% of everyone else's pushes were skipped), its push waits a
    few measured round trips, not 10 s, and then the stalling server gets none of that client's pushes; the other
    client's pushes all go (and it may still push to the stalling one: that is its own to find out)."""
    stalling = PeerID.from_base58("QmNnooDu7bfjPFoTZYxMNLWUQJyrVwtbZg5gBMjTezGAJN")
    timeouts, answered = [], []

    class Stub:
        def __init__(self, peer):
            self.peer = peer

        async def rpc_push(self, message, timeout):
            timeouts.append((self.peer, timeout))
            if self.peer == stalling:
                await asyncio.wait_for(asyncio.Event().wait(), timeout)
            answered.append(self.peer)
            return reply(metadata={"results": [{}]})

    monkeypatch.setattr(BlockRPC, "get_stub", classmethod(lambda cls, p2p, peer: Stub(peer)))
    monkeypatch.setattr(pushes, "MIN_PUSH_TIMEOUT", 0.05)

    async def scenario():
        pusher = pushes.Pusher(dict.fromkeys(COUNTERS, 0), Announcing())
        for _ in range(3):  # measured by earlier pushes (or pings): a round trip of 1 ms
            pusher.round_trips.add(stalling.to_base58(), 0.001)
        for _ in range(pushes.PUSHES_IN_FLIGHT):
            pusher.push([(stalling, 2, ENTRY, torch.zeros(1, 1, 8))], "hostile")
        skipped_of_hostile = pusher.counters["pushes_skipped"]
        for _ in range(10):
            pusher.push([(PEER, 2, ENTRY, torch.zeros(1, 1, 8))], "honest")
        skipped_of_honest = pusher.counters["pushes_skipped"] - skipped_of_hostile
        await asyncio.gather(*pusher.tasks)
        pusher.push([(stalling, 2, ENTRY, torch.zeros(1, 1, 8))], "hostile")  # it stalled: dropped
        dropped = len(pusher.tasks) == 0
        pusher.push([(stalling, 2, ENTRY, torch.zeros(1, 1, 8))], "honest")  # not dropped for another client
        sent_for_honest = len(pusher.tasks) == 1
        for task in pusher.tasks:
            task.cancel()
        return skipped_of_hostile, skipped_of_honest, dropped, sent_for_honest, pusher.counters

    skipped_of_hostile, skipped_of_honest, dropped, sent_for_honest, counters = asyncio.run(scenario())
    assert skipped_of_hostile == pushes.PUSHES_IN_FLIGHT - pushes.PUSHES_PER_CLIENT and skipped_of_honest == 0
    assert answered.count(PEER) == 10 and dropped and sent_for_honest
    assert {timeout for peer, timeout in timeouts if peer == stalling} == {0.05}  # 10 round trips, at least 0.05 s
    to_live = [timeout for peer, timeout in timeouts if peer == PEER]
    assert to_live[0] == pushes.PUSH_TIMEOUT and set(to_live[1:]) == {0.05}  # none measured yet, then measured
    assert counters["pushes_failed"] == pushes.PUSHES_PER_CLIENT

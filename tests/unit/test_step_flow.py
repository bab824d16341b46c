"""The block server's rpc_steps handler (swarm/server/handler.py) against a peer that sends and never reads, and
against oversized messages: it reads a peer's messages only while the peer has messages in flight to spare
(so that its replies never pile up on the server), gives those back when a stream ends however it ends, caps
a peer's step streams, and refuses an oversized message before decoding any of its tensors. The handler is
the real one; the backend and the transport are stand-ins (a transport that never sends a reply is one whose
peer does not read)."""

import asyncio
from types import SimpleNamespace

import pytest
import torch
from hivemind.compression import serialize_torch_tensor

from swarm import wire
from swarm.protocol import error_from_wire
from swarm.server.handler import BlockHandler
from swarm.server.settings import ServerLimits
from swarm.wire import pack, unpack

HIDDEN, SESSIONS_PER_PEER, REQUEST_TOKENS = 8, 4, 64
MESSAGES = 2000


class Session:
    """A session of peer QmPeer whose steps return their inputs."""

    peer_id, end, batch_size = "QmPeer", 2, 1


async def run_steps(items: list) -> list:
    """The backend's: each step's outputs are its inputs."""
    return [hidden for _, hidden, _ in items]


def handler() -> BlockHandler:
    limits = ServerLimits(max_sessions_per_peer=SESSIONS_PER_PEER, max_request_tokens=REQUEST_TOKENS)
    backend = SimpleNamespace(limits=limits, hidden_size=HIDDEN, sessions=SimpleNamespace(by_id={"mine": Session()}),
                              run_steps=run_steps)
    return BlockHandler(backend)


def context(peer: str = "QmPeer"):
    return SimpleNamespace(remote_id=SimpleNamespace(to_base58=lambda: peer))


class Requests:
    """A peer's side of one stream: `count` messages of steps of no session, as fast as the server reads them."""

    def __init__(self, count: int = MESSAGES, then_wait: bool = False):
        self.count, self.read, self.then_wait = count, 0, then_wait

    async def __aiter__(self):
        for index in range(self.count):
            self.read += 1
            yield pack(metadata={"message_id": index, "steps": []})
        if self.then_wait:  # the stream stays open
            await asyncio.Event().wait()


async def run_loop(turns: int = 3000) -> None:
    """Everything the event loop has to do, done: the stand-ins do no I/O."""
    for _ in range(turns):
        await asyncio.sleep(0)


def test_a_peer_that_never_reads_its_replies_stops_being_read():
    async def scenario():
        server, requests = handler(), Requests()
        replies = server.rpc_steps(requests.__aiter__(), context())
        first = unpack(await anext(replies))[1]  # the transport sends one reply, then the peer reads no more
        await run_loop()
        return server, requests.read, first

    server, read, first = asyncio.run(scenario())
    assert first["message_id"] == 0
    # before: the server read all 2,000 messages and queued their replies
    assert read <= server.flow.messages_per_peer + 1 < MESSAGES


def test_a_stream_whose_replies_go_unread_too_long_is_ended_and_read_to_its_end(monkeypatch):
    from swarm.server import handler as handler_module

    monkeypatch.setattr(handler_module, "STALLED_STREAM_SECONDS", 0.05)

    async def scenario():
        server, requests = handler(), Requests()
        replies = server.rpc_steps(requests.__aiter__(), context())
        await anext(replies)
        await asyncio.sleep(0.3)  # the peer reads nothing meanwhile
        rest = [unpack(reply)[1] async for reply in replies]  # then reads what is left: the stream has ended
        return server, requests.read, rest

    server, read, rest = asyncio.run(scenario())
    assert read == MESSAGES  # read to its end, unanswered: the end of a hung-up peer's stream is seen
    assert [metadata["message_id"] for metadata in rest[:-1]] == list(range(1, len(rest)))
    assert len(rest) <= server.flow.messages_per_peer + 1
    assert "read none of its replies" in str(error_from_wire(rest[-1])) and rest[-1].get("message_id") is None
    assert server.flow.in_flight() == 0 and not server.flow._peers


def test_a_peers_streams_share_its_slots_and_an_ended_stream_gives_them_back():
    async def scenario():
        server = handler()
        stalled, other = Requests(), Requests()
        stalled_replies = server.rpc_steps(stalled.__aiter__(), context())
        await anext(stalled_replies)
        await run_loop()
        other_replies = server.rpc_steps(other.__aiter__(), context())
        waiting = asyncio.ensure_future(anext(other_replies))
        await run_loop()
        held = (stalled.read, other.read, waiting.done())
        await stalled_replies.aclose()  # the stalled stream ends with its replies unsent: its slots come back
        answered = [unpack(await waiting)[1]] + [unpack(await anext(other_replies))[1] for _ in range(100)]
        await other_replies.aclose()
        return server, held, answered

    server, (stalled_read, other_read, answered_early), answered = asyncio.run(scenario())
    assert stalled_read + other_read <= server.flow.messages_per_peer + 2 and not answered_early
    assert [metadata["message_id"] for metadata in answered] == list(range(101))
    assert server.flow.in_flight() == 0 and not server.flow._peers


def test_a_peers_new_stream_past_a_few_ends_its_oldest():
    """libp2p does not always tell the server that a peer hung up: the peer's newest streams are kept."""
    from swarm.server.flow import STREAMS_PER_PEER

    async def scenario():
        server = handler()
        streams = [server.rpc_steps(Requests(1, then_wait=True).__aiter__(), context())
                   for _ in range(STREAMS_PER_PEER)]
        for replies in streams:
            await anext(replies)
        newest_replies = server.rpc_steps(Requests(1, then_wait=True).__aiter__(), context())
        newest = unpack(await anext(newest_replies))[1]
        oldest_ended = [reply async for reply in streams[0]] == []
        others_open = [asyncio.ensure_future(anext(replies)) for replies in streams[1:]]
        await run_loop(100)
        other_peer = unpack(await anext(server.rpc_steps(Requests().__aiter__(), context("QmOther"))))[1]
        open_streams = len(server.flow._peers["QmPeer"].streams)
        for task in others_open:
            task.cancel()
        return newest, oldest_ended, [task.done() for task in others_open], open_streams, other_peer

    newest, oldest_ended, others_done, open_streams, other_peer = asyncio.run(scenario())
    assert error_from_wire(newest) is None and oldest_ended
    assert others_done == [False] * (STREAMS_PER_PEER - 1) and open_streams == STREAMS_PER_PEER
    assert error_from_wire(other_peer) is None


def hidden(rows: int = 1, positions: int = 1) -> torch.Tensor:
    return torch.randn(rows, positions, HIDDEN)


def steps(count: int) -> list:
    return [{"session_id": f"s{index}", "position": 0} for index in range(count)]


@pytest.mark.parametrize("tensors, entries, refusal", [
    ((hidden(),) * (SESSIONS_PER_PEER + 1), steps(SESSIONS_PER_PEER + 1), "5 tensors is over this server's limit of 4"),
    ((hidden(1, REQUEST_TOKENS + 1),), steps(1), "65 tokens is over this server's limit of 64"),
    ((hidden(2, 40), hidden(1, 40)), steps(2), "120 tokens is over this server's limit of 64"),
])
def test_an_oversized_message_is_refused_before_any_tensor_is_decoded(monkeypatch, tensors, entries, refusal):
    decoded = []
    monkeypatch.setattr(wire, "deserialize_torch_tensor", lambda tensor: decoded.append(tensor))
    request = pack(tensors, {"message_id": 7, "steps": entries})
    metadata = unpack(asyncio.run(handler()._reply_to_step_message(request, "QmPeer")))[1]
    assert metadata["message_id"] == 7 and refusal in str(error_from_wire(metadata))
    assert decoded == []


def test_oversized_metadata_is_refused_undecoded(monkeypatch):
    from hivemind.utils import MSGPackSerializer

    decoded = []
    monkeypatch.setattr(MSGPackSerializer, "loads", lambda data: decoded.append(data))
    request = pack(metadata={"message_id": 1, "steps": [], "padding": "x" * 10_000})
    reply = asyncio.run(handler()._reply_to_step_message(request, "QmPeer"))
    monkeypatch.undo()
    metadata = unpack(reply)[1]
    assert "metadata of" in str(error_from_wire(metadata)) and decoded == []


def test_a_misshapen_tensor_is_refused_undecoded(monkeypatch):
    """A message's one tensor of the wrong width refuses each of its steps, and a tensor that declares more
    tokens than a request may carry refuses the message, both before a byte of it is decoded."""
    from hivemind.proto import runtime_pb2

    real, decoded = wire.deserialize_torch_tensor, []
    monkeypatch.setattr(wire, "deserialize_torch_tensor", lambda tensor: decoded.append(tensor) or real(tensor))
    wrong_width = serialize_torch_tensor(torch.randn(1, 2, HIDDEN + 1))
    entries = [{"session_id": "mine", "position": 0, "rows": 1, "length": 1}] * 2
    request = runtime_pb2.ExpertRequest(tensors=[wrong_width],
                                        metadata=pack(metadata={"message_id": 3, "steps": entries}).metadata)
    tensors, metadata = unpack(asyncio.run(handler()._reply_to_step_message(request, "QmPeer")))
    codes = [getattr(error_from_wire(result), "code", "ok") for result in metadata["results"]]
    assert codes == ["bad_request", "bad_request"] and tensors == [] and decoded == []
    assert "got (1, 2, 9)" in str(error_from_wire(metadata["results"][0]))
    lying = serialize_torch_tensor(hidden())
    lying.size[:] = [1, 1_000_000, HIDDEN]  # declares far more than it carries (and than a request may)
    request = runtime_pb2.ExpertRequest(tensors=[lying], metadata=request.metadata)
    metadata = unpack(asyncio.run(handler()._reply_to_step_message(request, "QmPeer")))[1]
    assert "1000000 tokens is over" in str(error_from_wire(metadata)) and decoded == []


def test_a_big_message_is_decoded_off_the_event_loop(monkeypatch):
    import threading

    from swarm.server import handler as handler_module

    real, threads = wire.deserialize_torch_tensor, []
    monkeypatch.setattr(wire, "deserialize_torch_tensor",
                        lambda tensor: threads.append(threading.current_thread()) or real(tensor))
    monkeypatch.setattr(handler_module, "UNPACK_OFF_LOOP_BYTES", 10 * HIDDEN * 4)
    for positions in (10, 11):  # at the bound, then past it
        entries = [{"session_id": "mine", "position": 0, "rows": 1, "length": positions}]
        reply = asyncio.run(handler()._reply_to_step_message(pack((hidden(1, positions),),
                                                                  {"message_id": 1, "steps": entries}), "QmPeer"))
        assert unpack(reply)[0][0].shape == (1, positions, HIDDEN)
    assert threads[0] is threading.main_thread() and threads[2] is not threading.main_thread()

"""swarm/transport.py: a small message goes to the libp2p daemon in one socket write, the same bytes
hivemind's own framing writes in several."""

import asyncio

import pytest
from hivemind.p2p import p2p_daemon
from hivemind.p2p.p2p_daemon_bindings import control, utils
from hivemind.proto import p2pd_pb2, runtime_pb2

from swarm import transport


class Writer:
    """An asyncio StreamWriter's write and drain, kept."""

    def __init__(self):
        self.writes: list[bytes] = []

    def write(self, data) -> None:
        self.writes.append(bytes(data))

    async def drain(self) -> None:
        pass


def written(send, message) -> list[bytes]:
    writer = Writer()
    asyncio.run(send(message, writer))
    return writer.writes


@pytest.fixture
def patched(monkeypatch):
    """hivemind's framing writers before and after coalesce_small_writes (restored after the test; a node this
    process started already has them coalesced: hivemind's own are kept on them)."""
    monkeypatch.setattr(p2p_daemon.P2P, "send_protobuf", p2p_daemon.P2P.__dict__["send_protobuf"])
    monkeypatch.setattr(control, "write_pbmsg", control.write_pbmsg)
    before = getattr(p2p_daemon.P2P.send_protobuf, "hiveminds", None)
    if before is not None:  # put hivemind's own back, to be coalesced again here
        p2p_daemon.P2P.send_protobuf, control.write_pbmsg = staticmethod(before[0]), before[1]
    before = (p2p_daemon.P2P.send_protobuf, control.write_pbmsg)
    transport.coalesce_small_writes()
    transport.coalesce_small_writes()  # idempotent: not wrapped twice
    return before, (p2p_daemon.P2P.send_protobuf, control.write_pbmsg)


@pytest.mark.parametrize("size", [0, 100, 70_000], ids=["empty", "small", "over the limit"])
def test_a_stream_message_is_the_same_bytes_in_one_write(patched, size):
    (send_before, _), (send_after, _) = patched
    message = runtime_pb2.ExpertResponse(metadata=b"x" * size)
    for protobuf in (message, p2p_daemon.RPCError(message="refused"), p2p_daemon.P2P.END_OF_STREAM):
        old, new = written(send_before, protobuf), written(send_after, protobuf)
        assert b"".join(new) == b"".join(old) and len(old) >= 2  # marker, length, body (if any)
        small = len(protobuf.SerializeToString()) <= transport.COALESCE_BYTES
        assert len(new) == (1 if small else len(old))


@pytest.mark.parametrize("size", [1, 300, 20_000, 70_000])
def test_a_unary_message_is_the_same_bytes_in_one_write(patched, size):
    (_, write_before), (_, write_after) = patched
    message = p2pd_pb2.PersistentConnectionRequest(callId=b"\x07" * 16, callUnary=p2pd_pb2.CallUnaryRequest(
        peer=b"\x12" * 34, proto="BlockService.rpc_push", data=b"y" * size))
    old, new = (written(lambda pbmsg, writer: write(writer, pbmsg), message) for write in (write_before, write_after))
    assert b"".join(new) == b"".join(old) and len(old) >= 2  # each byte of the varint length, then the body
    assert len(new) == (1 if size <= transport.COALESCE_BYTES else len(old))


def test_varints_as_hivemind_writes_them():
    for integer in (0, 1, 127, 128, 300, 0x3FFF, 0x4000, 1 << 20, (1 << 35) + 5):
        assert transport.varint(integer) == b"".join(written(
            lambda value, writer: utils.write_unsigned_varint(writer, value), integer))

"""hivemind's framing of a small message written to the libp2p daemon in one socket write: the same bytes on the
wire, in one piece.

hivemind writes a stream message (an rpc_steps reply) as three writes: its 1-byte marker, its 8-byte length, its
body; and a unary message (an rpc_push call, a push's reply) as one write per byte of its varint length, each
followed by a drain, then its body. An asyncio socket transport with nothing buffered sends each write at once:
each is a syscall here and a read for the daemon. Profiled on a block server stepping one session of the tiny
model (py-spy, bench.engine --sessions 1), socket writes were 11-16% of the server's samples, for four messages
a token. `coalesce_small_writes` makes each small message one write (a message over COALESCE_BYTES keeps
hivemind's own path: joining would copy its body once more); applied once per process, a block server's and a
client's alike, before its node starts (swarm/dht.py's start_node).
"""

from __future__ import annotations

COALESCE_BYTES = 1 << 16  # messages up to this size go in one write; a step message of a few sessions is ~1-30 KB


def varint(integer: int) -> bytes:
    """An unsigned varint as hivemind's write_unsigned_varint writes it (7 bits a byte, low bits first)."""
    if integer < 0x4000:  # a message of up to 16 KiB: one or two bytes, without the loop
        return bytes((integer,)) if integer < 0x80 else bytes((integer & 0x7F | 0x80, integer >> 7))
    out = bytearray()
    while True:
        value, integer = integer & 0x7F, integer >> 7
        out.append(value | 0x80 if integer else value)
        if not integer:
            return bytes(out)


def coalesce_small_writes() -> None:
    """Replace hivemind's two framing writers with ones that write a small message in one piece (idempotent)."""
    from hivemind.p2p import p2p_daemon
    from hivemind.p2p.p2p_daemon_bindings import control

    peer = p2p_daemon.P2P
    if getattr(peer.send_protobuf, "coalesced", False):
        return
    send_protobuf, write_pbmsg = peer.send_protobuf, control.write_pbmsg

    async def send_protobuf_in_one_write(protobuf, writer) -> None:
        data = protobuf.SerializeToString()
        if len(data) > COALESCE_BYTES:
            return await send_protobuf(protobuf, writer)
        marker = peer.ERROR_MARKER if isinstance(protobuf, p2p_daemon.RPCError) else peer.MESSAGE_MARKER
        writer.write(b"".join((marker, len(data).to_bytes(peer.HEADER_LEN, peer.BYTEORDER), data)))
        await writer.drain()

    async def write_pbmsg_in_one_write(stream, pbmsg) -> None:
        data = pbmsg.SerializeToString()
        if len(data) > COALESCE_BYTES:
            return await write_pbmsg(stream, pbmsg)
        stream.write(varint(len(data)) + data)
        await stream.drain()

    send_protobuf_in_one_write.coalesced = True
    send_protobuf_in_one_write.hiveminds = (send_protobuf, write_pbmsg)  # hivemind's own, for the tests to compare
    peer.send_protobuf = staticmethod(send_protobuf_in_one_write)
    control.write_pbmsg = write_pbmsg_in_one_write

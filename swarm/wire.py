"""The block servers' wire: the RPC interface both sides speak, and tensors in messages.

Messages are hivemind's ExpertRequest/ExpertResponse over libp2p: tensors plus msgpack metadata.

    rpc_info       {} -> {start, end, dtype, device, cache_tokens_free, positions_served, steps_pushed, version,
                         loaded_names, step_messages, steps_received, push_messages, pushes_sent, pushes_failed,
                         pushes_skipped, step_messages_in_flight}
    rpc_forward    [hidden] {start, end} -> [hidden]                   cache-less sequences
    rpc_forward_stream  the same, for sequences too large for one unary message (hivemind's stop at 4 MiB):
                   request and reply each travel as messages of one part of the tensor (split_parts), the
                   first carrying the metadata; a refusal is one message with the error
    rpc_inference  a stream per session: {start, end, max_length, batch_size, session_id?} -> {ok}; it carries
                   nothing more (any other message is refused), and closing it ends the session and frees its
                   cache; the server ending it means it closed the session
    rpc_steps      a stream, one per (client, server), that steps the client's open sessions (opened by
                   rpc_inference): each request carries the steps of several sessions, each reply answers one
                   request (replies may come out of order: message_id pairs them)
                     request  [hidden (1, tokens, hidden): the steps' hidden states stacked, each (rows, length)
                              flattened] {message_id, steps: [{session_id, position, rows, length, step_id?,
                              push_to?: {peer_id, session_id}}, ... n]}
                     reply    [the outputs of the steps that succeeded, stacked likewise] {message_id, results:
                              [{} or {error}, ... n], timings: {decode, queue, compute, reply, total}: seconds
                              the message spent on the server (swarm/server/timings.py)}; a request that is no
                              list of steps: {message_id?, error}
                   a session is stepped only by the peer that opened it, one step at a time (else the step
                   is refused); one step's error leaves the others of its message as they were. A message of
                   more tensors than the server's sessions per peer, or more tokens in all than one request may
                   carry, is refused whole before any tensor is decoded (check_hidden_sizes); a peer's messages
                   are read only while it has few enough unanswered (see swarm/server/flow.py)
    rpc_push       [hidden, stacked] {pushes: [{session_id, step_id, position, rows, length}, ... n]} -> {results:
                   [{} or {error}, ... n]}: steps' inputs, pushed by the previous server of their chains (named by
                   the clients in push_to, if that peer announces the next block) as soon as it has them, so
                   that the next server starts before the clients' copies of the same inputs arrive; one
                   message per next server, however many steps

A refused request is answered with {"error": {code, message}} (see protocol.error_to_wire), never by a
broken stream, so the client can raise the same SwarmError the server raised. The server implements
BlockRPC (swarm/server/handler.py); clients call it through BlockRPC.get_stub (swarm/client/stubs.py).
"""

from __future__ import annotations

import functools
import hashlib
from typing import AsyncIterator, Callable, Optional

import torch
from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.p2p import P2PContext, ServicerBase
from hivemind.proto import runtime_pb2
from hivemind.utils import MSGPackSerializer
from hivemind.utils.streaming import split_for_streaming

from swarm.protocol import BadRequestError, SwarmError, error_from_wire

# hivemind widens bfloat16 to float32 on the wire; its bits travel as int16 instead, named under this key
BFLOAT16_KEY = "bfloat16_tensors"
# bytes per value of what hidden states travel as, by hivemind's dtype names (bfloat16 goes as int16, see pack;
# hivemind's own bfloat16 goes as float32)
HIDDEN_BYTES = {"float32": 4, "float16": 2, "int16": 2, "bfloat16": 4}
WIDEST_HIDDEN_BYTES = max(HIDDEN_BYTES.values())


ENVELOPE_BYTES = 64 << 10  # a unary call's metadata and the daemon's envelope around it, with room to spare


@functools.cache  # asked for every step a client sends
def unary_payload_bytes() -> int:
    """The most tensor bytes one unary call (rpc_push, rpc_forward) may carry: hivemind's P2P daemon refuses a
    call over its connection's message size ("Message size exceeds set limit"), which hivemind sets to this
    default unless told otherwise (nothing here does); streams (rpc_steps, rpc_forward_stream) have no such cap."""
    from hivemind.p2p.p2p_daemon_bindings.control import DEFAULT_MAX_MSG_SIZE

    return DEFAULT_MAX_MSG_SIZE - ENVELOPE_BYTES


def step_message_bytes() -> int:
    """The most tensor bytes one message of steps (rpc_steps), or its reply, may carry: a unary call's, as pushes
    (the outputs of the same steps). A client splits a longer step (a long prompt) into steps of the same session
    under it (swarm/client/step_channel.py), and a server refuses a message over it before decoding it."""
    return unary_payload_bytes()


def tensor_bytes(message) -> int:
    """The bytes of a message's tensors, as its protobuf carries them."""
    return sum(len(tensor.buffer) for tensor in message.tensors)


def pack(tensors: tuple[torch.Tensor, ...] = (), metadata: Optional[dict | Callable[[], dict]] = None,
         request: bool = True):
    """A message of `tensors` and `metadata`; metadata given as a function is made once the tensors are
    serialized (a reply that says how long it took to build, see swarm/server/timings.py)."""
    message = runtime_pb2.ExpertRequest() if request else runtime_pb2.ExpertResponse()
    bfloat16 = [index for index, tensor in enumerate(tensors) if tensor.dtype == torch.bfloat16]
    if bfloat16:
        tensors = tuple(tensor.view(torch.int16) if index in bfloat16 else tensor for index, tensor in enumerate(tensors))
    message.tensors.extend(serialize_torch_tensor(tensor) for tensor in tensors)
    metadata = metadata() if callable(metadata) else metadata
    if bfloat16:
        metadata = {**(metadata or {}), BFLOAT16_KEY: bfloat16}
    message.metadata = MSGPackSerializer.dumps(metadata or {})
    return message


def unpack(message, refuse: Optional[Callable[[runtime_pb2.Tensor], Optional[SwarmError]]] = None
           ) -> tuple[list, dict]:
    """A message's tensors and metadata. With `refuse`, a tensor it refuses (by what its protobuf declares) is
    never decoded: the error stands in its place in the list."""
    metadata = unpack_metadata(message)
    # peers send tensors as they are: hivemind's compressed formats would only widen what a stranger can reach
    if any(tensor.compression != runtime_pb2.CompressionType.NONE for tensor in message.tensors):
        raise BadRequestError("tensors must travel uncompressed")
    try:
        tensors = [_refused_or_decoded(tensor, refuse) for tensor in message.tensors]
    except Exception as error:  # any garbage in a stranger's message
        raise BadRequestError(f"undecodable message: {error}") from None
    named = metadata.pop(BFLOAT16_KEY, None) or []
    for index in named if isinstance(named, list) else [named]:
        if isinstance(index, int) and 0 <= index < len(tensors) and isinstance(tensors[index], SwarmError):
            continue  # refused already
        if not isinstance(index, int) or not 0 <= index < len(tensors) or tensors[index].dtype != torch.int16:
            raise BadRequestError(f"{BFLOAT16_KEY} must name int16 tensors of the message, got {index!r:.40}")
        tensors[index] = tensors[index].view(torch.bfloat16)
    return tensors, metadata


def _refused_or_decoded(tensor: runtime_pb2.Tensor, refuse):
    refusal = refuse(tensor) if refuse is not None else None
    return refusal if refusal is not None else deserialize_torch_tensor(tensor)


def unpack_metadata(message, max_bytes: Optional[int] = None) -> dict:
    """A message's metadata alone (a map), refused undecoded if over `max_bytes`."""
    if max_bytes is not None and len(message.metadata) > max_bytes:
        raise BadRequestError(f"a message's metadata of {len(message.metadata)} bytes is over this server's limit "
                              f"of {max_bytes} bytes")
    try:
        metadata = MSGPackSerializer.loads(message.metadata) if message.metadata else {}
    except Exception as error:  # any garbage in a stranger's message
        raise BadRequestError(f"undecodable message: {error}") from None
    if not isinstance(metadata, dict):
        raise BadRequestError("message metadata must be a map")
    return metadata


def check_hidden_sizes(message, max_tensors: int, max_tokens: int, hidden_size: int) -> None:
    """Refuse a message of hidden states bigger than the limits, from what its protobuf declares (the number of
    tensors, their shapes and byte sizes) before any tensor is decoded: an oversized message costs the server
    no more than reading it. A tensor of the wrong shape is left to `misshapen_hidden`, for its step alone."""
    if len(message.tensors) > max_tensors:
        raise BadRequestError(f"a message of {len(message.tensors)} tensors is over this server's limit of "
                              f"{max_tensors}")
    tokens = sum(_declared_tokens(tensor, hidden_size) for tensor in message.tensors)
    if tokens > max_tokens:
        raise BadRequestError(f"a message of {tokens} tokens is over this server's limit of {max_tokens} tokens per "
                              f"request")
    size = sum(len(tensor.buffer) for tensor in message.tensors)
    if size > max_tokens * hidden_size * WIDEST_HIDDEN_BYTES:
        raise BadRequestError(f"a message of {size} bytes of tensors is over this server's limit of {max_tokens} "
                              f"tokens per request")


def misshapen_hidden(tensor: runtime_pb2.Tensor, hidden_size: int) -> Optional[BadRequestError]:
    """The refusal of a tensor that cannot be hidden states of this size, from its protobuf alone; else None."""
    shape = tuple(tensor.size)
    if _declared_tokens(tensor, hidden_size) == 0:
        return BadRequestError(f"hidden states must have shape (batch, length >= 1, {hidden_size}), got "
                               f"{shape!r:.80}")
    if tensor.dtype not in HIDDEN_BYTES:
        return BadRequestError(f"hidden states must be floating point (float32, bfloat16, float16), got "
                               f"{tensor.dtype!r:.40}")
    expected = shape[0] * shape[1] * hidden_size * HIDDEN_BYTES[tensor.dtype]
    if len(tensor.buffer) != expected:
        return BadRequestError(f"a tensor of shape {shape} and dtype {tensor.dtype} carries {len(tensor.buffer)} "
                               f"bytes, not {expected}")
    return None


def _declared_tokens(tensor: runtime_pb2.Tensor, hidden_size: int) -> int:
    """rows x positions of a tensor of hidden states as its protobuf declares them; 0 for any other shape."""
    shape = tuple(tensor.size)
    if len(shape) != 3 or shape[2] != hidden_size or min(shape) < 1:
        return 0
    return shape[0] * shape[1]


def stacked(steps: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """Steps' hidden states (rows, length, hidden each) as a message carries them: one tensor (1, tokens,
    hidden), decoded and checked once whatever the number of steps (none: no tensor)."""
    if not steps:
        return ()
    if all(step.shape[0] == 1 for step in steps):  # one call, not one reshape per step: a 64-step message's reply
        return (torch.cat(steps, dim=1),)
    return (torch.cat([step.reshape(-1, step.shape[-1]) for step in steps])[None],)


def step_shape(step: torch.Tensor) -> dict:
    """What a message's entry says of its step's part of the stacked tensor."""
    return {"rows": step.shape[0], "length": step.shape[1]}


def unstacked(tensors: list, entries: list) -> list:
    """A message's stacked tensor back into its steps (rows, length, hidden), by each entry's 'rows' and
    'length': views, no copy. A tensor refused undecoded stands for every step; a message whose entries do not
    add up to its tensor is refused whole (BadRequestError), since which tokens are whose is unknown."""
    shapes = [(entry.get("rows"), entry.get("length")) if isinstance(entry, dict) else (None, None)
              for entry in entries]
    if not all(_is_int(rows) and _is_int(length) and rows >= 1 and length >= 1 for rows, length in shapes):
        raise BadRequestError("each step must say its 'rows' and 'length' (integers >= 1)")
    if len(tensors) != (1 if entries else 0):
        raise BadRequestError(f"a message of {len(entries)} steps carries {len(tensors)} tensors, not one")
    if not entries:
        return []
    whole = tensors[0]
    if isinstance(whole, SwarmError):
        return [whole] * len(entries)
    if whole.shape[1] != sum(rows * length for rows, length in shapes):
        raise BadRequestError(f"the steps' rows x length add up to {sum(r * n for r, n in shapes)} tokens, but "
                              f"the message carries {whole.shape[1]}")
    if all(rows == 1 for rows, _ in shapes):  # one split, not two tensor calls per step
        return list(whole.split([length for _, length in shapes], dim=1))
    steps, offset = [], 0
    for rows, length in shapes:
        steps.append(whole[0, offset : offset + rows * length].view(rows, length, whole.shape[-1]))
        offset += rows * length
    return steps


def _is_int(value) -> bool:
    return type(value) is int  # msgpack's true is a Python int too: a bool is no count of rows


def inputs_digest(hidden: torch.Tensor) -> str:
    """What a server answering a flowing step says its pushed inputs were (field 'pushed' of its result): the
    client compares it with the previous server's outputs, which a server could push otherwise than it returns."""
    data = hidden.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return hashlib.sha256(f"{hidden.dtype}{tuple(hidden.shape)}".encode() + data).hexdigest()[:32]


def reply(tensors: tuple[torch.Tensor, ...] = (), metadata: Optional[dict | Callable[[], dict]] = None):
    return pack(tensors, metadata, request=False)


class BlockRPC(ServicerBase):
    """The block server's RPC interface: hivemind builds the clients' stubs from these signatures, and the
    server's handler (a subclass) implements them."""

    SERVICE = "BlockService"  # the handlers' name on the wire, whatever class implements them

    @classmethod
    def _get_handle_name(cls, namespace: Optional[str], method_name: str) -> str:
        name = f"{cls.SERVICE}.{method_name}"
        return f"{namespace}::{name}" if namespace is not None else name

    async def rpc_info(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        raise NotImplementedError

    async def rpc_forward(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        raise NotImplementedError

    async def rpc_forward_stream(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        raise NotImplementedError
        yield  # an async generator, as the server's is

    async def rpc_push(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        raise NotImplementedError

    async def rpc_steps(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        raise NotImplementedError
        yield  # an async generator, as the server's is

    async def rpc_inference(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        raise NotImplementedError
        yield  # an async generator, as the server's is


def raise_if_error(metadata: dict) -> None:
    """The SwarmError a server answered with, raised on the client's side."""
    error = error_from_wire(metadata)
    if error is not None:
        raise error


# ------------------------------------------------------------------------------- messages in parts

PART_BYTES = 1 << 20  # a tensor's part per stream message (rpc_forward_stream)


def split_parts(message) -> list:
    """A message of at most one tensor as messages of one part of it each: the first carries the metadata."""
    kind = type(message)
    if not message.tensors:
        return [message]
    parts = split_for_streaming(message.tensors[0], PART_BYTES)
    first = kind(tensors=[next(parts)], metadata=message.metadata)
    return [first, *(kind(tensors=[part]) for part in parts)]


async def gather_parts(messages: AsyncIterator, max_elements: int, max_bytes: int):
    """split_parts' messages back into one, refused (BadRequestError) as soon as what they declare or carry
    is over `max_elements` tensor elements or `max_bytes`: nothing larger is ever held."""
    first = await anext(messages, None)
    if first is None or not first.tensors:
        return first
    if len(first.tensors) != 1:
        raise BadRequestError("each message of a streamed request carries one part of one tensor")
    head = first.tensors[0]
    elements = 1
    for size in head.size:
        elements *= max(size, 0)
    if elements > max_elements or min(head.size, default=0) < 0:
        raise BadRequestError(f"a streamed tensor of shape {tuple(head.size)} is over this server's limit of "
                              f"{max_elements} elements")
    if not 1 <= head.chunks <= max_bytes // PART_BYTES + 1:
        raise BadRequestError(f"a streamed tensor must come in 1 to {max_bytes // PART_BYTES + 1} parts")
    buffers, received = [head.buffer], len(head.buffer)
    while received <= max_bytes and len(buffers) < head.chunks:
        message = await anext(messages, None)
        if message is None or len(message.tensors) != 1:
            raise BadRequestError(f"a streamed tensor ended after {len(buffers)} of its {head.chunks} parts")
        buffers.append(message.tensors[0].buffer)
        received += len(buffers[-1])
    if received > max_bytes:
        raise BadRequestError(f"a streamed tensor is over this server's limit of {max_bytes} bytes")
    whole = runtime_pb2.Tensor()
    whole.CopyFrom(head)
    whole.buffer, whole.chunks = b"".join(buffers), 0
    return type(first)(tensors=[whole], metadata=first.metadata)

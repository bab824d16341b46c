"""Messages in parts (swarm/wire.py's split_parts and gather_parts): what rpc_forward_stream sends and reads,
round trip and the bounds a server reads a stranger's parts under."""

import asyncio

import pytest
import torch

from swarm.protocol import BadRequestError
from swarm.wire import PART_BYTES, gather_parts, pack, split_parts, unpack


async def _stream(messages):
    for message in messages:
        yield message


def gather(messages, max_elements=1 << 30, max_bytes=1 << 32):
    return asyncio.run(gather_parts(_stream(messages), max_elements, max_bytes))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_tensor_in_parts_comes_back_whole_with_its_metadata(dtype):
    hidden = torch.randn(2, 300, 1024).to(dtype)  # 2.4 MB in float32: three parts
    parts = split_parts(pack((hidden,), {"start": 1, "end": 3}))
    assert len(parts) == -(-hidden.numel() * hidden.element_size() // PART_BYTES) > 1
    assert all(len(part.tensors) == 1 for part in parts) and not parts[1].metadata
    tensors, metadata = unpack(gather(parts))
    assert metadata == {"start": 1, "end": 3} and tensors[0].dtype == dtype
    assert torch.equal(tensors[0], hidden)


def test_a_message_without_tensors_is_one_part():
    message = pack(metadata={"error": {"code": "bad_request", "message": "no"}})
    assert split_parts(message) == [message] and gather([message]) == message
    assert gather([]) is None


def test_a_declared_shape_over_the_limit_is_refused_at_the_first_part():
    parts = split_parts(pack((torch.zeros(4, 300, 1024),)))

    async def first_part_only():
        yield parts[0]
        raise AssertionError("read past the first part")

    with pytest.raises(BadRequestError, match="over this server's limit"):
        asyncio.run(gather_parts(first_part_only(), max_elements=4 * 300 * 1024 - 1, max_bytes=1 << 30))


def test_parts_carrying_more_bytes_than_allowed_are_refused():
    parts = split_parts(pack((torch.zeros(4, 300, 1024),)))  # 4.9 MB in five parts
    parts[0].tensors[0].size[:] = [1]  # declares one element
    with pytest.raises(BadRequestError, match="in 1 to 3 parts"):
        gather(parts, max_bytes=2 * PART_BYTES)
    parts[0].tensors[0].chunks = 2  # and two parts, then sends more bytes in them than the limit
    with pytest.raises(BadRequestError, match="limit of 1048676 bytes"):
        gather(parts, max_bytes=PART_BYTES + 100)


def test_a_stream_that_ends_before_its_last_part_is_refused():
    parts = split_parts(pack((torch.zeros(2, 300, 1024),)))
    with pytest.raises(BadRequestError, match="ended after 2 of its 3 parts"):
        gather(parts[:2])

import pytest

from swarm.protocol import (
    BadRequestError,
    CacheFullError,
    ServerInfo,
    ServerState,
    SwarmError,
    dht_prefix,
    error_from_wire,
    error_to_wire,
    format_block_ranges,
)


def test_server_info_round_trips():
    info = ServerInfo(ServerState.ONLINE, 0, 15, 12.5, 4096)
    assert ServerInfo.from_wire(info.to_wire()) == info


@pytest.mark.parametrize(
    "record",
    [None, "x", {}, {"state": 2, "start": 3, "end": 3, "throughput": 1, "cache_tokens_free": 0},
     {"state": 9, "start": 0, "end": 3, "throughput": 1, "cache_tokens_free": 0},
     {"state": 2, "start": "a", "end": 3, "throughput": 1, "cache_tokens_free": 0}],
)
def test_malformed_records_are_ignored(record):
    assert ServerInfo.from_wire(record) is None


def test_errors_cross_the_wire_with_their_type():
    error = error_from_wire(error_to_wire(CacheFullError("server cache is full")))
    assert type(error) is CacheFullError and str(error) == "server cache is full"
    assert type(error_from_wire({"error": {"code": "??", "message": "m"}})) is SwarmError
    assert error_from_wire({"ok": True}) is None


def test_names():
    assert dht_prefix("/tmp/models/My Model/") == "My-Model"
    assert dht_prefix("SmolLM2-135M-Instruct") == "SmolLM2-135M-Instruct"
    # a Hub id keeps its organization: the same name under two, or beside the known model, are different weights
    assert dht_prefix("HuggingFaceTB/SmolLM2-135M-Instruct") == "HuggingFaceTB--SmolLM2-135M-Instruct"
    assert dht_prefix("other-org/SmolLM2-135M-Instruct") == "other-org--SmolLM2-135M-Instruct"
    assert dht_prefix("org/name.v1") == "org--name-v1"
    assert format_block_ranges([(15, 30), (3, 4)]) == "15..29, 3"


def test_bfloat16_travels_as_its_16_bits_and_bad_names_are_refused():
    import torch

    from swarm.wire import BFLOAT16_KEY, pack, unpack

    hidden = torch.randn(2, 3, 576).to(torch.bfloat16)
    tensors, metadata = unpack(pack((hidden, torch.ones(2)), {"position": 4}))
    assert tensors[0].dtype == torch.bfloat16 and torch.equal(tensors[0], hidden)
    assert tensors[1].dtype == torch.float32 and metadata == {"position": 4}
    assert len(pack((hidden,)).SerializeToString()) < len(pack((hidden.float(),)).SerializeToString()) * 0.6

    for bad in (5, [1], ["x"], {"a": 1}):
        with pytest.raises(BadRequestError, match=BFLOAT16_KEY):
            unpack(pack((torch.ones(2),), {BFLOAT16_KEY: bad}))

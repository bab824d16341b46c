import pytest

from swarm.protocol import (
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
    assert format_block_ranges([(15, 30), (3, 4)]) == "15..29, 3"

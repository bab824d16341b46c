"""Open-swarm records: any peer may write one, so what a record says is parsed within bounds (or the record is
ignored), routing trusts what the client measured over what a server claims, and the longest session the
swarm can hold comes from the servers' max_session_tokens."""

import math

import pytest

from swarm.client.routing import ChainLink, choose_chain, longest_session, seconds_per_block
from swarm.protocol import (
    MAX_CACHE_TOKENS,
    MAX_THROUGHPUT,
    ModelRecord,
    RemoteServer,
    ServerInfo,
    ServerState,
)

HONEST = {"state": 2, "start": 0, "end": 4, "throughput": 50.0, "cache_tokens_free": 4096, "version": "0.3.0"}


def with_fields(**fields) -> dict:
    return {**HONEST, **fields}


@pytest.mark.parametrize("hostile", [
    *(with_fields(throughput=value) for value in (math.inf, -math.inf, math.nan, 1e300, MAX_THROUGHPUT * 2, -1.0,
                                                    "fast", None, True, [1.0])),
    with_fields(throughput=0.0),  # an online server has measured its speed
    *(with_fields(cache_tokens_free=value) for value in (-1, 1.5, math.inf, math.nan, MAX_CACHE_TOKENS + 1, 10**400,
                                                           "4096", None, True)),
    *(with_fields(start=start, end=end) for start, end in ((3, 2), (2, 2), (-1, 2), (0, 10**30), (0.0, 4), (0, 4.5))),
    with_fields(end=5),  # past the model's 4 blocks
    *(with_fields(version=value) for value in ("x" * 10_000, ["0.3.0"], 3)),
    *(with_fields(max_session_tokens=value) for value in (-5, 2.5, math.inf, "8192", MAX_CACHE_TOKENS + 1)),
    with_fields(state=7), with_fields(state="2"), {"state": 2}, [], "record", None, 42,
])
def test_hostile_records_are_ignored(hostile):
    assert ServerInfo.from_wire(hostile, num_blocks=4) is None


def test_sane_records_parse_and_old_ones_too():
    info = ServerInfo.from_wire(with_fields(max_session_tokens=8192), num_blocks=4)
    assert info == ServerInfo(ServerState.ONLINE, 0, 4, 50.0, 4096, "0.3.0", max_session_tokens=8192)
    assert ServerInfo.from_wire(info.to_wire()) == info
    old = ServerInfo.from_wire(HONEST)  # written by a server that predates max_session_tokens
    assert old.max_session_tokens is None and "max_session_tokens" not in old.to_wire()
    joining = with_fields(state=int(ServerState.JOINING), throughput=0.0)  # not measured yet: 0 is fine
    assert ServerInfo.from_wire(joining).throughput == 0.0
    at_bounds = with_fields(throughput=MAX_THROUGHPUT, cache_tokens_free=MAX_CACHE_TOKENS, max_session_tokens=0)
    assert ServerInfo.from_wire(at_bounds) is not None


@pytest.mark.parametrize("hostile", [
    {"name": "m", "prefix": "m", "num_blocks": math.inf, "source": "m"},
    {"name": "m", "prefix": "m", "num_blocks": 10**9, "source": "m"},
    {"name": "m", "prefix": "m", "num_blocks": 0, "source": "m"},
    {"name": "m" * 100_000, "prefix": "m", "num_blocks": 4, "source": "m"},
    {"name": ["m"], "prefix": "m", "num_blocks": 4, "source": "m"},
    {"name": "m", "prefix": "", "num_blocks": 4, "source": "m"},
    ["m", "m", 4, "m"], None,
])
def test_hostile_catalogue_entries_are_ignored(hostile):
    assert ModelRecord.from_wire(hostile) is None
    assert ModelRecord.from_wire({"name": "m", "prefix": "m", "num_blocks": 4, "source": "m"}) == ModelRecord("m", "m", 4, "m")


def server(peer_id, throughput, start=0, end=4, max_session_tokens=None, cache=4096):
    return RemoteServer(peer_id, ServerInfo(ServerState.ONLINE, start, end, throughput, cache,
                                            max_session_tokens=max_session_tokens))


def test_a_claimed_speed_never_outranks_a_measured_one():
    liar, honest = server("liar", MAX_THROUGHPUT), server("honest", 1000.0)  # the highest claim a record may make
    servers = [liar, honest]
    assert choose_chain(servers, 4, "m") == [ChainLink("liar", 0, 4)]  # nothing measured: claims are all there is
    # once both are measured, the liar's claim cannot make it faster than it was seen to be
    measured = {"liar": 0.050, "honest": 0.002}  # seconds per block of a decode step
    assert choose_chain(servers, 4, "m", measured=measured) == [ChainLink("honest", 0, 4)]
    assert seconds_per_block(servers, measured) == {"liar": 0.050, "honest": 0.002}
    # not measured yet, a claim is believed no further than the fastest server measured: no win on a claim alone
    speeds = seconds_per_block(servers, {"honest": 0.002})
    assert speeds["liar"] == speeds["honest"] == 0.002
    assert choose_chain(servers, 4, "m", measured={"honest": 0.002}) == [ChainLink("honest", 0, 4)]
    # until the measured one is busier: then the other is tried (and measured)
    assert choose_chain(servers, 4, "m", load={"honest": 2.0}, measured={"honest": 0.002}) == [ChainLink("liar", 0, 4)]


@pytest.mark.parametrize("claim", [math.nan, math.inf, 1e300, -5.0, 0.0])
def test_records_built_by_hand_with_absurd_speeds_do_not_win(claim):
    """Records from the DHT never carry these (they parse as None); a hand-built one must not win routing either."""
    absurd, honest = server("absurd", claim), server("honest", 100.0)
    chain = choose_chain([absurd, honest], 4, "m")
    if claim == 1e300:  # capped to the bound: a legal claim, beaten once measured
        assert choose_chain([absurd, honest], 4, "m", measured={"absurd": 0.05, "honest": 0.002}) == \
            [ChainLink("honest", 0, 4)]
    else:
        assert chain == [ChainLink("honest", 0, 4)]
    assert all(math.isfinite(seconds) and seconds > 0 for seconds in seconds_per_block([absurd, honest], {}).values())


def test_longest_session_is_the_best_server_of_the_weakest_block():
    servers = [server("a", 10.0, 0, 2, max_session_tokens=4096), server("b", 10.0, 0, 2, max_session_tokens=1024),
               server("c", 10.0, 2, 4, max_session_tokens=2048), server("d", 10.0, 1, 4, max_session_tokens=512)]
    assert longest_session(servers, 4) == 2048  # blocks 0..1: 4096 (a); blocks 2..3: 2048 (c)
    assert longest_session(servers[:2], 4) is None  # blocks 2..3 have no server
    assert longest_session([server("a", 10.0, 0, 4), *servers[2:]], 4) is None  # blocks 0: a record too old to say
    assert longest_session([server("old", 10.0, 0, 4), server("new", 10.0, 0, 4, max_session_tokens=8)], 4) == 8
    assert longest_session([], 4) is None

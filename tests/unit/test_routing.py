import pytest

from swarm.client.routing import DEFAULT_ROUND_TRIP, ChainLink, chain_step_seconds, choose_chain, speaks
from swarm.protocol import MissingBlocksError, RemoteServer, ServerInfo, ServerState, missing_ranges
from swarm.server.placement import choose_span


def server(peer_id, start, end, throughput=10.0):
    return RemoteServer(peer_id, ServerInfo(ServerState.ONLINE, start, end, throughput, 1000))


def test_a_hop_is_worth_its_round_trip_only_when_compute_saves_more():
    # a and b: 0.01 s per block (0.2 s in all); whole: 0.0125 s per block (0.25 s)
    servers = [server("a", 0, 10), server("b", 10, 20), server("whole", 0, 20, throughput=4.0)]
    far = {"a": 0.1, "b": 0.1, "whole": 0.1}  # the extra hop costs 0.1 s, compute saves 0.05 s
    assert choose_chain(servers, 20, "m", rtt=far) == [ChainLink("whole", 0, 20)]
    near = {"a": 0.01, "b": 0.01, "whole": 0.01}  # now the hop costs less than it saves
    assert choose_chain(servers, 20, "m", rtt=near) == [ChainLink("a", 0, 10), ChainLink("b", 10, 20)]
    for rtt in (far, near):  # what it chose is what chain_step_seconds rates best
        chosen = chain_step_seconds(choose_chain(servers, 20, "m", rtt=rtt), servers, rtt, {}, {})
        other = [ChainLink("whole", 0, 20)] if len(choose_chain(servers, 20, "m", rtt=rtt)) == 2 else \
            [ChainLink("a", 0, 10), ChainLink("b", 10, 20)]
        assert chosen < chain_step_seconds(other, servers, rtt, {}, {})


def test_fewest_hops_on_a_tie():
    servers = [server("a", 0, 10), server("b", 10, 20), server("whole", 0, 20, throughput=5.0)]
    assert choose_chain(servers, 20, "m", rtt={"a": 0.0, "b": 0.0, "whole": 0.0}) == [ChainLink("whole", 0, 20)]


def test_the_replica_with_the_shorter_round_trip_serves():
    servers = [server("near", 0, 10), server("far", 0, 10), server("tail", 10, 20)]
    rtt = {"near": 0.02, "far": 0.15, "tail": 0.05}
    assert choose_chain(servers, 20, "m", rtt=rtt)[0] == ChainLink("near", 0, 10)
    rtt = {"near": 0.15, "far": 0.02, "tail": 0.05}  # conditions changed: new sessions follow
    assert choose_chain(servers, 20, "m", rtt=rtt)[0] == ChainLink("far", 0, 10)
    # a server not measured yet counts as the median of those measured: neither preferred nor shunned
    assert chain_step_seconds([ChainLink("new", 0, 10)], [server("new", 0, 10), *servers], rtt, {}, {}) == \
        pytest.approx(0.05 + 10 * 0.01)
    assert chain_step_seconds([ChainLink("a", 0, 10)], [server("a", 0, 10)], {}, {}, {}) == \
        pytest.approx(DEFAULT_ROUND_TRIP + 10 * 0.01)


def test_measured_compute_and_load_count_per_block_and_round_trips_per_hop():
    servers = [server("a", 0, 10), server("b", 10, 20)]
    chain = [ChainLink("a", 0, 10), ChainLink("b", 10, 20)]
    seconds = chain_step_seconds(chain, servers, {"a": 0.05, "b": 0.07}, {"a": 0.02}, {"b": 2.0})
    # b claims 0.01 s per block, but counts as no faster than the fastest server measured (seconds_per_block)
    assert seconds == pytest.approx(0.05 + 10 * 0.02 + 0.07 + 10 * 0.02 * 2.0)
    assert chain_step_seconds([ChainLink("gone", 0, 20)], servers, {}, {}, {}) == float("inf")


def test_a_hop_may_leave_a_slow_server_before_its_end():
    servers = [server("slow", 0, 20, throughput=0.5), server("head", 0, 5, throughput=20.0),
               server("fast", 5, 20, throughput=20.0)]
    # slow: 0.1 s per block; head and fast: 0.01 and 0.0033 s per block. Entering fast at block 5 beats both
    # the one slow hop and head-then-slow
    rtt = {"slow": 0.01, "head": 0.01, "fast": 0.01}
    assert choose_chain(servers, 20, "m", rtt=rtt) == [ChainLink("head", 0, 5), ChainLink("fast", 5, 20)]
    slow_first = [server("slow", 0, 20, throughput=0.5), server("fast", 5, 20, throughput=20.0)]
    assert choose_chain(slow_first, 20, "m", rtt=rtt) == [ChainLink("slow", 0, 5), ChainLink("fast", 5, 20)]


def test_chain_breaks_ties_by_throughput():
    servers = [server("slow", 0, 10, 1.0), server("fast", 0, 10, 50.0), server("b", 10, 20)]
    assert choose_chain(servers, 20, "m") == [ChainLink("fast", 0, 10), ChainLink("b", 10, 20)]


def test_chain_enters_a_server_mid_span():
    servers = [server("a", 0, 12), server("b", 8, 20)]
    assert choose_chain(servers, 20, "m") == [ChainLink("a", 0, 12), ChainLink("b", 12, 20)]


def test_chain_skips_excluded_peers():
    servers = [server("a", 0, 20), server("b", 0, 20, throughput=1.0)]
    assert choose_chain(servers, 20, "m", exclude={"a"}) == [ChainLink("b", 0, 20)]


def test_missing_blocks_are_named():
    servers = [server("a", 0, 15)]
    with pytest.raises(MissingBlocksError, match=r"no server holds blocks 15\.\.29 of SmolLM"):
        choose_chain(servers, 30, "SmolLM")
    with pytest.raises(MissingBlocksError, match=r"blocks 0\.\.29 of m"):
        choose_chain([], 30, "m")


def test_missing_ranges():
    servers = [server("a", 2, 4), server("b", 6, 7)]
    assert missing_ranges(servers, 9) == [(0, 2), (4, 6), (7, 9)]
    assert missing_ranges([server("a", 0, 9)], 9) == []


def test_span_goes_where_the_swarm_is_thinnest():
    assert choose_span([server("a", 0, 15)], 30, 15) == (15, 30)
    assert choose_span([], 30, 10) == (0, 10)
    assert choose_span([server("a", 0, 10), server("b", 0, 20)], 30, 10) == (20, 30)
    assert choose_span([], 4, 99) == (0, 4)


def test_chain_may_stop_before_the_last_block():
    servers = [server("a", 0, 10), server("b", 10, 30)]
    assert choose_chain(servers, 15, "m") == [ChainLink("a", 0, 10), ChainLink("b", 10, 15)]
    assert choose_chain(servers, 5, "m") == [ChainLink("a", 0, 5)]


def test_chain_over_a_middle_range_for_failover():
    servers = [server("a", 0, 10), server("b", 5, 20), server("c", 10, 30)]
    assert choose_chain(servers, 20, "m", start=12) == [ChainLink("c", 12, 20)]  # a smaller share of its span
    assert choose_chain(servers, 20, "m", start=12, exclude={"c"}) == [ChainLink("b", 12, 20)]
    with pytest.raises(MissingBlocksError, match=r"blocks 12\.\.19"):
        choose_chain([server("a", 0, 10)], 20, "m", start=12)


def test_load_and_free_cache_steer_new_sessions():
    twins = [server("busy", 0, 10), server("idle", 0, 10)]
    assert choose_chain(twins, 10, "m", load={"busy": 3.0}) == [ChainLink("idle", 0, 10)]
    full = RemoteServer("full", ServerInfo(ServerState.ONLINE, 0, 10, 100.0, 5))
    assert choose_chain([full, server("roomy", 0, 10)], 10, "m", min_cache_tokens=64) == [ChainLink("roomy", 0, 10)]
    assert choose_chain([full], 10, "m", min_cache_tokens=64) == [ChainLink("full", 0, 10)]  # the only choice


def test_only_a_redundant_server_moves_and_only_toward_a_gap():
    from swarm.server.placement import span_to_move_to

    me, twin = server("b", 0, 2), server("a", 0, 2)
    assert span_to_move_to([twin], 4, me) == (2, 4)  # redundant, and blocks 2..3 have nobody
    assert span_to_move_to([server("c", 0, 2)], 4, me) is None  # the twin "c" > "b" moves first
    assert span_to_move_to([], 4, me) is None  # the only server of its blocks stays
    assert span_to_move_to([twin, server("c", 2, 4)], 4, me) is None  # balanced: stays
    crowded = [twin, server("x", 0, 2), server("y", 0, 2), server("z", 2, 4)]
    assert span_to_move_to(crowded, 4, server("zz", 0, 2)) == (2, 4)  # 3 others on its blocks vs 1 there
    assert span_to_move_to(crowded[:2] + crowded[3:], 4, server("zz", 0, 2)) is None  # 2 vs 1: within hysteresis



def test_a_client_speaks_only_its_own_protocol_line():
    assert speaks("0.6.0", "0.6.0") and speaks("0.6.3", "0.6.0") and speaks("0.6", "0.6.0")  # a patch: the same
    for other in ("0.5.0", "0.4.2", "0.7.0", "1.6.0", "", "six", "0.x.0", "0." + "9" * 100):
        assert not speaks(other, "0.6.0"), other

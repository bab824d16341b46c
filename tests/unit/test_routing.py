import pytest

from swarm.client.routing import ChainLink, choose_chain
from swarm.protocol import MissingBlocksError, RemoteServer, ServerInfo, ServerState, missing_ranges
from swarm.server.placement import choose_span


def server(peer_id, start, end, throughput=10.0):
    return RemoteServer(peer_id, ServerInfo(ServerState.ONLINE, start, end, throughput, 1000))


def test_chain_prefers_fewest_hops():
    servers = [server("a", 0, 10), server("b", 10, 20), server("whole", 0, 20, throughput=1.0)]
    assert choose_chain(servers, 20, "m") == [ChainLink("whole", 0, 20)]


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

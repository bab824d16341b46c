"""The client's own view of servers (swarm/client/peers.py), with the real classes: a step's time split into
the round trip and compute per block (the least of the last few steps, forgotten a while after the last), round trips the least of the last few, a restarted server's ban lifted (never a liar's) with its strikes kept,
and the record field that tells a restart."""

import time

import pytest

from swarm.client.peers import Bans, PeerLoad
from swarm.protocol import ServerInfo, ServerState


def test_a_steps_round_trip_is_not_counted_as_compute_per_block():
    load = PeerLoad()
    load.round_trip("far", 0.100)
    load.observed("far", 0.100 + 10 * 0.002, blocks=10)  # 100 ms of network, 2 ms per block of compute
    assert load.measured()["far"] == pytest.approx(0.002)
    load.observed("near", 0.030, blocks=10)  # not probed yet: the whole step counts, as before
    assert load.measured()["near"] == pytest.approx(0.003)
    load.observed("far", 0.050, blocks=10)  # faster than its round trip (the average lags): no negative compute
    assert load.measured()["far"] >= 0


def test_a_session_of_this_client_weighs_a_share_of_a_step_not_a_whole_one():
    """A server batches its sessions' steps in one round: a client's second session there does not double what
    routing expects a step to cost (the old factor, 1 + sessions, sent sessions down chains twice as long)."""
    from swarm.client.peers import SESSION_WEIGHT

    load = PeerLoad()
    load.opened("a")
    load.opened("a")
    load.opened("b")
    load.opened("b", -1)
    assert load.factors() == {"a": pytest.approx(1 + 2 * SESSION_WEIGHT), "b": 1.0}
    assert 1 + 16 * SESSION_WEIGHT < 3  # 16 sessions of one gateway on a server: well under 16x


def test_one_held_up_step_does_not_make_a_server_look_slow():
    from swarm.client.peers import COMPUTE_SAMPLES

    load = PeerLoad()
    load.observed("a", 0.010, blocks=10)
    load.observed("a", 1.0, blocks=10)  # held up once: a busy moment of a loaded machine
    assert load.measured()["a"] == pytest.approx(0.001)
    for _ in range(COMPUTE_SAMPLES - 2):  # slower steps, but the last few still hold a fast one
        load.observed("a", 0.050, blocks=10)
    assert load.measured()["a"] == pytest.approx(0.001)
    load.observed("a", 0.050, blocks=10)  # it really got slower: counted once all its last steps say so
    assert load.measured()["a"] == pytest.approx(0.005)


def test_a_servers_measured_compute_is_forgotten_a_while_after_the_last_step_there():
    """A measurement only ever makes a server look slower than it announces: kept for good, it would keep a server
    that sped up (or was held up while measured) out of routing; once forgotten, its announced speed counts."""
    from swarm.client.peers import COMPUTE_FRESH_SECONDS

    now = [100.0]
    load = PeerLoad(clock=lambda: now[0])
    load.observed("slow once", 0.5, blocks=10)
    load.observed("stepped through", 0.5, blocks=10)
    now[0] += COMPUTE_FRESH_SECONDS / 2
    load.observed("stepped through", 0.5, blocks=10)
    assert set(load.measured()) == {"slow once", "stepped through"}
    now[0] += COMPUTE_FRESH_SECONDS / 2 + 1
    assert set(load.measured()) == {"stepped through"}


def test_a_round_trip_is_the_least_of_the_last_few_probes():
    from swarm.client.peers import RTT_SAMPLES

    load = PeerLoad()
    load.round_trip("a", 0.100)
    assert load.round_trips() == {"a": pytest.approx(0.100)}  # the first sample as it is
    for queued in (0.400, 0.350, 0.900):  # a loaded server's loop: queueing only adds
        load.round_trip("a", queued)
    assert load.round_trips()["a"] == pytest.approx(0.100)
    for farther in [0.200] * RTT_SAMPLES:  # the route itself got longer: counted once the window has passed
        load.round_trip("a", farther)
    assert load.round_trips()["a"] == pytest.approx(0.200)


def test_a_restart_may_lift_a_failure_ban_but_keeps_its_strikes_and_never_lifts_distrust():
    bans = Bans(base_seconds=0.1, max_seconds=600)
    bans.ban("flaky")
    bans.ban("liar", 86400, distrust=True)
    assert bans.may_retry("flaky") and not bans.may_retry("liar")
    bans.pardon("flaky")  # it answered the probe its restart earned
    bans.pardon("liar")
    assert bans.current() == {"liar"} and bans.distrusted() == {"liar"}
    bans.ban("flaky")
    time.sleep(0.15)
    assert "flaky" in bans.current()  # a new failure is its second strike: 0.2 s


def test_records_carry_when_the_server_started_within_bounds():
    info = ServerInfo(ServerState.ONLINE, 0, 4, 10.0, 100, started=1_764_000_000.5)
    assert ServerInfo.from_wire(info.to_wire()) == info
    older = ServerInfo(ServerState.ONLINE, 0, 4, 10.0, 100)
    assert "started" not in older.to_wire()  # as servers older than the field wrote it
    assert ServerInfo.from_wire(older.to_wire()).started is None
    for insane in (-1.0, float("nan"), 1e300, "yesterday"):
        assert ServerInfo.from_wire({**info.to_wire(), "started": insane}) is None

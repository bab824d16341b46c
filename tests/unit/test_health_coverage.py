"""/health's look at the swarm (web/health.py RecentCoverage): answered from the last look, renewed in the background, so
that a busy gateway still answers at once; a failed or too old look is never used."""

from __future__ import annotations

import math
import threading

import pytest

from gateway.web.health import RecentCoverage


class Swarm:
    """A look-up that counts its calls, and can be held (a DHT lookup on a busy gateway) or made to fail."""

    def __init__(self):
        self.looks, self.covered, self.failing = 0, True, False
        self.held, self.done = threading.Event(), threading.Event()
        self.held.set()

    def __call__(self) -> dict:
        self.held.wait(10)
        self.looks += 1
        self.done.set()
        if self.failing:
            raise RuntimeError("the swarm cannot be reached")
        return {"covered": self.covered, "look": self.looks}


def test_the_first_look_is_the_request_s_own_and_is_then_reused():
    swarm, recent = Swarm(), RecentCoverage(seconds=math.inf)
    assert [recent.get(swarm)["look"] for _ in range(5)] == [1] * 5
    assert swarm.looks == 1


def test_an_old_look_is_answered_at_once_and_renewed_in_the_background():
    swarm, recent = Swarm(), RecentCoverage(seconds=0, stale=math.inf)
    recent.get(swarm)
    swarm.held.clear()  # the next lookup takes its time
    swarm.done.clear()
    assert recent.get(swarm)["look"] == 1  # not held up by the lookup it started
    assert recent.get(swarm)["look"] == 1  # and one lookup at a time
    swarm.held.set()
    assert swarm.done.wait(10)
    for _ in range(100):  # the background lookup stores its answer right after it returns
        if recent.get(swarm)["look"] >= 2:
            break
        threading.Event().wait(0.05)
    assert recent.get(swarm)["look"] >= 2


def test_a_failed_look_is_not_used():
    swarm, recent = Swarm(), RecentCoverage(seconds=0, stale=math.inf)
    recent.get(swarm)
    swarm.failing, swarm.done = True, threading.Event()
    recent.get(swarm)  # starts a lookup that fails
    assert swarm.done.wait(10)
    for _ in range(100):
        try:
            recent.get(swarm)
        except RuntimeError:
            break  # the request looked itself, and got the error
        threading.Event().wait(0.05)
    else:
        pytest.fail("a failed look kept being answered")


def test_a_look_too_old_to_trust_is_looked_again_by_the_request():
    swarm, recent = Swarm(), RecentCoverage(seconds=0, stale=0)
    assert [recent.get(swarm)["look"] for _ in range(3)] == [1, 2, 3]


def test_the_swarm_page_marks_and_counts_servers_of_another_protocol():
    from gateway.web.health import _with_protocols
    from swarm.protocol import PROTOCOL_VERSION

    health = {"num_blocks": 4, "servers": [{"peer_id": "upgraded", "version": PROTOCOL_VERSION},
                                           {"peer_id": "lagging", "version": "0.5.0"},
                                           {"peer_id": "ancient", "version": ""}]}
    marked = _with_protocols(health)
    assert [server["compatible"] for server in marked["servers"]] == [True, False, False]
    assert marked["incompatible_servers"] == 2 and marked["num_blocks"] == 4

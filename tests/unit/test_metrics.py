"""The metrics' small parts: which API a request counts under, token timing, and a joining server's announcements."""

import asyncio

from prometheus_client import REGISTRY

from gateway.engine.metrics import observe_token
from gateway.web.metrics import api_of
from gateway.engine.stats import RequestStats


def test_requests_count_under_their_api():
    assert api_of("petals_http") == "petals_http" and api_of("petals_ws") == "petals_ws"
    assert {api_of(name) for name in ("openai_v1", "openai_api_oai", "openai_api_oai_v1", "openai_extras")} == {"openai"}
    assert api_of("docs") is None and api_of("monitoring") is None and api_of(None) is None


def test_the_first_token_is_timed_against_the_start_and_the_others_against_each_other():
    sample = lambda name: REGISTRY.get_sample_value(name, {"model": "unit-test"}) or 0.0
    stats = RequestStats()
    stats.prompt(3)
    for count in range(4):
        observe_token("unit-test", stats.step_done(first=count == 0), first=count == 0)
    assert stats.prefill_seconds > 0 and stats.completion_tokens == 4
    assert sample("gateway_time_to_first_token_seconds_count") == 1
    assert sample("gateway_inter_token_latency_seconds_count") == 3
    assert sample("gateway_generated_tokens_total") == 4


def test_a_loading_server_stays_announced_as_joining(monkeypatch):
    from swarm import dht
    from swarm.protocol import ServerInfo, ServerState
    from swarm.server.main import _announced_while

    announced = []

    async def announce(node, prefix, info, expiration):
        announced.append((prefix, info.state, expiration))

    async def load():
        await asyncio.sleep(0.35)
        return "span"

    monkeypatch.setattr(dht, "announce", announce)
    joining = ServerInfo(ServerState.JOINING, 0, 2, 0.0, 100)
    assert asyncio.run(_announced_while(None, "tiny", joining, 0.1, load())) == "span"
    assert 3 <= len(announced) <= 5 and set(announced) == {("tiny", ServerState.JOINING, 0.1 * 3)}

"""The simulated network map (swarm/network_map.py, swarm/server/links.py): its parsing and its errors (each
naming the setting), the server flags that take it, and the delays a server applies per caller: each
exchange held its own link's round trip (half in, half out), by the region its caller announced, the map's
default region for a caller that announced none, and pushes not delayed by their sender (their receiver
delays them, once)."""

import asyncio
import json
import time

import pytest

from swarm.network_map import NetworkMapError, parse_network_map, parse_region
from swarm.server.links import MappedLatency, RegionBook

MAP = {"round_trip_ms": [["home", "home", 0], ["home", "dc", 240], ["dc", "dc", 40]], "jitter_ms": 0, "seed": 3,
       "default_region": "home"}
PEER = "/ip4/127.0.0.1/tcp/9/p2p/QmNnooDu7bfjPFoTZYxMNLWUQJyrVwtbZg5gBMjTezGAJN"


def test_a_map_parses_inline_or_from_a_file(tmp_path):
    network_map = parse_network_map(json.dumps(MAP))
    assert network_map.regions == {"home", "dc"}
    assert network_map.round_trip_ms("home", "dc") == network_map.round_trip_ms("dc", "home") == 240
    assert network_map.round_trip_ms("dc", "dc") == 40 and network_map.default_region == "home"
    path = tmp_path / "map.json"
    path.write_text(json.dumps(MAP))
    assert parse_network_map(str(path)) == network_map
    assert "region dc, round trips to dc 40 ms, home 240 ms" in network_map.describe("dc")


@pytest.mark.parametrize("value, message", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "expected a JSON object"),
    ('{"round_trip_ms": []}', "round_trip_ms must be a list"),
    ('{"round_trip_ms": [["a", "a", -1]]}', "each round_trip_ms entry must be"),
    ('{"round_trip_ms": [["a", "a", "5"]]}', "each round_trip_ms entry must be"),
    ('{"round_trip_ms": [["a b", "a b", 5]]}', "each round_trip_ms entry must be"),
    ('{"round_trip_ms": [["a", "a", 1e9]]}', "each round_trip_ms entry must be"),
    ('{"round_trip_ms": [["a", "b", 5], ["a", "a", 1]]}', "no round trip for b - b"),
    ('{"round_trip_ms": [["a", "a", 5], ["a", "a", 1]]}', "the link a - a is listed twice"),
    ('{"round_trip_ms": [["a", "a", 5]], "jitter_ms": -2}', "jitter_ms must be"),
    ('{"round_trip_ms": [["a", "a", 5]], "seed": 1.5}', "seed must be an integer"),
    ('{"round_trip_ms": [["a", "a", 5]], "default_region": "b"}', "default_region 'b' is not a region"),
    ('{"round_trip_ms": [["a", "a", 5]], "regions": ["a"]}', "unknown field(s) regions"),
    ("/no/such/map.json", "cannot read the map file"),
])
def test_a_bad_map_is_one_clear_error_naming_the_setting(value, message):
    with pytest.raises(NetworkMapError) as error:
        parse_network_map(value, "--network-map")
    assert str(error.value).startswith("--network-map: ") and message in str(error.value)


def test_a_region_must_be_one_of_the_maps():
    network_map = parse_network_map(json.dumps(MAP))
    assert parse_region("dc", network_map) == "dc" and parse_region("", network_map) is None
    with pytest.raises(NetworkMapError, match="--region: 'mars' is not a region of the network map"):
        parse_region("mars", network_map)


def test_the_server_flags(capsys, monkeypatch):
    from swarm.server.settings import parse_settings

    monkeypatch.delenv("SIMULATED_LATENCY_MS", raising=False)
    monkeypatch.delenv("NETWORK_MAP", raising=False)
    base = ["--blocks", "0:1", "--initial-peers", PEER]
    latency = parse_settings([*base, "--network-map", json.dumps(MAP), "--region", "dc"]).latency
    assert isinstance(latency, MappedLatency) and latency.region == "dc" and latency.enabled
    monkeypatch.setenv("NETWORK_MAP", json.dumps(MAP))  # every server started on the machine
    assert parse_settings([*base, "--region", "home"]).latency.region == "home"
    assert parse_settings(base).latency.region == "home"  # the map's default region
    no_default = json.dumps({**MAP, "default_region": None})
    for flags, message in [(["--network-map", no_default], "--network-map needs --region"),
                           (["--region", "mars"], "--region: 'mars' is not a region"),
                           (["--region", "dc", "--simulated-latency", "50"], "use one or the other"),
                           (["--network-map", "{", "--region", "dc"], "--network-map: not valid JSON")]:
        with pytest.raises(SystemExit):
            parse_settings([*base, *flags])
        assert message in capsys.readouterr().err
    monkeypatch.delenv("NETWORK_MAP")
    with pytest.raises(SystemExit):
        parse_settings([*base, "--region", "dc"])
    assert "--region needs --network-map" in capsys.readouterr().err


class _Book(RegionBook):
    """Regions as announced, without a DHT."""

    def __init__(self, regions):
        super().__init__()
        self.regions, self.lookups = regions, 0

    async def region_of(self, peer_id):
        self.lookups += 1
        await asyncio.sleep(0.01)  # a look-up takes time: part of the delay, not added to it
        return self.regions.get(peer_id)


class _Context:
    def __init__(self, peer_id):
        self.remote_id = type("PeerID", (), {"to_base58": lambda _: peer_id})()


def _mapped(region="dc", **changes):
    book = _Book({"near": "dc", "far": "home", "stranger": "mars"})
    return MappedLatency(parse_network_map(json.dumps({**MAP, **changes})), region, book)


def test_each_caller_is_delayed_by_its_own_link():
    latency = _mapped()

    async def answer(request, context):
        return request

    delayed = latency.wrap(answer, stream_input=False, stream_output=False)

    async def timed(peer):
        began = time.monotonic()
        await delayed(1, _Context(peer))
        return time.monotonic() - began

    async def scenario():
        return {peer: await timed(peer) for peer in ("near", "far", "unknown", "stranger")}

    seconds = asyncio.run(scenario())
    assert 0.040 <= seconds["near"] < 0.040 + 0.1  # dc - dc, the look-up's 10 ms within it
    assert 0.240 <= seconds["far"] < 0.240 + 0.1  # dc - home
    assert 0.240 <= seconds["unknown"] < 0.240 + 0.1  # announced nothing: the default region, home
    assert 0.240 <= seconds["stranger"] < 0.240 + 0.1  # announced a region the map lacks: the same


def test_without_a_default_region_a_caller_of_no_region_is_taken_as_local():
    latency = _mapped(default_region=None)
    assert latency.link_to(None).round_trip_ms == 40 and latency.link_to("home").round_trip_ms == 240
    assert _mapped(region="home", default_region=None).link_to(None).round_trip_ms == 0


def test_a_streams_messages_each_take_the_callers_link_one_way_in_order():
    latency = _mapped(jitter_ms=30)

    async def echo(requests, context):
        async for request in requests:
            yield request

    async def burst():
        for index in range(20):
            yield index

    async def scenario():
        began = time.monotonic()
        seen = [item async for item in latency.wrap(echo, True, True)(burst(), _Context("far"))]
        return seen, time.monotonic() - began

    seen, seconds = asyncio.run(scenario())
    assert seen == list(range(20))
    assert 0.240 <= seconds < 0.240 + 0.030 + 0.2  # in and out once each, overlapping, plus at most the jitter


def test_the_jitter_is_seeded_and_within_the_map():
    draws = [_mapped(jitter_ms=30).link_to("home").one_way() for _ in range(3)]
    assert len(set(draws)) == 1  # the same seed and region: the same draws
    link = _mapped(jitter_ms=30).link_to("home")
    spread = [link.one_way() for _ in range(500)]
    assert 0.120 <= min(spread) and max(spread) <= 0.135 and max(spread) - min(spread) > 0.01
    assert _mapped(jitter_ms=30, seed=4).link_to("home").one_way() != draws[0]


def test_pushes_are_not_delayed_by_their_sender():
    """The next server delays a push (and its reply) by the link between the two: the sender must not add its
    own, or a push would cross the link twice."""
    latency = _mapped()

    async def scenario():
        began = time.monotonic()
        await latency.delay()
        return time.monotonic() - began

    assert asyncio.run(scenario()) < 0.01

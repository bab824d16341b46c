"""The swarm's health (/api/v1/swarm and the /swarm page) and the gateway's Prometheus metrics (/metrics),
through real gunicorn in front of the tiny swarm."""

from __future__ import annotations
from unittest.mock import ANY

import json
import re
import time
from html.parser import HTMLParser
from pathlib import Path

import openai
import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families
from websockets.sync.client import connect

from gunicorn_gateway import running_gateway
from shared_swarm import TINY_BLOCKS, TINY_PREFIX
from swarm.protocol import PROTOCOL_VERSION

SPARE_PREFIX = "tiny-health"  # a second model whose servers the tests start and stop
CHROMIUM = "/usr/bin/chromium"


def swarm_health(gateway, **params) -> dict:
    reply = requests.get(gateway.url + "/api/v1/swarm", params=params, timeout=60)
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["ok"] is True and body["version"] == PROTOCOL_VERSION
    return body


def wait_for(check, timeout=30.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not (result := check()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.3)
    return result


@pytest.fixture(scope="module")
def health_gateway(tiny_swarm, tiny_llama, tmp_path_factory):
    """A gateway serving the tiny model, the same model under a prefix no server holds yet, and a model that
    cannot be loaded at all."""
    models = [
        {"name": "tiny", "path": str(tiny_llama), "dht_prefix": TINY_PREFIX},
        {"name": "spare", "path": str(tiny_llama), "dht_prefix": SPARE_PREFIX},
        {"name": "broken", "path": str(tmp_path_factory.mktemp("empty") / "no-such-model")},
    ]
    env = {"INITIAL_PEERS": " ".join(tiny_swarm.initial_peers), "MODELS": json.dumps(models)}
    with running_gateway(env, tmp_path_factory.mktemp("health-gateway")) as server:
        yield server


# ------------------------------------------------------------------------------------------ /api/v1/swarm


def test_swarm_json_lists_servers_and_coverage(gateway):
    [model] = swarm_health(gateway)["models"]
    assert model["name"] == "tiny" and model["dht_prefix"] == TINY_PREFIX and model["num_blocks"] == TINY_BLOCKS
    assert model["coverage"] == [1] * TINY_BLOCKS
    assert model["covered"] is True and model["missing_ranges"] == [] and model["missing_blocks"] is None
    assert model["incompatible_servers"] == 0
    servers = model["servers"]
    assert [(server["start"], server["end"], server["state"]) for server in servers] == [(0, 2, "online"),
                                                                                         (2, 4, "online")]
    for server in servers:
        assert set(server) == {"peer_id", "start", "end", "state", "throughput", "cache_tokens_free", "version",
                               "relayed", "rtt_ms", "compatible", "caught_lying"}
        assert server["peer_id"].startswith("Qm") and server["throughput"] > 0 and server["relayed"] is False
        assert server["compatible"] is True and server["caught_lying"] is False
        assert server["cache_tokens_free"] > 0 and server["version"] == PROTOCOL_VERSION
    assert servers[0]["peer_id"] != servers[1]["peer_id"]

    # asked for by name, the same model; its servers' load may have changed in between (they re-announce it)
    load = ("cache_tokens_free", "throughput", "rtt_ms")
    [again] = swarm_health(gateway, model="tiny")["models"]
    assert {**again, "servers": None} == {**model, "servers": None}
    assert [{key: value for key, value in server.items() if key not in load} for server in again["servers"]] == \
        [{key: value for key, value in server.items() if key not in load} for server in servers]
    reply = requests.get(gateway.url + "/api/v1/swarm", params={"model": "gpt-9"}, timeout=30)
    assert reply.status_code == 404
    assert reply.json()["ok"] is False and "unknown model 'gpt-9'" in reply.json()["error"]


def test_swarm_json_shows_each_servers_round_trip_as_the_gateway_measures_it(gateway):
    """Loopback: well under a second, measured (a number) once the gateway has probed the servers."""
    def measured():
        servers = swarm_health(gateway)["models"][0]["servers"]
        return servers if all(isinstance(server["rtt_ms"], (int, float)) for server in servers) else None

    for server in wait_for(measured, 30, "the servers' round trips"):
        assert 0 < server["rtt_ms"] < 1000


def test_an_unreachable_or_uncovered_model_still_appears(health_gateway):
    tiny, spare, broken = swarm_health(health_gateway)["models"]
    assert tiny["covered"] is True and len(tiny["servers"]) == 2
    assert spare["dht_prefix"] == SPARE_PREFIX and spare["servers"] == []
    assert spare["coverage"] == [0] * TINY_BLOCKS and spare["covered"] is False
    assert spare["missing_ranges"] == [[0, TINY_BLOCKS]] and spare["missing_blocks"] == "0..3"
    assert broken["name"] == "broken" and broken["ok"] is False and broken["error"] and "servers" not in broken
    assert broken["dht_prefix"] == "no-such-model"


def test_a_server_that_left_is_listed_as_offline(health_gateway, tiny_swarm):
    # announced for 12 s (3 periods): time enough, on a loaded machine, to stop the server and look again
    server = tiny_swarm.add_server(["--blocks", "1:3", "--dht-prefix", SPARE_PREFIX, "--announce-period", "4"])
    spare = swarm_health(health_gateway, model="spare")["models"][0]
    assert [(entry["start"], entry["end"], entry["state"]) for entry in spare["servers"]] == [(1, 3, "online")]
    assert spare["coverage"] == [0, 1, 1, 0] and spare["missing_ranges"] == [[0, 1], [3, 4]]
    assert spare["missing_blocks"] == "0, 3"

    server.stop()  # a clean shutdown announces OFFLINE: listed as such until the record expires
    spare = swarm_health(health_gateway, model="spare")["models"][0]
    assert [(entry["start"], entry["end"], entry["state"]) for entry in spare["servers"]] == [(1, 3, "offline")]
    assert spare["coverage"] == [0] * TINY_BLOCKS and spare["covered"] is False
    wait_for(lambda: swarm_health(health_gateway, model="spare")["models"][0]["servers"] == [], 30,
             "the offline record to expire")


# ------------------------------------------------------------------------------------------ the /swarm page


class PageParser(HTMLParser):
    def __init__(self):
        super().__init__()
        self.scripts, self.links, self.inline_scripts = [], [], 0

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "script":
            if attrs.get("src"):
                self.scripts.append(attrs["src"])
            else:
                self.inline_scripts += 1
        for name in ("href", "src"):
            if attrs.get(name):
                self.links.append(attrs[name])


def test_swarm_page_loads_its_script_from_static_only(gateway):
    page = requests.get(gateway.url + "/swarm", timeout=30)
    assert page.status_code == 200 and page.headers["Content-Type"].startswith("text/html")
    parser = PageParser()
    parser.feed(page.text)
    assert parser.scripts == ["/static/swarm.js"] and parser.inline_scripts == 0
    assert all(link.startswith("/") and not link.startswith("//") for link in parser.links), parser.links

    script = requests.get(gateway.url + "/static/swarm.js", timeout=30)
    assert script.status_code == 200 and "javascript" in script.headers["Content-Type"]
    assert "/api/v1/swarm" in script.text
    for text in (page.text, script.text):
        assert "http://" not in text and "https://" not in text  # no CDN, nothing from elsewhere


@pytest.mark.browser
def test_swarm_page_draws_servers_and_gaps(health_gateway, tiny_swarm, tmp_path_factory):
    """In a real headless Chromium: a bar per server, and the coverage row with the gaps in red."""
    sync_api = pytest.importorskip("playwright.sync_api")
    if not Path(CHROMIUM).exists():
        pytest.skip(f"no Chromium at {CHROMIUM}")
    server = tiny_swarm.add_server(["--blocks", "0:1", "--dht-prefix", SPARE_PREFIX])  # spare's 1..3 uncovered
    errors = []
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--headless", "--no-sandbox"])
        page = browser.new_page(viewport={"width": 1200, "height": 900})
        page.on("pageerror", lambda error: errors.append(str(error)))
        external = []
        page.on("request", lambda request: None if request.url.startswith(health_gateway.url)
                else external.append(request.url))
        page.goto(health_gateway.url + "/swarm")
        tiny = page.get_by_role("region", name="tiny", exact=True)
        sync_api.expect(tiny.locator("tr.server")).to_have_count(2)
        sync_api.expect(tiny.locator("tr.server .span.online")).to_have_text(["0:2", "2:4"])
        sync_api.expect(tiny.locator("tr.coverage .cell")).to_have_count(TINY_BLOCKS)
        sync_api.expect(tiny.locator("tr.coverage .cell.gap")).to_have_count(0)
        # each server's round trip as the gateway measures it, in ms (the page redraws every 5 s)
        sync_api.expect(tiny.locator("tr.server td[title='round trip from this gateway']")).to_have_text(
            [re.compile(r"^\d+(\.\d)?$")] * 2, timeout=20000)

        spare = page.get_by_role("region", name="spare", exact=True)
        sync_api.expect(spare.locator("tr.server .span.online")).to_have_text(["0:1"])
        sync_api.expect(spare.locator("tr.coverage .cell.gap")).to_have_count(3)
        sync_api.expect(spare).to_contain_text("No server holds blocks 1..3.")
        gap_color = spare.locator("tr.coverage .cell.gap").first.evaluate("cell => getComputedStyle(cell).backgroundColor")
        red, green, blue = (int(part) for part in gap_color.removeprefix("rgb(").rstrip(")").split(",")[:3])
        assert red > 150 and green < 100 and blue < 100, gap_color

        broken = page.get_by_role("region", name="broken", exact=True)
        sync_api.expect(broken.locator(".error")).to_contain_text("Unavailable: unknown model")
        page.screenshot(path=tmp_path_factory.mktemp("swarm-page") / "swarm.png")
        browser.close()
    server.stop()
    assert errors == [] and external == []


# ------------------------------------------------------------------------------------------ /metrics


def scrape(url: str) -> dict:
    """{(sample name, sorted labels): value} of a Prometheus text page, parsed by prometheus_client itself."""
    reply = requests.get(url, timeout=30)
    assert reply.status_code == 200 and reply.headers["Content-Type"].startswith("text/plain")
    families = {family.name: family for family in text_string_to_metric_families(reply.text)}
    samples = {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
               for family in families.values() for sample in family.samples}
    samples["families"] = {name: family.type for name, family in families.items()}
    return samples


def requests_of(samples: dict, api: str, status: int) -> float:
    return samples.get(("gateway_requests_total", (("api", api), ("status", str(status)))), 0.0)


def test_gateway_metrics(gateway):
    before = scrape(gateway.url + "/metrics")

    http = requests.post(gateway.url + "/api/v1/generate", json={"inputs": "Hello", "max_new_tokens": 4}, timeout=60)
    assert http.json()["ok"] and http.json()["token_count"] == 4
    assert requests.post(gateway.url + "/api/v1/generate", json={"inputs": "x", "session_id": "nope"}).status_code == 404
    with connect(gateway.ws_url) as ws:
        ws.send(json.dumps({"type": "open_inference_session", "max_length": 64}))
        assert json.loads(ws.recv(timeout=60)) == {"ok": True, "session_id": ANY}
        ws.send(json.dumps({"type": "generate", "inputs": "Hi", "max_new_tokens": 3}))
        assert json.loads(ws.recv(timeout=60))["token_count"] == 3
        ws.send("not json")
        assert json.loads(ws.recv(timeout=60))["ok"] is False
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)
    reply = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                           max_tokens=3, temperature=0)
    generated = 4 + 3 + reply.usage.completion_tokens
    session_id = requests.post(gateway.url + "/api/v1/open_inference_session", json={"max_length": 16}).json()["session_id"]
    assert requests.get(gateway.url + "/health").status_code == 200  # a poller's, not an API's request

    after = scrape(gateway.url + "/metrics")
    grew = lambda api, status: requests_of(after, api, status) - requests_of(before, api, status)
    assert grew("petals_http", 200) == 2 and grew("petals_http", 404) == 1  # generate, open_inference_session
    assert grew("petals_ws", 200) == 2 and grew("petals_ws", 400) == 1  # per message, not per connection
    assert grew("openai", 200) == 1
    assert requests_of(after, "monitoring", 200) == 0  # only the APIs are counted

    families = after["families"]
    assert families["gateway_time_to_first_token_seconds"] == "histogram"
    assert families["gateway_inter_token_latency_seconds"] == "histogram"
    count = lambda samples, name: samples.get((name, (("model", "tiny"),)), 0.0)
    assert count(after, "gateway_time_to_first_token_seconds_count") - count(before, "gateway_time_to_first_token_seconds_count") == 3
    assert (count(after, "gateway_inter_token_latency_seconds_count")
            - count(before, "gateway_inter_token_latency_seconds_count")) == generated - 3
    assert count(after, "gateway_time_to_first_token_seconds_sum") > count(before, "gateway_time_to_first_token_seconds_sum")
    assert count(after, "gateway_generated_tokens_total") - count(before, "gateway_generated_tokens_total") == generated

    assert families["gateway_open_sessions"] == "gauge" and after[("gateway_open_sessions", ())] >= 1
    assert families["swarm_client_retries"] == "counter" and ("swarm_client_retries_total", ()) in after
    assert families["swarm_client_failovers"] == "counter" and ("swarm_client_failovers_total", ()) in after
    # the imports, the model's client half and the swarm client, frozen out of collections (swarm/gc_tuning.py)
    assert after[("python_gc_frozen_objects", ())] > 100_000
    requests.post(gateway.url + "/api/v1/close_inference_session", json={"session_id": session_id})

"""A block server's Prometheus metrics (--metrics-port), scraped from a real server of the tiny swarm while a
real session runs through it, and parsed by prometheus_client's own parser."""

import time

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from processes import free_port
from swarm.local import LocalSwarmError
from swarm.protocol import PAGE_TOKENS
from swarm.client.remote_model import RemoteModel

PREFIX = "tiny-metrics"
CACHE_TOKENS = 1000


def scrape(url: str) -> dict:
    """{(sample name, sorted labels): value}, plus "families": {name: type}."""
    reply = requests.get(url, timeout=30)
    assert reply.status_code == 200 and reply.headers["Content-Type"].startswith("text/plain")
    families = list(text_string_to_metric_families(reply.text))
    samples = {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
               for family in families for sample in family.samples}
    samples["families"] = {family.name: family.type for family in families}
    return samples


def value(samples: dict, name: str, **labels) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


@pytest.fixture(scope="module")
def metered(tiny_swarm):
    """A server holding every block of the tiny model under its own prefix, with metrics on; its metrics URL."""
    port = free_port()
    server = tiny_swarm.add_server(["--blocks", "0:4", "--dht-prefix", PREFIX, "--cache-tokens", str(CACHE_TOKENS),
                                    "--metrics-port", str(port)], wait=False)
    ready = server.wait_for_line(lambda line: line.startswith("ready:"), 180)
    url = f"http://127.0.0.1:{port}/metrics"
    assert ready.endswith(f", metrics at {url}")
    yield url
    server.stop()


@pytest.fixture(scope="module")
def model(tiny_swarm, tiny_llama, settings, metered):
    model = RemoteModel.from_pretrained(str(tiny_llama), tiny_swarm.initial_peers, settings.cache_dir, PREFIX)
    yield model
    model.close()


def test_server_metrics_follow_a_session(metered, model):
    idle = scrape(metered)
    assert idle["families"]["swarm_server_batch_size"] == "histogram"
    assert idle["families"]["swarm_server_step_seconds"] == "histogram"
    assert idle["families"]["swarm_server_positions_served"] == "counter"
    assert value(idle, "swarm_server_open_sessions") == 0
    assert value(idle, "swarm_server_cache_tokens_used") == 0
    assert value(idle, "swarm_server_cache_tokens_free") == CACHE_TOKENS
    assert value(idle, "swarm_server_batch_size_count") == 0
    assert ("process_resident_memory_bytes", ()) in idle  # the process's own metrics, as Prometheus expects

    with model.session(max_length=64) as session:
        session.step([[1, 2, 3]])
        session.step([[4]])
        with model.session(max_length=32, batch_size=2) as pair:
            pair.step([[1, 2], [3, 4]])
            busy = scrape(metered)
            assert value(busy, "swarm_server_open_sessions") == 2
            # a page per sequence: one for the first session, one for each row of the pair
            assert value(busy, "swarm_server_cache_tokens_used") == PAGE_TOKENS + PAGE_TOKENS * 2
            assert value(busy, "swarm_server_cache_tokens_free") == CACHE_TOKENS - 3 * PAGE_TOKENS

    assert value(busy, "swarm_server_batch_size_count") == 3  # one per forward pass
    assert value(busy, "swarm_server_batch_size_bucket", le="1.0") == 2
    assert value(busy, "swarm_server_batch_size_bucket", le="2.0") == 3
    assert value(busy, "swarm_server_batch_size_sum") == 1 + 1 + 2
    assert value(busy, "swarm_server_step_seconds_count") == 3
    assert value(busy, "swarm_server_step_seconds_sum") > 0
    assert value(busy, "swarm_server_positions_served_total") == 3 + 1 + 2

    # closing a session ends its stream: the server frees the cache as soon as it notices
    deadline = time.monotonic() + 10
    while value(done := scrape(metered), "swarm_server_open_sessions") != 0:
        assert time.monotonic() < deadline, "the sessions were not closed on the server"
        time.sleep(0.1)
    assert value(done, "swarm_server_cache_tokens_used") == 0
    assert value(done, "swarm_server_cache_tokens_free") == CACHE_TOKENS


def test_a_taken_metrics_port_is_a_one_line_error(tiny_swarm, metered):
    port = metered.rsplit(":", 1)[1].split("/")[0]
    server = tiny_swarm.add_server(["--blocks", "0:4", "--dht-prefix", PREFIX, "--metrics-port", port], wait=False)
    with pytest.raises(LocalSwarmError, match=rf"(?s)exited with 1;.*error: --metrics-port {port}: cannot listen"):
        server.wait_for_line(lambda line: line.startswith("ready:"), 120)
    assert "Traceback" not in server.log_path.read_text()


def test_a_served_step_leaves_the_collector_nothing_old_to_walk(metered, model):
    """swarm/gc_tuning.py: what the server built before its ready line is frozen out of collections (a full
    collection would walk ~400,000 objects: 120-200 ms with the GIL held), and 100 decode steps cause no full
    collection and fewer young ones than steps."""
    before = scrape(metered)
    assert value(before, "python_gc_frozen_objects") > 100_000  # torch's and transformers' modules, the weights
    with model.session(max_length=128) as session:
        session.step([[1, 2, 3]])
        for token in range(100):
            session.step([[token % 7 + 1]])
    after = scrape(metered)
    collections = {generation: value(after, "python_gc_collections_total", generation=generation)
                   - value(before, "python_gc_collections_total", generation=generation) for generation in "012"}
    assert collections["2"] == 0 and collections["1"] == 0, collections
    # young ones: 3 to 10 seen (the server's announces and probes allocate too), never one a step
    assert collections["0"] < 100, collections

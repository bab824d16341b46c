"""CUDA decode graphs without a GPU: the bounded set of rounds a span captures (run eagerly over the same padded
tensors, capture=False), a capture that fails (torch.cuda's graph and stream APIs replaced by fakes that keep
track of the thread's current stream), and a rebalance whose new span or pool cannot be had: the old span
serves on."""

import asyncio
import contextlib
import itertools

import pytest
import torch

from swarm.server import graphs as graphs_module
from swarm.server import main as server_main
from swarm.server.attention import PackedBatch, Segment
from swarm.server.backend import Backend, ServerLimits
from swarm.server.cache import CacheBudget
from swarm.server.span import load_span
from tiny_model import build_tiny_model

ATOL = 1e-4
BLOCKS = 3


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("llama"), "llama", BLOCKS)


@pytest.fixture
def span(folder):
    span = load_span(folder, 0, BLOCKS)
    span.new_pool(1024)
    return span


@pytest.fixture
def made(monkeypatch) -> list[tuple]:
    """The (start, end) of every round DecodeGraphs makes (captures, on a GPU)."""
    rounds, captured_round = [], graphs_module.CapturedRound

    def counted(inputs, hidden_size, dtype, forward, device, capture, *args):
        rounds.append(forward)
        return captured_round(inputs, hidden_size, dtype, forward, device, capture, *args)

    monkeypatch.setattr(graphs_module, "CapturedRound", counted)
    return rounds


def prefilled(span, past: int):
    cache = span.new_cache(1, 96)
    span(torch.randn(1, past, span.config.hidden_size), 0, cache)
    return cache


def decode(span, cache, position: int, start: int, end: int):
    """One decode step of `cache` at `position` through blocks [start, end): through the span's graphs (None
    when they leave it to the eager path) and eagerly; the step rewrites the same position each time."""
    hidden = torch.randn(1, 1, span.config.hidden_size)
    graphed = span.graphs.replay(hidden, [Segment(1, 1, position, cache)], start, end)
    eager = span.forward_packed(hidden, [Segment(1, 1, position, cache)], start, end)
    return graphed, eager


def test_only_a_bounded_set_of_block_ranges_gets_rounds(span, made, monkeypatch):
    """A client walking every sub-range of the span, over and over: the whole range keeps its round, at most
    OTHER_RANGES others hold theirs, and after OTHER_RANGE_CAPTURES captures of other ranges their rounds run
    eagerly (the old code kept a round for every range it was ever asked, and never let one go)."""
    monkeypatch.setattr(graphs_module, "OTHER_RANGES", 2, raising=False)
    monkeypatch.setattr(graphs_module, "OTHER_RANGE_CAPTURES", 8, raising=False)
    cache = prefilled(span, 5)  # eagerly: a prompt of a few positions is a round graphs take too
    span.use_graphs(capture=False)
    ranges = [(start, end) for start, end in itertools.combinations(range(BLOCKS + 1), 2)]
    for start, end in ranges * 6:
        graphed, eager = decode(span, cache, 5, start, end)
        if graphed is not None:
            torch.testing.assert_close(graphed, eager, atol=ATOL, rtol=0)
        assert len({key[:2] for key in span.graphs.rounds}) <= 1 + 2
    assert len(made) == 1 + 8 and span.graphs.other_captures == 8
    assert (0, BLOCKS) in {key[:2] for key in span.graphs.rounds}
    without = next(pair for pair in ranges if pair not in span.graphs.other_ranges and pair != (0, BLOCKS))
    assert decode(span, cache, 5, *without)[0] is None and len(made) == 9  # no capture left: eager


def test_a_range_in_use_keeps_its_rounds(span, made):
    cache = prefilled(span, 5)  # eagerly: a prompt of a few positions is a round graphs take too
    span.use_graphs(capture=False)
    for _ in range(10):
        for start, end in ((0, BLOCKS), (1, BLOCKS)):
            graphed, eager = decode(span, cache, 5, start, end)
            torch.testing.assert_close(graphed, eager, atol=ATOL, rtol=0)
    assert len(made) == 2


def eager(span, hidden, segments):
    """The round through the eager path (a packed batch of groups), whatever graphs the span has."""
    batch = PackedBatch.of(segments, span.pool, 0, span.device)
    return span.forward_batch(hidden, batch, 0, BLOCKS)


def test_every_round_is_made_ahead_and_making_them_writes_no_page(span, made):
    """capture_ahead makes every bucket of the whole range within the bounds (rows x query slots up to the
    round's tokens, keys up to the context), from padding sequences only (they read the zero page and write the
    scratch page); the rounds that come later use them."""
    pool = span.pool
    caches = [prefilled(span, 3 + index) for index in range(3)]
    span.use_graphs(capture=False)
    before = [part.clone() for cache in caches for layer in range(BLOCKS) for part in cache.read(layer, 16)]
    captured = span.capture_graphs_ahead(max_tokens=64, max_keys=128)
    assert captured.rounds == len(made) == len(graphs_module.round_shapes(64, 128))
    assert {key[2:] for key in span.graphs.rounds} == set(graphs_module.round_shapes(64, 128))
    assert {(sequences, keys) for sequences, queries, keys in graphs_module.round_shapes(64, 128)
            if queries == 1} == {(sequences, keys) for sequences in (1, 2, 4, 8, 16, 32, 64) for keys in (64, 128)}
    after = [part for cache in caches for layer in range(BLOCKS) for part in cache.read(layer, 16)]
    assert all(torch.equal(was, now) for was, now in zip(before, after))
    assert not pool.keys[:, pool.zero_slot : pool.scratch_slot].any()
    assert not pool.values[:, pool.zero_slot : pool.scratch_slot].any()


@pytest.mark.parametrize("lengths", [[1, 1, 1], [4, 4], [1, 9, 1, 3], [33]], ids=["decode", "verify", "mixed",
                                                                               "longest draft"])
def test_decode_and_verify_rounds_replay_graphs_made_ahead_and_equal_the_eager_round(span, made, lengths):
    """Rounds of decode steps, of verify steps (1 + a draft's positions), and of both: each replays a round
    made ahead (none is made on the serving path) as the sessions grow past a bucket of keys, and gives the
    eager round's outputs."""
    caches = [prefilled(span, 20 + 7 * index) for index in range(len(lengths))]
    span.use_graphs(capture=False)
    span.capture_graphs_ahead(max_tokens=256, max_keys=256)
    made.clear()
    rounds = graphs_module.metrics.GRAPH_ROUNDS._value.get()
    for past in (0, 30, 60):  # 20 + 60 + a draft: past 64 keys
        segments = [Segment(1, length, 20 + 7 * index + past, cache)
                    for index, (length, cache) in enumerate(zip(lengths, caches))]
        for cache, segment in zip(caches, segments):
            cache.prepare(segment.position, segment.position + segment.length)
        hidden = torch.randn(1, sum(lengths), span.config.hidden_size)
        graphed = span.graphs.replay(hidden, segments, 0, BLOCKS)
        assert graphed is not None
        torch.testing.assert_close(graphed, eager(span, hidden, segments), atol=ATOL, rtol=0)
    assert not made and graphs_module.metrics.GRAPH_ROUNDS._value.get() == rounds + 3


def test_prefill_and_adapter_rounds_run_eagerly_and_are_counted(span):
    cache = prefilled(span, 4)
    span.use_graphs(capture=False)
    counted = graphs_module.metrics.EAGER_ROUNDS.labels("prefill")._value.get()
    assert span.graphs.replay(torch.randn(1, 40, span.config.hidden_size), [Segment(1, 40, 4, cache)], 0, BLOCKS) \
        is None
    assert graphs_module.metrics.EAGER_ROUNDS.labels("prefill")._value.get() == counted + 1


class FakeCuda:
    """torch.cuda's streams and graphs as far as a capture uses them, on a CPU: the thread's current stream is
    tracked (torch.cuda.stream restores it on the way out, as torch's does), and ending a capture fails."""

    def __init__(self):
        self.default = self.Stream()
        self.current = self.default
        self.captures = 0

    class Stream:
        def __init__(self, device=None):
            pass

        def wait_stream(self, other):
            pass

    @contextlib.contextmanager
    def stream(self, stream):
        previous, self.current = self.current, stream
        try:
            yield
        finally:
            self.current = previous

    def graph_class(self):
        fake = self

        class Graph:
            def __init__(self, *args, **kwargs):
                fake.captures += 1

            def capture_begin(self, *args, **kwargs):
                pass

            def capture_end(self):
                raise RuntimeError("CUDA error: operation failed due to a previous error during capture")

        return Graph

    def install(self, monkeypatch) -> None:
        for name, value in {"Stream": self.Stream, "stream": self.stream, "current_stream": lambda *_: self.current,
                            "synchronize": lambda *_: None, "empty_cache": lambda: None,
                            "CUDAGraph": self.graph_class(), "graph_pool_handle": lambda: "memory pool"}.items():
            monkeypatch.setattr(torch.cuda, name, value)
        monkeypatch.setattr(torch._C, "_host_emptyCache", lambda: None, raising=False)
        monkeypatch.setattr(torch.cuda.graph, "default_capture_stream", None)  # torch's own keeps a fake stream


def test_a_failed_capture_restores_the_stream_and_turns_graphs_off_for_the_process(span, monkeypatch):
    """Ending the capture fails: the round still gets its (eager) outputs, the thread is back on its own
    stream (torch.cuda.graph's exit skipped that, and the old code stayed on the capture stream), and no
    capture is tried again in this process, not even by a span's new graphs (the old code tried each time)."""
    monkeypatch.setattr(graphs_module, "_capture_failed", False, raising=False)
    cuda = FakeCuda()
    cuda.install(monkeypatch)
    span.use_graphs(capture=True)
    cache = prefilled(span, 5)
    hidden = torch.randn(1, 1, span.config.hidden_size)
    output = span.forward_packed(hidden, [Segment(1, 1, 5, cache)])
    assert cuda.captures == 1
    assert cuda.current is cuda.default
    assert span.graphs is None
    torch.testing.assert_close(output, span.forward_packed(hidden, [Segment(1, 1, 5, cache)]), atol=ATOL, rtol=0)
    span.use_graphs(capture=True)  # what a new pool, or a new span after a rebalance, asks for
    span.new_pool(1024)
    span.forward_packed(hidden, [Segment(1, 1, 0, span.new_cache(1, 16))])
    assert cuda.captures == 1 and span.graphs is None


# ------------------------------------------------------------------------------ a rebalance that fails


def presence_of(backend: Backend, span, monkeypatch, new_span=None, error=None) -> list:
    """A server's Presence around `backend`, with no network: its announcements are recorded (returned), and
    loading the next span gives `new_span` or raises `error`."""
    announced = []

    async def announce(*args, **kwargs):
        announced.append(args)

    async def load(*args, **kwargs):
        if error is not None:
            raise error
        return new_span, 1.0

    monkeypatch.setattr(server_main.dht, "announce", announce)
    monkeypatch.setattr(server_main, "_load", load)
    presence = server_main.Presence.__new__(server_main.Presence)
    presence.node, presence.settings, presence.folder, presence.num_blocks = None, None, None, BLOCKS
    presence.prefix, presence.span, presence.throughput, presence.backend = "tiny", span, 1.0, backend
    presence.expiration, presence.relayed, presence.pusher, presence._pings = 10, False, None, None
    return presence, announced


@pytest.mark.parametrize("failing", ["loading the span", "the new pool"])
def test_a_rebalance_that_runs_out_of_memory_keeps_serving_the_old_span(folder, span, monkeypatch, failing):
    """Out of memory while the new span loads, or while its pool is made: the server stays on its blocks,
    its sessions go on, nothing is announced (the old code's error ended the server; or, failing in the
    pool, it had already evicted every session)."""
    new_span = load_span(folder, 1, BLOCKS)
    out_of_memory = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    if failing == "the new pool":
        monkeypatch.setattr(new_span, "new_pool", lambda tokens: (_ for _ in ()).throw(out_of_memory))

    async def scenario():
        backend = Backend(span, CacheBudget(256), ServerLimits())
        try:
            presence, announced = presence_of(backend, span, monkeypatch, new_span,
                                              out_of_memory if failing == "loading the span" else None)
            session = await backend.open_session({"start": 0, "end": BLOCKS, "max_length": 32, "batch_size": 1},
                                                 "peer")
            await presence.move_to(1, BLOCKS)
            assert presence.span is span and backend.span is span and not announced
            assert not session.evicted
            await session.step([torch.randn(1, 2, span.config.hidden_size)], {"position": 0})
        finally:
            backend.close()

    asyncio.run(scenario())


def test_a_gpu_servers_memory_counts_its_graphs_and_the_cuda_context(span, monkeypatch):
    """What a server says it holds on its GPU (the ready line): weights, the cache pool, the graphs captured
    ahead, and what torch's allocator does not see (the CUDA context, workspaces): the device's used memory past
    what torch reserved."""
    from swarm.server.span import GraphsCaptured

    gib = 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (10 * gib, 16 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 4 * gib)
    held = server_main.device_memory(span, GraphsCaptured(rounds=200, seconds=3.0, memory_bytes=gib // 2))
    pool = span.pool.keys.numel() * span.pool.keys.element_size() * 2
    assert held == {"weights": span.weight_bytes(), "cache": pool, "graphs": gib // 2, "context": 2 * gib}


def test_rounds_of_one_to_the_cap_of_sessions_never_capture_after_start_up(folder, made):
    """Decode rounds of 1 to 64 sessions as their keys grow past two buckets: every one replays a round made at
    start-up (capture_ahead), none is made on the serving path."""
    span = load_span(folder, 0, BLOCKS)
    span.new_pool(64 * 160)
    caches = [span.new_cache(1, 160) for _ in range(64)]
    for cache in caches:
        span(torch.randn(1, 40, span.config.hidden_size), 0, cache)
    span.use_graphs(capture=False)
    span.capture_graphs_ahead(max_tokens=64, max_keys=256)
    made.clear()
    for sessions in (1, 7, 64):
        for past in (0, 30, 90):  # 41, 71 and 131 keys: three buckets
            segments = [Segment(1, 1, 40 + past, cache) for cache in caches[:sessions]]
            for cache in caches[:sessions]:
                cache.prepare(40 + past, 41 + past)
            assert span.graphs.replay(torch.randn(1, sessions, span.config.hidden_size), segments, 0, BLOCKS) \
                is not None
    assert not made


HOST_READS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero", "cpu", "numpy")


@pytest.mark.parametrize("lengths", [[1, 1, 1], [9, 5, 1]], ids=["decode", "mixed"])
def test_a_graphed_round_reads_nothing_back_to_the_host(span, monkeypatch, lengths):
    """What would stall the host on a GPU, reading a tensor's value (item, tolist, bool, int, nonzero, cpu ...),
    never happens inside a graphed round's forward, decode or verify: the round's indices are all built on the
    host before it (graphs.padded_round), and its outputs go back after it. A fake of torch's sync debug mode,
    for a CPU; tests/integration/test_devices.py has the real one for a GPU."""
    caches = [prefilled(span, 20) for _ in lengths]
    span.use_graphs(capture=False)
    span.capture_graphs_ahead(max_tokens=64, max_keys=64)
    reads, inside = [], [False]
    for name in HOST_READS:
        def recorded(self, *args, _name=name, _original=getattr(torch.Tensor, name), **kwargs):
            if inside[0]:
                reads.append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, recorded)
    forward_batch = span.graphs.forward_batch

    def watched(*args):
        inside[0] = True
        try:
            return forward_batch(*args)
        finally:
            inside[0] = False

    monkeypatch.setattr(span.graphs, "forward_batch", watched)
    segments = [Segment(1, length, 20, cache) for length, cache in zip(lengths, caches)]
    assert span.graphs.replay(torch.randn(1, sum(lengths), span.config.hidden_size), segments, 0, BLOCKS) is not None
    assert reads == []
    inside[0] = True  # the fake sees a read when there is one
    torch.ones(1).item()
    assert reads == ["item"]

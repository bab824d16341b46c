"""Continuous batching: requests run together (packed, chunked) give what each gives alone; the cache budget
is enforced with a bounded wait and fully given back."""

import asyncio
import time

import pytest
import torch

from swarm.server import metrics
from swarm.server.batching import Scheduler, Job
from swarm.server.attention import Segment
from swarm.server.span import load_span
from swarm.server.cache import PAGE_TOKENS, CacheBudget
from swarm.protocol import CacheFullError
from swarm.server.backend import Backend, ServerLimits
from op_counts import count_torch_ops
from tiny_model import build_tiny_model

ATOL = 1e-4  # float32 sums in another order when more rows share a matrix product
FAMILY_OVERRIDES = {"mistral": {"sliding_window": 5}, "qwen2": {"perturb_vectors": True}}


@pytest.fixture(scope="module", params=["llama", "mistral", "qwen2", "bloom", "gpt2"])
def family_span(request, tmp_path_factory):
    folder = build_tiny_model(tmp_path_factory.mktemp(request.param), request.param, 3,
                              **FAMILY_OVERRIDES.get(request.param, {}))
    return load_span(folder, 0, 3)


@pytest.fixture(scope="module")
def llama_span(tmp_path_factory):
    return load_span(build_tiny_model(tmp_path_factory.mktemp("llama"), "llama", 3), 0, 3)


def batch_hidden(span, rows: int, length: int) -> torch.Tensor:
    return torch.randn(rows, length, span.config.hidden_size)


def histogram(histogram_metric) -> dict:
    """{'count': rounds so far, 'single': rounds of one sequence} of the batch-size histogram."""
    samples = {(sample.name, sample.labels.get("le")): sample.value
               for metric in histogram_metric.collect() for sample in metric.samples}
    return {"count": samples[("swarm_server_batch_size_count", None)],
            "single": samples[("swarm_server_batch_size_bucket", "1.0")]}


# ------------------------------------------------------------------------------------------- packing


def test_packed_segments_equal_each_run_alone(family_span):
    """Fresh prompts, decode steps at different positions, a chunk in the middle, two rows and a cache-less
    sequence, all in one forward: each output and each cache as if its request had run alone."""
    span = family_span
    requests = [  # (rows, past positions already cached, new positions, cached?)
        (1, 0, 6, True),
        (1, 7, 1, True),
        (2, 9, 1, True),
        (1, 4, 3, True),
        (1, 0, 5, False),
    ]
    alone_caches, packed_caches, segments, inputs, expected = [], [], [], [], []
    for rows, past, new, cached in requests:
        prefix, hidden = batch_hidden(span, rows, past), batch_hidden(span, rows, new)
        caches = [span.new_cache(rows, capacity=16) if cached else None for _ in range(2)]
        if past:
            for cache in caches:
                span(prefix, 0, cache)
        expected.append(span(hidden, past, caches[0]))
        alone_caches.append(caches[0])
        packed_caches.append(caches[1])
        segments.append(Segment(rows, new, past, caches[1]))
        inputs.append(hidden.reshape(-1, hidden.shape[-1]))

    output = span.forward_packed(torch.cat(inputs)[None], segments)[0]
    offset = 0
    for segment, wanted in zip(segments, expected):
        torch.testing.assert_close(output[offset : offset + segment.tokens].view(wanted.shape), wanted, atol=ATOL, rtol=0)
        offset += segment.tokens
    for alone, packed, (_, past, new, cached) in zip(alone_caches, packed_caches, requests):
        if cached:
            for layer in range(3):
                for packed_part, alone_part in zip(packed.read(layer, past + new), alone.read(layer, past + new)):
                    torch.testing.assert_close(packed_part, alone_part)


# ------------------------------------------------------------------------------------------- the scheduler


async def run_session(scheduler, span, prompt: torch.Tensor, steps: list[torch.Tensor]) -> list[torch.Tensor]:
    cache = span.new_cache(prompt.shape[0], capacity=64)
    outputs = [await scheduler.submit(prompt, 0, 0, 3, cache)]
    for position, step in enumerate(steps, start=prompt.shape[1]):
        outputs.append(await scheduler.submit(step, position, 0, 3, cache))
    return outputs


def run_alone(span, prompt, steps) -> list[torch.Tensor]:
    cache = span.new_cache(prompt.shape[0], capacity=64)
    outputs = [span(prompt, 0, cache)]
    for position, step in enumerate(steps, start=prompt.shape[1]):
        outputs.append(span(step, position, cache))
    return outputs


@pytest.mark.parametrize("pipeline", [False, True], ids=["one round at a time", "pipelined"])
def test_concurrent_sessions_batch_and_equal_each_alone(llama_span, pipeline):
    """Also pipelined, as on a GPU: each round is queued before the one in flight is delivered (a prompt's next
    chunk waits for its last one)."""
    span = llama_span
    sessions = [(batch_hidden(span, 1, length), [batch_hidden(span, 1, 1) for _ in range(12)])
                for length in (3, 9, 17, 5, 1, 30)]
    before = histogram(metrics.BATCH_SIZE)

    async def all_at_once():
        scheduler = Scheduler(lambda: span, prefill_chunk_tokens=8, pipeline=pipeline)
        try:
            return await asyncio.gather(*(run_session(scheduler, span, *session) for session in sessions))
        finally:
            scheduler.stop()

    results = asyncio.run(all_at_once())
    for session, outputs in zip(sessions, results):
        for got, wanted in zip(outputs, run_alone(span, *session)):
            torch.testing.assert_close(got, wanted, atol=ATOL, rtol=0)
    after = histogram(metrics.BATCH_SIZE)
    rounds = after["count"] - before["count"]
    assert rounds < 6 * 13, "steps of different sessions were never batched"
    assert after["single"] - before["single"] < rounds


@pytest.mark.parametrize("pipeline", [False, True], ids=["one round at a time", "pipelined"])
def test_a_long_prompt_runs_in_chunks_and_keeps_its_outputs(llama_span, pipeline):
    span = llama_span
    prompt = batch_hidden(span, 1, 37)
    decoding = (batch_hidden(span, 1, 4), [batch_hidden(span, 1, 1) for _ in range(6)])

    async def scenario():
        scheduler = Scheduler(lambda: span, prefill_chunk_tokens=4, pipeline=pipeline)
        try:
            return await asyncio.gather(run_session(scheduler, span, *decoding), run_session(scheduler, span, prompt, []))
        finally:
            scheduler.stop()

    before = histogram(metrics.BATCH_SIZE)
    decoded, (prefilled,) = asyncio.run(scenario())
    torch.testing.assert_close(prefilled, span(prompt), atol=ATOL, rtol=0)  # chunking preserves the outputs
    for got, wanted in zip(decoded, run_alone(span, *decoding)):
        torch.testing.assert_close(got, wanted, atol=ATOL, rtol=0)
    assert histogram(metrics.BATCH_SIZE)["count"] - before["count"] >= 37 // 4  # in chunks of 4 positions


def test_a_round_takes_every_decode_step_first_then_one_chunk_of_a_prompt(llama_span):
    """The policy that keeps decoding sessions going while a long prompt is read, checked round by round."""
    span, loop = llama_span, asyncio.new_event_loop()
    scheduler = Scheduler(lambda: span, prefill_chunk_tokens=4)
    scheduler.stop()  # its thread picks no round: this test picks them

    def job(length: int, position: int = 0) -> Job:
        return Job(batch_hidden(span, 1, length), position, 0, 3, span.new_cache(1, 64), loop,
                    loop.create_future())

    prompt, steps = job(37), [job(1, position=9) for _ in range(3)]
    scheduler._waiting = [prompt, *steps]
    assert scheduler._next_round() == [(steps[0], 1), (steps[1], 1), (steps[2], 1), (prompt, 4)]
    scheduler._waiting = [prompt]
    assert scheduler._next_round() == [(prompt, 4)]  # alone, a prompt still goes a chunk at a time
    loop.close()


# ------------------------------------------------------------------------------------------- the budget


def test_the_budget_waits_a_bounded_time_then_refuses():
    async def scenario():
        budget = CacheBudget(256)
        await budget.take(200, wait=0)
        with pytest.raises(CacheFullError, match="more than this server's whole cache"):
            await budget.take(257, wait=5)  # could never fit: refused at once
        began = time.monotonic()
        with pytest.raises(CacheFullError, match="after waiting 0.2 s"):
            await budget.take(100, wait=0.2)
        assert 0.2 <= time.monotonic() - began < 2

        waiter = asyncio.ensure_future(budget.take(100, wait=5))
        await asyncio.sleep(0.05)
        assert not waiter.done()  # waiting for room
        budget.give_back(200)
        await asyncio.wait_for(waiter, 2)  # the room that came back went to it
        assert budget.used == 100

    asyncio.run(scenario())


def test_sessions_take_pages_as_they_grow_and_give_all_back(llama_span):
    span = llama_span

    async def scenario():
        backend = Backend(span, CacheBudget(3 * PAGE_TOKENS), ServerLimits(cache_wait=0.1))
        try:
            opening = {"start": 0, "end": 3, "max_length": 4 * PAGE_TOKENS, "batch_size": 1}
            first, second = await backend.open_session(opening, "peer"), await backend.open_session(opening, "peer")
            assert backend.budget.used == 2 * PAGE_TOKENS  # one page each, not max_length

            await first.step([batch_hidden(span, 1, PAGE_TOKENS + 1)], {"position": 0})
            assert backend.budget.used == 3 * PAGE_TOKENS  # the first grew by a page
            with pytest.raises(CacheFullError):
                await second.step([batch_hidden(span, 1, PAGE_TOKENS + 1)], {"position": 0})
            await second.step([batch_hidden(span, 1, 5)], {"position": 0})  # within its page: goes on

            first.close()
            await second.step([batch_hidden(span, 1, PAGE_TOKENS)], {"position": 5})  # now there is room
            second.close()
            assert backend.budget.used == 0 and not backend.sessions
        finally:
            backend.close()

    asyncio.run(scenario())


# ------------------------------------------------------------------------------------------- structure


@pytest.mark.parametrize("sessions", [8, 64])
def test_a_decode_round_issues_as_many_torch_ops_for_many_sessions_as_for_two(family_span, sessions):
    """Attention runs per group of sequences over the page pool, never per session: a round's op count does
    not grow with the number of sessions (what a GPU needs, so that its CPU is not the bottleneck); a lone
    session's may be lower (swarm/server/attention.py: its consecutive pages are read in place)."""
    span = family_span
    span.new_pool(64 * 64 * 2)

    def decode_round(count: int) -> int:
        segments = []
        for index in range(count):
            cache = span.new_cache(1, capacity=64)
            past = 3 + (index * 7) % 40  # sessions at different lengths, some across page boundaries
            span(batch_hidden(span, 1, past), 0, cache)
            segments.append(Segment(1, 1, past, cache))
        hidden = batch_hidden(span, count, 1).reshape(1, count, -1)
        try:
            return count_torch_ops(lambda: span.forward_packed(hidden, segments))
        finally:
            for segment in segments:
                segment.cache.release()

    # a lone session's pages lie one after another here: it reads them in place, one call fewer per gather
    assert decode_round(sessions) == decode_round(2) >= decode_round(1)


# ------------------------------------------------------------------------------------------- decode graphs


@pytest.mark.parametrize("sessions", [1, 3, 6])
def test_padded_decode_rounds_equal_eager_ones(family_span, sessions):
    """The CUDA decode path's rounds (padded to a bucket of sequences and keys, over static tensors), run
    eagerly on the CPU: the same outputs and caches as unpadded eager rounds, round after round, with padding
    that never touches the zero page."""
    span = family_span
    pasts = [3 + 9 * index for index in range(sessions)]  # different lengths, across page boundaries
    eager_caches, graph_caches = [span.new_cache(1, 96) for _ in pasts], [span.new_cache(1, 96) for _ in pasts]
    for past, eager, graphed in zip(pasts, eager_caches, graph_caches):
        prompt = batch_hidden(span, 1, past)
        span(prompt, 0, eager)
        span(prompt, 0, graphed)
    graphs = span.new_graphs(capture=False)
    try:
        for step in range(PAGE_TOKENS + 2):  # some sessions cross into a new page on the way
            hidden = batch_hidden(span, sessions, 1).reshape(1, sessions, -1)
            positions = [past + step for past in pasts]
            eager = span.forward_packed(hidden, [Segment(1, 1, p, c) for p, c in zip(positions, eager_caches)])
            graphed = graphs.replay(hidden, [Segment(1, 1, p, c) for p, c in zip(positions, graph_caches)], 0, 3)
            torch.testing.assert_close(graphed, eager, atol=ATOL, rtol=0)
        assert len(graphs.rounds) <= 2  # one bucket of sequences, at most two of keys
        for eager, graphed, past in zip(eager_caches, graph_caches, pasts):
            for layer in range(3):
                for graphed_part, eager_part in zip(graphed.read(layer, past + PAGE_TOKENS + 2),
                                                    eager.read(layer, past + PAGE_TOKENS + 2)):
                    torch.testing.assert_close(graphed_part, eager_part, atol=ATOL, rtol=0)
        zero_page = span.pool.keys[:, span.pool.zero_slot : span.pool.scratch_slot]
        assert not zero_page.any()
    finally:
        for cache in eager_caches + graph_caches:
            cache.release()


def test_rounds_a_graph_cannot_serve_run_eagerly(llama_span):
    span = llama_span
    span.new_pool(1024)  # the tests above leave their caches' pages taken
    graphs = span.new_graphs(capture=False)
    cache = span.new_cache(1, 64)
    try:
        prefill = [Segment(1, 40, 0, cache)]  # longer than the longest draft being verified
        assert graphs.replay(batch_hidden(span, 1, 40).reshape(1, 40, -1), prefill, 0, 3) is None
        assert graphs.replay(batch_hidden(span, 1, 4).reshape(1, 4, -1), [Segment(1, 4, 0, None)], 0, 3) is None
        too_many = [Segment(1, 1, 0, cache)] * 257
        assert graphs.replay(batch_hidden(span, 257, 1).reshape(1, 257, -1), too_many, 0, 3) is None
        assert not graphs.rounds
    finally:
        cache.release()


# ------------------------------------------------------------------------------------------- head-of-line


async def rounds_by_hand(scheduler, span, sessions: int, until) -> list[list]:
    """Run rounds on this thread, one by one, until `until` is done; before each round every one of
    `sessions` decoding sessions queues its next step (as sessions decoding flat out do). Returns the rounds."""
    loop = asyncio.get_running_loop()
    caches = [span.new_cache(1, 512) for _ in range(sessions)]
    rounds = []
    try:
        while not until():
            steps = [Job(batch_hidden(span, 1, 1), len(rounds), 0, 3, cache, loop, loop.create_future())
                     for cache in caches]
            scheduler._waiting.extend(steps)
            round_ = scheduler._next_round()
            scheduler._compute_round(round_)
            rounds.append(round_)
            for _ in range(4):  # the results' callbacks, and the coroutines they wake
                await asyncio.sleep(0)
            assert all(step.future.done() for step in steps)
    finally:
        for cache in caches:
            cache.release()
    return rounds


def assert_every_session_steps_in_every_round(rounds: list[list], sessions: int, chunk: int) -> None:
    for index, round_ in enumerate(rounds):
        decoded = [job for job, positions in round_ if positions == 1 and job.hidden.shape[1] == 1]
        assert len(decoded) == sessions, f"round {index}: {len(decoded)} of {sessions} sessions stepped"
        others = sum(job.rows * positions for job, positions in round_ if job not in decoded)
        assert others <= chunk, f"round {index}: {others} other tokens, over one chunk"


def test_a_long_cacheless_forward_holds_no_session_up_for_more_than_a_chunk(llama_span):
    """A cache-less forward of 2,000 positions (an embedding, /v1/chooses, a spot check's replay) goes through
    in chunks of a temporary cache, between the decoding sessions' steps, round by round; its output is the
    unchunked forward's, and its temporary cache goes back."""
    span, chunk, sessions = llama_span, 128, 4
    sequence = batch_hidden(span, 1, 2000)

    async def scenario():
        backend = Backend(span, CacheBudget(4096), ServerLimits(), prefill_chunk_tokens=chunk)
        backend.scheduler.stop()  # its thread picks no round: this test runs them
        try:
            forward = asyncio.ensure_future(backend.forward([sequence], {"start": 0, "end": 3}))
            while not backend.scheduler._waiting:
                await asyncio.sleep(0)
            assert backend.budget.used == 2000  # its temporary cache: 125 pages
            rounds = await rounds_by_hand(backend.scheduler, span, sessions, forward.done)
            return rounds, await forward, backend.budget.used
        finally:
            backend.close()

    rounds, output, used = asyncio.run(scenario())
    assert len(rounds) == -(-2000 // chunk)
    assert_every_session_steps_in_every_round(rounds, sessions, chunk)
    torch.testing.assert_close(output, span(sequence), atol=ATOL, rtol=0)
    assert used == 0


def test_a_6613_token_prompt_holds_no_session_up_for_more_than_a_chunk(llama_span):
    """A chat client's prompt with 36 tool definitions: 6,613 tokens, read a chunk per round while the other
    sessions decode."""
    span, chunk, sessions = llama_span, 128, 4
    span.new_pool(16384)

    async def scenario():
        scheduler = Scheduler(lambda: span, prefill_chunk_tokens=chunk)
        scheduler.stop()
        loop = asyncio.get_running_loop()
        cache = span.new_cache(1, 6613)
        prompt = Job(batch_hidden(span, 1, 6613), 0, 0, 3, cache, loop, loop.create_future())
        scheduler._waiting.append(prompt)
        try:
            return await rounds_by_hand(scheduler, span, sessions, prompt.future.done), prompt.future.result()
        finally:
            cache.release()

    rounds, output = asyncio.run(scenario())
    assert len(rounds) == -(-6613 // chunk)
    assert_every_session_steps_in_every_round(rounds, sessions, chunk)
    assert output.shape == (1, 6613, span.config.hidden_size)


@pytest.mark.parametrize("rows, length, rounds", [(2, 37, 10), (5, 3, 3), (1, 8, 1)])
def test_cacheless_forwards_in_chunks_equal_the_unchunked_forward(family_span, rows, length, rounds):
    """Through the compute thread, a chunk at a time: with a temporary cache when a sequence is longer than a
    chunk (2 x 37), a few rows at a time when it is not (5 x 3: rows of 2, 2 and 1), whole when it fits."""
    span = family_span
    hidden = batch_hidden(span, rows, length)

    async def scenario():
        backend = Backend(span, CacheBudget(1024), ServerLimits(), prefill_chunk_tokens=8)
        try:
            output = await backend.forward([hidden], {"start": 0, "end": 3})
            return output, backend.budget.used
        finally:
            backend.close()

    before = histogram(metrics.BATCH_SIZE)["count"]
    output, used = asyncio.run(scenario())
    torch.testing.assert_close(output, span(hidden), atol=ATOL, rtol=0)
    assert used == 0
    assert histogram(metrics.BATCH_SIZE)["count"] - before == rounds  # 4 positions of 2 rows a round; 2 rows of 3


def test_a_temporary_cache_goes_back_after_success_failure_and_cancel(llama_span, monkeypatch):
    import threading

    from swarm.protocol import InternalServerError

    span, hidden = llama_span, batch_hidden(llama_span, 1, 40)  # 3 pages of temporary cache, 5 chunks of 8
    original, calls = span.forward_packed, []
    entered, release, fail = threading.Event(), threading.Event(), threading.Event()

    def forward_packed(*args, **kwargs):
        calls.append(1)
        entered.set()
        release.wait(30)
        if fail.is_set():
            raise RuntimeError("out of memory, say")
        return original(*args, **kwargs)

    monkeypatch.setattr(span, "forward_packed", forward_packed)

    async def scenario():
        backend = Backend(span, CacheBudget(1024), ServerLimits(cache_wait=0.1), prefill_chunk_tokens=8)
        request = {"start": 0, "end": 3}
        try:
            release.set()
            await backend.forward([hidden], request)  # success
            assert backend.budget.used == 0 and len(calls) == 5
            fail.set()
            with pytest.raises(InternalServerError):  # failure
                await backend.forward([hidden], request)
            assert backend.budget.used == 0
            fail.clear(), release.clear(), entered.clear(), calls.clear()
            forward = asyncio.ensure_future(backend.forward([hidden], request))  # cancelled mid-way
            await asyncio.get_running_loop().run_in_executor(None, entered.wait, 30)
            assert backend.budget.used == 3 * PAGE_TOKENS
            forward.cancel()
            release.set()
            deadline = time.monotonic() + 30
            while backend.budget.used and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            assert backend.budget.used == 0
            assert len(calls) == 1  # its caller hung up: the rest of it never ran
            await backend.budget.take(1024 - PAGE_TOKENS, wait=0)  # too little room left: refused after the wait
            with pytest.raises(CacheFullError, match="after waiting 0.1 s"):
                await backend.forward([hidden], request)
            assert backend.budget.used == 1024 - PAGE_TOKENS
        finally:
            backend.close()

    asyncio.run(scenario())

"""--simulated-latency's delays (swarm/server/latency.py), with the real class on a real event loop: each
message held half a round trip each way, messages in flight overlapping (never queued behind each other), order
kept on a stream whatever the jitter, and the handler's clean-up run when its stream is torn down."""

import asyncio
import time

import pytest

from swarm.server.latency import SimulatedLatency


async def _collect(iterator) -> list:
    return [item async for item in iterator]


async def _burst(count: int):
    for index in range(count):
        yield index


def test_the_delay_is_half_the_round_trip_each_way_plus_at_most_half_the_jitter():
    latency = SimulatedLatency(80, jitter_ms=40, seed=7)
    draws = [latency.one_way() for _ in range(2000)]
    assert min(draws) >= 0.040 and max(draws) <= 0.060
    assert max(draws) - min(draws) > 0.015  # spread over the range, not a constant
    again, other = SimulatedLatency(80, 40, seed=7), SimulatedLatency(80, 40, seed=8)
    assert draws[:50] == [again.one_way() for _ in range(50)]  # seeded: repeatable
    assert draws[:50] != [other.one_way() for _ in range(50)]
    assert not SimulatedLatency().enabled and SimulatedLatency(0, 5).enabled
    with pytest.raises(ValueError):
        SimulatedLatency(-1)


def test_a_burst_of_messages_arrives_after_one_delay_in_order_despite_jitter():
    latency = SimulatedLatency(200, jitter_ms=150, seed=1)  # draws vary by more than messages are apart

    async def scenario():
        began = time.monotonic()
        arrived = await _collect(latency.wrap(_echo_stream, stream_input=True, stream_output=True)(_burst(40), None))
        return arrived, time.monotonic() - began

    arrived, seconds = asyncio.run(scenario())
    assert arrived == list(range(40))  # in order: a message never overtakes the one before it
    assert seconds >= 0.2  # held a round trip: in, then out
    assert seconds < 0.2 * 40 / 4  # overlapping: queued one behind the other, 40 would take 8 s


async def _echo_stream(requests, context):
    async for request in requests:
        yield request


def test_unary_calls_are_delayed_both_ways_and_overlap():
    latency = SimulatedLatency(200)

    async def answer(request, context):
        return request * 2

    delayed = latency.wrap(answer, stream_input=False, stream_output=False)

    async def scenario():
        began = time.monotonic()
        answers = await asyncio.gather(*(delayed(index, None) for index in range(20)))
        return answers, time.monotonic() - began

    answers, seconds = asyncio.run(scenario())
    assert answers == [index * 2 for index in range(20)]
    assert 0.2 <= seconds < 2.0  # one round trip, not twenty


def test_a_torn_down_stream_runs_the_handlers_clean_up_and_stops_reading():
    latency = SimulatedLatency(20)

    async def scenario():
        done = asyncio.Event()

        async def handler(requests, context):
            try:
                async for request in requests:
                    yield request
            finally:
                done.set()

        async def endless():
            while True:
                yield "step"
                await asyncio.sleep(0.001)

        stream = latency.wrap(handler, stream_input=True, stream_output=True)(endless(), None)
        assert await anext(stream) == "step"
        await stream.aclose()  # the client hung up
        assert done.is_set()
        tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
        return tasks

    assert asyncio.run(scenario()) == []  # no pump left reading the hung-up stream


def test_a_broken_stream_is_told_after_the_messages_before_it():
    latency = SimulatedLatency(20)

    async def breaking():
        yield 1
        yield 2
        raise ConnectionResetError("gone")

    async def scenario():
        seen = []
        with pytest.raises(ConnectionResetError):
            async for item in latency.wrap(_echo_stream, stream_input=True, stream_output=True)(breaking(), None):
                seen.append(item)
        return seen

    assert asyncio.run(scenario()) == [1, 2]


def test_the_flags_are_off_unless_asked_and_checked(capsys, monkeypatch):
    from swarm.server.settings import parse_settings

    monkeypatch.delenv("SIMULATED_LATENCY_MS", raising=False)
    base = ["--blocks", "0:1", "--initial-peers", "/ip4/127.0.0.1/tcp/9/p2p/QmNnooDu7bfjPFoTZYxMNLWUQJyrVwtbZg5gBMjTezGAJN"]
    assert not parse_settings(base).latency.enabled
    latency = parse_settings([*base, "--simulated-latency", "50", "--simulated-latency-jitter", "10",
                              "--simulated-latency-seed", "3"]).latency
    assert (latency.round_trip_ms, latency.jitter_ms, latency.seed) == (50, 10, 3)
    assert latency.describe() == "simulated latency 50 ms per round trip + up to 10 ms jitter (seed 3)"
    monkeypatch.setenv("SIMULATED_LATENCY_MS", "25")  # the default of every server started on the machine
    assert parse_settings(base).latency.round_trip_ms == 25
    with pytest.raises(SystemExit):
        parse_settings([*base, "--simulated-latency", "-5"])
    assert "--simulated-latency must be between 0 and 60000 ms, got -5" in capsys.readouterr().err

"""A block server's own failures, without the network: a compute round that fails is one internal error
(counted and logged once, with its traceback), each of its requests answered with the code "internal_error";
a failed server-to-server push is counted and said once per next server at WARNING."""

import asyncio
import logging

import torch

from swarm.protocol import BadRequestError, InternalServerError, error_from_wire
from swarm.server import metrics
from swarm.server.batching import Scheduler, Job

PEERS = ("QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N", "QmNnooDu7bfjPFoTZYxMNLWUQJyrVwtbZg5gBMjTezGAJN")


def counted(counter, *labels) -> float:
    return counter.labels(*labels)._value.get()


class FailingSpan:
    def __init__(self, error: Exception):
        self.error = error

    def on_device(self, hidden):
        return hidden

    def forward_packed(self, *args, **kwargs):
        raise self.error


def run_one_round(error: Exception) -> list[BaseException]:
    """Three requests in one round of a span that fails with `error`: what each request gets."""

    async def scenario():
        scheduler = Scheduler(lambda: FailingSpan(error))
        scheduler.stop()  # this test runs the round
        loop = asyncio.get_running_loop()
        jobs = [Job(torch.zeros(1, length, 8), 0, 0, 2, None, loop, loop.create_future()) for length in (1, 2, 3)]
        scheduler._waiting.extend(jobs)
        round_ = scheduler._next_round()
        assert len(round_) == 3
        scheduler._compute_round(round_)
        await asyncio.wait([job.future for job in jobs])
        assert not scheduler._waiting
        return [job.future.exception() for job in jobs]

    return asyncio.run(scenario())


def test_a_failed_round_is_one_internal_error_for_each_of_its_requests(caplog):
    from swarm.server.handler import wire_error

    before, handled = counted(metrics.INTERNAL_ERRORS, "compute"), counted(metrics.INTERNAL_ERRORS, "handler")
    with caplog.at_level(logging.ERROR):
        errors = run_one_round(RuntimeError("CUDA out of memory, say"))
        replies = [wire_error(error) for error in errors]
    assert all(isinstance(error, InternalServerError) for error in errors)
    assert {error_from_wire(reply).code for reply in replies} == {"internal_error"}
    assert all("out of memory" not in str(reply) for reply in replies)  # the details stay in the server's log
    assert counted(metrics.INTERNAL_ERRORS, "compute") == before + 1  # one round, however many requests
    assert counted(metrics.INTERNAL_ERRORS, "handler") == handled  # and the replies do not count it again
    logged = [record for record in caplog.records if record.levelno >= logging.ERROR]
    assert len(logged) == 1 and logged[0].exc_info is not None and "out of memory" in caplog.text


def test_a_requests_own_error_in_a_round_travels_as_it_is(caplog):
    before = counted(metrics.INTERNAL_ERRORS, "compute")
    with caplog.at_level(logging.ERROR):
        errors = run_one_round(BadRequestError("blocks 0:2 are outside this server's span"))
    assert all(isinstance(error, BadRequestError) for error in errors)
    assert counted(metrics.INTERNAL_ERRORS, "compute") == before and not caplog.records


def test_any_other_error_reaching_a_reply_is_an_internal_error(caplog):
    from swarm.server.handler import wire_error

    before = counted(metrics.INTERNAL_ERRORS, "handler")
    with caplog.at_level(logging.ERROR):
        reply = wire_error(KeyError("a bug's secret detail"))
    assert error_from_wire(reply).code == "internal_error" and "secret" not in str(reply)
    assert counted(metrics.INTERNAL_ERRORS, "handler") == before + 1
    assert len(caplog.records) == 1 and caplog.records[0].exc_info is not None
    assert wire_error(BadRequestError("field 'x'")) == {"error": {"code": "bad_request", "message": "field 'x'"}}
    assert counted(metrics.INTERNAL_ERRORS, "handler") == before + 1


def test_failed_pushes_are_counted_and_said_once_per_next_server(monkeypatch, caplog):
    """Pushes to an unreachable server and to one that refuses them: every failed push counts, by reason, and
    each server is named once at WARNING (the later failures go to DEBUG)."""
    from hivemind.p2p import PeerID

    from swarm.protocol import ServerUnavailableError, error_to_wire
    from swarm.server.handler import COUNTERS
    from swarm.server.pushes import Pusher
    from swarm.wire import BlockRPC, reply

    unreachable, refusing = (PeerID.from_base58(peer) for peer in PEERS)

    class Stub:
        def __init__(self, peer):
            self.peer = peer

        async def rpc_push(self, message, timeout):
            if self.peer == unreachable:
                raise ConnectionError("connection refused")
            refusal = error_to_wire(ServerUnavailableError("no open session has this 'session_id'"))
            return reply(metadata={"results": [refusal, refusal]} if len(message.tensors) > 1 else refusal)

    monkeypatch.setattr(BlockRPC, "get_stub", classmethod(lambda cls, p2p, peer: Stub(peer)))
    output = torch.zeros(1, 1, 8)
    entry = {"session_id": "s" * 32, "step_id": 1, "position": 0}

    class EveryoneAnnounces:
        async def announce(self, peer_id, block):
            return True

    async def scenario():
        pusher = Pusher(dict.fromkeys(COUNTERS, 0), EveryoneAnnounces())
        for client in range(3):  # each time: one push to the first server, two in one message to the other
            # (of another client each time: an unreachable server gets no more of one client's pushes for a while)
            pusher.push([(unreachable, 2, entry, output), (refusing, 2, entry, output), (refusing, 2, entry, output)],
                        f"client {client}")
            await asyncio.gather(*pusher.tasks)
        return pusher.counters

    before = {reason: counted(metrics.PUSHES_FAILED, reason) for reason in ("unreachable", "refused")}
    with caplog.at_level(logging.DEBUG, logger="swarm.server.pushes"):
        counters = asyncio.run(scenario())
    assert counted(metrics.PUSHES_FAILED, "unreachable") == before["unreachable"] + 3
    assert counted(metrics.PUSHES_FAILED, "refused") == before["refused"] + 6
    assert counters["pushes_failed"] == 9 and counters["pushes_sent"] == 9 and counters["push_messages"] == 6
    warnings = [record.getMessage() for record in caplog.records if record.levelno == logging.WARNING]
    assert len(warnings) == 2
    assert sum(PEERS[0] in line for line in warnings) == 1 and sum(PEERS[1] in line for line in warnings) == 1
    assert "unreachable" in " ".join(warnings) and "refused" in " ".join(warnings)
    debug = [record for record in caplog.records if record.levelno == logging.DEBUG and "pushed to" in record.getMessage()]
    assert len(debug) == 4  # the second and third failure of each server

"""Multiplexed steps on a real swarm: the steps of all of a client's sessions on one server travel as one
rpc_steps message (and the servers' pushes to one next server as one rpc_push message), and each session still
equals the local model; a session is stepped only by the peer that opened it; garbage in a message gets
per-step errors, never a crash, and the other steps of the message run as if it were not there."""

import asyncio
import random
import secrets
import threading
import time

import pytest
import torch
import transformers

from shared_swarm import TINY_BLOCKS
from exact_match import assert_interleaved_sessions_match
from swarm.client import SwarmClient
from swarm.protocol import error_from_wire

PREFIX = "multiplex"
HIDDEN = 64  # the tiny model's
CACHE_TOKENS, MAX_SESSIONS_PER_PEER = 1024, 8


@pytest.fixture(scope="module")
def local_model(tiny_llama):
    return transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def server(tiny_swarm):
    return tiny_swarm.add_server(["--blocks", f"0:{TINY_BLOCKS}", "--dht-prefix", PREFIX, "--cache-tokens",
                                  str(CACHE_TOKENS), "--max-sessions-per-peer", str(MAX_SESSIONS_PER_PEER)])


@pytest.fixture(scope="module")
def client(tiny_swarm, server):
    client = SwarmClient(tiny_swarm.initial_peers)
    yield client
    client.shutdown()


@pytest.fixture(scope="module")
def intruder(tiny_swarm, server):
    """Another peer: it knows a session's id (as the previous server of the chain does), nothing more."""
    client = SwarmClient(tiny_swarm.initial_peers)
    yield client
    client.shutdown()


# ------------------------------------------------------------------------------------------------ helpers


class RawSteps:
    """An rpc_steps stream driven by hand: messages as a careless or hostile peer would send them."""

    def __init__(self, client, peer_id: str):
        from hivemind.p2p import PeerID

        from swarm.wire import BlockRPC

        self.stub = BlockRPC.get_stub(client.node.p2p, PeerID.from_base58(peer_id))
        self.requests: asyncio.Queue = asyncio.Queue()
        self.responses = None

    async def open(self) -> "RawSteps":
        async def requests():
            while (message := await self.requests.get()) is not None:
                yield message

        self.responses = await self.stub.rpc_steps(requests())
        return self

    def send(self, tensors=(), metadata=None, raw_metadata: bytes = None) -> None:
        """The steps' tensors as a message carries them: stacked in one, each map among the entries told its rows
        and length; tensors that do not match the entries, or cannot stack, go as they are."""
        from hivemind.proto import runtime_pb2

        from swarm.wire import pack, stacked

        tensors, entries = list(tensors), (metadata or {}).get("steps")
        if isinstance(entries, list) and len(entries) == len(tensors) and all(t.ndim == 3 for t in tensors):
            metadata = {**metadata, "steps": [{**entry, "rows": t.shape[0], "length": t.shape[1]}
                                              if isinstance(entry, dict) else entry
                                              for entry, t in zip(entries, tensors)]}
        if tensors and all(t.ndim == 3 and t.shape[2] == tensors[0].shape[2] and t.dtype == tensors[0].dtype
                           and t.numel() for t in tensors):
            tensors = list(stacked(tensors))
        message = pack(tuple(tensors), metadata)
        if raw_metadata is not None:
            message = runtime_pb2.ExpertRequest(tensors=message.tensors, metadata=raw_metadata)
        self.requests.put_nowait(message)

    async def receive(self) -> tuple[list, dict]:
        from swarm.wire import unpack

        return unpack(await asyncio.wait_for(anext(self.responses), 30))

    async def exchange(self, tensors=(), metadata=None, raw_metadata: bytes = None) -> tuple[list, dict]:
        self.send(tensors, metadata, raw_metadata)
        return await self.receive()

    async def close(self) -> None:
        self.requests.put_nowait(None)
        await self.responses.aclose()


def outcomes(metadata: dict) -> list[str]:
    """Each step's outcome in a reply: "ok" or its error's code."""
    return [getattr(error_from_wire(result), "code", "ok") for result in metadata["results"]]


def step(session_id: str, position: int, step_id: int, **extra) -> dict:
    return {"session_id": session_id, "position": position, "step_id": step_id, **extra}


async def open_stream(client, server, max_length: int = 32):
    from swarm.client.stubs import InferenceStream

    stream = InferenceStream(client.node.p2p, server.peer_id, 0, TINY_BLOCKS, 30, client.step_channels)
    await stream.open(max_length, batch_size=1)
    return stream


def forward(client, server, hidden):
    from swarm.client.stubs import call_forward

    return client.loop.run(call_forward(client.node.p2p, server.peer_id, hidden, 0, TINY_BLOCKS, timeout=30))


async def served(client, server) -> int:
    """Positions the server ran (read on the client's event loop, from inside a scenario)."""
    from swarm.client.stubs import call_info

    return (await call_info(client.node.p2p, server.peer_id))["positions_served"]


def counters(client, peer_ids) -> dict:
    return {peer: client.server_info(peer) for peer in peer_ids}


# ------------------------------------------------------------------------------------------------- tests


def test_concurrent_sessions_share_messages_and_match_the_local_model(tiny_remote, local_model):
    """Sessions stepping at once from six threads: each equals the local model token by token, and the servers
    got fewer step messages than steps (and the first server fewer push messages than pushes)."""
    chain = [link.peer_id for link in tiny_remote.client.chain(tiny_remote.prefix, tiny_remote.num_blocks,
                                                               tiny_remote.name)]
    before = counters(tiny_remote.client, chain)
    channels = [tiny_remote.client.loop.run(_channel_counts(tiny_remote.client, peer)) for peer in chain]
    errors = []

    def check(seed):
        try:
            assert_interleaved_sessions_match(tiny_remote, local_model, (2 + seed % 3, 5 + seed), new_tokens=10,
                                              seed=seed)
        except BaseException as error:  # reported by the main thread
            errors.append(error)

    threads = [threading.Thread(target=check, args=(seed,)) for seed in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    assert not errors, errors[0]

    after = counters(tiny_remote.client, chain)
    sent = {name: after[chain[0]][name] - before[chain[0]][name] for name in ("push_messages", "pushes_sent")}
    for peer in chain:
        messages = after[peer]["step_messages"] - before[peer]["step_messages"]
        steps = after[peer]["steps_received"] - before[peer]["steps_received"]
        print(f"\nserver {peer[-6:]}: {steps} steps in {messages} messages; pushes {sent}")
        assert steps >= 12 * 10  # twelve sessions of ten steps each went through every server
        assert messages < steps
    assert 0 < sent["push_messages"] < sent["pushes_sent"]
    for peer, (messages, steps) in zip(chain, channels):  # the client's side of the same count
        now = tiny_remote.client.loop.run(_channel_counts(tiny_remote.client, peer))
        assert now[0] - messages < now[1] - steps


async def _channel_counts(client, peer_id: str) -> tuple[int, int]:
    channel = client.step_channels.get(peer_id)
    return channel.messages_sent, channel.steps_sent


def test_a_session_cannot_be_stepped_by_another_peer(client, intruder, server):
    inputs = torch.randn(1, 3, HIDDEN)

    async def scenario():
        owner = await open_stream(client, server)
        own, foreign = await RawSteps(client, server.peer_id).open(), await RawSteps(intruder, server.peer_id).open()
        try:
            outputs, metadata = await own.exchange([inputs[:, :2]], {"message_id": 1, "steps": [
                step(owner.session_id, 0, 1)]})
            assert outcomes(metadata) == ["ok"] and metadata["message_id"] == 1
            ran = await served(client, server)
            # the intruder names the owner's session, and a session that does not exist: the same refusal
            stolen, refused = await foreign.exchange([inputs[:, 2:], inputs[:, 2:]], {"message_id": 7, "steps": [
                step(owner.session_id, 2, 2), step(secrets.token_hex(16), 0, 1)]})
            assert stolen == [] and outcomes(refused) == ["session_closed"] * 2
            assert refused["results"][0] == refused["results"][1]  # nothing tells the owner's session apart
            assert await served(client, server) == ran  # nothing ran
            rest, metadata = await own.exchange([inputs[:, 2:]], {"message_id": 2, "steps": [
                step(owner.session_id, 2, 2)]})
            assert outcomes(metadata) == ["ok"]
            return torch.cat([outputs[0], rest[0]], dim=1)
        finally:
            await own.close()
            await foreign.close()
            await owner.close()

    steps = client.loop.run(scenario(), timeout=60)
    torch.testing.assert_close(steps, forward(client, server, inputs), atol=1e-4, rtol=0)


def test_garbage_in_a_message_gets_per_step_errors_and_the_good_steps_run(client, server):
    sent = []  # the inputs of the session's steps that ran, in order

    async def scenario():
        session = await open_stream(client, server)
        stream = await RawSteps(client, server.peer_id).open()
        sid, good = session.session_id, lambda length=1: torch.randn(1, length, HIDDEN)
        outputs = []
        try:
            # not a list of steps: the whole message is refused, and says which message it was
            _, metadata = await stream.exchange([good()], {"message_id": 1, "steps": "all of them"})
            assert error_from_wire(metadata).code == "bad_request" and metadata["message_id"] == 1
            _, metadata = await stream.exchange([good()], raw_metadata=b"\xc1 not msgpack")
            assert error_from_wire(metadata).code == "bad_request" and metadata.get("message_id") is None
            too_many = [step(secrets.token_hex(16), 0, 1)] * (MAX_SESSIONS_PER_PEER + 1)
            _, metadata = await stream.exchange([], {"message_id": 2, "steps": too_many})
            assert "limit" in str(error_from_wire(metadata))

            # steps that do not say their part of the tensor, or parts that do not add up to it: which tokens are
            # whose is unknown, so none runs
            _, metadata = await stream.exchange([good(2)], {"message_id": 3, "steps": [step(sid, 0, 1)] * 2})
            assert error_from_wire(metadata).code == "bad_request" and metadata["message_id"] == 3
            _, metadata = await stream.exchange([good(), good()], {"message_id": 5, "steps": ["a step",
                                                                                            step(sid, 0, 1)]})
            assert error_from_wire(metadata).code == "bad_request"

            # bad entries and unknown sessions beside a good step: only the good one runs
            first = good(2)
            entries = [{"session_id": 5}, {}, step(secrets.token_hex(16), 0, 1), step(sid, 0, 1)]
            tensors, metadata = await stream.exchange([good(), good(), good(), first],
                                                      {"message_id": 4, "steps": entries})
            assert outcomes(metadata) == ["bad_request"] * 2 + ["session_closed", "ok"]
            assert len(tensors) == 1 and tensors[0].shape == (1, 2, HIDDEN)
            outputs.append(tensors[0]), sent.append(first)

            # non-finite, misshapen, mistyped inputs, wrong positions, a bad push target: refused, one by one
            nan, inf = good(), good()
            nan[0, 0, 3], inf[0, 0, 0] = float("nan"), float("inf")
            cases = [(nan, step(sid, 2, 2)), (inf, step(sid, 2, 2)), (torch.randn(1, 1, HIDDEN + 1), step(sid, 2, 2)),
                     (torch.ones(1, 1, HIDDEN, dtype=torch.int64), step(sid, 2, 2)), (good(), step(sid, 99, 2)),
                     (good(), step(sid, 2, "two")), (good(), step(sid, 2, 2, push_to={"peer_id": "x"}))]
            for index, (tensor, entry) in enumerate(cases):
                ran = await served(client, server)
                tensors, metadata = await stream.exchange([tensor], {"message_id": 10 + index, "steps": [entry]})
                assert (tensors, outcomes(metadata)) == ([], ["bad_request"]), (index, metadata)
                assert await served(client, server) == ran

            # the same session twice in one message: it steps once, the other is refused
            second = good()
            tensors, metadata = await stream.exchange([second, good()], {"message_id": 20, "steps": [
                step(sid, 2, 2), step(sid, 2, 2)]})
            assert outcomes(metadata) == ["ok", "bad_request"]
            outputs.append(tensors[0]), sent.append(second)
            return torch.cat(outputs, dim=1)
        finally:
            await stream.close()
            await session.close()

    outputs = client.loop.run(scenario(), timeout=120)
    torch.testing.assert_close(outputs, forward(client, server, torch.cat(sent, dim=1)), atol=1e-4, rtol=0)


def test_a_list_of_pushes_is_answered_push_by_push(client, server):
    from hivemind.p2p import PeerID

    from swarm.wire import BlockRPC, pack, stacked, unpack

    hidden = torch.randn(1, 1, HIDDEN)

    async def scenario():
        session = await open_stream(client, server)
        stub = BlockRPC.get_stub(client.node.p2p, PeerID.from_base58(server.peer_id))
        try:
            pushes = [{"session_id": session.session_id, "step_id": 1, "position": 0, "rows": 1, "length": 1},
                      {"session_id": secrets.token_hex(16), "step_id": 1, "position": 0, "rows": 1, "length": 1}]
            _, metadata = unpack(await stub.rpc_push(pack(stacked([hidden] * 2), {"pushes": pushes}), timeout=30))
            # parts that do not add up to the tensor, or a push that does not say its part: refused whole
            _, mismatched = unpack(await stub.rpc_push(pack((hidden,), {"pushes": pushes}), timeout=30))
            _, unsaid = unpack(await stub.rpc_push(pack((hidden,), {"pushes": ["a push"]}), timeout=30))
            assert error_from_wire(unsaid).code == "bad_request"
            # the pushed step started early; the client's own copy of it collects the result
            output = await session.step(hidden, 0, step_id=1)
            return outcomes(metadata), error_from_wire(mismatched), output
        finally:
            await session.close()

    pushed = client.server_info(server.peer_id)["steps_pushed"]
    answers, mismatched, output = client.loop.run(scenario(), timeout=60)
    assert answers == ["ok", "bad_request"]
    assert mismatched is not None and mismatched.code == "bad_request"
    assert client.server_info(server.peer_id)["steps_pushed"] == pushed + 1
    torch.testing.assert_close(output, forward(client, server, hidden), atol=1e-4, rtol=0)


# ------------------------------------------------------------------------------------------------ fuzzer

SEED = 20261123
MESSAGES = 300


def garbage_tensor(rng: random.Random) -> torch.Tensor:
    shape = [1, rng.randint(1, 3), HIDDEN]
    if rng.random() < 0.3:
        shape[rng.randrange(3)] = rng.choice([0, 2, HIDDEN + 1])
    values = torch.randn(shape) * rng.choice([1.0, 1e38])
    if values.numel() and rng.random() < 0.3:
        values.view(-1)[rng.randrange(values.numel())] = rng.choice([float("nan"), float("inf")])
    return values.to(rng.choice([torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64]))


def test_the_server_survives_fuzzed_step_messages(client, intruder, server):
    """Messages of random steps (of the client's sessions, of sessions that do not exist, garbage), several in
    flight at once on two streams (the owner's and an intruder's): every reply is well-formed, no error is
    internal, and the cache comes back when the sessions close."""
    tally = {}

    def entry(rng: random.Random, sessions) -> object:
        draw = rng.random()
        if draw < 0.6:
            return step(rng.choice(sessions).session_id, rng.randint(0, 4), rng.choice([1, 2, 3, None, "x"]))
        if draw < 0.8:
            return step(secrets.token_hex(16), 0, 1)
        return rng.choice([None, 1, "x", [], {"session_id": None}, {"session_id": b"x"}, step("", 0, 0)])

    async def fuzz(raw: RawSteps, sessions, first_id: int):
        rng = random.Random(SEED + first_id)  # one each: the two streams interleave as they will
        for group in range(0, MESSAGES, 6):  # six in flight at a time: the replies may come in any order
            ids = set()
            for message_id in range(first_id + group, first_id + group + 6):
                count = rng.randint(0, 4)
                tensors = [garbage_tensor(rng) if rng.random() < 0.3 else torch.randn(1, 1, HIDDEN)
                           for _ in range(count + rng.choice([0, 0, 0, 1, -1]) if count else 0)]
                raw.send(tensors, {"message_id": message_id, "steps": [entry(rng, sessions) for _ in range(count)]})
                ids.add(message_id)
            for _ in range(len(ids)):
                tensors, metadata = await raw.receive()
                ids.discard(metadata.get("message_id"))
                codes = outcomes(metadata) if "results" in metadata else [error_from_wire(metadata).code]
                assert len(tensors) == (1 if "ok" in codes else 0)  # the outputs that came, stacked in one
                for code in codes:
                    assert code not in ("swarm_error", "internal_error"), "an internal error"
                    tally[code] = tally.get(code, 0) + 1
            assert not ids, "a message went unanswered"

    async def scenario():
        sessions = [await open_stream(client, server) for _ in range(3)]
        own, foreign = await RawSteps(client, server.peer_id).open(), await RawSteps(intruder, server.peer_id).open()
        try:
            await asyncio.gather(fuzz(own, sessions, 0), fuzz(foreign, sessions, 10**6))
        finally:
            await own.close()
            await foreign.close()
            for session in sessions:
                await session.close()

    client.loop.run(scenario(), timeout=300)
    print(f"\nfuzzed step messages (seed {SEED}): {tally}")
    assert server.process.poll() is None, "the server died"
    assert tally.get("ok") and tally.get("bad_request") and tally.get("session_closed")
    deadline = time.monotonic() + 10
    while client.server_info(server.peer_id)["cache_tokens_free"] != CACHE_TOKENS and time.monotonic() < deadline:
        time.sleep(0.2)
    assert client.server_info(server.peer_id)["cache_tokens_free"] == CACHE_TOKENS
    inputs = torch.randn(1, 5, HIDDEN)  # and the next sessions are served right
    model_session = client.open_session(PREFIX, TINY_BLOCKS, "the multiplex test's model", 8)
    with model_session as session:
        steps = torch.cat([session.step(inputs[:, :3]), session.step(inputs[:, 3:4]), session.step(inputs[:, 4:])], 1)
    torch.testing.assert_close(steps, forward(client, server, inputs), atol=1e-4, rtol=0)

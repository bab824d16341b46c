"""A real block server against hostile peers: its limits on one client over the RPC, and a fuzzer that sends
hundreds of random and mutated requests to every handler. The server never dies, answers every request with
a reply or a SwarmError (never an internal error), gives all its cache back, and serves the next valid
request correctly."""

import asyncio
import collections
import contextlib
import random
import secrets
import time

import pytest
import torch

from shared_swarm import TINY_BLOCKS
from swarm.client import SwarmClient
from swarm.protocol import BadRequestError, CacheFullError

PREFIX = "hostile"
HIDDEN = 64  # the tiny model's
CACHE_TOKENS, MAX_REQUEST_TOKENS, MAX_SESSION_TOKENS, MAX_SESSIONS_PER_PEER = 1024, 256, 128, 4


@pytest.fixture(scope="module")
def server(tiny_swarm):
    return tiny_swarm.add_server([
        "--blocks", f"0:{TINY_BLOCKS}", "--dht-prefix", PREFIX, "--cache-tokens", str(CACHE_TOKENS),
        "--cache-wait", "0.2", "--max-request-tokens", str(MAX_REQUEST_TOKENS),
        "--max-session-tokens", str(MAX_SESSION_TOKENS), "--max-sessions-per-peer", str(MAX_SESSIONS_PER_PEER),
    ])


@pytest.fixture(scope="module")
def client(tiny_swarm, server):
    client = SwarmClient(tiny_swarm.initial_peers)
    yield client
    client.shutdown()


def forward(client, server, hidden):
    from swarm.client.stubs import call_forward

    return client.loop.run(call_forward(client.node.p2p, server.peer_id, hidden, 0, TINY_BLOCKS, timeout=30))


def open_session(client, max_length: int, batch_size: int = 1):
    return client.open_session(PREFIX, TINY_BLOCKS, "the hostile test's model", max_length, batch_size)


def test_limits_on_one_client(client, server):
    with pytest.raises(BadRequestError, match=f"limit of {MAX_REQUEST_TOKENS} tokens per request"):
        forward(client, server, torch.zeros(1, MAX_REQUEST_TOKENS + 1, HIDDEN))
    with pytest.raises(BadRequestError, match="per request"):
        forward(client, server, torch.zeros(3, MAX_REQUEST_TOKENS // 3 + 1, HIDDEN))
    assert forward(client, server, torch.zeros(2, MAX_REQUEST_TOKENS // 2, HIDDEN)).shape == (2, 128, HIDDEN)

    with pytest.raises(CacheFullError, match=f"limit of {MAX_SESSION_TOKENS} tokens per session"):
        open_session(client, MAX_SESSION_TOKENS // 2 + 1, batch_size=2)  # the only server refuses: no route
    sessions = [open_session(client, MAX_SESSION_TOKENS) for _ in range(MAX_SESSIONS_PER_PEER)]
    with pytest.raises(CacheFullError, match="sessions open on this server already"):
        open_session(client, 8)
    sessions.pop().close()
    sessions.append(open_session(client, 8))  # a closed session frees its place
    for session in sessions:
        session.close()


def test_nan_hidden_states_are_refused_and_the_session_goes_on(client, server):
    session = open_session(client, 8)
    try:
        with pytest.raises(BadRequestError, match="finite"):
            session.step(torch.full((1, 2, HIDDEN), float("nan")))
        assert torch.isfinite(session.step(torch.randn(1, 2, HIDDEN))).all()
    finally:
        session.close()


FLOOD = 20_000  # messages, each of MAX_SESSIONS_PER_PEER steps of no session: a reply of some 700 bytes each


def test_a_peer_that_never_reads_its_replies_stops_being_read(client, server):
    """A hostile peer sends step messages on one stream and never reads the replies: once the transport's
    buffers are full, the server stops reading the stream (its messages in flight stay within the bound) and
    the peer's own writes stall, instead of the server reading on and queueing replies without bound (before:
    it read all 20,000, and held the replies of most of them)."""
    from hivemind.p2p import PeerID

    from swarm.client.stubs import call_info
    from swarm.server.flow import SLACK_MESSAGES
    from swarm.server.handler import STALLED_STREAM_SECONDS
    from swarm.wire import BlockRPC, pack

    stub = BlockRPC.get_stub(client.node.p2p, PeerID.from_base58(server.peer_id))
    entries = [{"session_id": secrets.token_hex(16), "position": 0}] * MAX_SESSIONS_PER_PEER
    written = 0

    async def requests():
        nonlocal written
        for index in range(FLOOD):
            written += 1
            yield pack(metadata={"message_id": index, "steps": entries})

    async def flood() -> dict:
        """What the server says once the peer's writes stall (or, as before, once every message went)."""
        responses = await stub.rpc_steps(requests())
        try:
            while True:
                before = written
                await asyncio.sleep(1.0)
                if written in (before, FLOOD):
                    return await call_info(client.node.p2p, server.peer_id)
        finally:
            await responses.aclose()

    read_before = client.server_info(server.peer_id)["step_messages"]
    info = client.loop.run(flood(), timeout=120)
    print(f"\n{written} messages written, {info['step_messages'] - read_before} read by the server, "
          f"{info['step_messages_in_flight']} in flight")
    assert written < FLOOD and info["step_messages"] - read_before < FLOOD // 2
    assert info["step_messages_in_flight"] <= MAX_SESSIONS_PER_PEER + SLACK_MESSAGES
    # the peer hung up: the server ends the stalled stream, reads it to its end, and lets go of what it held
    deadline = time.monotonic() + STALLED_STREAM_SECONDS + 20
    while client.server_info(server.peer_id)["step_messages_in_flight"] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert client.server_info(server.peer_id)["step_messages_in_flight"] == 0


def test_pushes_go_only_to_servers_announcing_the_next_blocks(client, server, tiny_swarm):
    """A step of a session over every block, told to push its outputs on to a peer that serves none of that
    model: the server runs the step and pushes nothing (before: it sent them to whichever peer it was told)."""
    from types import SimpleNamespace

    from swarm.client.stubs import InferenceStream

    stranger = SimpleNamespace(peer_id=tiny_swarm.servers[0].peer_id, session_id=secrets.token_hex(16))
    stream = InferenceStream(client.node.p2p, server.peer_id, 0, TINY_BLOCKS, 30, client.step_channels)
    before = client.server_info(server.peer_id)
    client.loop.run(stream.open(8, batch_size=1))
    try:
        output = client.loop.run(stream.step(torch.randn(1, 2, HIDDEN), 0, step_id=1, push_to=stranger))
    finally:
        client.loop.run(stream.close())
    assert output.shape == (1, 2, HIDDEN)
    deadline = time.monotonic() + 20  # the server looks up who announces block TINY_BLOCKS, then decides
    while time.monotonic() < deadline:
        info = client.server_info(server.peer_id)
        if info["pushes_sent"] + info.get("pushes_skipped", 0) > before["pushes_sent"] + before.get("pushes_skipped", 0):
            break
        time.sleep(0.2)
    assert (info["pushes_sent"], info.get("pushes_skipped")) == (before["pushes_sent"], before["pushes_skipped"] + 1)


# ------------------------------------------------------------------------------------------------ fuzzer

SEED = 20240907
FIELDS = ["start", "end", "max_length", "batch_size", "session_id", "position", "step_id", "push_to", "rows", "length",
          "bfloat16_tensors"]
VALUES = [0, 1, 2, 3, 4, 7, 31, -1, MAX_REQUEST_TOKENS + 1, 2**31, 2**63 - 1, -2**63, True, False, None, 0.5,
          float("nan"), float("inf"), "2", "", "x" * 32, b"\x00", [], [0], [1, 2], {},
          {"peer_id": "x", "session_id": "y"}]
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int8, torch.uint8,
          torch.bool, torch.complex64]
DTYPE_NAMES = ["float32", "bfloat16", "float16", "int64", "object", "float128", "V8", "<U4", "", "complex128",
               "bool", "nonsense", "O"]
HANG_UP = 0.25  # the share of streams that hang up mid-step
VICTIM_STEPS = 100
REQUESTS = {"rpc_info": 300, "rpc_forward": 1000, "rpc_push": 1000, "rpc_inference": 400}  # inference: streams


class Fuzzer:
    """Random and mutated requests, sent with hivemind's raw stubs; tallies what the server answers."""

    def __init__(self, client, server, seed: int):
        from hivemind.p2p import PeerID

        from swarm.client.stubs import InferenceStream
        from swarm.wire import BlockRPC

        self.rng = random.Random(seed)
        self.stub = BlockRPC.get_stub(client.node.p2p, PeerID.from_base58(server.peer_id))
        self.sent = collections.Counter()  # handler -> requests (for rpc_inference: every message of a stream)
        self.answers = collections.Counter()  # (handler, "ok" or the error's code) -> replies
        # an honest client's session, open all along: pushes aim at it, and its outputs must stay right
        self.victim = InferenceStream(client.node.p2p, server.peer_id, 0, TINY_BLOCKS, 30, client.step_channels)
        self.victim_inputs, self.victim_outputs = [], []

    # -------------------------------------------------------------------------------- what is sent

    def metadata(self, valid: dict, wrap=lambda fields: fields) -> bytes:
        """Half the time the valid metadata; else garbage, a non-map, or the valid one with fields changed
        (`wrap` puts the fields where the message carries them: a push's, in its entry of 'pushes')."""
        from hivemind.utils import MSGPackSerializer

        draw = self.rng.random()
        if draw < 0.5:
            return MSGPackSerializer.dumps(wrap(valid))
        if draw < 0.55:
            return self.rng.randbytes(self.rng.randint(1, 40))
        if draw < 0.6:
            return MSGPackSerializer.dumps(self.rng.choice([None, 1, "map", [1, 2], b"bytes", 1.5, [valid]]))
        metadata = dict(valid)
        for _ in range(self.rng.randint(1, 3)):
            field = self.rng.choice(FIELDS)
            if self.rng.random() < 0.2:
                metadata.pop(field, None)
            else:
                metadata[field] = self.rng.choice(VALUES + [self.victim.session_id])
        return MSGPackSerializer.dumps(wrap(metadata))

    def tensors(self, valid_shape: tuple) -> list:
        from hivemind.compression import serialize_torch_tensor

        if self.rng.random() < 0.5:
            return [serialize_torch_tensor(torch.randn(valid_shape))]
        return [self.tensor(valid_shape) for _ in range(self.rng.choice([0, 1, 1, 1, 2, 3]))]

    def tensor(self, valid_shape: tuple):
        """A real tensor of another shape, dtype or values; or a protobuf whose fields disagree."""
        from hivemind.compression import serialize_torch_tensor
        from hivemind.proto import runtime_pb2

        rng = self.rng
        if rng.random() < 0.6:
            shape = list(valid_shape)
            if rng.random() < 0.5:
                index = rng.randrange(len(shape))
                shape[index] = rng.choice([0, 1, 2, HIDDEN - 1, HIDDEN + 1, MAX_REQUEST_TOKENS + 1])
            if rng.random() < 0.2:
                shape = shape[: rng.randint(0, len(shape))] + [1] * rng.randint(0, 2)
            values = torch.randn(shape) * rng.choice([1.0, 1e4, 1e38])
            if values.numel() and rng.random() < 0.3:
                values.view(-1)[rng.randrange(values.numel())] = rng.choice([float("nan"), float("inf"), -float("inf")])
            dtype = rng.choice(DTYPES)
            tensor = (values != 0) if dtype == torch.bool else values.to(dtype)
            if tensor.is_floating_point():
                tensor.requires_grad_(rng.random() < 0.2)
            return serialize_torch_tensor(tensor)
        return runtime_pb2.Tensor(
            buffer=rng.randbytes(rng.choice([0, 3, 4 * HIDDEN, 8 * HIDDEN, 1000])),
            size=[rng.choice([0, 1, 2, HIDDEN, 2**32 - 1]) for _ in range(rng.randint(0, 4))],
            dtype=rng.choice(DTYPE_NAMES),
            compression=rng.choice([0, 0, 0, 1, 2, 3, 4, 5, 99]),
            requires_grad=rng.random() < 0.2,
        )

    def request(self, valid_metadata: dict, valid_shape: tuple = None, wrap=lambda fields: fields):
        from hivemind.proto import runtime_pb2

        tensors = self.tensors(valid_shape) if valid_shape is not None and self.rng.random() < 0.9 else []
        return runtime_pb2.ExpertRequest(tensors=tensors, metadata=self.metadata(valid_metadata, wrap))

    def valid_shape(self, rows: int = 1) -> tuple:
        return (rows, self.rng.randint(1, 4), HIDDEN)

    # ------------------------------------------------------------------------------- what comes back

    def tally(self, handler: str, response) -> bool:
        """Count the reply; True if it succeeded. Any reply must be well-formed, and no error internal."""
        from swarm.protocol import error_from_wire
        from swarm.wire import unpack

        _, metadata = unpack(response)
        error = error_from_wire(metadata)
        outcome = "ok" if error is None else error.code
        assert outcome not in ("swarm_error", "internal_error"), f"{handler}: an internal error: {error}"  # an exception we did not expect
        self.answers[handler, outcome] += 1
        return error is None

    # ------------------------------------------------------------------------------------ handlers

    async def info(self):
        self.sent["rpc_info"] += 1
        self.tally("rpc_info", await self.stub.rpc_info(self.request({}, self.valid_shape()), timeout=30))

    async def forward(self):
        rows = self.rng.randint(1, 3)
        request = self.request({"start": 0, "end": TINY_BLOCKS}, self.valid_shape(rows))
        self.sent["rpc_forward"] += 1
        self.tally("rpc_forward", await self.stub.rpc_forward(request, timeout=30))

    async def push(self):
        """Mostly at the victim's session, as its next step (an early start that the victim's own copy of
        the step must override), else at sessions that do not exist."""
        if self.rng.random() < 0.05:
            return await self.push_of_bool_rows()
        shape = self.valid_shape()
        if self.rng.random() < 0.7:
            valid = {"session_id": self.victim.session_id, "step_id": len(self.victim_inputs) + 1,
                     "position": len(self.victim_inputs)}
        else:
            valid = {"session_id": secrets.token_hex(16), "step_id": 1, "position": 0}
        valid.update(rows=shape[0], length=shape[1])  # its part of the message's stacked tensor
        request = self.request(valid, shape, wrap=lambda entry: {"pushes": [entry]})
        self.sent["rpc_push"] += 1
        self.tally("rpc_push", await self.stub.rpc_push(request, timeout=30))

    async def push_of_bool_rows(self):
        """msgpack's true is a Python int: a step of `"rows": true` beside one of 2 rows failed decoding with a
        TypeError (an internal error, logged with its traceback) before it was refused."""
        from hivemind.compression import serialize_torch_tensor
        from hivemind.proto import runtime_pb2
        from hivemind.utils import MSGPackSerializer

        field = self.rng.choice(["rows", "length"])
        entries = [{"session_id": secrets.token_hex(16), "step_id": 1, "position": 0, "rows": 1, "length": 1,
                    field: True}, {"session_id": secrets.token_hex(16), "step_id": 1, "position": 0, "rows": 2,
                                   "length": 1}]
        request = runtime_pb2.ExpertRequest(tensors=[serialize_torch_tensor(torch.randn(1, 3, HIDDEN))],
                                            metadata=MSGPackSerializer.dumps({"pushes": entries}))
        self.sent["rpc_push"] += 1
        assert not self.tally("rpc_push", await self.stub.rpc_push(request, timeout=30))

    async def victim_step(self):
        hidden = torch.randn(1, 1, HIDDEN)
        position = len(self.victim_inputs)
        self.victim_outputs.append(await self.victim.step(hidden, position, step_id=position + 1))
        self.victim_inputs.append(hidden)

    async def stream(self):
        """One inference stream: an opening, up to 7 messages more (steps, which the stream refuses: they go
        through rpc_steps), then a close. A quarter of the streams hang up instead: every message at once, then
        the connection closes after the first reply, with messages still in flight."""
        rng = self.rng
        messages = [self.request({"start": 0, "end": TINY_BLOCKS, "max_length": 32, "batch_size": 1,
                                  "session_id": secrets.token_hex(16)})]
        position = 0
        for step_id in range(1, rng.randint(1, 8)):
            length = rng.randint(1, 4)
            messages.append(self.request({"position": position, "step_id": step_id}, (1, length, HIDDEN)))
            position = min(position + length, 28)
        hang_up = rng.random() < HANG_UP
        queue: asyncio.Queue = asyncio.Queue()

        async def requests():
            while (message := await queue.get()) is not None:
                yield message

        responses = await self.stub.rpc_inference(requests())
        self.sent["rpc_inference"] += len(messages)
        try:
            if hang_up:
                for message in [*messages, None]:  # hivemind's reader waits for the requests to end
                    queue.put_nowait(message)
                with contextlib.suppress(StopAsyncIteration, ConnectionError):  # a refused opening ends the stream
                    self.tally("rpc_inference", await asyncio.wait_for(anext(responses), 30))
                return
            for index, message in enumerate(messages):
                queue.put_nowait(message)
                try:
                    response = await asyncio.wait_for(anext(responses), 30)
                except StopAsyncIteration:
                    raise AssertionError("the server broke an open session's stream") from None
                if not self.tally("rpc_inference", response) and index == 0:
                    break  # the opening was refused: the server ended the stream
        finally:
            queue.put_nowait(None)
            await responses.aclose()  # closes the connection (hanging up, with steps in flight)

    async def run(self, concurrency: int = 6) -> None:
        jobs = [handler for handler, count in REQUESTS.items() for _ in range(count)]
        self.rng.shuffle(jobs)
        calls = {"rpc_info": self.info, "rpc_forward": self.forward, "rpc_push": self.push,
                 "rpc_inference": self.stream}
        await self.victim.open(VICTIM_STEPS, batch_size=1)
        for group, first in enumerate(range(0, len(jobs), concurrency)):  # a few at once: they overlap
            await asyncio.gather(*(calls[job]() for job in jobs[first: first + concurrency]))
            if group % (len(jobs) // concurrency // VICTIM_STEPS + 1) == 0:
                await self.victim_step()
        await self.victim.close()


def test_the_server_survives_a_fuzzer(client, server):
    began = time.monotonic()
    fuzzer = Fuzzer(client, server, SEED)
    client.loop.run(fuzzer.run(), timeout=120)
    elapsed = time.monotonic() - began

    assert server.process.poll() is None, "the server died"
    by_handler = {handler: {outcome: count for (name, outcome), count in fuzzer.answers.items() if name == handler}
                  for handler in REQUESTS}
    early_starts = client.server_info(server.peer_id)["steps_pushed"]  # pushes the victim's own steps overrode
    print(f"\nfuzzed in {elapsed:.1f} s (seed {SEED}); sent {dict(fuzzer.sent)}; answers {by_handler}; "
          f"{early_starts} pushed steps started")
    assert early_starts > 0
    for handler, count in REQUESTS.items():
        assert fuzzer.sent[handler] >= count
        if handler != "rpc_info":  # which reads nothing of the request
            answers = by_handler[handler]
            assert answers.get("ok") and set(answers) - {"ok"}, f"{handler}: {answers}"

    deadline = time.monotonic() + 10  # streams the fuzzer hung up on close on the server's side
    while client.server_info(server.peer_id)["cache_tokens_free"] != CACHE_TOKENS and time.monotonic() < deadline:
        time.sleep(0.2)
    assert client.server_info(server.peer_id)["cache_tokens_free"] == CACHE_TOKENS

    # the session that the pushes aimed at went on right: its steps equal a whole forward of its inputs
    assert len(fuzzer.victim_inputs) > VICTIM_STEPS // 2
    torch.testing.assert_close(torch.cat(fuzzer.victim_outputs, dim=1),
                               forward(client, server, torch.cat(fuzzer.victim_inputs, dim=1)), atol=1e-4, rtol=1e-4)
    # the next valid requests are served, and served right
    inputs = torch.randn(1, 6, HIDDEN)
    with open_session(client, 8) as session:
        steps = torch.cat([session.step(inputs[:, :4]), session.step(inputs[:, 4:])], dim=1)
    torch.testing.assert_close(steps, forward(client, server, inputs), atol=1e-4, rtol=0)

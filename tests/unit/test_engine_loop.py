"""The engine loop's shape: per tick one embedding call, one LM-head call and one sampling call whatever the number of
sessions; only token ids cross from the head's logits to the host; slow chains hold nobody; an abort settles a
session exactly where its reader stopped."""

import threading
from dataclasses import replace
import time

import pytest
import torch

from config import GatewaySettings, Limits, ModelConfig, Settings, SwarmSettings
from gateway.engine.generation import Engine, GenerationRequest
from gateway.engine.loop import EngineLoop, Pipeline
from gateway.engine.sampler import Sampler
from gateway.engine.sampling import SamplingParams
from gateway.engine.sequences import Sequence
from local_remote import LocalRemote

TOKENS = 6


@pytest.fixture(scope="module")
def remote(tiny_llama):
    return LocalRemote(tiny_llama)


@pytest.fixture
def engine(tiny_llama, remote, tmp_path):
    gateway = GatewaySettings(models=(ModelConfig("tiny", str(tiny_llama), max_session_length=64),),
                              limits=Limits(max_sessions=80, max_sessions_per_client=80, speculative_tokens=0))
    return Engine(Settings(swarm=SwarmSettings(cache_dir=tmp_path), gateway=gateway), connect=lambda config: remote)


def sequences(engine, count: int, params=SamplingParams(), tokens: int = TOKENS) -> list[Sequence]:
    model = engine.model("tiny")
    made = []
    for index in range(count):
        session = engine.open_session("tiny", 64, expires=False)
        feed = model.encode(f"prompt number {index}", at_start=True)
        # no stop token: every reply has all its tokens
        made.append(Sequence(session, feed, tokens, Sampler(params, model.vocab_size), None, set(), None))
    return made


def run_together(loop: EngineLoop, batch: list[Sequence]) -> None:
    loop.submit(*batch)
    for sequence in batch:
        assert sequence.settled.wait(60) and sequence.stream.error is None, sequence.stream.error


@pytest.mark.parametrize("count", [1, 8, 64])
def test_a_tick_embeds_runs_the_head_and_samples_once_whatever_the_sessions(engine, remote, count):
    loop = EngineLoop(engine.model("tiny"), max_drafting_sessions=0)
    batch = sequences(engine, count)
    calls_before = dict(remote.calls)
    run_together(loop, batch)
    calls = {name: remote.calls[name] - calls_before[name] for name in calls_before}
    counts = loop.counts
    # a tick sends every prompt; then each tick takes every session's row and sends every next token
    assert counts.ticks == TOKENS + 1
    assert calls["embed"] == counts.embeds == TOKENS  # the last token of each reply is never sent
    assert calls["start_steps"] == TOKENS  # all sessions' steps started together: one message per server
    assert calls["head"] == counts.heads == TOKENS and counts.samplings == TOKENS
    assert counts.rows == count * TOKENS and counts.steps == count * TOKENS
    assert all(len(sequence.generated) == TOKENS for sequence in batch)


def test_the_batched_loop_gives_each_session_what_it_gives_alone(engine):
    alone = []
    for sequence in sequences(engine, 4, SamplingParams(do_sample=True, temperature=0.8, top_k=20, seed=7)):
        run_together(EngineLoop(engine.model("tiny"), 0), [sequence])
        alone.append(sequence.generated)
    together = sequences(engine, 4, SamplingParams(do_sample=True, temperature=0.8, top_k=20, seed=7))
    run_together(EngineLoop(engine.model("tiny"), 0), together)
    assert [sequence.generated for sequence in together] == alone


class HostReads(torch.Tensor):
    """Logits as the head's device would hold them: every read of their values by the host is recorded."""

    reads: list = []
    READS = {torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.cpu, torch.Tensor.numpy, torch.Tensor.__int__,
             torch.Tensor.__float__, torch.Tensor.__bool__, torch.Tensor.__index__}

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in cls.READS or (func is torch.Tensor.to and "cpu" in map(str, args[1:])):
            cls.reads.append((func.__name__, args[0].numel()))
        return super().__torch_function__(func, types, args, kwargs or {})


class HeadOnADevice(LocalRemote):
    def logits_on_device(self, hidden):
        return super().logits_on_device(hidden).as_subclass(HostReads)


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(do_sample=True, top_k=40, top_p=0.9)])
def test_only_token_ids_cross_from_the_logits_to_the_host(tiny_llama, tmp_path, params):
    remote = HeadOnADevice(tiny_llama)
    gateway = GatewaySettings(models=(ModelConfig("tiny", str(tiny_llama), max_session_length=64),),
                              limits=Limits(max_sessions=16, max_sessions_per_client=16, speculative_tokens=0))
    engine = Engine(Settings(swarm=SwarmSettings(cache_dir=tmp_path), gateway=gateway), connect=lambda config: remote)
    HostReads.reads = []
    run_together(EngineLoop(engine.model("tiny"), 0), sequences(engine, 8, params))
    assert HostReads.reads  # the token ids, once per tick
    assert all(name == "tolist" and size == 8 for name, size in HostReads.reads), HostReads.reads


class SlowChains(LocalRemote):
    """Steps of the sessions listed in `slow` come back `delay` seconds later, from another thread."""

    def __init__(self, folder, delay):
        super().__init__(folder)
        self.delay, self.slow = delay, set()

    def start_steps(self, steps, on_done):
        fast = [step for step in steps if step[1] not in self.slow]
        super().start_steps(fast, on_done)
        for step in steps:
            if step[1] in self.slow:
                threading.Timer(self.delay, super().start_steps, ([step], on_done)).start()


def test_a_session_on_a_slow_chain_never_holds_the_others(tiny_llama, tmp_path):
    remote = SlowChains(tiny_llama, delay=0.3)
    gateway = GatewaySettings(models=(ModelConfig("tiny", str(tiny_llama), max_session_length=64),),
                              limits=Limits(speculative_tokens=0))
    engine = Engine(Settings(swarm=SwarmSettings(cache_dir=tmp_path), gateway=gateway), connect=lambda config: remote)
    slow, fast = sequences(engine, 2, tokens=12)
    remote.slow.add(slow.session.inference)
    loop = EngineLoop(engine.model("tiny"), 0)
    loop.submit(slow)
    began = time.monotonic()
    run_together(loop, [fast])
    assert time.monotonic() - began < 0.3 * 4  # 12 tokens at its own pace, not 13 x 0.3 s
    assert not slow.done
    assert slow.settled.wait(30) and len(slow.generated) == 12


def test_an_abort_settles_the_session_at_the_last_token_read_once(engine):
    from gateway.engine.metrics import ABORTED_REPLIES

    model = engine.model("tiny")
    request = GenerationRequest(inputs="Hello there", sampling=SamplingParams(), max_new_tokens=20)
    whole = engine.open_session("tiny", 64, expires=False)
    with engine.sessions.use(whole.id):
        list(engine.generate(whole, request))
    prompt = model.encode("Hello there", at_start=True)
    reply = (whole.history + whole.pending)[len(prompt):]

    aborts = ABORTED_REPLIES.labels("tiny")._value.get()
    session = engine.open_session("tiny", 64, expires=False)
    with engine.sessions.use(session.id):
        deltas = engine.generate(session, request)
        assert sum(next(deltas).token_count for _ in range(3)) == 3
        deltas.close()  # the client went away after three tokens
    assert session.history + session.pending == prompt + reply[:3]
    assert ABORTED_REPLIES.labels("tiny")._value.get() == aborts + 1
    assert not engine.loop_of(model)._running  # nothing of it is left in the loop


class WideAreaCosts:
    """Steps priced as over a wide-area swarm: drafts pay."""

    def line(self):
        return 0.100, 0.001

    def observed(self, positions, seconds):
        pass


def drafting_sequences(engine, count):
    from gateway.engine.speculation import Pacing

    model = engine.model("tiny")
    batch = sequences(engine, count, tokens=16)
    for sequence in batch:  # a prompt that repeats itself: prompt lookup always has a guess
        sequence.feed = model.encode(" one two three" * 3, at_start=True)

        sequence.start = list(sequence.feed)
        sequence.pacing = Pacing(WideAreaCosts(), 8)
    return batch


@pytest.mark.parametrize("count, drafts", [(2, True), (6, False)])
def test_sessions_draft_only_while_few_decode_together(engine, remote, count, drafts):
    batch = drafting_sequences(engine, count)
    run_together(EngineLoop(engine.model("tiny"), max_drafting_sessions=2), batch)
    steps = [step for sequence in batch for step in sequence.session.inference.sent[1:]]
    assert any(len(step) > 1 for step in steps) == drafts
    if not drafts:
        assert all(len(step) == 1 for step in steps)


def test_n_choices_are_forks_of_one_prefill_decoded_together(engine, remote):
    model = engine.model("tiny")
    prompt = model.encode("choices for one prompt", at_start=True)
    requests = [GenerationRequest(inputs=None, sampling=SamplingParams(do_sample=True, seed=seed), max_new_tokens=8,
                                  input_ids=tuple(prompt) if seed == 1 else ()) for seed in (1, 2, 3)]
    alone = []
    for request in requests:  # each choice on a session of its own
        session = engine.open_session("tiny", 64, expires=False)
        with engine.sessions.use(session.id):
            list(engine.generate(session, replace(request, input_ids=tuple(prompt))))
        alone.append((session.history + session.pending)[len(prompt):])
    session = engine.open_session("tiny", 64, expires=False)
    counts = engine.loop_of(model).counts
    heads, rows = counts.heads, counts.rows
    with engine.sessions.use(session.id):
        deltas = list(engine.generate_choices(session, requests))
    assert remote.sessions[-1].sent[0] == prompt[:-1]  # the prompt went through once, but its last token
    assert sorted({index for index, _ in deltas}) == [0, 1, 2]
    assert sum(delta.token_count for _, delta in deltas) == 24
    assert (session.history + session.pending)[len(prompt):] == alone[0]
    assert counts.rows - rows == 24 and counts.heads - heads == 8  # the three choices stepped in the same ticks


@pytest.mark.parametrize("waiting, deltas", [(3, 3), (20, 1)])
def test_a_reader_that_lags_gets_the_waiting_tokens_as_one_delta(remote, waiting, deltas):
    from gateway.engine.outputs import MERGE_BACKLOG, OutputStream, ReplyReader, Token
    from gateway.engine.stops import StopMatcher
    from swarm.client import IncrementalDetokenizer

    assert (waiting <= MERGE_BACKLOG) == (deltas == waiting)
    ids = remote.tokenizer("one two three four five six seven eight nine ten eleven twelve thirteen fourteen "
                           "fifteen sixteen seventeen eighteen nineteen twenty")["input_ids"][:waiting]
    stream = OutputStream()
    stream.put(*[Token(token, finish_reason="length" if index == waiting - 1 else None)
                 for index, token in enumerate(ids)])
    reader = ReplyReader(stream, IncrementalDetokenizer(remote.tokenizer), StopMatcher((), True),
                         abort=lambda *args, **kwargs: None, cancelled=lambda: False, on_token=lambda first: None)
    got = list(reader.deltas())
    assert len(got) == deltas and sum(delta.token_count for delta in got) == waiting
    assert "".join(delta.text for delta in got) == remote.tokenizer.decode(ids)


@pytest.mark.parametrize("count, pipeline, groups", [
    (16, Pipeline(), [0, 1]),  # many sessions on chains of two servers: a group per server
    (4, Pipeline(), [0]),  # a few sessions: servers are not the bottleneck, one group (nobody waits for a group)
    (16, Pipeline(groups=1), [0]),  # PIPELINE_GROUPS=1: every session in step
    (16, Pipeline(groups=4, min_sessions=2), [0, 1, 2, 3]),
])
def test_past_its_threshold_the_loop_sends_sessions_in_a_group_per_server(engine, count, pipeline, groups):
    batch = sequences(engine, count)
    for sequence in batch:
        sequence.session.inference.servers = 2
    run_together(EngineLoop(engine.model("tiny"), 0, pipeline), batch)
    assigned = [sequence.session.inference.group for sequence in batch]
    assert sorted(set(assigned)) == groups
    assert all(assigned.count(group) in (count // len(groups), count // len(groups) + 1) for group in groups)
    assert all(len(sequence.generated) == TOKENS for sequence in batch)

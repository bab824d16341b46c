"""The gateway's pool of warm conversations (gateway/engine/warm.py), with stand-ins for sessions: which parked
session a prompt continues, by whole pages, that reuse never crosses keys (nor requests, where a key is only an
address and the request gave no salt), forks for a partial match, and the caps."""

from __future__ import annotations

import threading

import pytest

from gateway.engine.warm import MIN_SHARED_TOKENS, WarmConversations, WarmKey, shared_prefix
from swarm.protocol import PAGE_TOKENS


class FakeInference:
    def __init__(self, forkable=True):
        self.parked, self.forkable = 0, forkable
        self.forks: list[int] = []

    def park(self):
        self.parked += 1


class FakeSession:
    def __init__(self, history, max_length=1000, forkable=True):
        self.history, self.pending, self.max_length = list(history), [99], max_length
        self.inference, self.closed = FakeInference(forkable), False
        self.id = f"s{id(self)}"

    def forked(self, length):
        if not self.inference.forkable:
            raise RuntimeError("a server refused the fork")
        self.inference.forks.append(length)
        return FakeSession(self.history[:length], self.max_length)

    def close(self):
        self.closed = True


A, B = WarmKey("tiny", "key:a"), WarmKey("tiny", "key:b")
CONVERSATION = list(range(100, 160))  # 60 tokens: 3 whole pages (48) and 12 more


def test_shared_prefix():
    assert shared_prefix([1, 2, 3], [1, 2, 4]) == 2 and shared_prefix([], [1]) == 0 and shared_prefix([1], [1]) == 1


def test_a_prompt_continuing_a_conversation_takes_it_whole_cut_to_the_shared_part():
    pool, session = WarmConversations(8, 4), FakeSession(CONVERSATION)
    pool.park(A, session)
    assert session.inference.parked == 1 and len(pool) == 1
    reuse = pool.take(A, CONVERSATION + [7, 8], max_length=100)
    assert reuse.session is session and reuse.cached == 48 and session.history == CONVERSATION[:48]
    assert session.pending == [] and len(pool) == 0  # the request's now: nobody else takes it meanwhile


def test_a_prompt_leaving_a_short_tail_takes_the_conversation_and_rewinds_it():
    """A reply rendered back into a chat may tokenize differently at its end: not worth keeping a second session."""
    pool, session = WarmConversations(8, 4), FakeSession(CONVERSATION)
    pool.park(A, session)
    reuse = pool.take(A, CONVERSATION[:-3] + [1, 2], max_length=100)
    assert reuse.session is session and reuse.cached == 48 and session.history == CONVERSATION[:48]
    assert session.inference.forks == [] and len(pool) == 0


def test_the_prompts_last_token_is_always_computed_again():
    pool, session = WarmConversations(8, 4), FakeSession(CONVERSATION)
    pool.park(A, session)
    reuse = pool.take(A, CONVERSATION[:33], max_length=100)  # a regenerate of an earlier point: a fork
    assert reuse.cached == 32 and reuse.session is not session and session.inference.forks == [32]


@pytest.mark.parametrize("shared", [PAGE_TOKENS, 2 * PAGE_TOKENS - 1, 3 * PAGE_TOKENS + 5])
def test_reuse_goes_by_whole_pages(shared):
    """What a request reuses, and is told it reused, says only to a page how much of its prompt matched."""
    pool, session = WarmConversations(8, 4), FakeSession(CONVERSATION)
    pool.park(A, session)
    reuse = pool.take(A, CONVERSATION[:shared] + [1, 2], max_length=100)
    assert reuse.cached == shared - shared % PAGE_TOKENS and reuse.session.history == CONVERSATION[:reuse.cached]


def test_where_a_key_is_only_an_address_only_a_salted_request_is_kept_and_reused():
    pool = WarmConversations(8, 4, salt_only=True)
    address, salted = WarmKey("tiny", "ip:10.0.0.1"), WarmKey("tiny", "ip:10.0.0.1", salt="secret")
    unsalted_session, salted_session = FakeSession(CONVERSATION), FakeSession(CONVERSATION)
    pool.park(address, unsalted_session)
    assert unsalted_session.closed and len(pool) == 0  # nobody may continue it: closed at once
    assert pool.take(address, CONVERSATION + [1], max_length=100) is None
    pool.park(salted, salted_session)
    assert pool.take(address, CONVERSATION + [1], max_length=100) is None
    assert pool.take(salted, CONVERSATION + [1], max_length=100).session is salted_session


def test_reuse_never_crosses_keys_models_or_salts():
    pool = WarmConversations(8, 4)
    pool.park(A, FakeSession(CONVERSATION))
    prompt = CONVERSATION + [1]
    for other in (B, WarmKey("other-model", "key:a"), WarmKey("tiny", "key:a", salt="s")):
        assert pool.take(other, prompt, max_length=100) is None
    assert pool.take(A, prompt, max_length=100) is not None


def test_the_longest_shared_prefix_wins_and_short_ones_are_not_worth_it():
    pool = WarmConversations(8, 4)
    short, long = FakeSession(CONVERSATION[:20]), FakeSession(CONVERSATION)
    pool.park(A, long)
    pool.park(A, short)
    assert pool.take(A, CONVERSATION + [5], max_length=100).session is long
    assert pool.take(A, CONVERSATION[: MIN_SHARED_TOKENS - 1] + [5, 6], max_length=100) is None  # too little shared


def test_a_divergent_prompt_forks_leaving_the_parked_conversation_whole():
    pool, session = WarmConversations(8, 4), FakeSession(CONVERSATION)
    pool.park(A, session)
    divergent = CONVERSATION[:25] + [1, 2, 3]
    reuse = pool.take(A, divergent, max_length=100)
    assert reuse.cached == 16 and reuse.session.history == CONVERSATION[:16] and session.inference.forks == [16]
    assert session.history == CONVERSATION and len(pool) == 1  # still there for its own next turn


def test_when_a_fork_fails_a_divergent_prompt_is_computed_afresh():
    pool, session = WarmConversations(8, 4), FakeSession(CONVERSATION, forkable=False)
    pool.park(A, session)
    assert pool.take(A, CONVERSATION[:25] + [1, 2, 3], max_length=100) is None
    assert session.history == CONVERSATION and len(pool) == 1


def test_a_session_too_short_for_the_request_is_not_reused():
    pool = WarmConversations(8, 4)
    pool.park(A, FakeSession(CONVERSATION, max_length=60))
    assert pool.take(A, CONVERSATION + [1], max_length=80) is None


def test_a_conversation_being_forked_is_not_taken_whole():
    """Taken whole, it would be rewound and overwritten while its pages are being shared with the fork."""
    pool, session = WarmConversations(8, 4), FakeSession(CONVERSATION)
    pool.park(A, session)
    forking, taken = threading.Event(), []

    def slow_fork(length):
        forking.set()
        release.wait(5)
        return FakeSession(session.history[:length])

    release = threading.Event()
    session.forked = slow_fork
    forker = threading.Thread(target=lambda: taken.append(pool.take(A, CONVERSATION[:20] + [1], max_length=100)))
    forker.start()
    assert forking.wait(5)
    whole = pool.take(A, CONVERSATION + [1], max_length=100)  # meanwhile: forked too, never taken whole
    release.set()
    forker.join(5)
    assert whole.session is not session and taken[0].session is not session and len(pool) == 1


def test_the_least_recently_parked_give_way_overall_and_per_client():
    pool = WarmConversations(3, 2)
    a1, a2, a3 = (FakeSession(CONVERSATION) for _ in range(3))
    for session in (a1, a2, a3):
        pool.park(A, session)
    assert a1.closed and not a2.closed and not a3.closed and len(pool) == 2  # 2 per client
    b1, b2 = FakeSession(CONVERSATION), FakeSession(CONVERSATION)
    pool.park(B, b1)
    pool.park(B, b2)
    assert a2.closed and len(pool) == 3  # 3 in all: the oldest of anyone's went
    pool.close_all()
    assert all(session.closed for session in (a3, b1, b2)) and len(pool) == 0


@pytest.mark.parametrize("history", [[], None])
def test_nothing_worth_keeping_is_closed_at_once(history):
    pool = WarmConversations(8, 4) if history is not None else WarmConversations(0, 0)
    session = FakeSession(history if history is not None else CONVERSATION)
    pool.park(A, session)
    assert session.closed and len(pool) == 0

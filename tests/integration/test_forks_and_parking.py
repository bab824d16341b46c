"""Copy-on-write forks and parked sessions through real servers (two, blocks 0:2 and 2:4 of the tiny Llama, with
a cache of 32 pages each): a fork continues its source's prefix on the servers that hold it, sharing its pages,
and answers what a fresh session would; a parked session is evicted when another needs room (one in use is
not), and its next step recomputes it with the same outputs."""

import time

import pytest
import torch

from exact_match import ATOL
from shared_swarm import TINY_PREFIX
from swarm.client.remote_model import RemoteModel
from swarm.protocol import PAGE_TOKENS

PREFIX = "warm"  # its own servers: these tests fill their caches
CACHE_PAGES = 32
PROMPT = [(7 * index + 3) % 250 for index in range(40)]  # two pages and a half


@pytest.fixture(scope="module")
def servers(tiny_swarm):
    added = [tiny_swarm.add_server(["--blocks", blocks, "--dht-prefix", PREFIX, "--cache-wait", "0.2",
                                    "--cache-tokens", str(CACHE_PAGES * PAGE_TOKENS)], wait=False)
             for blocks in ("0:2", "2:4")]
    for server in added:
        server.ready_line = server.wait_for_line(lambda line: line.startswith("ready:"), 180)
    return added


@pytest.fixture(scope="module")
def model(servers, tiny_swarm, tiny_llama, settings):
    remote = RemoteModel.from_pretrained(str(tiny_llama), tiny_swarm.initial_peers, settings.cache_dir, PREFIX)
    assert remote.prefix != TINY_PREFIX
    yield remote
    remote.close()


@pytest.fixture(autouse=True)
def empty_caches(model, servers):
    """Each test begins, and ends, with the servers' caches empty (closed sessions end a moment later there)."""
    settled(model, servers, "cache_pages_used", 0)
    yield
    settled(model, servers, "cache_pages_used", 0)


def settled(model, servers, field: str, value: int, seconds: float = 20.0) -> None:
    deadline = time.monotonic() + seconds
    while any(info[field] != value for info in infos(model, servers)):
        assert time.monotonic() < deadline, f"{field} never came to {value}: {infos(model, servers)}"
        time.sleep(0.05)


def filler(tokens: int) -> list[int]:
    return [1 + index % 250 for index in range(tokens)]


def infos(model, servers) -> list[dict]:
    return [model.client.server_info(server.peer_id) for server in servers]


def greedy(session, logits: torch.Tensor, tokens: int) -> tuple[list[int], list[torch.Tensor]]:
    chosen, seen = [], [logits]
    for _ in range(tokens):
        chosen.append(int(logits[0].argmax()))
        logits = session.step([[chosen[-1]]])
        seen.append(logits)
    return chosen, seen


def fresh(model, ids: list[int], tokens: int) -> tuple[list[int], list[torch.Tensor]]:
    with model.session(max_length=128) as session:
        return greedy(session, session.step([ids]), tokens)


@pytest.mark.parametrize("length", [len(PROMPT), len(PROMPT) - 3])
def test_a_fork_and_its_source_each_answer_as_a_fresh_session_would(model, servers, length):
    with model.session(max_length=128) as source:
        source.step([PROMPT])
        with source.fork(length) as forked:
            assert forked.position == length and [hop.link.peer_id for hop in forked.blocks.hops] == \
                [hop.link.peer_id for hop in source.blocks.hops]  # the same servers: they hold the prefix
            assert all(info["cache_pages_shared"] == 3 for info in infos(model, servers))
            theirs = greedy(forked, forked.step([[11, 12, 13]]), 8)  # another continuation
            ours = greedy(source, source.step([[5]]), 8)
    for (tokens, logits), (want_tokens, want_logits) in ((ours, fresh(model, PROMPT + [5], 8)),
                                                        (theirs, fresh(model, PROMPT[:length] + [11, 12, 13], 8))):
        assert tokens == want_tokens
        torch.testing.assert_close(torch.cat(logits), torch.cat(want_logits), rtol=0, atol=1e-4)


def test_eight_forks_of_a_four_page_prefix_take_far_fewer_pages_than_eight_copies(model, servers):
    with model.session(max_length=128) as source:
        source.step([filler(4 * PAGE_TOKENS)])
        forks = [source.fork(4 * PAGE_TOKENS) for _ in range(8)]
        for index, forked in enumerate(forks):
            forked.step([[index + 1]])
        for info in infos(model, servers):
            assert info["cache_pages_used"] == 4 + 8  # the prefix once, a page each for their own tokens
            assert info["cache_pages_shared"] == 4
        for forked in forks:
            forked.close()


def test_a_parked_session_is_evicted_for_a_new_one_and_its_next_step_recomputes_it(model, servers):
    want_tokens, want_logits = fresh(model, PROMPT, 6)
    with model.session(max_length=128) as parked, model.session(max_length=128) as in_use:
        logits = parked.step([PROMPT])  # 3 pages on each server
        in_use.step([[1, 2, 3]])  # 1 page, idle but not parked
        parked.park()
        assert all(info["parked_sessions"] == 1 for info in infos(model, servers))
        with model.session(max_length=CACHE_PAGES * PAGE_TOKENS) as big:  # 29 pages: only 28 are free
            big.step([filler(29 * PAGE_TOKENS)])
            assert all(info["parked_sessions"] == 0 for info in infos(model, servers))
            assert all(info["cache_pages_used"] == 1 + 29 for info in infos(model, servers))  # in_use kept its page
            assert [hop.link.peer_id for hop in big.blocks.hops] == [server.peer_id for server in servers]
        parked.park()  # again, on servers that closed it: nothing to do, and no error
        tokens, seen = greedy(parked, logits, 6)  # its sessions are gone: replayed, then on as before
        in_use.step([[4]], position=3)  # its session is still there
    assert tokens == want_tokens
    torch.testing.assert_close(torch.cat(seen), torch.cat(want_logits), rtol=0, atol=1e-4)


def test_a_fork_of_a_session_a_server_no_longer_holds_is_recomputed_there(model, servers):
    want_tokens, want_logits = fresh(model, PROMPT[:30] + [9], 4)
    with model.session(max_length=128) as source:
        source.step([PROMPT])
        source.park()
        with model.session(max_length=CACHE_PAGES * PAGE_TOKENS) as big:
            big.step([filler(31 * PAGE_TOKENS)])  # the parked session is evicted on both servers
        with source.fork(30) as forked:
            assert all(info["cache_pages_shared"] == 0 for info in infos(model, servers))
            tokens, seen = greedy(forked, forked.step([[9]]), 4)
    assert tokens == want_tokens
    torch.testing.assert_close(torch.cat(seen), torch.cat(want_logits), rtol=0, atol=1e-4)


def test_the_prefix_share_benchmark_measures_forks_within_the_bound(model, servers):
    """bench/prefix_share.py's measurement, small: 4 forks of a saved 64-token prefix on these servers."""
    from bench.prefix_share import bound_pages, measure

    figures, same = measure(model, [server.peer_id for server in servers], 4 * PAGE_TOKENS, 4, 5, 3)
    assert same
    for figure in figures:
        assert figure.pages_used == 4 + 4 * 1 and figure.pages_shared == 4  # the prefix once, a page each
        assert figure.bound == bound_pages(4 * PAGE_TOKENS, 4, 8) == 6 + 4 and figure.verdict == "PASS"
        assert figure.copies == 4 * 5 + 4


def test_a_rejected_draft_gives_its_pages_back_on_every_server_and_is_forgotten(model, servers):
    """Speculative decoding's rollback: a step of many positions (a draft), then a step at an earlier position (all
    but the draft's first token rejected): every server of the chain lets go of the pages past it, and what
    follows is what a session that never saw the rest of the draft computes."""
    draft = filler(40)
    with model.session(max_length=5 * PAGE_TOKENS) as session:
        session.step([PROMPT])
        assert session.step([draft], every_position=True).shape == (1, 40, model.config.vocab_size)
        assert all(info["cache_pages_used"] == 5 for info in infos(model, servers))  # 80 positions
        logits = session.step([[5]], position=len(PROMPT) + 1)
        assert all(info["cache_pages_used"] == 3 for info in infos(model, servers))  # 42 positions
    with model.session(max_length=len(PROMPT) + 2) as fresh:
        expected = fresh.step([PROMPT + draft[:1] + [5]])
    torch.testing.assert_close(logits, expected, rtol=0, atol=ATOL)

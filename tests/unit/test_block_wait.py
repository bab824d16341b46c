"""SwarmClient.wait_for_chain: while no server holds some blocks, a session or request waits for one (block_wait
at most), tells its hook once, and shows in the metrics; a fake routing stands in for the swarm."""

import logging

import pytest

from swarm.client import metrics, swarm_client
from swarm.client.routing import ChainLink
from swarm.client.swarm_client import SwarmClient
from swarm.protocol import MissingBlocksError

CHAIN = [ChainLink("peer", 0, 4)]


def client_whose_blocks_come_back_after(looks: int, block_wait: float, monkeypatch) -> SwarmClient:
    """A client whose routing finds blocks 2..3 missing for the first `looks` looks (no DHT node: chain() is fake)."""
    monkeypatch.setattr(swarm_client, "BLOCK_POLL_SECONDS", 0.01)
    client = SwarmClient.__new__(SwarmClient)
    client.block_wait = block_wait
    client.looks = 0

    def chain(prefix, num_blocks, model_name, **routing):
        client.looks += 1
        if client.looks <= looks:
            raise MissingBlocksError(f"no server holds blocks 2..3 of {model_name}")
        return CHAIN

    client.chain = chain
    return client


def waits(outcome: str) -> float:
    return metrics.BLOCK_WAITS.labels(outcome)._value.get()


def test_a_gap_is_waited_out_and_told_once(monkeypatch, caplog):
    client = client_whose_blocks_come_back_after(5, block_wait=60, monkeypatch=monkeypatch)
    told, waiting_while_told = [], []

    def on_wait(message):
        told.append(message)
        waiting_while_told.append(metrics.WAITING_FOR_BLOCKS._value.get())

    served_before = waits("served")
    with caplog.at_level(logging.INFO, logger="swarm.client.swarm_client"):
        assert client.wait_for_chain("tiny", 4, "tiny", on_wait=on_wait) == CHAIN
    assert client.looks == 6
    assert told == ["no server holds blocks 2..3 of tiny; waiting up to 60 s"]
    assert waiting_while_told[0] >= 1 and metrics.WAITING_FOR_BLOCKS._value.get() == waiting_while_told[0] - 1
    assert waits("served") == served_before + 1
    warnings = [record.getMessage() for record in caplog.records if record.levelno == logging.WARNING]
    assert warnings == told  # one line per wait, not one per look
    assert any("served again" in record.getMessage() for record in caplog.records)


def test_the_wait_is_bounded_and_then_the_blocks_are_named(monkeypatch):
    client = client_whose_blocks_come_back_after(10**9, block_wait=0.3, monkeypatch=monkeypatch)
    gave_up_before = waits("gave_up")
    with pytest.raises(MissingBlocksError, match=r"^no server holds blocks 2\.\.3 of tiny$"):
        client.wait_for_chain("tiny", 4, "tiny")
    assert client.looks > 2 and waits("gave_up") == gave_up_before + 1


def test_no_wait_when_block_wait_is_zero(monkeypatch):
    client = client_whose_blocks_come_back_after(1, block_wait=0, monkeypatch=monkeypatch)
    with pytest.raises(MissingBlocksError):
        client.wait_for_chain("tiny", 4, "tiny", on_wait=lambda message: pytest.fail("told of a wait"))
    assert client.looks == 1


def test_a_hook_that_fails_ends_the_wait(monkeypatch):
    """A WebSocket whose client left: nobody waits anymore."""
    client = client_whose_blocks_come_back_after(10**9, block_wait=60, monkeypatch=monkeypatch)
    waiting = metrics.WAITING_FOR_BLOCKS._value.get()

    def gone(message):
        raise ConnectionError("the client went away")

    with pytest.raises(ConnectionError):
        client.wait_for_chain("tiny", 4, "tiny", on_wait=gone)
    assert client.looks == 1 and metrics.WAITING_FOR_BLOCKS._value.get() == waiting


@pytest.mark.parametrize("value", ["soon", "-1", "nan", "inf", "1e9"])
def test_block_wait_seconds_is_checked_and_named(value, tmp_path):
    from config import SwarmSettings

    with pytest.raises(ValueError, match="BLOCK_WAIT_SECONDS must be"):
        SwarmSettings.from_env({"SWARM_CACHE_DIR": str(tmp_path), "BLOCK_WAIT_SECONDS": value})
    assert SwarmSettings.from_env({"SWARM_CACHE_DIR": str(tmp_path)}).block_wait_seconds == 30.0
    assert SwarmSettings.from_env({"SWARM_CACHE_DIR": str(tmp_path), "BLOCK_WAIT_SECONDS": "0"}).block_wait_seconds == 0

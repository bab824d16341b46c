"""Concurrent row-wise calls merge into fewer calls, and each caller gets its own rows' results."""

import threading
import time

import pytest
import torch

from swarm.client.coalesce import Coalescer


def test_concurrent_calls_merge_and_each_gets_its_rows():
    batches = []

    def slow_double(rows):
        batches.append(len(rows))
        time.sleep(0.02)  # long enough for the other threads to queue behind the running call
        return rows * 2

    coalescer = Coalescer(slow_double)
    inputs = [torch.full((1 + index % 2, 3), float(index)) for index in range(12)]
    results = [None] * len(inputs)

    def call(index):
        results[index] = coalescer(inputs[index])

    threads = [threading.Thread(target=call, args=(index,)) for index in range(len(inputs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    for given, got in zip(inputs, results):
        torch.testing.assert_close(got, given * 2)
    assert sum(batches) == sum(len(rows) for rows in inputs)
    assert len(batches) < len(inputs)  # merged
    assert coalescer(torch.ones(1, 3)).tolist() == [[2.0, 2.0, 2.0]]  # a lone caller runs at once


def test_an_error_reaches_every_caller_of_the_merged_call_and_the_next_call_works():
    fail = threading.Event()

    def function(rows):
        if fail.is_set():
            raise ValueError("broken")
        return rows

    coalescer = Coalescer(function)
    fail.set()
    with pytest.raises(ValueError, match="broken"):
        coalescer(torch.ones(1, 2))
    fail.clear()
    assert coalescer(torch.ones(1, 2)).shape == (1, 2)

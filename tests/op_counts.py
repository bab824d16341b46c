"""Counting the torch operators a piece of code runs: structural checks of what predicts a GPU's speed (how many
kernels a round issues), without a GPU."""

from __future__ import annotations


def count_torch_ops(function) -> int:
    """The number of aten operators `function` runs (every kernel it issues goes through one of them)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Counter(TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(self, op, types, args=(), kwargs=None):
            Counter.calls += 1
            return op(*args, **(kwargs or {}))

    with Counter():
        function()
    return Counter.calls

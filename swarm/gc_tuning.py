"""CPython's garbage collector in a long-running serving process (a block server, the gateway's worker).

A full collection walks every container object alive, and a process that imported torch, transformers and
hivemind and built a model holds about 400,000 of them: one full collection took 120-200 ms of CPU on this
machine with the GIL held, a stall of every session the process serves (a block server of the tests' tiny model
ran one about every 20 s under load). What start-up builds (modules, the model and its tokenizer, the swarm
client) lives as long as the process, so it is frozen out of every later collection (gc.freeze, as vLLM and
SGLang do once started): a full collection then walks only what serving made, 0.03 ms right after start-up.

The young generation's threshold stays CPython's: a step's objects mostly die by reference counting, and a
server collected its young generation 3 to 10 times in 100 decode steps.

A frozen object is still freed when its last reference goes, but never as part of a cycle: so once something
frozen is let go (a model the gateway unloads past MAX_LOADED_MODELS), everything is thawed for good. Nothing is
frozen again in that process, since what was let go may still be in use (its open sessions) at any later freeze.
"""

from __future__ import annotations

import gc

_freezing = False  # only in a serving process: a test's process that loads a model in passing freezes nothing
# objects frozen, as counted at the last freeze: gc.get_freeze_count() walks every frozen object (37 ms for 379,000,
# with the GIL held: a stall of every session at each /metrics scrape), so it is counted only when it changes
_frozen = 0


def serving_process() -> int:
    """This process serves until stopped (a block server, the gateway's worker): freeze what it built so far,
    and from now on what later start-up work builds (freeze_long_lived). Returns how many objects are frozen."""
    global _freezing
    _freezing = True
    return freeze_long_lived()


def freeze_long_lived() -> int:
    """In a serving process, free what start-up left as garbage, then keep every object alive now out of later
    collections (each call freezes what is new: a model loaded later); elsewhere, or once thawed, nothing.
    Returns how many objects are frozen in all."""
    global _frozen
    if _freezing:
        gc.collect()  # cycles left by loading would otherwise be frozen with the rest, and never freed
        gc.freeze()
        _frozen = gc.get_freeze_count()
    return _frozen


def frozen_objects() -> int:
    """How many objects the last freeze left frozen (fewer since, as frozen objects are freed one by one)."""
    return _frozen


def thaw() -> None:
    """Something frozen is let go: every object is collected as usual from now on (see the module's docstring)."""
    global _freezing, _frozen
    _freezing, _frozen = False, 0
    gc.unfreeze()


def expose(registry) -> None:
    """python_gc_frozen_objects on a Prometheus registry, beside prometheus_client's python_gc_collections_total
    (collections by generation): together they show the freeze at work."""
    from prometheus_client import Gauge

    Gauge("python_gc_frozen_objects", "Objects kept out of the garbage collector's collections (swarm/gc_tuning.py)",
          registry=registry).set_function(frozen_objects)

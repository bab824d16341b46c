"""CPython's garbage collector in a long-running serving process (a block server, the gateway's worker).

A full collection walks every container object alive, and a process that imported torch, transformers and
hivemind and built a model holds about 400,000 of them: one full collection took 120-200 ms of CPU on this
machine with the GIL held, a stall of every session the process serves (a block server of the tests' tiny model
ran one about every 20 s under load). What start-up builds (modules, the model and its tokenizer, the swarm
client) lives as long as the process, so it is frozen out of every later collection (gc.freeze, as vLLM and
SGLang do once started): a full collection then walks only what serving made, 0.03 ms right after start-up.

The young generation's threshold stays CPython's: a step's objects mostly die by reference counting, and a
server collected its young generation 3 times in 100 decode steps.
"""

from __future__ import annotations

import gc


def freeze_long_lived() -> int:
    """Free what start-up left as garbage, then keep every object alive now out of later collections; returns
    how many objects are frozen in all. Called again after more start-up work (a model loaded later): each call
    freezes what is new."""
    gc.collect()  # cycles left by loading would otherwise be frozen with the rest, and never freed
    gc.freeze()
    return gc.get_freeze_count()


def expose(registry) -> None:
    """python_gc_frozen_objects on a Prometheus registry, beside prometheus_client's python_gc_collections_total
    (collections by generation): together they show the freeze at work."""
    from prometheus_client import Gauge

    Gauge("python_gc_frozen_objects", "Objects kept out of the garbage collector's collections (swarm/gc_tuning.py)",
          registry=registry).set_function(gc.get_freeze_count)

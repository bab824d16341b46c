"""swarm/gc_tuning.py in a process of its own (freezing is process-wide, and a test's process must not freeze):
only a serving process freezes, a /metrics scrape costs no walk of the frozen objects, a frozen cycle let go is freed
once thawed, and nothing freezes after a thaw."""

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent("""
    import gc, weakref
    from swarm import gc_tuning

    class Node:
        pass

    assert gc_tuning.freeze_long_lived() == 0  # not a serving process: a library call freezes nothing
    first = Node(); first.me = first  # a cycle, as a model let go may hold
    watch = weakref.ref(first)
    assert gc_tuning.serving_process() > 1000
    del first
    gc.collect()
    assert watch() is not None  # frozen: no collection frees its cycle
    from prometheus_client import CollectorRegistry, generate_latest
    registry, walks = CollectorRegistry(), []
    gc_tuning.expose(registry)
    counted, gc.get_freeze_count = gc.get_freeze_count, lambda: walks.append(1) or counted()
    assert f"python_gc_frozen_objects {float(gc_tuning.frozen_objects())}" in generate_latest(registry).decode()
    assert walks == []  # a scrape never walks the frozen objects (tens of ms with the GIL held)
    gc.get_freeze_count = counted
    gc_tuning.thaw()
    gc.collect()
    assert watch() is None and gc.get_freeze_count() == 0  # thawed: collected as usual
    assert gc_tuning.freeze_long_lived() == 0  # and nothing is frozen again in this process
    print("ok")
""")


def test_only_a_serving_process_freezes_and_a_thaw_frees_what_was_let_go():
    run = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr

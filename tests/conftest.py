"""The suite's set-up: one compute thread per process, the repository root and tests/ on sys.path (the product's
packages, and the helper modules of tests/ that tests import by name), and the shared fixtures (tests/fixtures/)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Two xdist workers share 2 cores, each with servers and gateways of its own: a second compute thread per process
# only spins waiting for a core (a fifth more CPU for the same work, measured). Every process of the suite, its
# children included, computes on one thread; an explicit OMP_NUM_THREADS still wins.
os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

pytest_plugins = ["fixtures.swarms"]

"""The suite's set-up: one compute thread per process, the repository root and tests/ on sys.path (the product's
packages, and the helper modules of tests/ that tests import by name), and the shared fixtures (tests/fixtures/)."""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Two xdist workers share 2 cores, each with servers and gateways of its own: a second compute thread per process
# only spins waiting for a core (a fifth more CPU for the same work, measured). Every process of the suite, its
# children included, computes on one thread; an explicit OMP_NUM_THREADS still wins.
os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def _cache_of_the_suite() -> Path:
    """A cache folder of this test process's own (its children inherit it through SWARM_CACHE_DIR), so that no test
    writes into the user's cache: the session store `make run` opens, the servers' remembered throughputs. It reads
    the user's converted models through a link (`make test` converts the default model there first)."""
    from config import SwarmSettings

    models = SwarmSettings.from_env().cache_dir / "models"
    models.mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix="swarm-suite-cache-"))
    (folder / "models").symlink_to(models, target_is_directory=True)
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder


os.environ["SWARM_CACHE_DIR"] = str(_cache_of_the_suite())
os.environ.pop("SESSION_STORE", None)  # the default store, inside that folder

pytest_plugins = ["fixtures.swarms"]


def _settings_read_from_the_environment() -> frozenset[str]:
    """The names the product's settings read: quoted in config.py, gunicorn.conf.py and the servers' settings, and
    config.Limits' fields (each read as its name in capitals)."""
    import re

    from config import Limits

    sources = ("config.py", "gunicorn.conf.py", "swarm/server/settings.py")
    quoted = {name for source in sources for name in re.findall(r'"([A-Z][A-Z0-9_]{2,})"', (ROOT / source).read_text())}
    return frozenset(quoted | {name.upper() for name in Limits.__dataclass_fields__})


SETTINGS = _settings_read_from_the_environment()


@pytest.fixture(autouse=True)
def _settings_left_as_found():
    """A test that changes a setting in this process's environment and leaves it so decides for every gateway and
    server a later test of the same worker starts (a KEYLESS_SHARING left set once made another test's gateway
    share). Libraries' own variables (torch's caches) are theirs to set."""
    before = {name: os.environ.get(name) for name in SETTINGS}
    yield
    changed = sorted(name for name in SETTINGS if before[name] != os.environ.get(name))
    assert not changed, f"the test left settings changed in the environment: {changed}"

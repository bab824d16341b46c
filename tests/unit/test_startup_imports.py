"""What a process of the product imports before it serves: a server, the gateway's app and the swarm client load
hivemind's DHT and P2P, never its averager, optimizers or mixture of experts (with scipy), which its package
__init__ would import (swarm/__init__.py registers the package without running it). Each check runs in a fresh
interpreter, as a process starts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NEVER = ("scipy", "hivemind.averaging", "hivemind.optim", "hivemind.moe")


def modules_after(statement: str) -> set[str]:
    code = f"import sys; {statement}; print(' '.join(sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120, check=True)
    return set(out.stdout.split())


def test_a_server_the_gateway_and_the_client_import_hivemind_s_dht_and_p2p_without_the_rest():
    modules = modules_after("import swarm.server.main; import app; from swarm.client import SwarmClient; "
                            "from hivemind.dht.node import DHTNode")
    assert "hivemind.p2p" in modules and "hivemind.dht.node" in modules
    assert not [name for name in modules if any(name == never or name.startswith(never + ".") for never in NEVER)]


def test_hivemind_imported_whole_first_stays_whole():
    assert "hivemind.averaging" in modules_after("import hivemind; import swarm; assert hivemind.DHT")

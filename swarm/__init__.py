"""The distributed model: everything that knows about block servers, the DHT and remote sessions.

Two packages, and what both share:

    client/       SwarmClient, RemoteSession, RemoteModel: a model whose blocks run on remote servers (the
                  gateway's side; its public API is swarm.client's __all__)
    server/       the block server, `python -m swarm.server`: request handling, backend and sessions,
                  batching, cache, placement, throughput

    protocol.py   DHT key scheme, the ServerInfo and ModelRecord records, block coverage, the SwarmError tree
    wire.py       the RPC interface both sides speak (BlockRPC), and tensors in messages
    families/     every layer quirk of every model family, as a registry of functions
    weights.py    resolve a model name or folder; convert the shipped GGUF once; read only the tensors asked for
    hub.py        a model named by its Hugging Face Hub id: its config and tokenizer, and only the weight files
                  holding what a process loads, fetched into the Hub's cache; the Hub's refusals in one line
    trust.py      identity keys, and the DHT record validator: only records signed under their writer's subkey
    dht.py        the process's event loop, DHT nodes, announcing and finding servers; `python -m swarm.dht`
    transport.py  a small message written to the libp2p daemon in one socket write (hivemind's framing, joined)
    relays.py     servers behind a NAT: libp2p circuit relays through public peers (p2pd's flags, the wait)
    local.py      LocalSwarm: a bootstrap peer and block servers as child processes on this machine
    network_map.py  a simulated network map (NETWORK_MAP, --network-map): regions and the round trip of each link
    cli.py        what the command-line tools share: flag checks (multiaddrs, block ranges), one-line errors
    gc_tuning.py  serving processes (servers, the gateway's worker): start-up's objects frozen out of collections

Dependencies go one way: client -> shared modules <- server; the client and the server never import each
other. This package never imports flask or gateway; torch, transformers and hivemind load only when used.
"""

import importlib.util as _importlib_util
import sys as _sys
import types as _types


def _register_hivemind_without_its_init() -> None:
    """hivemind's package __init__ imports all of hivemind: its averager, optimizers and mixture of experts, with
    scipy. The swarm uses its DHT, P2P and utilities only, so the package is registered without running that
    __init__ (its submodules import one another by full name, never through it): half a second less in the
    start of every server, gateway and command. Where hivemind was imported whole already, it stays as it is."""
    if "hivemind" in _sys.modules:
        return
    spec = _importlib_util.find_spec("hivemind")
    if spec is None or not spec.submodule_search_locations:
        return
    package = _types.ModuleType("hivemind", "hivemind's modules, imported one by one (swarm/__init__.py)")
    package.__spec__, package.__file__ = spec, spec.origin
    package.__path__ = list(spec.submodule_search_locations)
    _sys.modules["hivemind"] = package


_register_hivemind_without_its_init()

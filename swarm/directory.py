"""The DHT layout of a model's servers: which key a server's record goes under, and what a key keeps.

One record per server, under the key of the block its span starts at (``block_key(prefix, start)``), rather than
under every block it holds: a lookup reads the keys of every start a chain may use (``start_keys``) and finds each
server's record once, whatever its span. A server holding block b starts at or before b, so the keys of the starts
[0, b] hold every server of b (what `servers_of_block` reads). The keys are the block keys of the layout before
(one record under every block held), so swarms upgrading server by server find each other both ways: a client of
either layout reads every block's key and keeps each server's newest record.

A key holds at most RECORDS_PER_KEY records (`kept`): the BEST_RECORDS_PER_KEY best by announced capacity (online,
with free cache, throughput x blocks), and SAMPLED_RECORDS_PER_KEY of the rest by a hash of their writer that every
node computes alike and that changes every SAMPLE_ROTATION_SECONDS (room for exploration: a new or slower server
still gets found some of the time). The nodes that store a key enforce it (swarm/bounded_storage.py), so a lookup's
replies stay bounded on the wire; readers enforce it again on what several replicas (or nodes of older versions)
sent back. The catalogue's one shared key is bounded too: at most CATALOGUE_ENTRIES_PER_MODEL entries per model, the
record most of them sign first, and CATALOGUE_ENTRIES in all, shared out among models by how many entries each has.

Pure functions of decoded values: no hivemind here.
"""

from __future__ import annotations

import hashlib
from collections import Counter, defaultdict
from typing import Hashable, Iterable, NamedTuple, Optional

from swarm.protocol import ModelRecord, ServerInfo, ServerState, block_key

BEST_RECORDS_PER_KEY = 24
SAMPLED_RECORDS_PER_KEY = 8
RECORDS_PER_KEY = BEST_RECORDS_PER_KEY + SAMPLED_RECORDS_PER_KEY
SAMPLE_ROTATION_SECONDS = 600.0
CATALOGUE_ENTRIES_PER_MODEL = 8
CATALOGUE_ENTRIES = 64


def record_key(prefix: str, info: ServerInfo) -> str:
    """The one key a server's record goes under: its span's first block's."""
    return block_key(prefix, info.start)


def start_keys(prefix: str, num_blocks: int, until: Optional[int] = None) -> list[str]:
    """The keys that hold every server of the blocks before `until` (default: all of them): those of the
    starts [0, until)."""
    return [block_key(prefix, start) for start in range(num_blocks if until is None else min(until, num_blocks))]


class Entry(NamedTuple):
    subkey: Hashable  # who wrote it (an owner marker): what the sample is drawn by
    value: object  # the decoded value, its signature stripped
    expiration: float


def kept(entries: Iterable[Entry], now: float) -> Optional[set]:
    """The subkeys of the entries a key keeps, or None where the key is not bounded (no server record nor
    catalogue entry in it: a key of another kind, such as the regions of a network map)."""
    entries = list(entries)
    servers = [(entry, ServerInfo.from_wire(entry.value)) for entry in entries]
    if any(info is not None for _, info in servers):
        return _kept_servers([(entry, info) for entry, info in servers if info is not None], now)
    models = [(entry, ModelRecord.from_wire(entry.value)) for entry in entries]
    if any(record is not None for _, record in models):
        return _kept_catalogue([(entry, record) for entry, record in models if record is not None])
    return None


def capacity(info: ServerInfo) -> tuple:
    """How a record ranks among those of a key: online first, then with free cache, then by tokens per second
    through its blocks (throughput x blocks: a longer span at the same speed does more of a chain)."""
    return (info.state == ServerState.ONLINE, info.cache_tokens_free > 0, info.throughput * (info.end - info.start))


def _kept_servers(servers: list[tuple[Entry, ServerInfo]], now: float) -> set:
    if len(servers) <= RECORDS_PER_KEY:
        return {entry.subkey for entry, _ in servers}
    ranked = sorted(servers, key=lambda pair: (capacity(pair[1]), pair[0].expiration), reverse=True)
    best = [entry for entry, _ in ranked[:BEST_RECORDS_PER_KEY]]
    epoch = int(now // SAMPLE_ROTATION_SECONDS)
    rest = sorted((entry for entry, _ in ranked[BEST_RECORDS_PER_KEY:]), key=lambda entry: _draw(entry.subkey, epoch))
    return {entry.subkey for entry in best + rest[:SAMPLED_RECORDS_PER_KEY]}


def _draw(subkey: Hashable, epoch: int) -> bytes:
    """A writer's place in this epoch's sample: the same on every node, another in the next epoch."""
    raw = subkey if isinstance(subkey, bytes) else repr(subkey).encode()
    return hashlib.blake2b(raw + epoch.to_bytes(8, "big"), digest_size=8).digest()


def _kept_catalogue(models: list[tuple[Entry, ModelRecord]]) -> set:
    """At most CATALOGUE_ENTRIES_PER_MODEL entries of each model, those of the record most of its entries sign
    first (so one stranger's entry never outlives the servers' majority); then CATALOGUE_ENTRIES in all, taken a
    round at a time: each model's first entry (models with the most entries first), then each one's second..."""
    by_prefix: dict[str, list[tuple[Entry, ModelRecord]]] = defaultdict(list)
    for entry, record in models:
        by_prefix[record.prefix].append((entry, record))
    columns = []
    for prefix, pairs in sorted(by_prefix.items(), key=lambda item: (-len(item[1]), item[0])):
        votes = Counter(record for _, record in pairs)
        pairs.sort(key=lambda pair: (votes[pair[1]], pair[0].expiration), reverse=True)
        columns.append([entry.subkey for entry, _ in pairs[:CATALOGUE_ENTRIES_PER_MODEL]])
    kept_subkeys: list = []
    for round_ in range(CATALOGUE_ENTRIES_PER_MODEL):
        kept_subkeys += [column[round_] for column in columns if round_ < len(column)]
    return set(kept_subkeys[:CATALOGUE_ENTRIES])

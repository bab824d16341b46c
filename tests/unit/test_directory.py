"""What a DHT key keeps (swarm/directory.py) and how a node's storage enforces it (swarm/bounded_storage.py): the
best records by announced capacity plus a rotating sample, the catalogue a few entries per model with the
servers' majority kept; decoded values here, signed bytes in a real storage object (no network)."""

from hivemind.dht.routing import DHTID
from hivemind.utils import MSGPackSerializer, get_dht_time

from swarm import directory
from swarm.bounded_storage import BoundedStorage
from swarm.directory import (BEST_RECORDS_PER_KEY, CATALOGUE_ENTRIES, CATALOGUE_ENTRIES_PER_MODEL, RECORDS_PER_KEY,
                             SAMPLE_ROTATION_SECONDS, Entry, kept)
from swarm.protocol import ModelRecord, ServerInfo, ServerState, block_key


def server(index: int, throughput: float, state=ServerState.ONLINE, free=1024) -> Entry:
    info = ServerInfo(state, 0, 4, throughput, free)
    return Entry(f"peer-{index}".encode(), info.to_wire(), 1000.0 + index)


def test_the_records_of_a_server_go_under_its_first_block_and_a_lookup_reads_every_start():
    info = ServerInfo(ServerState.ONLINE, 5, 9, 10.0, 64)
    assert directory.record_key("m", info) == block_key("m", 5)
    assert directory.start_keys("m", 8) == [block_key("m", start) for start in range(8)]
    assert directory.start_keys("m", 8, until=3) == [block_key("m", 0), block_key("m", 1), block_key("m", 2)]


def test_a_key_under_its_bound_keeps_everything():
    entries = [server(index, 10.0 + index) for index in range(RECORDS_PER_KEY)]
    assert kept(entries, now=0.0) == {entry.subkey for entry in entries}


def test_a_full_key_keeps_the_best_by_capacity_and_a_sample_of_the_rest():
    entries = [server(index, float(index + 1)) for index in range(100)]
    entries.append(server(100, 1e5, free=0))  # fastest, but no room for a session: ranks below any with room
    entries.append(server(101, 1e5, state=ServerState.JOINING))
    chosen = kept(entries, now=0.0)
    assert len(chosen) == RECORDS_PER_KEY
    fastest_with_room = {f"peer-{index}".encode() for index in range(100 - BEST_RECORDS_PER_KEY, 100)}
    assert fastest_with_room <= chosen
    assert len(chosen - fastest_with_room) == RECORDS_PER_KEY - BEST_RECORDS_PER_KEY  # the sample
    # every node draws the same sample at the same time, and another one in the next epoch
    assert kept(list(reversed(entries)), now=1.0) == chosen
    later = kept(entries, now=SAMPLE_ROTATION_SECONDS + 1.0)
    assert later != chosen and fastest_with_room <= later


def test_malformed_entries_under_a_key_of_server_records_are_dropped_first():
    entries = [server(index, 10.0) for index in range(RECORDS_PER_KEY)]
    junk = [Entry(f"junk-{index}".encode(), "not a record", 9e9) for index in range(10)]
    assert kept(entries + junk, now=0.0) == {entry.subkey for entry in entries}
    assert kept(junk, now=0.0) is None  # a key of another kind (the regions of a network map): not bounded


def catalogue_entry(index: int, prefix: str, source: str = "weights") -> Entry:
    return Entry(f"peer-{prefix}-{index}".encode(), ModelRecord(prefix, prefix, 4, source).to_wire(), 1000.0 + index)


def test_the_catalogue_keeps_a_few_entries_per_model_and_a_strangers_record_never_outlives_the_majority():
    honest = [catalogue_entry(index, "big") for index in range(20)]
    hijack = catalogue_entry(99, "big", source="/elsewhere/evil")  # the newest entry, of another record
    rare = catalogue_entry(0, "rare")
    chosen = kept(honest + [hijack, rare], now=0.0)
    assert hijack.subkey not in chosen and rare.subkey in chosen
    assert len(chosen) == CATALOGUE_ENTRIES_PER_MODEL + 1


def test_the_catalogue_shares_its_bound_among_models():
    entries = [catalogue_entry(index, f"model-{model}") for model in range(CATALOGUE_ENTRIES) for index in range(3)]
    chosen = kept(entries, now=0.0)
    assert len(chosen) == CATALOGUE_ENTRIES
    # a round at a time: every model keeps its first entry before any keeps a second
    assert {subkey.rsplit(b"-", 1)[0] for subkey in chosen} == {f"peer-model-{model}".encode()
                                                                 for model in range(CATALOGUE_ENTRIES)}


def signed(value) -> bytes:
    """A value as a node stores it: serialized, a signature appended (the storage never checks it: the
    validator did before)."""
    return MSGPackSerializer.dumps(value) + b"[signature:c2ln]"


def test_a_nodes_storage_keeps_at_most_the_bound_of_a_key_and_refuses_what_ranks_below():
    storage, key, now = BoundedStorage(), DHTID.generate("m.0"), get_dht_time()
    for index in range(RECORDS_PER_KEY + 20):
        info = ServerInfo(ServerState.ONLINE, 0, 4, 100.0 + index, 1024)
        storage.store_subkey(key, f"peer-{index}".encode(), signed(info.to_wire()), now + 30)
    dictionary = storage.get(key).value
    assert len(dictionary) == RECORDS_PER_KEY
    fastest = {f"peer-{index}".encode() for index in range(RECORDS_PER_KEY + 20 - BEST_RECORDS_PER_KEY,
                                                             RECORDS_PER_KEY + 20)}
    assert fastest <= set(dict(dictionary.items()))
    slow = ServerInfo(ServerState.ONLINE, 0, 4, 1.0, 1024)  # slower than all: kept only if the sample draws it
    stored = storage.store_subkey(key, b"slowest", signed(slow.to_wire()), now + 30)
    assert stored == (b"slowest" in dict(dictionary.items())) and len(dictionary) == RECORDS_PER_KEY
    regions = DHTID.generate("regions")  # a key of another kind keeps everything, as before
    for index in range(RECORDS_PER_KEY + 5):
        storage.store_subkey(regions, f"peer-{index}".encode(), signed("eu"), now + 30)
    assert len(storage.get(regions).value) == RECORDS_PER_KEY + 5

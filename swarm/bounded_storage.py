"""A DHT node's storage that keeps at most what swarm/directory.py allows under each key.

hivemind stores every subkey written under a key, and sends all of them back for each lookup: a thousand servers
writing under one key would make every lookup of it carry a thousand records. Its record validator sees one record
at a time, never what a key already holds, so the bound is kept by the storage instead: after each entry stored
under a key, the key's entries that swarm/directory.py does not keep are dropped (the entry just stored among them,
when it ranks below those there). Every node of the swarm that stores records runs it (dht.start_node), for what
it stores and what it caches.

This module imports hivemind: import it only where a node is started.
"""

from __future__ import annotations

from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.storage import DHTLocalStorage, DictionaryDHTValue
from hivemind.utils import MSGPackSerializer, get_dht_time

from swarm import directory


class BoundedStorage(DHTLocalStorage):
    """hivemind's storage, but a key holding server records or catalogue entries keeps what directory.kept keeps."""

    def store_subkey(self, key, subkey, value, expiration_time) -> bool:
        """Store as hivemind does, then drop what the key does not keep; whether the entry stored is kept."""
        stored = super().store_subkey(key, subkey, value, expiration_time)
        found = self.get(key)
        if not stored or found is None or not isinstance(found.value, DictionaryDHTValue):
            return stored
        dictionary = found.value
        if len(dictionary) <= min(directory.RECORDS_PER_KEY, directory.CATALOGUE_ENTRIES_PER_MODEL):
            return stored  # no bound can be reached yet: nothing to decode
        keep = directory.kept([directory.Entry(entry_subkey, _decoded(item.value), item.expiration_time)
                               for entry_subkey, item in dictionary.items()], get_dht_time())
        if keep is None:
            return stored
        for dropped in [entry_subkey for entry_subkey, _ in dictionary.items() if entry_subkey not in keep]:
            del dictionary[dropped]
        return subkey in keep


def _decoded(signed_value: bytes):
    """A stored value as its writer serialized it, its signature stripped; None if it is not one."""
    try:
        return MSGPackSerializer.loads(RSASignatureValidator._SIGNATURE_RE.sub(b"", signed_value))
    except Exception:  # whatever a peer stored: the validator checked the signature, not the contents
        return None


def install(node):
    """Give the node's protocol bounded storage and cache, with whatever it already holds; returns the node."""
    protocol = node.protocol
    for name in ("storage", "cache"):
        old = getattr(protocol, name)
        new = BoundedStorage(maxsize=None if old.maxsize == float("inf") else old.maxsize)
        for key, item in old.items():
            if isinstance(item.value, DictionaryDHTValue):
                for subkey, entry in item.value.items():
                    new.store_subkey(key, subkey, entry.value, entry.expiration_time)
            else:
                new.store(key, item.value, item.expiration_time)
        setattr(protocol, name, new)
    return node

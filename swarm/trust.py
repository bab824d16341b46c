"""Who wrote a DHT record: each node signs what it stores with its libp2p identity key, and the swarm keeps
only records signed under their writer's own subkey.

hivemind's RSASignatureValidator protects every record whose subkey holds an owner marker,
``[owner:<RSA public key>]``: peers refuse to store it, and readers drop it, unless that key signed it. The
swarm's validator (OwnerSignedRecords) goes further and refuses every record whose subkey is not exactly an
owner marker, so a server's records live under its own marker, and nothing else is stored at all (nor any
value over MAX_VALUE_BYTES). A libp2p peer id is a hash of the identity's public key, so the marker also says
which peer wrote the record (owner_peer_id): no one can overwrite a server's record, nor announce one under a
server's peer id.

Every node runs the validator (see dht.start_node): a full node (server, bootstrap peer) refuses to store a
forged record, and every node drops the forged records that a peer sends back for a lookup.

This module imports hivemind: import it only where a node is used (as dht.py does, inside its functions).
"""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from typing import Iterator, Optional

import multihash
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.validation import DHTRecord
from hivemind.p2p import PeerID
from hivemind.proto import crypto_pb2
from hivemind.utils import MSGPackSerializer
from hivemind.utils.crypto import RSAPrivateKey

from swarm.protocol import BadRequestError

_OWNER_MARKER = re.compile(RSASignatureValidator.PUBLIC_KEY_REGEX)
# a record's value, its signature included: a server's record takes some 700 bytes, a catalogue entry at most
# some 3,500 (names and a source of up to protocol.MAX_NAME_CHARS each). A bigger one is refused whether a peer
# asks this node to store it or sends it back for a lookup: no one can fill the peers' storage, or every
# lookup of a block, with megabytes of it.
MAX_VALUE_BYTES = 4096


@dataclass(frozen=True)
class Identity:
    path: str  # the libp2p daemon reads the key from this file when it starts
    key: RSAPrivateKey  # the same key: it signs the node's records
    created: bool  # written just now, so no other peer can be using it


@contextmanager
def identity(path: Optional[str] = None) -> Iterator[Identity]:
    """The node's identity: the RSA key in `path` (created there if missing), or with no path a new key in a
    temporary file, removed when the block ends (start the node inside it: the daemon reads the file once)."""
    if path is not None and os.path.exists(path):
        yield Identity(path, _read_identity(path), created=False)
    elif path is not None:
        key = RSAPrivateKey()
        _write_identity(path, key)
        yield Identity(path, key, created=True)
    else:
        key = RSAPrivateKey()
        with tempfile.TemporaryDirectory(prefix="swarm-identity-") as folder:
            temporary = os.path.join(folder, "identity.key")
            _write_identity(temporary, key)
            yield Identity(temporary, key, created=True)


class OwnerSignedRecords(RSASignatureValidator):
    """Signs the records this node stores under its owner marker; accepts a record only if its subkey is
    exactly an owner marker and that key signed it. Unsigned records are refused too: anyone could write
    them, and a flood of them under a block's key would slow every lookup of that block."""

    def validate(self, record: DHTRecord) -> bool:
        if len(record.value) > MAX_VALUE_BYTES:  # before anything is decoded or verified
            return False
        try:
            subkey = MSGPackSerializer.loads(record.subkey)
        except Exception:  # whatever a stranger put there
            return False
        return isinstance(subkey, bytes) and _OWNER_MARKER.fullmatch(subkey) is not None and super().validate(record)


def owner_subkey(node) -> bytes:
    """The subkey this node's records go under: its owner marker (from the validator start_node gave it)."""
    return node.protocol.record_validator.local_public_key


@lru_cache(maxsize=4096)
def owner_peer_id(subkey) -> Optional[str]:
    """The peer id (base58) of the key in an owner-marker subkey; None for any other subkey.

    A record under an owner marker reached this node only if that key signed it (the validator dropped it
    otherwise), so this is the peer that wrote it."""
    match = _OWNER_MARKER.fullmatch(subkey) if isinstance(subkey, bytes) else None
    if match is None:
        return None
    try:
        public_key = serialization.load_ssh_public_key(match.group(1))
    except (ValueError, TypeError):
        return None
    if not isinstance(public_key, rsa.RSAPublicKey):
        return None
    # what libp2p derives a peer id from: a sha2-256 multihash of the protobuf-wrapped DER public key
    # (https://github.com/libp2p/specs/blob/master/peer-ids/peer-ids.md; PeerID.from_identity does the same)
    der = public_key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    wrapped = crypto_pb2.PublicKey(key_type=crypto_pb2.RSA, data=der).SerializeToString()
    return PeerID(multihash.encode(hashlib.sha256(wrapped).digest(), multihash.coerce_code("sha2-256"))).to_base58()


def _write_identity(path: str, key: RSAPrivateKey) -> None:
    """A libp2p identity file, as hivemind's P2P.generate_identity writes one (a protobuf-wrapped RSA key)."""
    wrapped = crypto_pb2.PrivateKey(key_type=crypto_pb2.RSA, data=key.to_bytes())
    try:
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400)  # a private key: owner-readable
    except OSError as error:
        raise BadRequestError(f"--identity {path}: cannot create it: {error.strerror}") from None
    with os.fdopen(descriptor, "wb") as file:
        file.write(wrapped.SerializeToString())


def _read_identity(path: str) -> RSAPrivateKey:
    try:
        with open(path, "rb") as file:
            wrapped = crypto_pb2.PrivateKey.FromString(file.read())
        if wrapped.key_type != crypto_pb2.RSA:
            raise ValueError(f"it holds a {crypto_pb2.KeyType.Name(wrapped.key_type)} key")
        key = RSAPrivateKey.__new__(RSAPrivateKey)  # the key read, not a new one: as hivemind unpickles its keys
        key.__setstate__({"_private_key": wrapped.data})
    except (OSError, ValueError, TypeError) as error:  # protobuf's DecodeError is a ValueError too
        raise BadRequestError(f"--identity {path}: not an RSA libp2p identity ({error}); "
                              "the swarm signs records with RSA keys: give a new path to create one") from None
    return key

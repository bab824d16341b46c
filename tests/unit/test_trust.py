import os

import pytest

from swarm.protocol import BadRequestError


def test_an_identity_signs_as_the_peer_libp2p_derives_from_it(tmp_path):
    from hivemind.p2p import PeerID

    from swarm import trust

    path = str(tmp_path / "server.key")
    with trust.identity(path) as created:
        assert created.created and oct(os.stat(path).st_mode & 0o777) == "0o400"
    with trust.identity(path) as read:  # the same key, read back: the same peer
        assert not read.created
    marker = trust.OwnerSignedRecords(read.key).local_public_key
    with open(path, "rb") as file:
        assert trust.owner_peer_id(marker) == PeerID.from_identity(file.read()).to_base58()
    assert trust.owner_peer_id(trust.OwnerSignedRecords(created.key).local_public_key) == trust.owner_peer_id(marker)

    with trust.identity() as temporary:  # no path: a new key, in a file gone after the block
        assert temporary.created and os.path.exists(temporary.path)
    assert not os.path.exists(temporary.path)


@pytest.mark.parametrize("subkey", [b"QmPeer", "[owner:x]", b"[owner:ssh-rsa AAAA]", b"[owner:a][owner:a]", None])
def test_only_an_owner_marker_names_a_peer(subkey):
    from swarm.trust import owner_peer_id

    assert owner_peer_id(subkey) is None


def test_a_non_rsa_identity_is_refused_in_one_line(tmp_path):
    from hivemind.proto import crypto_pb2

    from swarm import trust

    path = tmp_path / "ed25519.key"
    path.write_bytes(crypto_pb2.PrivateKey(key_type=crypto_pb2.Ed25519, data=b"\0" * 64).SerializeToString())
    with pytest.raises(BadRequestError, match="not an RSA libp2p identity"):
        with trust.identity(str(path)):
            pass


def test_a_value_over_a_few_kilobytes_is_refused_however_well_signed():
    """validate() runs when a peer asks this node to store a record and when a peer sends one back for a
    lookup: a value this big is neither stored nor believed (before: any size was)."""
    from hivemind.dht.validation import DHTRecord
    from hivemind.utils import MSGPackSerializer, get_dht_time
    from hivemind.utils.crypto import RSAPrivateKey

    from swarm.protocol import MAX_NAME_CHARS, ModelRecord
    from swarm.trust import MAX_VALUE_BYTES, OwnerSignedRecords

    validator = OwnerSignedRecords(RSAPrivateKey())

    def signed(value) -> DHTRecord:
        record = DHTRecord(b"key", MSGPackSerializer.dumps(validator.local_public_key), MSGPackSerializer.dumps(value),
                           get_dht_time() + 60)
        return DHTRecord(record.key, record.subkey, validator.sign_value(record), record.expiration_time)

    longest_entry = ModelRecord("n" * MAX_NAME_CHARS, "p" * MAX_NAME_CHARS, 30, "s" * MAX_NAME_CHARS).to_wire()
    assert validator.validate(signed(longest_entry))  # the biggest value a server writes
    oversized = signed({"state": 2, "padding": "x" * MAX_VALUE_BYTES})
    assert len(oversized.value) > MAX_VALUE_BYTES and not validator.validate(oversized)

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

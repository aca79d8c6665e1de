"""The checkpoint's tree (RFC 6962): every leaf's audit path gives the root, a wrong one does not."""

from __future__ import annotations

import hashlib

from history.checkpoints import inclusion_path, merkle_root, root_from_path


def _leaves(n: int) -> list[bytes]:
    return [hashlib.sha256(b"\x00" + i.to_bytes(4, "big")).digest() for i in range(n)]


def _rfc_mth(hashes: list[bytes]) -> bytes:
    """RFC 6962's definition read literally: split at the largest power of two below n."""
    if len(hashes) == 1:
        return hashes[0]
    k = 1
    while k * 2 < len(hashes):
        k *= 2
    return hashlib.sha256(b"\x01" + _rfc_mth(hashes[:k]) + _rfc_mth(hashes[k:])).digest()


def test_every_leafs_path_gives_the_root_and_a_changed_leaf_does_not():
    for n in range(1, 40):
        leaves = _leaves(n)
        root = merkle_root(leaves)
        assert root == _rfc_mth(leaves)
        for i in range(n):
            path = inclusion_path(leaves, i)
            assert root_from_path(i, n, leaves[i], path) == root, (n, i)
            assert root_from_path(i, n, hashlib.sha256(b"x").digest(), path) != root
            if n > 1:
                assert root_from_path((i + 1) % n, n, leaves[i], path) != root

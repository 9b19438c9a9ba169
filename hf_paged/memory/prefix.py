"""Chained digests naming full blocks of token ids, for the prefix index.

The digest of block i covers the salt and *all* tokens up to the end of block i::

    digest_0 = blake2b(salt || tokens[0:bs])
    digest_i = blake2b(digest_{i-1} || tokens[i*bs:(i+1)*bs])

so equal digests mean equal prefixes up to a 128-bit collision. On top of that the allocator compares
the block's own tokens on every hit, and digests are only looked up along a chain that starts at the
salted root: a collision can make a lookup miss, never serve K/V of other tokens. Because a digest
stands for the whole prefix, a block can be found without its ancestors being present, which is what
sliding-window layer groups need (their early blocks are freed).
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

_ROOT = b"hf-paged/v1"


def block_digests(token_ids: Sequence[int], block_size: int, salt: str | bytes | None = None) -> list[bytes]:
    """Digests of every *full* block of `token_ids` (a trailing partial block gets none).

    Args:
        token_ids: the tokens of one sequence, in order, without padding.
        block_size: tokens per block.
        salt: keeps the prefixes of different tenants apart; None for no salt.

    Returns:
        `len(token_ids) // block_size` 16-byte digests.
    """
    if isinstance(salt, str):
        salt = salt.encode()
    parent = hashlib.blake2b(_ROOT + b"|" + (salt or b""), digest_size=16).digest()
    digests = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        chunk = array("q", token_ids[start : start + block_size]).tobytes()
        parent = hashlib.blake2b(parent + chunk, digest_size=16).digest()
        digests.append(parent)
    return digests

"""Chained digests naming full blocks of token ids, for the prefix index.

The digest of block i covers the salt and *all* tokens up to the end of block i::

    digest_0 = blake2b(salt || tokens[0:bs])
    digest_i = blake2b(digest_{i-1} || tokens[i*bs:(i+1)*bs])

so equal digests mean equal prefixes up to a 128-bit collision. On top of that the allocator compares
the block's own tokens on every hit, and digests are only looked up along a chain that starts at the
salted root: a collision can make a lookup miss, never serve K/V of other tokens. Because a digest
stands for the whole prefix, a block can be found without its ancestors being present, which is what
sliding-window layer groups need (their early blocks are freed).

Non-text inputs (images, video, audio) enter a prompt as runs of placeholder ids that are the same for every image.
So from the block holding a row's first placeholder on, the chain also covers a digest of that row's non-text
content (`content_keys`)::

    digest_i = blake2b(digest_{i-1} || "content" || content || tokens[i*bs:(i+1)*bs])   (first such block)

and the same tokens with other pixels never share a digest. A row whose content is unknown gets no digests from
that block on: those blocks are neither looked up nor indexed.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Mapping, Sequence

import torch

_ROOT = b"hf-paged/v1"


def block_digests(
    token_ids: Sequence[int], block_size: int, salt: str | bytes | None = None, *,
    content_from: int | None = None, content: bytes | None = None,
) -> list[bytes]:
    """Digests of every *full* block of `token_ids` (a trailing partial block gets none).

    Args:
        token_ids: the tokens of one sequence, in order, without padding.
        block_size: tokens per block.
        salt: keeps the prefixes of different tenants apart; None for no salt.
        content_from: index of the row's first token standing for non-text input (a placeholder), None if none.
        content: the row's `content_keys` entry; None while `content_from` is set means unknown content, and the
            digests stop before the block holding `content_from`.

    Returns:
        `len(token_ids) // block_size` 16-byte digests (fewer when the content is unknown).
    """
    if isinstance(salt, str):
        salt = salt.encode()
    parent = hashlib.blake2b(_ROOT + b"|" + (salt or b""), digest_size=16).digest()
    digests = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        chunk = array("q", token_ids[start : start + block_size]).tobytes()
        if content_from is not None and start + block_size > content_from:
            if content is None:
                break
            chunk, content_from = b"content" + content + chunk, None
        parent = hashlib.blake2b(parent + chunk, digest_size=16).digest()
        digests.append(parent)
    return digests


def content_keys(inputs: Mapping[str, torch.Tensor], placeholder_counts: Sequence[int]) -> list[bytes]:
    """Per row of a batch, a 16-byte key of its non-text content, for `block_digests(content=...)`.

    Every tensor of `inputs` is hashed (name, dtype, shape, bytes), with the row's index and every row's number of
    placeholders: processors give a batch's images in order over its rows and their placeholders, so these
    determine which pixels each row's placeholders stand for. (Rows of different batches key apart even with the
    same image; a batch of one row keys by its own content.)

    Args:
        inputs: the processor's non-text tensors, e.g. `pixel_values` `[num_images, channels, height, width]`,
            `image_sizes` `[num_images, 2]`, `image_grid_thw` `[num_images, 3]`.
        placeholder_counts: per row, the placeholder tokens of its prompt.

    Returns:
        `len(placeholder_counts)` digests.
    """
    h = hashlib.blake2b(_ROOT + b"|content", digest_size=16)
    for name in sorted(inputs):
        value = inputs[name]
        if not isinstance(value, torch.Tensor):
            raise TypeError(
                f"non-text input {name!r} must be a tensor (the processor's return_tensors='pt' output), got "
                f"{type(value).__name__}."
            )
        data = value.detach().to("cpu").contiguous()
        h.update(f"{name}|{data.dtype}|{tuple(data.shape)}|".encode())
        h.update(data.reshape(-1).view(torch.uint8).numpy().tobytes() if data.numel() else b"")
    h.update(array("q", placeholder_counts).tobytes())
    batch = h.digest()
    return [hashlib.blake2b(batch + array("q", [row]).tobytes(), digest_size=16).digest() for row in range(len(placeholder_counts))]

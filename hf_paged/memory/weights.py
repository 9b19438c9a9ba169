"""Which weights computed a cached prefix: a key per model object and a fingerprint of its current weights.

A prefix block holds K/V that a model computed from its weights; after an optimizer step, `load_state_dict`,
or any in-place edit, the same tokens give different K/V, and another model on the same pool gives other
K/V altogether. `weights_key(model)` returns `(model_key, fingerprint)`:

- `model_key`: 16 random bytes given to a model object the first time it is seen (held weakly here, so two
  models never share a key, even when one is created where the other was freed);
- `fingerprint`: a digest of `model_key` and, for every parameter and buffer, its storage address, its version
  counter (bumped by every in-place operation torch tracks: optimizer steps, `load_state_dict`, `mul_` under
  `no_grad`) and three of its elements (first, middle, last), which also catches most edits through `.data`
  (which torch does not count).

The Engine (and `KVPool.new_cache(model=...)`) salt the prefix index with the fingerprint, so K/V of other
weights are never looked up, and tell the pool (`BlockPool.note_weights`) so that it forgets the prefixes a
model cached before its weights changed. An edit the fingerprint cannot see (an adapter switch that changes
no tensor, a `.data` write that leaves the three probed elements as they were) needs
`pool.clear_prefix_cache()`.
"""

from __future__ import annotations

import hashlib
import os
import weakref

import torch

_MODEL_KEYS: weakref.WeakKeyDictionary[torch.nn.Module, bytes] = weakref.WeakKeyDictionary()


def weights_key(model: torch.nn.Module) -> tuple[bytes, bytes]:
    """`(model_key, fingerprint)` of a model's current weights (see the module docstring); 16 bytes each."""
    model_key = _MODEL_KEYS.get(model)
    if model_key is None:
        model_key = _MODEL_KEYS.setdefault(model, os.urandom(16))
    digest = hashlib.blake2b(model_key, digest_size=16)
    probes: dict[torch.device, list[torch.Tensor]] = {}
    for tensor in (*model.parameters(), *model.buffers()):
        if tensor.device.type == "meta" or tensor.numel() == 0:
            continue
        digest.update(b"%d:%d;" % (_version(tensor), tensor.numel()))
        try:
            digest.update(b"%d;" % tensor.data_ptr())
            probes.setdefault(tensor.device, []).append(_probe(tensor))
        except (RuntimeError, NotImplementedError, TypeError):
            pass  # a tensor subclass without storage access (e.g. a DTensor shard): its version counter only
    for device in sorted(probes, key=str):
        digest.update(torch.cat(probes[device]).cpu().numpy().tobytes())
    return model_key, digest.digest()


def _version(tensor: torch.Tensor) -> int:
    """The tensor's in-place version counter; -1 for inference-mode tensors, which keep none."""
    try:
        return tensor._version
    except RuntimeError:
        return -1


def _probe(tensor: torch.Tensor) -> torch.Tensor:
    """Three elements of a tensor's storage span (its first, one near the middle, and one near the end),
    `[3]` float64, read as a strided view: no copy of the tensor, no index tensor."""
    step = (tensor.numel() - 1) // 2  # a view of n elements spans at least n storage elements
    return torch.as_strided(tensor.detach(), (3,), (step,), tensor.storage_offset()).double()

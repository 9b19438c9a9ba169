"""`CrossAttentionCache`: an encoder-decoder's cross-attention K/V, stored once per request and shared by its rows.

`generate()` expands the encoder's output to one row per beam or sample before the first decoding step, so the
model projects the same encoder states into K/V once per row. The first `update()` of layer 0 finds which rows
carry bitwise equal K/V (the same request) and keeps one *entry* per distinct row; every later layer of that
forward checks its rows against their entry's first row and gives a row that differs an entry of its own. Rows
then only name their entry:

```
 rows (beams)   0  1  2  3  4  5        row_entries  [0, 0, 0, 1, 1, 1]
 entries        0: K/V [L, H, D]        ref_counts   [3, 3]
                1: K/V [L, H, D]        reorder_cache / batch_select_indices: remap row_entries, recount,
                                        drop entries no row names; no K/V is copied per row or per step
```

Inside a decoder layer whose self-attention a `PagedCache` served under `"paged"`, the model reads the layer's entries
(`[num_entries, num_kv_heads, kv_len, head_dim]`), staged with the rows' entries (`attention/handoff.py`), and the
`"paged"` attention attends each entry's rows together over them (`attention/shared_kv.py`). Any other reader (another
attention, a caller such as Whisper's `generate()` splitting its outputs) gets per-row K/V: a view when one entry
serves every row (stride 0 over the batch) or each row has its own, else gathered for that read.
"""

from __future__ import annotations

import weakref
from collections import Counter
from dataclasses import dataclass

import torch
from transformers import PretrainedConfig
from transformers.cache_utils import Cache, CacheLayerMixin

from ..attention import handoff
from ..attention.shared_kv import attend_shared
from ..memory.layers import decoder_layer_types, text_config_of


@dataclass(frozen=True, slots=True)
class CrossAttentionStats:
    """What a `CrossAttentionCache` holds.

    Attributes:
        num_rows: rows (beams, samples) of the batch.
        num_entries: distinct K/V entries stored (one per request when its rows share).
        ref_counts: rows naming each entry.
        bytes_in_use: bytes of the stored K/V tensors of every layer.
    """

    num_rows: int
    num_entries: int
    ref_counts: tuple[int, ...]
    bytes_in_use: int


class CrossAttentionCache(Cache):
    """Cross-attention K/V of an encoder-decoder model, one entry per distinct row, reference counted by rows.

    Args:
        config: the encoder-decoder model's config (its number of decoder layers), or its decoder's.
        offloading: must be False (T5Gemma's generate() passes it when it builds this cache again).

    `hf_paged.EncoderDecoderPagedCache(config)` builds one with the paged self-attention cache beside it.
    """

    def __init__(self, config: PretrainedConfig, offloading: bool = False) -> None:
        if offloading:  # (T5Gemma's generate() builds its cross-attention cache again with the cache's own class)
            raise ValueError(
                "CrossAttentionCache keeps the cross-attention K/V on the model's device; an offloaded cache "
                "(cache_implementation='offloaded') is not supported with hf_paged.EncoderDecoderPagedCache."
            )
        super().__init__(layers=[])
        self.config = config
        num_layers = len(decoder_layer_types(text_config_of(config)))
        self.layers = [CrossLayer(self, i) for i in range(num_layers)]
        self._keys: list[torch.Tensor | None] = [None] * num_layers  # [num_entries, num_kv_heads, kv_len, head_dim]
        self._values: list[torch.Tensor | None] = [None] * num_layers
        self.row_entries: list[int] = []  # row -> entry
        self.ref_counts: list[int] = []  # entry -> rows naming it
        self._first_rows: list[int] | None = None  # while the first forward fills the layers: each entry's first row
        self._index: torch.Tensor | None = None  # row_entries as a tensor on the K/V's device

    def __repr__(self) -> str:
        return f"CrossAttentionCache(rows={len(self.row_entries)}, entries={len(self.ref_counts)})"

    # ------------------------------------------------------------------ transformers.Cache API
    @property
    def is_initialized(self) -> bool:
        return bool(self.row_entries)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """The encoder's length (keys per row) of a stored layer, 0 before it is stored."""
        keys = self._keys[layer_idx] if 0 <= layer_idx < len(self._keys) else None
        return 0 if keys is None else keys.shape[2]

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.get_seq_length(layer_idx), 0

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Stores a layer's cross-attention K/V, once per distinct row.

        Args:
            key_states, value_states: `[batch, num_kv_heads, kv_len, head_dim]` projected from the encoder's output.
            layer_idx: the decoder layer.

        Returns:
            What the model reads (`read`): the entries under `"paged"`, per-row K/V otherwise.
        """
        if not 0 <= layer_idx < len(self._keys):
            raise IndexError(f"layer {layer_idx} out of range for a decoder of {len(self._keys)} layers.")
        if self._keys[layer_idx] is not None:
            raise ValueError(
                f"Cross-attention K/V of layer {layer_idx} are already stored; call reset() before encoding new inputs."
            )
        if not self.row_entries:
            self._group_rows(key_states, value_states)
        elif self._first_rows is None or key_states.shape[0] != len(self.row_entries):
            raise ValueError(
                f"Cross-attention K/V of {key_states.shape[0]} rows for a cache of {len(self.row_entries)} rows whose "
                "first forward is over; call reset() before encoding new inputs."
            )
        else:
            self._split_differing_rows(layer_idx, key_states, value_states)
        first = torch.tensor(self._first_rows, device=key_states.device)
        self._keys[layer_idx] = key_states.index_select(0, first).contiguous()
        self._values[layer_idx] = value_states.index_select(0, first).contiguous()
        if all(k is not None for k in self._keys):
            self._first_rows = None
        return self.read(layer_idx)

    def read(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A stored layer's K/V as the model reads them. Inside the model's decoder layer right after its `"paged"`
        self-attention (`handoff.follows_attention_of`): the entries `[num_entries, num_kv_heads, kv_len, head_dim]`,
        staged for the `"paged"` attention with the rows' entries. Otherwise (another attention, or a caller reading
        the cache): per-row `[batch, num_kv_heads, kv_len, head_dim]`."""
        keys, values = self._keys[layer_idx], self._values[layer_idx]
        if keys is None or values is None:
            raise ValueError(f"Cross-attention K/V of layer {layer_idx} are not stored yet.")
        staged = handoff.shared_staged(layer_idx)
        if staged is not None and staged.store is self and staged.key is keys:  # the values after the keys
            return keys, values
        if handoff.follows_attention_of(layer_idx):
            handoff.stage_shared(handoff.SharedStaged(self, layer_idx, keys, values, self._entry_index(keys.device)))
            return keys, values
        return self._per_row(keys), self._per_row(values)

    def attend(
        self,
        staged: handoff.SharedStaged,
        query: torch.Tensor,
        mask: torch.Tensor | None,
        scale: float,
        bias: torch.Tensor | None,
        want_weights: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The `"paged"` attention of `query [batch, num_heads, q_len, head_dim]` over the staged entries; returns
        `(out [batch, q_len, num_heads, head_dim_v], probabilities [batch, num_heads, q_len, kv_len] or None)`."""
        if query.shape[0] != staged.row_entries.shape[0]:
            raise ValueError(
                f"Cross-attention queries of {query.shape[0]} rows for a cache of {staged.row_entries.shape[0]} rows."
            )
        return attend_shared(query, staged.key, staged.value, staged.row_entries, mask, scale, bias, want_weights)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: row i names the entry of row `beam_idx[i]`; no K/V moves."""
        self._select(torch.as_tensor(beam_idx, device="cpu").tolist())

    def batch_repeat_interleave(self, repeats: int) -> None:
        if repeats < 1:
            raise ValueError(f"batch_repeat_interleave needs repeats >= 1, got {repeats}.")
        self._select([i for i in range(len(self.row_entries)) for _ in range(repeats)])

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._select(torch.as_tensor(indices, device="cpu").tolist())

    def crop(self, max_length: int) -> None:
        """Nothing to do: cross-attention K/V do not grow with the decoded tokens."""

    def reset(self) -> None:
        """Forgets every entry and row."""
        self._keys = [None] * len(self._keys)
        self._values = [None] * len(self._values)
        self.row_entries, self.ref_counts, self._first_rows, self._index = [], [], None, None

    # ------------------------------------------------------------------ our API
    def fork(self) -> CrossAttentionCache:
        """A new cache whose rows name the same entries (the stored tensors are shared; neither cache writes them)."""
        if self._first_rows is not None:
            raise RuntimeError("fork() during the first forward of a CrossAttentionCache.")
        other = CrossAttentionCache(self.config)
        other._keys, other._values = list(self._keys), list(self._values)
        other.row_entries, other.ref_counts = list(self.row_entries), list(self.ref_counts)
        return other

    def stats(self) -> CrossAttentionStats:
        return CrossAttentionStats(
            len(self.row_entries), len(self.ref_counts), tuple(self.ref_counts), self.bytes_in_use()
        )

    def bytes_in_use(self) -> int:
        """Bytes of the distinct storages behind the stored K/V."""
        storages = {}
        for t in (*self._keys, *self._values):
            if t is not None:
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return sum(storages.values())

    def check(self) -> None:
        """Raises AssertionError unless: each entry's reference count is the number of rows naming it and is
        positive; every stored layer holds one K/V per entry, of one encoder length; outside the first forward, either
        every layer is stored or none is (and then there are no rows)."""
        counts = Counter(self.row_entries)
        assert all(c > 0 for c in self.ref_counts), f"an entry no row names: {self.ref_counts}"
        assert [counts[e] for e in range(len(self.ref_counts))] == self.ref_counts and sum(counts.values()) == len(
            self.row_entries
        ), f"reference counts {self.ref_counts} differ from the rows' entries {self.row_entries}"
        stored = [(k, v) for k, v in zip(self._keys, self._values, strict=True) if k is not None]
        assert all(v is not None for k, v in zip(self._keys, self._values, strict=True) if k is not None)
        assert len({k.shape[2] for k, _ in stored}) <= 1, "layers of different encoder lengths"
        for keys, values in stored:
            assert (
                keys.shape[0] == values.shape[0] == len(self.ref_counts)
            ), f"a layer holds {keys.shape[0]} entries, the rows name {len(self.ref_counts)}"
        if self._first_rows is None:
            assert len(stored) in (0, len(self._keys)), "some layers stored, others not, outside the first forward"
            assert stored or not self.row_entries, "rows without stored K/V"

    # ------------------------------------------------------------------ internals
    def _group_rows(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """The first layer's rows: bitwise equal K and V -> one entry (candidates found by an exact digest)."""
        digests = (_digest(key_states) * 31 + _digest(value_states)).tolist()
        first_rows: list[int] = []
        row_entries: list[int] = []
        for row, digest in enumerate(digests):
            for entry, first in enumerate(first_rows):
                if digests[first] == digest and _rows_equal(key_states, value_states, row, first):
                    row_entries.append(entry)
                    break
            else:
                first_rows.append(row)
                row_entries.append(len(first_rows) - 1)
        self.row_entries, self._first_rows = row_entries, first_rows
        self.ref_counts = [row_entries.count(e) for e in range(len(first_rows))]
        self._index = None

    def _split_differing_rows(self, layer_idx: int, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """A later layer of the first forward: a row whose K/V differ from its entry's first row gets an entry of its
        own, holding its entry's earlier layers (equal there) — correct K/V over memory savings."""
        assert self._first_rows is not None
        for row, entry in enumerate(self.row_entries):
            first = self._first_rows[entry]
            if row == first or _rows_equal(key_states, value_states, row, first):
                continue
            for j in range(layer_idx):
                self._keys[j] = torch.cat([self._keys[j], self._keys[j][entry : entry + 1]])
                self._values[j] = torch.cat([self._values[j], self._values[j][entry : entry + 1]])
            self.ref_counts[entry] -= 1
            self.ref_counts.append(1)
            self.row_entries[row] = len(self._first_rows)
            self._first_rows.append(row)
            self._index = None

    def _select(self, indices: list[int]) -> None:
        """Row i becomes old row `indices[i]`; entries no row names any more are dropped."""
        if self._first_rows is not None:
            raise RuntimeError(
                "The cross-attention K/V of this cache's first forward are incomplete (the forward raised); call "
                "reset() and run the model again."
            )
        if any(not -len(self.row_entries) <= i < len(self.row_entries) for i in indices):
            raise IndexError(f"row indices {indices} out of range for a cache of {len(self.row_entries)} rows.")
        rows = [self.row_entries[i] for i in indices]
        kept = sorted(set(rows))
        if len(kept) < len(self.ref_counts):  # drop the entries no row names: their K/V are freed
            keep = torch.tensor(kept, device="cpu")
            for j, (k, v) in enumerate(zip(self._keys, self._values, strict=True)):
                if k is not None:
                    self._keys[j] = k.index_select(0, keep.to(k.device))
                    self._values[j] = v.index_select(0, keep.to(v.device))
            renumber = {old: new for new, old in enumerate(kept)}
            rows = [renumber[e] for e in rows]
        self.row_entries = rows
        self.ref_counts = [rows.count(e) for e in range(len(kept))]
        self._index = None

    def _entry_index(self, device: torch.device) -> torch.Tensor:
        """`row_entries` as an int64 tensor on `device` (kept until the rows change)."""
        if self._index is None or self._index.device != device:
            self._index = torch.tensor(self.row_entries, dtype=torch.int64, device=device)
        return self._index

    def _per_row(self, entries: torch.Tensor) -> torch.Tensor:
        """`[batch, ...]` K or V of every row: a view when one entry serves every row or each row has its own."""
        if len(self.ref_counts) == 1:
            return entries.expand(len(self.row_entries), *entries.shape[1:])
        if self.row_entries == list(range(len(self.ref_counts))):
            return entries
        return entries.index_select(0, self._entry_index(entries.device))


class CrossLayer(CacheLayerMixin):
    """One layer of a `CrossAttentionCache`, as transformers' `Cache.layers[i]`: models read `keys` / `values`
    after the first step (`CrossAttentionCache.read`)."""

    is_compileable = False
    is_croppable = True
    is_sliding = False
    supports_early_init = False

    def __init__(self, cache: CrossAttentionCache, layer_idx: int) -> None:
        self._cache_ref = weakref.ref(cache)  # (no cycle: the K/V are freed as soon as the cache is dropped)
        self.layer_idx = layer_idx

    @property
    def _cache(self) -> CrossAttentionCache:
        cache = self._cache_ref()
        if cache is None:
            raise RuntimeError("This CrossLayer's cache was garbage-collected.")
        return cache

    @property
    def keys(self) -> torch.Tensor:
        return self._cache.read(self.layer_idx)[0]

    @property
    def values(self) -> torch.Tensor:
        return self._cache.read(self.layer_idx)[1]

    @property
    def is_initialized(self) -> bool:
        return self._cache.get_seq_length(self.layer_idx) > 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Nothing to do: the cache stores the first update's entries."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        return self._cache.update(key_states, value_states, self.layer_idx)

    def get_seq_length(self) -> int:
        return self._cache.get_seq_length(self.layer_idx)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self._cache.get_mask_sizes(query_length, self.layer_idx)

    def get_max_length(self) -> int:
        return -1


def _digest(states: torch.Tensor) -> torch.Tensor:
    """An exact per-row digest `[batch]` (int64): the sum of each row's bit patterns, so bitwise equal rows have
    equal digests whatever the summation order."""
    flat = states.reshape(states.shape[0], -1)
    bits = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()]
    return flat.contiguous().view(bits).sum(dim=1, dtype=torch.int64)


def _rows_equal(key_states: torch.Tensor, value_states: torch.Tensor, row: int, other: int) -> bool:
    return bool(torch.equal(key_states[row], key_states[other])) and bool(
        torch.equal(value_states[row], value_states[other])
    )


__all__ = ["CrossAttentionCache", "CrossAttentionStats", "CrossLayer"]

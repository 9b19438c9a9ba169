"""`KVPool`: the public pool — `BlockPool` storage plus `new_cache()`, which hands out caches that start
from the longest cached prefix of their prompts."""

from __future__ import annotations

import weakref

import torch
from transformers import PretrainedConfig

from ..compat import forget_previous_positions
from .paged_cache import PagedCache
from .prefix_hits import check_prompt
from .state_snapshots import prefill_block_ends
from ..memory.pool import BlockPool
from ..memory.weights import weights_key


class KVPool(BlockPool):
    __doc__ = BlockPool.__doc__ + """
    Example:
        >>> pool = hf_paged.KVPool(model.config, block_size=16)
        >>> with pool.new_cache(inputs.input_ids, inputs.attention_mask) as cache:
        ...     out = model.generate(**inputs, past_key_values=cache, max_new_tokens=32)
    """

    def __init__(self, config: PretrainedConfig | None = None, **kwargs: object) -> None:
        if config is not None and not isinstance(config, PretrainedConfig):
            raise TypeError(
                f"KVPool's first argument is the model config, got {type(config).__name__} {config!r}: pass "
                "model.config (or AutoConfig.from_pretrained(path)), or nothing to learn it from the first forward."
            )
        super().__init__(config, **kwargs)
        self._weights: dict[bytes, bytes] = {}  # model key -> fingerprint of its weights when last noted
        # `for_model`'s model, held weakly: a hybrid's new_cache() runs its prompts' block-aligned prefixes on it
        self._model: weakref.ref[torch.nn.Module] | None = None

    def fixed_capacity(self) -> int | None:
        """Blocks per layer group of a fixed-size pool, once known (`num_blocks`, or `max_memory` once the first
        write sized it); None for a growing pool or a `max_memory` pool not sized yet."""
        with self.lock:
            if self.allocators is None:
                return self.num_blocks
            sizes = [a.max_blocks for a in self.allocators]
            return None if any(size is None for size in sizes) else min(sizes)

    def note_weights(self, model_key: bytes, fingerprint: bytes) -> None:
        """Records the weights a model computes with now (`weights.weights_key`); when they differ from those of
        this model's previous call, every cached prefix is forgotten (`clear_prefix_cache`): they may hold K/V
        of the old weights. Lookups are also salted with the fingerprint, so this only returns memory early."""
        with self.lock:
            previous = self._weights.get(model_key)
            self._weights[model_key] = fingerprint
            if previous is not None and previous != fingerprint:
                self.clear_prefix_cache()

    @classmethod
    def for_model(cls, model: torch.nn.Module, **kwargs: object) -> KVPool:
        """A pool for `model`: its config, and the device of each attention layer (so `max_memory="90%"` sizes
        the pool from the free memory of every device holding layers under a `device_map`). For a hybrid model,
        `new_cache()` without `model=` runs prompts' block-aligned prefixes on this model (see `new_cache`).

        Args:
            model: a transformers model; its modules with an int `layer_idx` and parameters are the layers.
            kwargs: `KVPool` arguments (`block_size`, `max_memory`, `num_blocks`, `prefix_caching`, `kv_dtype`).
        """
        devices = {}
        for module in model.modules():
            layer_idx = getattr(module, "layer_idx", None)
            param = next(module.parameters(recurse=True), None)
            if isinstance(layer_idx, int) and param is not None and layer_idx not in devices:
                devices[layer_idx] = param.device
        pool = cls(model.config, layer_devices=devices, **kwargs)
        pool._model = weakref.ref(model)
        return pool

    def weights_salt(self, model: torch.nn.Module, salt: str | bytes | None = None) -> bytes:
        """The prefix-index salt of `model`'s current weights (and `salt`), after telling the pool which weights
        the model has now (`note_weights`: a change forgets the prefixes cached before it)."""
        model_key, fingerprint = weights_key(model)
        self.note_weights(model_key, fingerprint)
        return fingerprint + (salt.encode() if isinstance(salt, str) else salt or b"")

    def new_cache(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        *,
        salt: str | bytes | None = None,
        model: torch.nn.Module | None = None,
        **non_text: torch.Tensor | None,
    ) -> PagedCache:
        """A `PagedCache` on this pool, holding the longest cached prefix of each prompt row.

        Args:
            input_ids: `[batch, seq_len]` (left-padded) integer prompts, or None for an empty cache.
            attention_mask: `[batch, seq_len]`, 0 on padding; None when there is none.
            salt: tenant key. Prefixes cached under one salt are never hit (nor timed) under another.
            model: the model that will run on the cache. Given, prefixes are keyed by its current weights
                (`weights.py`): K/V another model, or this one before its weights changed, computed are never
                served. Without it, call `clear_prefix_cache()` after changing the weights, and give each model
                its own pool (or salt). For a hybrid model (recurrent layers), a prefix hit also needs the recurrent
                states at its end, which exist only where a forward ended: given the model, `new_cache` runs the
                prompt up to each row's last block end (`state_snapshots.py`), so that a later prompt starting with
                it hits (a pool made by `for_model` uses its model for this when none is given); without any, a hybrid
                hits only where an earlier forward happened to end on a block end.
                Models whose recurrent layers restart each forward from zero states (`support.py`) always miss.
                Its config also names a vision-language model's placeholder token ids (else those the pool learned
                from its config: `BlockPool.placeholder_ids`), and a hit clears the position offset such a model
                keeps from its previous call (`compat.forget_previous_positions`).
            non_text: the prompts' non-text inputs, as the processor returned them (`pixel_values`
                `[num_images, channels, height, width]`, `image_sizes`, `image_grid_thw`, ...; so
                `new_cache(**inputs, model=model)` passes everything). A row's blocks from its first placeholder
                token (`image_token_id` ...) on are keyed by them too: the same text with another image never hits.
                Without them, a prompt's blocks from its first placeholder on are neither looked up nor indexed.
                A hit may cover a whole prompt's placeholders for `support.HITS_OVER_PLACEHOLDERS`; pass
                `cache.uncached_inputs(inputs)` to `generate()`, which leaves the non-text inputs out then.

        Returns:
            A cache whose `get_seq_length()` tells `generate()` how many prompt columns it already holds.
            It records the prompt tokens, so its own full blocks are indexed for later caches.

        Raises:
            TypeError, ValueError: ids that are not a `[batch, seq_len]` integer tensor of the vocabulary, a mask of
                another shape or with values other than 0/1, a row without tokens; nothing is stored then.
        """
        if model is not None:
            salt = self.weights_salt(model, salt)
        inputs = {name: value for name, value in non_text.items() if value is not None}
        runner = model if model is not None or self._model is None else self._model()
        if input_ids is not None and runner is not None and self.keeps_state_snapshots and not inputs:
            # (with non-text inputs, no forward is run here: hits stop before the placeholders anyway)
            cache = self._new_hybrid_cache(input_ids, attention_mask, salt, runner)
        else:
            cache = PagedCache(pool=self, salt=salt)
            if input_ids is not None:
                config = model.config if model is not None else None
                cache.load_prompt(input_ids, attention_mask, non_text=inputs, config=config)
        if model is not None and cache.get_seq_length() > 0:
            forget_previous_positions(model)  # a hit starts a conversation to generate(), it continues none
        return cache

    def _new_hybrid_cache(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, salt: str | bytes | None,
        model: torch.nn.Module,
    ) -> PagedCache:
        """A hybrid model's cache for `[batch, seq_len]` prompts whose forwards end at the rows' last block ends
        (`state_snapshots.py`): in one cache when every row has the same padding, else row by row, joined."""
        check_prompt(input_ids, attention_mask, getattr(self.config, "vocab_size", None))
        mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
        lengths = [int(n) for n in mask.sum(dim=1).tolist()]
        left_padded = all(bool(mask[b, mask.shape[1] - n :].all()) for b, n in enumerate(lengths))
        if len(set(lengths)) == 1 or min(lengths) < 2 or not left_padded:
            # one forward column serves every row's block ends (or load_prompt refuses the prompts)
            cache = PagedCache(model.config, pool=self, salt=salt)
            cache.load_prompt(input_ids, attention_mask)
            prefill_block_ends(cache, model, input_ids, attention_mask)
            return cache
        width, parts = input_ids.shape[1], []
        try:
            for b, length in enumerate(lengths):
                part = PagedCache(model.config, pool=self, salt=salt)
                parts.append(part)
                row = input_ids[b : b + 1, width - length :]
                part.load_prompt(row)
                prefill_block_ends(part, model, row, None, through=length - 1)
            cache = PagedCache(model.config, pool=self, salt=salt)
            cache.adopt_rows(parts, width)
            return cache
        finally:
            for part in parts:
                part.release()

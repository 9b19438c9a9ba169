"""The Engine's draft model (`Engine(model, draft_model=...)`): drafts `k` tokens for every request it serves, in
`k` packed forwards of its own, before the target's step.

The draft model keeps its own `KVPool` and one `PagedCache` per request (`Request.draft_cache`), holding the K/V
of `Request.draft_tokens`. Before drafting, each cache is brought in step with the request's tokens: tokens only
ever grow, so what it holds beyond their common prefix is a rejected draft (or a draft of a step that was
retried), cropped off with `PagedCache.crop`; then::

    forward 1:  every request feeds its tokens the draft has not seen (its whole prompt the first time) -> d1
    forward 2:  every request feeds d1 -> d2
    ...
    forward k:  d(k-1) -> dk            (dk itself is never fed: the next step's sync feeds what was kept)

Each forward packs all requests, one segment per request cache (`packed.forward_packed`). Drafts are the draft
model's argmax (no logits processors): they only decide how many tokens the target keeps, never which.
The scheduler releases a request's draft cache with its own blocks (`Request.release_draft`: finish, preemption,
abort, end of a run).
"""

from __future__ import annotations

import inspect

import torch

from ..cache.kvpool import KVPool
from ..cache.paged_cache import PagedCache
from .packed import Segment, forward_packed, step_inputs
from .request import Request


class Drafter:
    """Drafts with a second model.

    Args:
        model: a decoder-only model loaded with `attn_implementation="paged"` whose forward takes `position_ids`,
            with the target's vocabulary (same tokenizer).
        vocab_size: the target model's vocabulary size.
        num_tokens: tokens drafted per step (`k`).
        pool: the draft model's pool; default a growing `KVPool` of its own.
    """

    def __init__(self, model: torch.nn.Module, vocab_size: int | None, num_tokens: int, pool: KVPool | None = None) -> None:
        config = model.config
        if getattr(config, "_attn_implementation", None) != "paged" or "position_ids" not in inspect.signature(
            model.forward
        ).parameters:
            raise ValueError(
                "Engine(draft_model=...) needs a model loaded with attn_implementation='paged' whose forward takes "
                "position_ids (its requests are packed like the target's)."
            )
        if getattr(config, "vocab_size", None) != vocab_size:
            raise ValueError(
                f"Engine(draft_model=...): the draft model's vocabulary ({getattr(config, 'vocab_size', None)}) differs "
                f"from the model's ({vocab_size}); a draft model must share the model's tokenizer."
            )
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 1:
            raise ValueError(f"num_draft_tokens must be a positive int, got {num_tokens!r}.")
        self.model = model
        self.num_tokens = num_tokens
        self.device = model.get_input_embeddings().weight.device
        self.pool = pool if pool is not None else KVPool(config)
        self.pool.bind_config(config)
        # (only drafts past max_new_tokens can reach beyond the positions; the target never keeps them)
        self.last_position = (getattr(config, "max_position_embeddings", None) or 2**62) - 1

    def draft(self, reqs: list[Request]) -> dict[Request, list[int]]:
        """`k` drafted tokens per request (each a decoding request whose last token is not fed yet)."""
        feeds = {req: self._sync(req) for req in reqs}
        drafts: dict[Request, list[int]] = {req: [] for req in reqs}
        for _ in range(self.num_tokens):
            ids: list[int] = []
            positions: list[int] = []
            segments: list[Segment] = []
            keep: list[int] = []
            for req, feed in feeds.items():
                start = len(req.draft_tokens)
                segments.append(Segment(req.draft_cache, len(ids), 1, len(feed)))
                ids.extend(feed)
                positions.extend(min(p, self.last_position) for p in range(start, start + len(feed)))
                keep.append(len(ids) - 1)
                req.draft_tokens.extend(feed)
            inputs = step_inputs(self.model, self.device, ids, positions, [])
            logits = forward_packed(self.model, inputs, segments, keep, self.pool.layout.attending_layers)
            for (req, _), token in zip(feeds.items(), logits.argmax(dim=-1).tolist(), strict=True):
                drafts[req].append(token)
                feeds[req] = [token]
        return drafts

    def _sync(self, req: Request) -> list[int]:
        """Crops the request's draft cache to the prefix of its tokens it holds; returns the tokens to feed next
        (at least its last one)."""
        if req.draft_cache is None:
            req.draft_cache = PagedCache(self.model.config, pool=self.pool, dedupe_rows=False)
            req.draft_tokens = []
        tokens, held = req.tokens, req.draft_tokens
        common = max(0, len(held) - self.num_tokens)  # (everything before the last drafts came from `tokens`)
        while common < min(len(held), len(tokens)) and held[common] == tokens[common]:
            common += 1
        common = min(common, len(tokens) - 1)  # the last token is always fed: its logits give the first draft
        if common < len(held):
            req.draft_cache.crop(common - len(held))
            del held[common:]
        return tokens[common:]


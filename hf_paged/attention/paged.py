"""The `"paged"` attention implementation and its mask function, registered with transformers.

transformers passes a mask to an attention implementation only if a mask function is registered under
the same name (otherwise it silently passes None and padding is lost). Ours returns the 2D padding mask
`[batch, kv_len]` (bool, True = real token), or None when nothing is padded.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, causal_mask_function, sdpa_mask

from . import handoff
from ..compat import attentions_recorded
from ..errors import UnsupportedModelError
from ..support import (
    PAGED,
    LayerFacts,
    check_attention_interface,
    install_load_check,
    layer_facts,
    model_type_of,
    not_causal_error,
    shares_kv,
)
from .torch_backend import attention_probs, torch_paged_attention
from .plan import AttentionFeatures
from .torch_meta import TorchMeta
from .graph_step import GRAPH_STEP_KWARG
from .outside_graph import run_outside_graph

NAME = PAGED
_warned_contiguous = False


def paged_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function: Callable | None = None,
    attention_mask: torch.Tensor | None = None,
    **kwargs: object,
) -> torch.Tensor | None:
    """Mask function of `"paged"`.

    When the keys end at the queries (a `PagedCache`, a `DynamicCache`: `kv_offset + kv_length ==
    q_offset + q_length`), the bool `[batch, kv_length]` padding mask (True = real token), or None if
    nothing is padded: causality and sliding windows are applied by the attention from positions. Any other
    cache (a `StaticCache` hands back its whole buffer, a sliding static cache a rolling one), and any cache whose
    query offset is a tensor (a `StaticCache`'s: comparing it would read it back from the device, which a
    compiled step cannot), gets transformers' own 4D bool mask `[batch, 1, q_length, kv_length]`, built from
    its real length, so the attention never guesses which slots are real. So does a forward in which
    `mask_function` lets some real tokens attend later ones (a causal mask with bidirectional blocks, e.g. over
    Gemma 3's image tokens): positions cannot say which, and the attention applies the mask as given over the rows'
    K/V read back (`PagedCache.write_and_read`).
    """
    check_attention_interface(kwargs.get("config"))
    if not torch.compiler.is_compiling():  # (traced, it cannot clear without a graph break: see handoff.py)
        handoff.clear()  # a forward begins: no slot of an earlier, interrupted forward may be read
    if (
        isinstance(q_offset, torch.Tensor)
        or int(kv_offset) + int(kv_length) != int(q_offset) + q_length
        or (
            q_length > 1
            and mask_function is not None
            and _lets_some_tokens_see_the_next(
                mask_function, batch_size, q_length, q_offset, kwargs.get("device", "cpu"),
                prompt_bidirectional=bool(getattr(kwargs.get("config"), "use_bidirectional_attention", False)),
            )
        )
    ):
        return sdpa_mask(
            batch_size=batch_size,
            q_length=q_length,
            kv_length=kv_length,
            q_offset=q_offset,
            kv_offset=kv_offset,
            mask_function=mask_function if mask_function is not None else causal_mask_function,
            attention_mask=attention_mask,
            allow_is_causal_skip=False,
            device=kwargs.get("device", "cpu"),
        )
    if attention_mask is None or (attention_mask.shape[-1] >= kv_length and bool(attention_mask.all())):
        return None  # (every column real, read in one op: the common case)
    attention_mask = attention_mask[:, -kv_length:].to(torch.bool)
    if attention_mask.shape[1] == kv_length and bool(attention_mask.all()):
        return None
    if shares_kv(kwargs.get("config")):
        # Gemma 4 keeps only some queries in its layers that reuse K/V, and cuts its masks to them as 4D masks
        return attention_mask[:, None, None, :]  # (`_row_mask` undoes it in the attention)
    return attention_mask


def _row_mask(mask: torch.Tensor) -> torch.Tensor:
    """The 2D padding mask `[batch, kv_len]` of a model whose layers reuse other layers' K/V: `paged_mask` gave it
    as `[batch, 1, 1, kv_len]`, which such a model may cut to its kept queries (a size-1 axis stays one). A 4D
    mask of another shape (transformers' own, which `paged_mask` gives other caches) is returned as it is."""
    if mask.shape[1] == 1 and mask.shape[2] == 1 and mask.dtype == torch.bool:
        return mask[:, 0, 0]
    return mask


def _lets_some_tokens_see_the_next(
    mask_function: Callable,
    batch_size: int,
    q_length: int,
    q_offset: int,
    device: torch.device | str,
    prompt_bidirectional: bool = False,
) -> bool:
    """Whether transformers' mask function lets some real tokens attend the token right after them in a causal
    model: a causal mask with bidirectional blocks or-ed on (Gemma 3's images), which positions alone cannot
    reproduce. A forward that begins a sequence (`q_offset` 0) in which every real token sees the next is an
    encoder's (the attention function judges its module: a non-causal module is refused a cache), unless the
    language model is configured to attend its prompt bidirectionally (`prompt_bidirectional`: PaliGemma's prefix,
    `use_bidirectional_attention`); later in a sequence, it is a chunk that lies within a bidirectional block.
    Evaluated on the diagonal and the `batch_size * (q_length - 1)` pairs next to it only, with index tensors on
    `device` (where the mask function's padding mask lives)."""
    batch = torch.arange(batch_size, device=device)[:, None]
    head = torch.zeros((), dtype=torch.long, device=device)
    idx = torch.arange(q_length, device=device)[None, :] + int(q_offset)
    try:
        real = torch.as_tensor(mask_function(batch, head, idx, idx), device=device).expand(batch_size, q_length)
        ahead = torch.as_tensor(mask_function(batch, head, idx[:, :-1], idx[:, 1:]), device=device)
        ahead = ahead.expand(batch_size, q_length - 1)
    except (IndexError, RuntimeError, TypeError):  # a mask function that cannot take index tensors: not judged
        return False
    judged = real[:, :-1] & real[:, 1:]
    seen = ahead & judged
    return bool(seen.any()) and (prompt_bidirectional or int(q_offset) > 0 or not torch.equal(seen, judged))


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """Attention function registered as `attn_implementation="paged"`.

    Args:
        module: the attention module (`layer_idx`, `config`, optional `sinks`).
        query: `[batch, num_heads, q_len, head_dim]`.
        key, value: from `PagedCache.update()`: this step's `[batch, num_kv_heads, q_len, head_dim]` and
            `[..., head_dim_v]`, staged for this call (`handoff.py`); from any other cache (or a model that
            expands what its cache stores, `support.reads_gathered`): contiguous `[batch, num_kv_heads, kv_len,
            head_dim]` and `[..., head_dim_v]`. `head_dim_v` differs from `head_dim` only in multi-latent
            attention (DeepSeek V2/V3: K 192, V 128).
        attention_mask: from `paged_mask`: bool `[batch, kv_len]` or None; or transformers' own (or a caller's)
            `[batch, 1, q_len, kv_len]` mask, applied as given (`paged_mask`: a static cache, a mask that lets some
            tokens see later ones).
        scaling: multiplier of `q·k` (default `head_dim ** -0.5`).
        dropout: must be 0 (inference only).
        sliding_window: keys at positions `p - sliding_window < k <= p` are visible, or None.
        softcap: logit soft-capping, or None.
        s_aux (kwarg) / `module.sinks`: `[num_heads]` attention-sink logits, or None.

        paged_graph_step (kwarg): a `GraphStep` (`graph_step.py`): a forward without a cache, compiled whole,
            whose layers write and attend through the custom ops over the step's tensors.

    Under a compiled model without a `GraphStep`, a layer whose K/V a `PagedCache` staged attends eagerly, in a
    graph break (`outside_graph.py`); K/V of any other cache are attended in the graph.

    Returns:
        `(attn_output [batch, q_len, num_heads, head_dim_v], None)`, as sdpa/eager return it.
    """
    graph_step = kwargs.get(GRAPH_STEP_KWARG)
    if graph_step is not None:
        sinks = kwargs.get("s_aux")
        return graph_step.attend(
            module, query, key, value, scaling, softcap, sinks if sinks is not None else getattr(module, "sinks", None)
        )
    if torch.compiler.is_compiling() and (
        handoff.has_staged() or (getattr(module, "is_kv_shared_layer", False) and handoff.has_kept_for_readers())
    ):  # a PagedCache under a compiled model
        return run_outside_graph(
            paged_attention_forward, module, query, key, value, attention_mask, scaling, dropout, sliding_window,
            softcap, **kwargs,
        )
    if dropout and module.training:
        raise NotImplementedError("attn_implementation='paged' is for inference; use 'sdpa' to train with dropout.")
    scale = scaling if scaling is not None else 1.0 / math.sqrt(query.shape[-1])
    facts = layer_facts(module)
    sinks = kwargs.get("s_aux")
    if sinks is None and facts.has_sinks:
        sinks = module.sinks
    if sliding_window is None:  # some models apply their window only through the mask they build
        sliding_window = facts.window
    causal = facts.causal
    want_weights = bool(kwargs.get("output_attentions")) or attentions_recorded()
    staged = handoff.take(facts.layer_idx, key)
    if (
        staged is not None
        and facts.plain_self_attention
        and not staged.cache.causal_writers_only
        and key is staged.key
        and value is staged.value
        and sinks is None
        and softcap is None
        and not want_weights
        and (attention_mask is None or attention_mask.dim() == 2)
    ):  # the common case (a decoder-only model's layer, K/V as update() staged them), which `_attend` hands on as is
        return staged.cache.attend(
            module, query, key, value, staged.layer_idx, attention_mask, AttentionFeatures(scale, sliding_window),
        )
    bias = kwargs.get("position_bias")  # T5's relative position bias, added to the scores
    shared = handoff.take_shared(facts.layer_idx, key) if staged is None else None
    if shared is not None:  # an encoder-decoder's cross-attention K/V, stored once per request
        return shared.store.attend(shared, query, attention_mask, scale, bias, want_weights)
    handoff.note_self_attention(None)
    if attention_mask is not None and facts.shares_kv and attention_mask.dim() == 4:
        attention_mask = _row_mask(attention_mask)
    if staged is None and facts.reuses_kv:  # reuses an earlier layer's K/V
        source = handoff.taken_for_reader(key)
        if source is not None:
            if value is not source.value:
                raise UnsupportedModelError(
                    f"Model type {model_type_of(facts.config)}: layer {facts.layer_idx} reuses "
                    f"the keys of layer {source.layer_idx} with other values; attn_implementation='paged' cannot "
                    "read them from the blocks. Load the model with attn_implementation='sdpa'."
                )
            features = AttentionFeatures(scale, sliding_window, softcap, sinks)
            if attention_mask is not None and attention_mask.dim() == 4:  # transformers' own mask (see `_attend`)
                return attend_under_mask(
                    source.cache, module, query, key, value, (facts.layer_idx, source.layer_idx), attention_mask,
                    features, causal, want_weights, bias,
                )
            return source.cache.attend_reused(
                query, source.layer_idx, facts.layer_idx, attention_mask, features, want_weights
            )
    out = _attend(
        module, facts, query, key, value, attention_mask, staged, scale=scale, sliding_window=sliding_window,
        softcap=softcap, sinks=sinks, want_weights=want_weights, bias=bias,
    )
    if (staged is not None and staged.cache.causal_writers_only) or (
        causal and staged is None and facts.cross_attention_follows
    ):
        # a decoder layer of an encoder-decoder (its cache staged the K/V, or was read gathered) finished its
        # self-attention: the cross-attention, next, may read shared K/V (cache/cross.py). A decoder-only model's
        # layers leave no note (no cross-attention would take it, and a later read from outside a forward would
        # take it for one)
        handoff.note_self_attention(facts.layer_idx)
    return out


def _attend(
    module: torch.nn.Module,
    facts: LayerFacts,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    staged: handoff.Staged | None,
    *,
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
    sinks: torch.Tensor | None,
    want_weights: bool,
    bias: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`paged_attention_forward` of K/V a `PagedCache` staged (`staged`) or of any other K/V (`staged` None)."""
    causal = facts.causal
    if staged is None:  # a model that reads its PagedCache gathered, or an encoder's attention: no reason to warn
        # (nor for a layer reusing K/V that an earlier layer read gathered: that layer warned if it had a reason)
        warn = causal and not facts.reads_gathered and not facts.reuses_kv
        return _contiguous_attention(
            query, key, value, attention_mask, scale, sliding_window, softcap, sinks, causal, want_weights, warn=warn,
            bias=bias,
        )
    given_mask = attention_mask is not None and attention_mask.dim() == 4  # transformers' own mask (see below)
    if not causal and not staged.cache.causal_writers_only and not given_mask and not staged.cache.is_initialized:
        # (a non-causal module is served under a mask that says what each token sees, as PaliGemma's language model
        # gets for its prompt, and after it: transformers masks a forward that follows stored tokens causally)
        raise not_causal_error(module)
    as_staged = key is staged.key and value is staged.value  # (the common case, checked without a call)
    if not as_staged and not (
        handoff.received_as_staged(key, staged.key) and handoff.received_as_staged(value, staged.value)
    ):
        if staged.cache.attention_still_open(staged.layer_idx):
            # First forward of a cache that did not know the model's attention: it handed over history + new
            # K/V, so plain attention over what the model made of them is right, and the cache keeps the plain
            # (gathering) path from here on.
            return _contiguous_attention(
                query, key, value, attention_mask, scale, sliding_window, softcap, sinks, causal, want_weights,
                warn=False, bias=bias,
            )
        raise UnsupportedModelError(
            f"Model type {model_type_of(facts.config)}: {type(module).__name__} changes the K/V "
            "that PagedCache.update() returned before calling the attention, so attn_implementation='paged' cannot "
            "read its history from the blocks. Use hf_paged.PagedCache() without config= (it then learns that the "
            "model reads gathered K/V), load the model with attn_implementation='sdpa', or use the default cache."
        )
    if facts.keeps_kv_for_readers:
        # later layers reuse these K/V (`taken_for_reader`)
        handoff.keep_for_readers(staged)
    features = AttentionFeatures(scale, sliding_window, softcap, sinks)
    if given_mask:
        # transformers' own mask, applied as given over the rows' K/V read back: some tokens attend later ones
        # (`paged_mask`: Gemma 3's images), or the caller passed a custom 4D mask
        return attend_under_mask(
            staged.cache, module, query, key, value, (staged.layer_idx, staged.layer_idx), attention_mask, features,
            causal, want_weights, bias,
        )
    return staged.cache.attend(module, query, key, value, staged.layer_idx, attention_mask, features, want_weights)


def attend_under_mask(
    cache: object,
    module: torch.nn.Module | None,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layers: tuple[int, int],
    attention_mask: torch.Tensor,
    features: AttentionFeatures,
    causal: bool,
    want_weights: bool,
    bias: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A layer's attention under a 4D mask `[batch, 1, q_len, kv_len]` (transformers' own, a caller's, or the
    Engine's for a prefill chunk holding an image whose tokens attend each other both ways): `cache` (a `PagedCache`;
    a `PackedCache` refuses) writes the K/V of `layers = (layer, kv_layer)` (none for a layer reusing another layer's,
    which needs no `module`) and reads every row back over the mask's columns; the mask is applied as given. Returns
    as `paged_attention_forward`."""
    keys, values = cache.write_and_read(module, key, value, *layers, attention_mask)
    return _contiguous_attention(
        query, keys, values, attention_mask, features.scale, features.sliding_window, features.softcap, features.sinks,
        causal, want_weights, warn=False, bias=bias,
    )


def _contiguous_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    padding: torch.Tensor | None,
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
    sinks: torch.Tensor | None,
    causal: bool = True,
    want_weights: bool = False,
    warn: bool = True,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`"paged"` over an ordinary contiguous cache (e.g. DynamicCache), or an encoder's attention (no cache):
    correct, warns once (`warn`). `bias`: additive `[1 or batch, num_heads, q_len, kv_len]` (T5's position bias).

    Returns `(out [batch, q_len, num_heads, head_dim_v], probabilities [batch, num_heads, q_len, kv_len] or None)`.
    """
    global _warned_contiguous
    if warn and not _warned_contiguous:
        _warned_contiguous = True
        warnings.warn(
            "attn_implementation='paged' got K/V from a cache that is not a hf_paged.PagedCache; computing plain "
            "attention over them. Pass a hf_paged.PagedCache to generate() to use paged storage.",
            stacklevel=3,
        )
    q_len, kv_len = query.shape[2], key.shape[2]
    if padding is not None and padding.dim() == 4:  # transformers' own mask for this cache (see paged_mask)
        allowed = padding if padding.dtype == torch.bool else padding > torch.finfo(padding.dtype).min / 2
        allowed = allowed[..., -kv_len:].to(query.device)
        if padding.dtype != torch.bool:  # a float mask also adds its values to the scores, as sdpa adds them
            added = padding[..., -kv_len:].to(query.device).masked_fill(~allowed, 0.0)
            if bool(added.any()):
                bias = added if bias is None else bias[..., -kv_len:] + added
    else:
        q_pos = torch.arange(kv_len - q_len, kv_len, device=query.device)[:, None]
        k_pos = torch.arange(kv_len, device=query.device)[None, :]
        allowed = k_pos <= q_pos if causal else torch.ones_like(k_pos <= q_pos)
        if sliding_window is not None and causal:
            allowed &= k_pos > q_pos - sliding_window
        elif sliding_window is not None:  # an encoder's window reaches both ways (transformers: |q - k| <= window)
            allowed &= (k_pos - q_pos).abs() <= sliding_window
        allowed = allowed[None, None]
        if padding is not None:
            allowed = allowed & padding[:, None, None, -kv_len:].to(query.device)
    allowed = allowed | ~allowed.any(dim=-1, keepdim=True)  # rows with nothing visible stay finite
    if bias is not None:  # additive scores: the plain float32 computation
        groups = query.shape[1] // key.shape[1]
        k, v = (t.float().repeat_interleave(groups, dim=1) if groups > 1 else t.float() for t in (key, value))
        scores = torch.matmul(query.float(), k.transpose(-1, -2)) * scale + bias[..., -kv_len:].float()
        probs = scores.masked_fill(~allowed, -math.inf).softmax(dim=-1)
        out = torch.matmul(probs, v).to(query.dtype).transpose(1, 2).contiguous()
        return out, probs.to(query.dtype) if want_weights else None
    meta = TorchMeta(direct=True, gather_table=None, contiguous_start=None, mask=allowed, is_causal=False)
    out = torch_paged_attention(query, key, value, key, value, meta, scale, softcap, sinks)
    if not want_weights:
        return out, None
    return out, attention_probs(query, key, allowed, False, scale, softcap, sinks).to(query.dtype)


def register() -> None:
    """Registers `"paged"` with transformers' attention and mask interfaces, and the load-time check that
    refuses it for models with attention code of their own (`support.refuse_own_attention`). Idempotent."""
    AttentionInterface.register(NAME, paged_attention_forward)
    AttentionMaskInterface.register(NAME, paged_mask)
    install_load_check()


def is_registered() -> bool:
    """Whether `"paged"` is registered with both interfaces."""
    return (
        AttentionInterface._global_mapping.get(NAME) is paged_attention_forward
        and AttentionMaskInterface._global_mapping.get(NAME) is paged_mask
    )

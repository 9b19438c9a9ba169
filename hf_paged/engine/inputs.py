"""What a request's inputs may be: token ids (with a multimodal model's non-text inputs) and arrival times, checked
before anything runs."""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence

import torch

from ..compat import ENGINE_IMAGES, TRANSFORMERS_VERSION
from ..errors import UnsupportedModelError


def prompt_ids(i: int, prompt: object, vocab: int | None, placeholders: frozenset[int] = frozenset()) -> list[int]:
    """A prompt's token ids as ints; raises for anything that is not a non-empty 1-D run of integer ids in
    the vocabulary (floats are refused, never truncated), and for ids among `placeholders` (a multimodal model's
    image/video/audio tokens, whose inputs the Engine does not take)."""
    if isinstance(prompt, torch.Tensor):
        if prompt.dim() != 1:
            raise ValueError(f"Prompt {i} is a tensor of shape {list(prompt.shape)}; pass 1-D token ids per prompt.")
        if prompt.dtype.is_floating_point or prompt.dtype.is_complex or prompt.dtype == torch.bool:
            raise TypeError(
                f"Prompt {i} is a {prompt.dtype} tensor; token ids must be integers (e.g. torch.long), not "
                "truncated from another dtype: pass tokenizer output as is."
            )
        prompt = prompt.tolist()
    elif isinstance(prompt, (str, bytes)) or not isinstance(prompt, Sequence):
        raise TypeError(f"Prompt {i} is a {type(prompt).__name__}; pass token ids (a list of ints or a 1-D tensor).")
    bad = next((t for t in prompt if isinstance(t, bool) or not isinstance(t, numbers.Integral)), None)
    if bad is not None:
        raise TypeError(
            f"Prompt {i} holds {bad!r} ({type(bad).__name__}); token ids must be ints (tokenize text first, e.g. "
            "tokenizer.encode(text)); floats are not truncated."
        )
    ids = [int(t) for t in prompt]
    if not ids:
        raise ValueError(f"Prompt {i} is empty; every request needs at least one token (e.g. the BOS token).")
    if vocab is not None and (min(ids) < 0 or max(ids) >= vocab):
        raise ValueError(f"Prompt {i} has token ids outside the model's vocabulary [0, {vocab}).")
    if not placeholders.isdisjoint(ids):
        raise ValueError(
            f"Prompt {i} holds image/video/audio placeholder tokens but no inputs they stand for; pass the processor's "
            "output for the prompt instead of its ids alone: {'input_ids': ..., 'pixel_values': ..., ...}."
        )
    return ids


def prompt_inputs(
    i: int, prompt: object, vocab: int | None, placeholders: frozenset[int] = frozenset()
) -> tuple[list[int], dict[str, torch.Tensor]]:
    """A prompt's token ids and its non-text inputs: token ids alone (see `prompt_ids`), or a mapping as a processor
    returns it for one prompt (`return_tensors="pt"`): `input_ids` `[1, prompt_len]` or `[prompt_len]`, an optional
    all-ones `attention_mask` of the same shape, and the non-text tensors (`pixel_values`, `image_sizes`,
    `image_grid_thw`, `mm_token_type_ids`, ...; None values are dropped).

    Raises:
        TypeError, ValueError: bad ids (`prompt_ids`), a batch of several prompts or a padded one, a non-text input
            that is not a tensor, non-text inputs without placeholder tokens, or placeholders without inputs.
    """
    if not isinstance(prompt, Mapping):
        return prompt_ids(i, prompt, vocab, placeholders), {}
    if "input_ids" not in prompt:
        raise ValueError(f"Prompt {i} is a mapping without 'input_ids'; pass the processor's output for one prompt.")
    ids, mask = prompt["input_ids"], prompt.get("attention_mask")
    if isinstance(ids, torch.Tensor) and ids.dim() == 2:
        if ids.shape[0] != 1:
            raise ValueError(
                f"Prompt {i} holds a batch of {ids.shape[0]} prompts; the Engine takes one request per prompt: run the "
                "processor on each prompt (with its own images) and pass the list of its outputs."
            )
        ids = ids[0]
    if mask is not None:
        if not isinstance(mask, torch.Tensor) or mask.numel() != len(ids) or not bool((mask == 1).all()):
            raise ValueError(
                f"Prompt {i}'s attention_mask is not all ones for its input_ids: the Engine takes unpadded prompts, "
                "one per request (run the processor on each prompt alone)."
            )
    non_text = {k: v for k, v in prompt.items() if k not in ("input_ids", "attention_mask") and v is not None}
    if non_text and not ENGINE_IMAGES:
        raise UnsupportedModelError(
            f"Prompt {i} brings {sorted(non_text)}: the Engine takes requests with images on transformers 5.23 and "
            f"later (installed: {TRANSFORMERS_VERSION}). Upgrade transformers, or run the request with "
            "model.generate(**inputs, **hf_paged.cache_kwargs(pool.new_cache(**inputs, model=model)))."
        )
    bad = next((k for k, v in non_text.items() if not isinstance(v, torch.Tensor)), None)
    if bad is not None:
        raise TypeError(
            f"Prompt {i}'s non-text input {bad!r} is a {type(non_text[bad]).__name__}; pass tensors (the processor's "
            "return_tensors='pt' output)."
        )
    token_ids = prompt_ids(i, ids, vocab, frozenset() if non_text else placeholders)
    if non_text and placeholders.isdisjoint(token_ids):
        raise ValueError(
            f"Prompt {i} comes with {sorted(non_text)} but holds no placeholder token of the model "
            f"({sorted(placeholders)}) to put them at; pass the input_ids the processor made with them."
        )
    return token_ids, non_text


def arrival_times(arrival_s: Sequence[float], num_requests: int) -> list[float]:
    """`arrival_s` as floats, after checking there is one finite, non-negative time per request."""
    if isinstance(arrival_s, (str, bytes)) or not isinstance(arrival_s, Sequence):
        raise TypeError(f"arrival_s must be a sequence of seconds, one per prompt, got {type(arrival_s).__name__}.")
    if len(arrival_s) != num_requests:
        raise ValueError(f"arrival_s has {len(arrival_s)} entries for {num_requests} prompts.")
    times = []
    for i, t in enumerate(arrival_s):
        if isinstance(t, bool) or not isinstance(t, numbers.Real) or not math.isfinite(t) or t < 0:
            raise ValueError(
                f"arrival_s[{i}] = {t!r}: arrival times are finite seconds >= 0 after the call (0 = at once)."
            )
        times.append(float(t))
    return times

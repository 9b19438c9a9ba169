"""What a request's inputs may be: token ids and arrival times, checked before anything runs."""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

import torch


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
            f"Prompt {i} holds image/video/audio placeholder tokens; the Engine takes token ids only, not the inputs "
            "they stand for. Run such a request with model.generate(**processor_outputs, cache=pool.new_cache("
            "**processor_outputs, model=model))."
        )
    return ids


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

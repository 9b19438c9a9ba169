"""`num_return_sequences` in the engine: one request, `n` samples sharing the prompt's blocks.

The request's first sample (the leader) is the only one queued and admitted; it prefills the prompt once.
Its other samples ride along as `followers` until the step that ends that prefill: there each sample draws
its first token from the same last-position logits with its own generator, and each joins the decoding rows
with `append_row_of` of the leader's prefill cache, so all `n` rows share the prompt's blocks and the first
write into a shared partial block copies it (copy-on-write). From then on the samples are independent
requests (each may finish, be preempted and recomputed on its own).

Seeds: sample `k` of a request seeded `s` samples with a generator seeded `(s + k * 0x9E3779B1) mod 2**32`
(torch's CPU generator keeps 32 bits of a seed): the samples of one request never share a stream, and a
neighbouring request's seed (`s + 1`, as `Engine.generate(seed=s)` gives prompt 1) is far from them.
"""

from __future__ import annotations

import copy
import dataclasses

import torch

from .request import Request

SAMPLE_SEED_STRIDE = 0x9E3779B1  # odd, about 2**32 / golden ratio: k * stride mod 2**32 never repeats


def attach_samples(leader: Request, n: int) -> list[Request]:
    """Gives `leader` its `n - 1` followers (sample 1 .. n-1, row indices `leader.index + k`); returns all `n`.

    Each follower gets copies of the leader's logits processors (a processor may keep per-sequence state) and
    its own generator; the stopping criteria are shared (they keep no per-sequence state). Greedy samples (no
    generator) are identical by construction.
    """
    if n < 1:
        raise ValueError(f"num_return_sequences must be >= 1, got {n}.")
    samples = [leader]
    for k in range(1, n):
        generator = None
        if leader.generator is not None:
            generator = torch.Generator().manual_seed((leader.generator.initial_seed() + k * SAMPLE_SEED_STRIDE) % 2**32)
        samples.append(
            dataclasses.replace(
                leader,
                index=leader.index + k,
                sample=k,
                processors=copy.deepcopy(leader.processors),
                generator=generator,
                output=[],
                logprobs=[],
                followers=[],
                draft=[],
                ngrams=None,
                draft_cache=None,
                draft_tokens=[],
            )
        )
    leader.followers = samples[1:]
    return samples

"""Text prompts for the Engine: encoded with the engine's tokenizer on the way in, outputs decoded on the way out.

A call whose prompts are all `str` is a text call: `generate()` returns each output's text and `stream()`
yields text deltas. A call whose prompts are token ids works on ids, as before. The two kinds are not mixed
in one call, so what a call returns follows from what it was given.
"""

from __future__ import annotations

from collections.abc import Generator, Iterator, Mapping, Sequence

import torch


def is_text(prompts: object) -> bool:
    """Whether `prompts` (a list of prompts) is a text call: every prompt a `str`.

    Raises:
        ValueError: `prompts` is one prompt (a `str`, a tensor, a processor output or a flat list of ids) rather than
            a list of them.
        TypeError: text and token-id prompts are mixed.
    """
    if isinstance(prompts, (str, torch.Tensor, Mapping)) or (
        isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)
    ):
        raise ValueError(
            "Engine takes a list of prompts (strings, token-id lists, 1-D tensors or processor outputs), not a single "
            "prompt: wrap it in a list."
        )
    kinds = {isinstance(p, str) for p in prompts}
    if kinds == {True, False}:
        raise TypeError("Prompts mix text and token ids; pass all of them as text or all as token ids.")
    return kinds == {True}


def encode(prompts: Sequence[str], tokenizer) -> list[list[int]]:
    """Each text's token ids, as `tokenizer(text)` gives them (special tokens added as the tokenizer adds them,
    the same ids `model.generate(**tokenizer(text, return_tensors="pt"))` starts from)."""
    if tokenizer is None:
        raise TypeError(
            "Text prompts need a tokenizer: Engine(model, tokenizer=tokenizer); or pass token ids "
            "(tokenizer.encode(text)) instead."
        )
    return [tokenizer.encode(text) for text in prompts]


def decode(outputs: list[list[int]], tokenizer) -> list[str]:
    """Each output's text (special tokens such as EOS skipped)."""
    return [tokenizer.decode(ids, skip_special_tokens=True) for ids in outputs]


class Detokenizer:
    """The text of one output's tokens as deltas that are never taken back: a trailing incomplete UTF-8
    character (decoded as `\\ufffd`) is held back until a later token completes it or the output ends.

    Each token decodes together with the tokens since the last delta's start (`prefix`), so a tokenizer that
    drops a leading space at the start of a decode still gives the space, and decoding stays short.
    """

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self.prefix = 0  # tokens[prefix:read] decode to text already handed out
        self.read = 0  # tokens[:read] are handed out

    def add(self, token: int, finished: bool) -> str:
        """Appends a token; returns the text that is now certain (all the rest once `finished`)."""
        self.tokens.append(token)
        done = self.tokenizer.decode(self.tokens[self.prefix : self.read], skip_special_tokens=True)
        text = self.tokenizer.decode(self.tokens[self.prefix :], skip_special_tokens=True)
        if len(text) <= len(done) or (text.endswith("\ufffd") and not finished):
            return ""
        self.prefix, self.read = self.read, len(self.tokens)
        return text[len(done) :]


def stream_text(events: Generator[tuple[int, int, bool], None, None], tokenizer) -> Iterator[tuple[int, str, bool]]:
    """`(output_index, token_id, finished)` events as `(output_index, text_delta, finished)`; a delta may be
    empty (a token that only starts a character, or EOS)."""
    outputs: dict[int, Detokenizer] = {}
    try:
        for index, token, finished in events:
            detokenizer = outputs.setdefault(index, Detokenizer(tokenizer))
            yield index, detokenizer.add(token, finished), finished
            if finished:
                del outputs[index]
    finally:
        events.close()  # a consumer that stops early ends the run at once: its blocks go back to the pool

"""`response_format={"type": "json_object"}`: a logits processor that keeps the output a prefix of one JSON object.

A small pushdown recognizer reads the output character by character (`JsonState`, immutable and hashable).
Per step, every vocabulary token's text is run from the current state: tokens that would break the JSON are
masked to `-inf`; EOS is allowed only once the top-level object is closed, and then it is the only token
allowed. Bounds that keep it finite: nesting depth at most `MAX_DEPTH`, at most `MAX_WS` whitespace characters
in a row between tokens; a token whose text is empty or not valid UTF-8 on its own (a byte-level piece of a
multi-byte character) is never allowed, so the output is ASCII-safe JSON text. The output may still stop
unfinished when `max_tokens` ends it first (`finish_reason="length"`), as OpenAI's API does.

Cost per step: one pass over the vocabulary's texts for a state not seen before (`JsonVocabulary` keeps the
masks of up to `MAX_CACHED_MASKS` states; states inside strings and between values repeat a lot).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import NamedTuple

import torch
from transformers import LogitsProcessor

MAX_DEPTH = 16
MAX_WS = 4
MAX_CACHED_MASKS = 2048
_WS = " \t\n\r"
_DIGITS = "0123456789"
_HEX = "0123456789abcdefABCDEF"
# number sub-states: which characters continue each, and where a number may end
_NUMBER = {
    "sign": {**dict.fromkeys("0", "zero"), **dict.fromkeys("123456789", "int")},
    "zero": {".": "dot", "e": "exp", "E": "exp"},
    "int": {**dict.fromkeys(_DIGITS, "int"), ".": "dot", "e": "exp", "E": "exp"},
    "dot": dict.fromkeys(_DIGITS, "frac"),
    "frac": {**dict.fromkeys(_DIGITS, "frac"), "e": "exp", "E": "exp"},
    "exp": {**dict.fromkeys(_DIGITS, "expd"), "+": "expsign", "-": "expsign"},
    "expsign": dict.fromkeys(_DIGITS, "expd"),
    "expd": dict.fromkeys(_DIGITS, "expd"),
}
_NUMBER_ENDS = frozenset({"zero", "int", "frac", "expd"})
_LITERALS = {"t": "rue", "f": "alse", "n": "ull"}


class JsonState(NamedTuple):
    """Where a JSON text prefix stands.

    Attributes:
        stack: open containers, outermost first (`"{"` / `"["`).
        mode: what may come next: `start` (the top-level `{`), `value`, `value_or_close` (after `[`),
            `key_or_close` (after `{`), `key` (after `,` in an object), `colon`, `after` (a value ended inside a
            container), `string`, `escape`, `unicode`, `number`, `literal`, `done` (the object is closed).
        aux: `string`: `"k"` (a key) or `"v"`; `number`: its sub-state; `literal`: the characters still due.
        count: whitespace characters in a row (structural modes) or hex digits still due (`unicode`).
    """

    stack: str = ""
    mode: str = "start"
    aux: str = ""
    count: int = 0


def _value_done(stack: str) -> JsonState:
    return JsonState(stack, "after" if stack else "done")


def _open_value(state: JsonState, ch: str) -> JsonState | None:
    stack = state.stack
    if ch in "{[":
        if len(stack) >= MAX_DEPTH:
            return None
        return JsonState(stack + ch, "key_or_close" if ch == "{" else "value_or_close")
    if ch == '"':
        return JsonState(stack, "string", "v")
    if ch == "-":
        return JsonState(stack, "number", "sign")
    if ch in _DIGITS:
        return JsonState(stack, "number", "zero" if ch == "0" else "int")
    if ch in _LITERALS:
        return JsonState(stack, "literal", _LITERALS[ch])
    return None


def _close(state: JsonState, ch: str) -> JsonState | None:
    if state.stack and ch == {"{": "}", "[": "]"}[state.stack[-1]]:
        return _value_done(state.stack[:-1])
    return None


def step(state: JsonState, ch: str) -> JsonState | None:
    """The state after one more character, or None when `ch` cannot continue a JSON object."""
    mode = state.mode
    if mode == "string":
        if ch == '"':
            return JsonState(state.stack, "colon") if state.aux == "k" else _value_done(state.stack)
        if ch == "\\":
            return state._replace(mode="escape")
        return None if ord(ch) < 0x20 else state
    if mode == "escape":
        if ch == "u":
            return state._replace(mode="unicode", count=4)
        return state._replace(mode="string") if ch in '"\\/bfnrt' else None
    if mode == "unicode":
        if ch not in _HEX:
            return None
        return state._replace(mode="string", count=0) if state.count == 1 else state._replace(count=state.count - 1)
    if mode == "number":
        nxt = _NUMBER[state.aux].get(ch)
        if nxt is not None:
            return state._replace(aux=nxt)
        if state.aux not in _NUMBER_ENDS:
            return None
        return step(_value_done(state.stack), ch)  # the number ended; `ch` belongs to what follows
    if mode == "literal":
        if ch != state.aux[0]:
            return None
        return _value_done(state.stack) if len(state.aux) == 1 else state._replace(aux=state.aux[1:])
    if mode == "done":
        return None  # only EOS may follow the closed object
    if ch in _WS:
        return None if state.count >= MAX_WS else state._replace(count=state.count + 1)
    state = state._replace(count=0)
    if mode == "start":
        return JsonState("{", "key_or_close") if ch == "{" else None
    if mode in ("value", "value_or_close"):
        return _open_value(state, ch) or (_close(state, ch) if mode == "value_or_close" else None)
    if mode in ("key", "key_or_close"):
        if ch == '"':
            return JsonState(state.stack, "string", "k")
        return _close(state, ch) if mode == "key_or_close" else None
    if mode == "colon":
        return JsonState(state.stack, "value") if ch == ":" else None
    if mode == "after":
        if ch == ",":
            return JsonState(state.stack, "key" if state.stack[-1] == "{" else "value")
        return _close(state, ch)
    raise AssertionError(f"unknown JSON mode {mode!r}")


def run(state: JsonState | None, text: str) -> JsonState | None:
    """`step` over every character of `text`; None once a character breaks the JSON (or `text` is empty)."""
    if not text:
        return None
    for ch in text:
        if state is None:
            return None
        state = step(state, ch)
    return state


class JsonVocabulary:
    """A tokenizer's token texts and the allowed-token masks per `JsonState`, shared by every request.

    Args:
        tokenizer: the model's tokenizer; each id's text is `tokenizer.decode([id])`.
        vocab_size: the model's logits width (may exceed the tokenizer's; the extra ids are never allowed).
        eos_ids: the ids that end generation (allowed only once the object is closed).
    """

    def __init__(self, tokenizer, vocab_size: int, eos_ids: frozenset[int]) -> None:
        texts: list[str | None] = [None] * vocab_size
        special = set(getattr(tokenizer, "all_special_ids", []) or [])
        for token_id in range(min(vocab_size, len(tokenizer))):
            text = tokenizer.decode([token_id])
            texts[token_id] = None if token_id in special or "\ufffd" in text else text
        self.texts = texts
        self.eos_ids = eos_ids
        self._masks: OrderedDict[JsonState, torch.Tensor] = OrderedDict()

    def allowed(self, state: JsonState | None) -> torch.Tensor:
        """Bool `[vocab_size]`: the tokens that may follow `state` (None: a broken state, EOS only)."""
        if state is not None and state in self._masks:
            self._masks.move_to_end(state)
            return self._masks[state]
        mask = torch.zeros(len(self.texts), dtype=torch.bool, device="cpu")
        if state is None or state.mode == "done":
            mask[list(self.eos_ids)] = True
        else:
            mask[[i for i, text in enumerate(self.texts) if text is not None and run(state, text) is not None]] = True
        if state is not None:
            self._masks[state] = mask
            if len(self._masks) > MAX_CACHED_MASKS:
                self._masks.popitem(last=False)
        return mask


class JsonObjectProcessor(LogitsProcessor):
    """Masks every token that would make the output (the tokens after `prompt_len`) stop being a prefix of
    one JSON object. Keeps its own state: give each sequence its own instance (`copy.deepcopy` shares the
    vocabulary's masks too, which is harmless but copies them; the engine copies processors per sample).

    Args:
        vocab: the shared `JsonVocabulary`.
        prompt_len: tokens of the prompt (the output starts after them).
    """

    def __init__(self, vocab: JsonVocabulary, prompt_len: int) -> None:
        self.vocab = vocab
        self.prompt_len = prompt_len
        self.state: JsonState | None = JsonState()
        self.seen = 0  # output tokens already read into `state`

    def __deepcopy__(self, memo: dict) -> JsonObjectProcessor:
        other = JsonObjectProcessor(self.vocab, self.prompt_len)  # the vocabulary is shared, not copied
        other.state, other.seen = self.state, self.seen
        return other

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        """`input_ids [1, seq]` (prompt + output so far), `scores [1, vocab]` -> masked scores."""
        output = input_ids[0, self.prompt_len :].tolist()
        for token in output[self.seen :]:
            text = self.vocab.texts[token] if token < len(self.vocab.texts) else None
            self.state = None if text is None else run(self.state, text)
        self.seen = len(output)
        mask = self.vocab.allowed(self.state).to(scores.device)
        return scores.masked_fill(~mask[: scores.shape[-1]], float("-inf"))

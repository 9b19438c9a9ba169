"""Token ids to text for the server: incremental detokenization with stop strings, the chat template, and
token strings for log-probabilities.

The chat template is the tokenizer's own, or `--chat-template FILE`; a tokenizer without one (the shipped
demo model's) gets `DEFAULT_CHAT_TEMPLATE`, one line per message as `<|role|>` then its text, ending with
`<|assistant|>` and a newline for the reply.
"""

from __future__ import annotations

import json
import re

DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def chat_prompt(tokenizer, messages: list[dict[str, str]], template: str | None) -> list[int]:
    """Token ids of `messages` (`[{"role", "content"}]`) rendered by `template` (None: the tokenizer's own
    template, else `DEFAULT_CHAT_TEMPLATE`), with the generation prompt added."""
    if template is None and not getattr(tokenizer, "chat_template", None):
        template = DEFAULT_CHAT_TEMPLATE
    text = tokenizer.apply_chat_template(messages, chat_template=template, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


class TextStream:
    """The text of one sample's tokens, handed out as deltas that never need taking back.

    A delta holds back what could still change: a trailing incomplete UTF-8 character (`\\ufffd`) and a
    trailing piece that could begin a stop string. Once a stop string appears, the text ends before it
    (`stopped` becomes True) and later tokens add nothing.

    Args:
        tokenizer: decodes the ids (special tokens skipped).
        stops: stop strings (not part of the returned text).
    """

    def __init__(self, tokenizer, stops: list[str]) -> None:
        self.tokenizer = tokenizer
        self.stops = stops
        self.tokens: list[int] = []
        self.text = ""  # the text handed out so far
        self.stopped = False
        self.decoded_len = 0  # characters of the decoded tokens so far (a trailing incomplete character not counted)

    def add(self, token: int) -> str:
        """Appends a token; returns the new text that is now certain (may be empty)."""
        if self.stopped:
            return ""
        self.tokens.append(token)
        full = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        self.decoded_len = len(full.rstrip("\ufffd"))
        cut = min((i for i in (full.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            return self._advance(full[:cut])
        end, hold = len(full.rstrip("\ufffd")), 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, end), 0, -1):
                if full[end - k : end] == stop[:k]:
                    hold = max(hold, k)
                    break
        return self._advance(full[: end - hold])

    def finish(self) -> str:
        """The rest of the text once the sample ended (what was held back for a stop string that never came)."""
        if self.stopped:
            return ""
        return self._advance(self.tokenizer.decode(self.tokens, skip_special_tokens=True))

    def _advance(self, text: str) -> str:
        if len(text) <= len(self.text):
            return ""
        delta, self.text = text[len(self.text) :], text
        return delta




def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: each byte as the printable character a byte-level BPE vocabulary writes it as."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), ord("\xff") + 1)]
    cs = bs[:]
    extra = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + extra)
            extra += 1
    return dict(zip(bs, map(chr, cs), strict=True))


_BYTE_DECODER = {char: byte for byte, char in _bytes_to_unicode().items()}
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte-fallback pieces


def _decoder_kinds(tokenizer) -> set[str]:
    """The types of a fast tokenizer's decoder and of its parts (`{"ByteLevel"}`, `{"Sequence", "ByteFallback",
    "Replace", ...}`); empty when it has none or is not a `tokenizers` one."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    try:
        decoder = json.loads(backend.to_str())["decoder"] if backend is not None else None
    except Exception:  # noqa: BLE001 - no usable description: treat as unknown
        return set()
    kinds, todo = set(), [decoder]
    while todo:
        item = todo.pop()
        if isinstance(item, dict):
            kinds.add(str(item.get("type")))
            todo.extend(item.get("decoders") or [])
    return kinds


class TokenPieces:
    """Each token's own text and bytes, as log-probabilities report them (cached per id).

    `text(id)` is `tokenizer.decode([id])` (OpenAI's `logprobs.tokens`; a token holding part of a UTF-8 character
    decodes to U+FFFD). `bytes(id)` is the token's real bytes, so that clients can join such tokens into the right
    characters: for a byte-level BPE tokenizer (GPT-2's alphabet, as the demo model's) its vocabulary piece mapped
    back through the byte alphabet; for SentencePiece byte-fallback pieces (`<0xC3>`) that byte, and other
    SentencePiece pieces with `▁` as a space; added and special tokens, and tokenizers that give no way to the bytes,
    fall back to the UTF-8 of `text(id)`.
    """

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        slow_decoder = getattr(tokenizer, "byte_decoder", None)  # slow GPT-2-style tokenizers keep the table
        kinds = _decoder_kinds(tokenizer)
        self._byte_decoder = slow_decoder if isinstance(slow_decoder, dict) else (
            _BYTE_DECODER if "ByteLevel" in kinds else None)
        self._metaspace = bool(kinds & {"Metaspace", "ByteFallback"}) or hasattr(tokenizer, "sp_model")
        added = getattr(tokenizer, "added_tokens_decoder", None) or {}
        self._added = set(added) | set(getattr(tokenizer, "all_special_ids", None) or [])
        self._texts: dict[int, str] = {}
        self._bytes: dict[int, bytes] = {}

    def text(self, token: int) -> str:
        if token not in self._texts:
            self._texts[token] = self.tokenizer.decode([token])
        return self._texts[token]

    def bytes(self, token: int) -> bytes:
        if token not in self._bytes:
            self._bytes[token] = self._token_bytes(token)
        return self._bytes[token]

    def _token_bytes(self, token: int) -> bytes:
        text = self.text(token)
        if token in self._added:
            return text.encode()
        try:
            piece = self.tokenizer.convert_ids_to_tokens(token)
        except Exception:  # noqa: BLE001 - an id the tokenizer cannot name: its text is all there is
            piece = None
        if isinstance(piece, str) and piece:
            if self._byte_decoder is not None and all(ch in self._byte_decoder for ch in piece):
                return bytes(self._byte_decoder[ch] for ch in piece)
            match = _BYTE_PIECE.fullmatch(piece)
            if match:
                return bytes([int(match.group(1), 16)])
            if self._metaspace:
                return piece.replace("\u2581", " ").encode()
        return text.encode()

    def key(self, token: int) -> str:
        """The token as OpenAI writes a token whose bytes are not text of their own: `bytes:\\xNN...`."""
        return "bytes:" + "".join(f"\\x{b:02x}" for b in self.bytes(token))

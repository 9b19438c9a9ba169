"""Token ids to text for the server: incremental detokenization with stop strings, the chat template, and
token strings for log-probabilities.

The chat template is the tokenizer's own, or `--chat-template FILE`; a tokenizer without one (the shipped
demo model's) gets `DEFAULT_CHAT_TEMPLATE`, one line per message as `<|role|>` then its text, ending with
`<|assistant|>` and a newline for the reply.
"""

from __future__ import annotations

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

    def add(self, token: int) -> str:
        """Appends a token; returns the new text that is now certain (may be empty)."""
        if self.stopped:
            return ""
        self.tokens.append(token)
        full = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
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


def token_text(tokenizer, token: int) -> str:
    """One token's own text, as OpenAI's `logprobs.tokens` shows it."""
    return tokenizer.decode([token])

"""The demo model's tokenizer: byte-level BPE training, and encoding the corpus into one token stream.

The single special token :data:`EOS_TOKEN` (id 0) is bos, eos *and* pad; padding is on the left; no
token is added automatically when encoding.
"""

from __future__ import annotations

from typing import Sequence

import torch

#: The one special token; it serves as bos, eos and pad.
EOS_TOKEN = "<|endoftext|>"


def train_tokenizer(texts: Sequence[str], vocab_size: int, model_max_length: int = 4096):
    """Train a byte-level BPE tokenizer on ``texts`` and wrap it as a ``PreTrainedTokenizerFast``.

    ``<|endoftext|>`` gets id 0 and is used as bos, eos and pad; padding is on the left.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(texts), trainer=trainer, length=len(texts))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=EOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        unk_token=None,
        padding_side="left",
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )


def encode_stream(tokenizer, texts: Sequence[str]) -> torch.Tensor:
    """Encode ``texts`` and concatenate them, each followed by the eos token, into one 1-D stream."""
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    for enc in tokenizer.backend_tokenizer.encode_batch(list(texts), add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.long, device="cpu")

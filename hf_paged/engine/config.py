"""Each Engine request's generation settings, built the way `model.generate()` builds them.

`generate()` merges the model's `generation_config` into the one it is given, prepares the special tokens
(EOS falls back to the model's), turns `max_new_tokens` into an absolute `max_length`, validates the lengths,
then builds its logits processors and stopping criteria from the result. `prepare_request` calls those same
transformers methods for one prompt, so a request honours every field `generate()` honours in greedy
search and sampling (penalties, `min_new_tokens` / `min_length`, `forced_eos_token_id`, `bad_words_ids`,
`exponential_decay_length_penalty`, EOS lists, stop strings, ...). The methods are private: they are listed
in `compat.PRIVATE_NAMES`, whose check runs on every supported release.

Prompt-lookup decoding is asked as `generate()` asks it (`prompt_lookup_num_tokens`, `max_matching_ngram_size`)
and served in greedy search (`speculation.py`); a draft model is the Engine's (`Engine(model, draft_model=...)`).
What the Engine cannot honour (beam search, contrastive search, an `assistant_model` per request, speculation
with sampling, ...) is refused with a ValueError naming the field, before anything is stored.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList

from .speculation import Speculation

#: Generation modes the Engine serves (`GenerationConfig.get_generation_mode()` values).
_SERVED_MODES = ("greedy_search", "sample")

#: Fields that make `generate()` do something other than one-row greedy search or sampling, or return more
#: than token ids: (field, value that is fine, what to do instead).
_REFUSED: tuple[tuple[str, object, str], ...] = (
    ("num_beams", 1, "beam search keeps several rows per request: use model.generate(num_beams=...) with a PagedCache"),
    ("guidance_scale", 1, "classifier-free guidance runs a second forward per step: use model.generate()"),
    ("token_healing", False, "token healing rewrites the prompt: use model.generate()"),
    ("return_dict_in_generate", False, "the Engine returns token ids only: use model.generate() for output objects"),
    ("output_scores", False, "the Engine returns token ids only: use model.generate(output_scores=True)"),
    ("output_logits", False, "the Engine returns token ids only: use model.generate(output_logits=True)"),
    ("output_attentions", False, "the Engine returns no attention weights: use model.generate()"),
    ("output_hidden_states", False, "the Engine returns no hidden states: use model.generate()"),
)


@dataclass(slots=True)
class RequestSetup:
    """What `generate()` would build for one prompt.

    Attributes:
        config: the prepared config (model defaults merged, special tokens prepared, absolute `max_length`).
        max_new_tokens: `config.max_length - len(prompt)`, at least 1.
        processors: the logits processors `generate()` would apply (on CPU).
        stopping: the stopping criteria `generate()` would check after each token (on CPU).
        speculation: prompt-lookup drafting the config asks for, or None.
    """

    config: GenerationConfig
    max_new_tokens: int
    processors: LogitsProcessorList
    stopping: StoppingCriteriaList
    speculation: Speculation | None = None


def prepare_request(
    model: torch.nn.Module,
    generation_config: GenerationConfig | None,
    kwargs: dict[str, object],
    prompt: list[int],
    tokenizer: object | None,
) -> RequestSetup:
    """Builds one request's config, logits processors and stopping criteria as `model.generate()` does.

    Args:
        model: the transformers model (a `GenerationMixin`).
        generation_config: the request's config, or None for the model's.
        kwargs: `GenerationConfig` fields given to `Engine.generate()` (they win over `generation_config`).
        prompt: the prompt's token ids.
        tokenizer: needed for `stop_strings`.

    Raises:
        ValueError: an unknown field, a field the Engine cannot honour, or what `generate()` raises for these
            settings (e.g. a `max_length` the prompt already reaches).
    """
    for name in ("assistant_model", "assistant_tokenizer"):
        if name in kwargs:
            raise ValueError(
                f"Engine: {name} per request is not supported; give the engine its draft model once, "
                "Engine(model, draft_model=assistant), or ask for prompt lookup with prompt_lookup_num_tokens=k."
            )
    config = copy.deepcopy(generation_config) if generation_config is not None else GenerationConfig()
    unused = config.update(**kwargs)
    if unused:
        raise ValueError(
            f"Unknown generation options {sorted(unused)}: the engine takes GenerationConfig fields "
            "(max_new_tokens, do_sample, temperature, top_k, top_p, repetition_penalty, min_new_tokens, "
            "eos_token_id, stop_strings, ...) and seed=."
        )
    # as generate(): whether max_length / min_length are the library defaults decides how they are completed
    has_default_max_length = config.max_length is None and model.generation_config.max_length is None
    has_default_min_length = config.min_length is None and model.generation_config.min_length is None
    config, model_kwargs = model._prepare_generation_config(config)
    config.update(**kwargs)  # as generate(): the keywords win over the model's defaults, an explicit None included
    if model_kwargs:
        raise ValueError(f"Engine: {sorted(model_kwargs)} are not served; use model.generate() for them.")
    _refuse_unserved(config)
    ids = torch.tensor([prompt], dtype=torch.long, device="cpu")  # (the processors run on the host)
    model._prepare_special_tokens(config, kwargs_has_attention_mask=True, device="cpu", batch_size=1)
    config = model._prepare_generated_length(
        generation_config=config, has_default_max_length=has_default_max_length,
        has_default_min_length=has_default_min_length, model_input_name="input_ids",
        input_ids_length=len(prompt), inputs_tensor=ids,
    )
    model._validate_generated_length(config, len(prompt), has_default_max_length)
    if config.stop_strings and tokenizer is None:
        raise ValueError("stop_strings need the tokenizer: Engine(model, tokenizer=tokenizer).")
    processors = model._get_logits_processor(
        generation_config=config, input_ids_seq_length=len(prompt), encoder_input_ids=ids,
        logits_processor=LogitsProcessorList(), device="cpu", model_kwargs={},
    )
    stopping = model._get_stopping_criteria(config, StoppingCriteriaList(), tokenizer=tokenizer)
    max_new_tokens = max(config.max_length - len(prompt), 1)
    return RequestSetup(config, max_new_tokens, processors, stopping, _prompt_lookup(config))


def _prompt_lookup(config: GenerationConfig) -> Speculation | None:
    """The prompt-lookup drafting a config asks for (`max_matching_ngram_size` defaults to 2, as in `generate()`)."""
    k = config.prompt_lookup_num_tokens
    if k is None:
        return None
    n = config.max_matching_ngram_size or 2
    for name, value in (("prompt_lookup_num_tokens", k), ("max_matching_ngram_size", n)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"Engine: {name} must be a positive int, got {value!r}.")
    if config.do_sample:
        raise ValueError(
            "Engine: prompt_lookup_num_tokens with do_sample=True is not supported: the Engine speculates in greedy "
            "search only (it verifies drafts against the argmax). Drop prompt_lookup_num_tokens for sampling."
        )
    return Speculation(k, n)


def _refuse_unserved(config: GenerationConfig) -> None:
    """Raises ValueError naming the first field the Engine cannot honour."""
    for name, fine, instead in _REFUSED:
        value = getattr(config, name, None)
        if value is not None and value != fine:
            raise ValueError(f"Engine: {name}={value!r} is not supported; {instead}.")
    for name in ("use_mtp", "assistant_early_exit"):
        if getattr(config, name, None) not in (None, False):
            raise ValueError(
                f"Engine: {name} is not supported; the Engine drafts by prompt lookup (prompt_lookup_num_tokens=k) "
                "or with its draft model (Engine(model, draft_model=...)). Use model.generate() for it."
            )
    base = copy.copy(config)
    base.prompt_lookup_num_tokens = None  # prompt lookup is served on top of greedy search (see _prompt_lookup)
    mode = str(getattr(base.get_generation_mode(), "value", base.get_generation_mode()))
    if mode not in _SERVED_MODES:
        fields = {
            "contrastive_search": "penalty_alpha with top_k > 1",
            "constrained_beam_search": "constraints / force_words_ids",
            "group_beam_search": "num_beam_groups",
            "dola_generation": "dola_layers",
        }
        raise ValueError(
            f"Engine: generation mode {mode!r} (set by {fields.get(mode, 'the config')}) is not supported; the Engine "
            "serves greedy search and sampling. Use model.generate() with a hf_paged.PagedCache for it."
        )

"""A request's non-text inputs (images, video) in the Engine: the model's own vision path, run when a chunk first
needs it, and its output spliced into the Engine's steps (packed, or a hybrid model's batched rows).

::

    prompt:      t t t t [I I I I I I] t t t       (I: placeholder ids, `support.placeholder_token_ids`)
    encode():    model(prompt, **inputs), stopped by a forward pre-hook on its language model (`get_decoder()`):
                 the `inputs_embeds` the model would feed it -> `features`, its rows at the placeholders
                 `[num_placeholders, hidden]`; its `position_ids` when they are multimodal rotary positions
                 (Qwen2-VL's mrope, `[3, 1, prompt_len]`) -> `positions` `[3, prompt_len]`
    a step:      a prefill chunk `[start, stop)` gets the text embeddings of its ids with the rows of the placeholders
                 it holds replaced by their features (a chunk may split an image: the slice follows the offsets)

A family whose mask lets an image's tokens attend each other both ways (Gemma 3, Gemma 4 with
`use_bidirectional_attention="vision"`: `support.attends_images_bidirectionally`) gets its images' runs of placeholders
(`runs`) kept whole: a prefill chunk never ends inside one (`chunk_stop`), and a chunk holding one attends under a
mask that lets each of its tokens see the rest of its run (`chunk_mask`), for the layer kinds whose mask does so. Which
kinds those are, `encode()` reads from the mask the model itself built for the prompt, and it refuses a mask that is
not causal plus whole runs.

Nothing here reimplements a family's vision code: whatever the model does between its inputs and its language model
(vision tower, projector, tiles, pixel shuffle, `get_placeholder_mask`, `get_rope_index`) runs as the model runs it.
`encode()` refuses a model whose language model gets more than embeddings, positions and a causal mask from that
path (e.g. Qwen3-VL's deepstack features, injected into later layers), or whose text rows differ from
`get_input_embeddings()` of the ids: the packed step could not reproduce either.

`Media` owns the features: the scheduler drops them (`release_features`) once its request stores every placeholder; a
request preempted before that keeps them, one preempted later encodes again if its prefix hit does not cover its
images. The positions are kept for the request's life (a few ints per token).
"""

from __future__ import annotations

import bisect
import inspect
from collections.abc import Mapping

import torch

from ..errors import UnsupportedModelError
from ..support import model_type_of

#: Arguments of the language model that may carry what `encode()` reads or nothing the packed step must reproduce.
_PLAIN_ARGUMENTS = frozenset({
    "input_ids", "inputs_embeds", "position_ids", "attention_mask", "cache", "past_key_values", "use_cache",
    "cache_position", "return_dict", "output_attentions", "output_hidden_states",
})


class _Reached(Exception):
    """Raised by the pre-hook on the language model: the vision path is done, the rest of the forward is skipped."""


class Media:
    """One request's non-text inputs and what the model's vision path made of them.

    Args:
        inputs: the processor's non-text tensors for this one prompt (`pixel_values`, `image_sizes`,
            `image_grid_thw`, `mm_token_type_ids`, ...), as `generate()` would take them.
        placeholders: prompt indices of the placeholder tokens, ascending (at least one).
        bidirectional: the model may attend an image's tokens both ways (`support.attends_images_bidirectionally`):
            its runs of consecutive placeholders are kept whole (`runs`).

    Attributes:
        features: `[num_placeholders, hidden]` on the model's device, the embeddings of the placeholders in order;
            None before `encode()` and after `release_features()`.
        positions: `[3, prompt_len]` multimodal rotary positions (long, CPU), or None when the model positions
            tokens by their index (set by the first `encode()`).
        num_encodes: how many times the vision path ran for this request.
        runs: with `bidirectional`, `(start, stop)` prompt indices of each run of consecutive placeholders, in order;
            else empty.
    """

    def __init__(
        self, inputs: Mapping[str, torch.Tensor], placeholders: list[int], bidirectional: bool = False
    ) -> None:
        self.inputs = dict(inputs)
        self.placeholders = placeholders
        self.runs = _runs(placeholders) if bidirectional else []
        # per layer kind (True: sliding-window layers), the runs whose tokens its mask lets attend each other both
        # ways, as the model's own mask said (`encode`); empty before
        self._both_ways: dict[bool, list[tuple[int, int]]] = {}
        self.features: torch.Tensor | None = None
        self._positions: torch.Tensor | None = None
        self._after: tuple[int, ...] = ()  # each rotary dimension's position of the first token after the prompt
        self.num_encodes = 0

    # ------------------------------------------------------------------ the vision path
    def needs_features(self, start: int, stop: int) -> bool:
        """Whether feeding tokens `[start, stop)` of the request needs features it does not hold."""
        return self.features is None and self._count_below(stop) > self._count_below(start)

    def encode(self, model: torch.nn.Module, prompt: list[int]) -> None:
        """Runs the model on the prompt and its inputs up to its language model; keeps the placeholders' embeddings
        (and multimodal rotary positions).

        Raises:
            UnsupportedModelError: the model's vision path feeds its language model something the packed step
                cannot reproduce (see the module docstring), or a mask other than causal, plus, for a family
                attending its images both ways, whole runs of placeholders (`runs`).
        """
        device = model.get_input_embeddings().weight.device
        ids = torch.tensor([prompt], dtype=torch.long, device=device)
        captured = _language_model_inputs(model, ids, {k: v.to(device) for k, v in self.inputs.items()})
        embeds = captured.get("inputs_embeds")
        if not isinstance(embeds, torch.Tensor) or embeds.shape[:2] != ids.shape:
            raise _unsupported(model, "its language model is not fed `inputs_embeds` of the prompt's length")
        extra = sorted(
            k for k, v in captured.items()
            if k not in _PLAIN_ARGUMENTS and k != "per_layer_inputs" and _carries_tensors(v)
        )
        if extra:
            raise _unsupported(model, f"its vision path also feeds its language model {extra}")
        self._both_ways = self._runs_attended(model, captured.get("attention_mask"), len(prompt))
        at = torch.tensor(self.placeholders, dtype=torch.long, device=device)
        text = torch.ones(len(prompt), dtype=torch.bool, device=device)
        text[at] = False
        layer_inputs = captured.get("per_layer_inputs")
        if layer_inputs is not None and not (
            "per_layer_inputs" in inspect.signature(model.forward).parameters
            and torch.equal(layer_inputs, per_layer_inputs(model, ids, ~text[None]))
        ):
            raise _unsupported(model, "its per-layer inputs are not those of the token ids, placeholders as padding")
        with torch.no_grad():
            plain = model.get_input_embeddings()(ids)
        if not torch.equal(embeds[0, text], plain[0, text].to(embeds.dtype)):
            raise _unsupported(model, "it changes the embeddings of text tokens on their way to its language model")
        self.features = embeds[0, at].detach().clone()
        self.num_encodes += 1
        if self.positions is None:
            self.positions = _rope_positions(model, captured.get("position_ids"), len(prompt))

    def release_features(self) -> None:
        """Drops the features (every placeholder is stored in the request's blocks)."""
        self.features = None

    def all_stored(self, num_stored: int) -> bool:
        """Whether a request storing its first `num_stored` tokens stores every placeholder."""
        return num_stored > self.placeholders[-1]

    def _runs_attended(self, model: torch.nn.Module, mask: object, length: int) -> dict[bool, list[tuple[int, int]]]:
        """Per layer kind (True: sliding-window layers), the runs (`runs`) whose tokens the mask the model built for
        the prompt lets attend each other both ways; raises for a mask that is not causal apart from whole runs.

        Args:
            mask: what the model passes its language model: per layer type (`"full_attention"`,
                `"sliding_attention"`) or one for every layer, each None or a 2D all-ones mask where it is causal,
                else bool `[1, 1, length, length]`.
        """
        text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        window = getattr(text, "sliding_window", None)
        if not isinstance(mask, Mapping):  # one mask for every layer: its window cannot be told apart
            if _causal_only(mask):
                return {False: [], True: []}
            if window is not None:
                raise _unsupported(model, "it builds one mask of its own for layers with and without a window")
            mask = {"full_attention": mask}
        both_ways: dict[bool, list[tuple[int, int]]] = {}
        for layer_type, entry in mask.items():
            windowed = layer_type != "full_attention"
            if _causal_only(entry):
                both_ways[windowed] = []
                continue
            if layer_type not in ("full_attention", "sliding_attention") or (windowed and window is None):
                raise _unsupported(model, f"it builds a mask of its own for its {layer_type!r} layers")
            allowed = entry if entry.dtype == torch.bool else entry > torch.finfo(entry.dtype).min / 2
            allowed = allowed[0, 0].cpu() if tuple(allowed.shape) == (1, 1, length, length) else None
            runs = [] if allowed is None else [(a, b) for a, b in self.runs if b <= length and bool(allowed[a, b - 1])]
            if allowed is None or not torch.equal(allowed, _mask(runs, length, window if windowed else None)[0, 0]):
                raise _unsupported(
                    model, f"its mask for {layer_type!r} layers lets tokens attend others than the rest of their image"
                )
            both_ways[windowed] = runs
        return both_ways

    # ------------------------------------------------------------------ how a step feeds it
    def chunk_stop(self, start: int, stop: int) -> int:
        """Where a prefill chunk of tokens `[start, stop)` ends so that it holds no part of a run (`runs`) without the
        rest: `stop`, or the start of a run it would split, or (a chunk that begins at that run) the run's end."""
        for run_start, run_stop in self.runs:
            if run_start < stop < run_stop:
                return run_start if run_start > start else run_stop
        return stop

    def chunk_mask(self, start: int, stop: int, window: int | None) -> torch.Tensor | None:
        """The bool `[1, 1, stop - start, stop]` mask of a prefill chunk of tokens `[start, stop)` (`chunk_stop`)
        over every token up to its end, for layers of sliding window `window` (or None): each token sees the earlier
        ones (within the window) and, in a run its layer kind attends both ways (as `encode()` read the model's
        mask), the rest of its run; None where that is causal.

        Raises:
            RuntimeError: before `encode()`, for a chunk that holds a run.
        """
        if not any(run_start < stop and start < run_stop for run_start, run_stop in self.runs):
            return None
        if not self._both_ways:
            raise RuntimeError("a chunk holding an image is attended before the request's images were encoded")
        runs = [(a, b) for a, b in self._both_ways.get(window is not None, []) if a < stop and start < b]
        return _mask(runs, stop, window)[:, :, start:] if runs else None

    # ------------------------------------------------------------------ what a step feeds
    def rows(self, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The placeholders among tokens `[start, stop)`: `(offsets [k] from start, features [k, hidden])`, or None
        when there is none. Needs `features`."""
        first, last = self._count_below(start), self._count_below(stop)
        if first == last:
            return None
        if self.features is None:
            raise RuntimeError("a chunk holding placeholders is fed before the request's images were encoded")
        offsets = torch.tensor(self.placeholders[first:last], dtype=torch.long, device="cpu") - start
        return offsets, self.features[first:last]

    @property
    def positions(self) -> torch.Tensor | None:
        """`[3, prompt_len]` multimodal rotary positions (long, CPU), or None when the model positions tokens by
        their index."""
        return self._positions

    @positions.setter
    def positions(self, positions: torch.Tensor | None) -> None:
        self._positions = positions
        self._after = () if positions is None else tuple(int(p) + 1 for p in positions[:, -1])

    @property
    def rows_agree_after_prompt(self) -> bool:
        """Whether each token after the prompt has one position in every rotary dimension: true unless the
        prompt's last token has different ones (a prompt ending inside an image), each of which goes on by one."""
        return len(set(self._after)) <= 1

    def position(self, index: int) -> int:
        """The position of the token at `index` where the rotary dimensions agree (text tokens; generated tokens
        when `rows_agree_after_prompt`)."""
        if self._positions is None:
            return index
        length = self._positions.shape[1]
        if index < length:
            return int(self._positions[0, index])
        return self._after[0] + index - length

    def rope_positions(self, start: int, stop: int) -> torch.Tensor:
        """`[3, stop - start]` multimodal rotary positions of tokens `[start, stop)` (equal rows without them).

        Past the prompt each dimension goes on by one per token from the prompt's last position in it, as
        `generate()` steps its position ids (the last ones + 1), whatever position the prompt reached before.
        """
        if self.positions is None:
            return torch.arange(start, stop, device="cpu").expand(3, -1)
        length = self.positions.shape[1]
        inside = self.positions[:, start:stop]
        after = torch.tensor(self._after, device="cpu")[:, None] - length
        after = after + torch.arange(max(start, length), max(stop, length), device="cpu")
        return torch.cat([inside, after], dim=1)

    def _count_below(self, index: int) -> int:
        return bisect.bisect_left(self.placeholders, index)


def spliced_inputs(
    model: torch.nn.Module, input_ids: torch.Tensor, splices: list[tuple[int, int, tuple[torch.Tensor, torch.Tensor]]]
) -> dict[str, torch.Tensor]:
    """The model inputs of a step whose tokens hold placeholders: `inputs_embeds` `[rows, N, hidden]`, the embeddings of
    `input_ids` `[rows, N]` with each placeholder's row replaced by its features, and the ids' `per_layer_inputs` for a
    model that takes them (`per_layer_inputs`; checked against the model's own when the request's images were
    encoded).

    Args:
        splices: `(row, first column, (offsets [k] from it, features [k, hidden]))` per chunk (`Media.rows`).
    """
    device = input_ids.device
    with torch.no_grad():
        embeds = model.get_input_embeddings()(input_ids)
    placeholders = torch.zeros_like(input_ids, dtype=torch.bool)
    for row, start, (offsets, features) in splices:
        embeds[row, offsets.to(device) + start] = features.to(embeds.dtype)
        placeholders[row, offsets.to(device) + start] = True
    inputs = {"inputs_embeds": embeds}
    layer_inputs = per_layer_inputs(model, input_ids, placeholders)
    if layer_inputs is not None:
        inputs["per_layer_inputs"] = layer_inputs
    return inputs


def per_layer_inputs(model: torch.nn.Module, ids: torch.Tensor, placeholders: torch.Tensor) -> torch.Tensor | None:
    """The per-layer inputs (Gemma 3n's and Gemma 4's per-layer embeddings of the token ids) that the model hands its
    language model for `ids` `[rows, N]` whose positions `placeholders` (bool `[rows, N]`) hold non-text tokens,
    computed as it computes them (those positions as the text config's pad token); None for a model without them. A
    step fed as embeddings (placeholders replaced by features) passes them to the model, which cannot recover the
    ids."""
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    if not getattr(text, "hidden_size_per_layer_input", None):
        return None
    with torch.no_grad():
        return model.get_decoder().get_per_layer_inputs(torch.where(placeholders, text.pad_token_id, ids))


def _language_model_inputs(model: torch.nn.Module, ids: torch.Tensor, inputs: dict) -> dict[str, object]:
    """The arguments the model passes its language model for `input_ids` `[1, prompt_len]` and the non-text
    `inputs`, by name; the language model itself does not run."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    if not isinstance(decoder, torch.nn.Module) or decoder is model:
        raise _unsupported(model, "it names no language model of its own (get_decoder())")
    captured: dict[str, object] = {}

    def stop(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        bound = inspect.signature(module.forward).bind(*args, **kwargs).arguments
        for name, value in bound.items():
            if inspect.signature(module.forward).parameters[name].kind is inspect.Parameter.VAR_KEYWORD:
                captured.update(value)
            else:
                captured[name] = value
        raise _Reached

    handle = decoder.register_forward_pre_hook(stop, with_kwargs=True)
    try:
        with torch.no_grad():
            model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False, **inputs)
    except _Reached:
        return captured
    finally:
        handle.remove()
    raise _unsupported(model, "its forward did not call its language model (get_decoder())")


def _mask(runs: list[tuple[int, int]], stop: int, window: int | None) -> torch.Tensor:
    """Bool `[1, 1, stop, stop]`: token q sees key k when `k <= reach[q]` (the last token of q's run among `runs`,
    else q itself), and `k > q - window` with a window."""
    reach = torch.arange(stop, device="cpu")
    for run_start, run_stop in runs:
        reach[run_start : min(run_stop, stop)] = run_stop - 1
    keys = torch.arange(stop, device="cpu")[None, :]
    allowed = keys <= reach[:, None]
    if window is not None:
        allowed &= keys > torch.arange(stop, device="cpu")[:, None] - window
    return allowed[None, None]


def _runs(placeholders: list[int]) -> list[tuple[int, int]]:
    """`(start, stop)` of each run of consecutive indices in ascending `placeholders`."""
    runs: list[tuple[int, int]] = []
    for index in placeholders:
        if runs and runs[-1][1] == index:
            runs[-1] = (runs[-1][0], index + 1)
        else:
            runs.append((index, index + 1))
    return runs


def _carries_tensors(value: object) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, (list, tuple)):
        return any(_carries_tensors(v) for v in value)
    if isinstance(value, Mapping):
        return any(_carries_tensors(v) for v in value.values())
    return False


def _causal_only(mask: object) -> bool:
    """Whether the mask the model passes its language model is the plain one: none, our all-ones 2D mask, or the
    `"paged"` mask function's answer for it (None), per layer type."""
    if mask is None:
        return True
    if isinstance(mask, Mapping):
        return all(_causal_only(m) for m in mask.values())
    return isinstance(mask, torch.Tensor) and mask.dim() == 2 and bool(mask.bool().all())


def _rope_positions(model: torch.nn.Module, position_ids: object, length: int) -> torch.Tensor | None:
    """Multimodal rotary positions `[3, length]` from the position ids the model passes its language model, or None
    when they are the tokens' indices."""
    if position_ids is None:
        return None
    if not isinstance(position_ids, torch.Tensor):
        raise _unsupported(model, f"it passes its language model position ids of type {type(position_ids).__name__}")
    if position_ids.dim() == 3 and position_ids.shape[0] == 4:  # text positions first, then the 3 rotary ones
        position_ids = position_ids[1:]
    if position_ids.dim() == 2 and torch.equal(position_ids[0].cpu(), torch.arange(length, device="cpu")):
        return None
    if position_ids.dim() != 3 or position_ids.shape[:2] != (3, 1) or position_ids.shape[2] != length:
        raise _unsupported(model, f"its vision path gives position ids of shape {list(position_ids.shape)}")
    return position_ids[:, 0].to("cpu", torch.long)


def _unsupported(model: torch.nn.Module, why: str) -> UnsupportedModelError:
    return UnsupportedModelError(
        f"Model type {model_type_of(model.config)}: the Engine cannot serve its requests with images: {why}, which "
        "its packed steps (text embeddings with the placeholders' features spliced in) do not reproduce. Run such a "
        "request with model.generate(**inputs, **hf_paged.cache_kwargs(pool.new_cache(**inputs, model=model))) instead."
    )

"""Vision-language models of the coverage matrix: tiny configs with tiny vision towers, and their image inputs.

One line per family: `VlmCase(model_type, text=..., vision=..., top=...)`. `test_vlm.py` runs each through
`generate()` with an image (PagedCache + "paged" against DynamicCache + sdpa) and `support_table.py` renders them
into the README. `load_vlm` gives the language model `"paged"` and the rest sdpa (`attn_implementation` per
sub-config, as transformers takes it), or `"paged"` everywhere.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForImageTextToText

from matrix import TINY, _save_root

#: Placeholder id of every tiny VLM (inside the tiny vocabulary, never produced by the prompts' other ids).
IMAGE_TOKEN = 100
#: Text sizes of every tiny VLM's language model (`TINY`'s, with the vocabulary the placeholders live in).
TEXT = {k: TINY[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                             "num_attention_heads", "num_key_value_heads", "head_dim", "pad_token_id",
                             "bos_token_id", "eos_token_id", "tie_word_embeddings")}
SIGLIP = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
              num_attention_heads=2, image_size=28, patch_size=7)
CLIP = dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
            num_attention_heads=2, image_size=28, patch_size=7, projection_dim=32)


@dataclass(frozen=True)
class VlmCase:
    """One vision-language family of the matrix.

    Attributes:
        model_type: transformers model type of the whole model (`AutoConfig.for_model`).
        text: language-model config overrides on top of `TEXT` (with its `model_type`).
        vision: vision-tower config (with its `model_type`).
        top: overrides of the top-level config.
        images: `(seed, num_images) -> (placeholders per image, {non-text inputs})`.
        wrap: the tokens the processor puts before and after each image's placeholders.
        token_types: the name of the token types the processor returns (1 on placeholders), if any.
        features: what the family exercises (shown in the README).
        both_ways: the model's mask lets some tokens attend later ones (an image's tokens each other, or PaliGemma's
            whole prompt).
        engine_error: regex of the `UnsupportedModelError` the Engine raises for the family, where it refuses it and
            `generate()` serves it; "" where the Engine serves it too.
    """

    model_type: str
    text: dict
    vision: dict
    images: Callable[[int, int], tuple[int, dict]]
    top: dict = field(default_factory=dict)
    wrap: tuple[tuple[int, ...], tuple[int, ...]] = ((), ())
    token_types: str = ""
    features: str = ""
    both_ways: bool = False
    engine_error: str = ""

    @property
    def id(self) -> str:
        return self.model_type

    def __hash__(self) -> int:
        return hash(self.id)


def _square_images(size: int, tokens: int) -> Callable[[int, int], tuple[int, dict]]:
    """Images as `pixel_values` `[num_images, 3, size, size]`, `tokens` placeholders each."""

    def images(seed: int, num_images: int) -> tuple[int, dict]:
        gen = torch.Generator().manual_seed(seed)
        return tokens, {"pixel_values": torch.randn(num_images, 3, size, size, generator=gen)}

    return images


def _gemma4_images(seed: int, num_images: int) -> tuple[int, dict]:
    """Gemma 4's patches `[num_images, 16, 4 * 4 * 3]` of 4x4-patch images with their `(x, y)` positions, pooled 2x2
    into 4 placeholders each."""
    gen = torch.Generator().manual_seed(seed)
    ys, xs = torch.meshgrid(torch.arange(4), torch.arange(4), indexing="ij")
    positions = torch.stack([xs.flatten(), ys.flatten()], -1)[None].repeat(num_images, 1, 1)
    return 4, {"pixel_values": torch.randn(num_images, 16, 48, generator=gen), "image_position_ids": positions}


def _qwen2_vl_images(seed: int, num_images: int) -> tuple[int, dict]:
    """Flattened patches `[num_images * 16, 3 * 2 * 7 * 7]` of 4x4-patch images, merged 2x2 into 4 placeholders."""
    gen = torch.Generator().manual_seed(seed)
    return 4, {
        "pixel_values": torch.randn(num_images * 16, 3 * 2 * 7 * 7, generator=gen),
        "image_grid_thw": torch.tensor([[1, 4, 4]] * num_images),
    }


def _siglip2_images(seed: int, num_images: int) -> tuple[int, dict]:
    """SigLIP2's patches `[num_images, 64, 4 * 4 * 3]` (the first 16 real: 4x4 patches, `spatial_shapes`), merged
    2x2 into 4 placeholders each (LFM2-VL)."""
    gen = torch.Generator().manual_seed(seed)
    real = (torch.arange(64) < 16).long()[None].repeat(num_images, 1)
    return 4, {"pixel_values": torch.randn(num_images, 64, 48, generator=gen), "pixel_attention_mask": real,
               "spatial_shapes": torch.tensor([[4, 4]] * num_images)}


def _tiled_images(tiles: int, tokens: int) -> Callable[[int, int], tuple[int, dict]]:
    """Images as `pixel_values` `[num_images, tiles, 3, 28, 28]` (and `image_sizes`), `tokens` placeholders each."""

    def images(seed: int, num_images: int) -> tuple[int, dict]:
        gen = torch.Generator().manual_seed(seed)
        pixels = torch.randn(num_images, tiles, 3, 28, 28, generator=gen)
        sizes = {"image_sizes": torch.tensor([[28, 28]] * num_images)} if tiles > 1 else {}
        return tokens, {"pixel_values": pixels, **sizes}

    return images


def _sized_images(size: int, tokens: int) -> Callable[[int, int], tuple[int, dict]]:
    """Images as `pixel_values` `[num_images, 3, size, size]` with `image_sizes`, `tokens` placeholders each."""

    def images(seed: int, num_images: int) -> tuple[int, dict]:
        count, inputs = _square_images(size, tokens)(seed, num_images)
        return count, {**inputs, "image_sizes": torch.tensor([[size, size]] * num_images)}

    return images


_PIXTRAL = dict(model_type="pixtral", hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                image_size=28, patch_size=7, head_dim=16)
_IDEFICS_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                       patch_size=7)
_BIDIRECTIONAL_PREFIX = r"attends each prompt bidirectionally.*generate"
_MROPE = {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0}

VLMS: tuple[VlmCase, ...] = (
    VlmCase("llava", dict(model_type="llama"), CLIP, _square_images(28, 16),
            top=dict(vision_feature_layer=-1, vision_feature_select_strategy="default"),
            features="CLIP tower + projector, image features scattered over placeholders"),
    VlmCase("qwen2_vl", dict(model_type="qwen2_vl_text", rope_parameters=_MROPE),
            dict(model_type="qwen2_vl", depth=1, embed_dim=32, hidden_size=64, num_heads=2, patch_size=7,
                 spatial_merge_size=2, temporal_patch_size=2, in_channels=3, mlp_ratio=2),
            _qwen2_vl_images, top=dict(video_token_id=103, vision_start_token_id=101, vision_end_token_id=102),
            wrap=((101,), (102,)), token_types="mm_token_type_ids",
            features="3D (mrope) positions, patches merged 2x2"),
    VlmCase("llava_next", dict(model_type="llama"), CLIP, _tiled_images(2, 36),
            top=dict(vision_feature_layer=-1, vision_feature_select_strategy="default", image_grid_pinpoints=[[28, 28]]),
            features="any-resolution tiles (base + 1 tile, row newlines), image_sizes"),
    VlmCase("mistral3", dict(model_type="mistral"), _PIXTRAL, _sized_images(28, 4),
            top=dict(spatial_merge_size=2, vision_feature_layer=-1),
            features="Pixtral tower (2D RoPE), patches merged 2x2, image_sizes"),
    VlmCase("idefics3", dict(model_type="llama"), dict(_IDEFICS_VISION, model_type="idefics3_vision"),
            _tiled_images(1, 4), top=dict(scale_factor=2), features="pixel shuffle (scale factor 2)"),
    VlmCase("smolvlm", dict(model_type="llama"), dict(_IDEFICS_VISION, model_type="smolvlm_vision"),
            _tiled_images(1, 4), top=dict(scale_factor=2), features="pixel shuffle (scale factor 2)"),
    VlmCase("qwen2_5_vl", dict(model_type="qwen2_5_vl_text", rope_parameters=_MROPE),
            dict(model_type="qwen2_5_vl", depth=1, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=7,
                 spatial_merge_size=2, temporal_patch_size=2, in_channels=3, out_hidden_size=64, window_size=28,
                 fullatt_block_indexes=[0]),
            _qwen2_vl_images, top=dict(video_token_id=103, vision_start_token_id=101, vision_end_token_id=102),
            wrap=((101,), (102,)), token_types="mm_token_type_ids",
            features="3D (mrope) positions, windowed vision attention, patches merged 2x2"),
    VlmCase("vipllava", dict(model_type="llama"), dict(CLIP, num_hidden_layers=2), _square_images(28, 16),
            top=dict(vision_feature_layers=[-1, -2]), features="features of two tower layers concatenated"),
    VlmCase("aya_vision", dict(model_type="cohere2"), SIGLIP, _square_images(28, 4),
            top=dict(downsample_factor=2, vision_feature_layer=-1),
            features="SigLIP tower, pixel shuffle (downsample 2), Cohere2 language model"),
    # (four layers: with two, what an image's tokens see barely reaches the logits of the text after them, so a causal
    # attention over the image would pass every comparison)
    VlmCase("gemma3", dict(model_type="gemma3_text", sliding_window=8, num_hidden_layers=4), SIGLIP,
            _square_images(28, 4),
            top=dict(boi_token_id=101, eoi_token_id=102, mm_tokens_per_image=4), wrap=((101,), (102,)),
            token_types="token_type_ids", both_ways=True,
            features="bidirectional attention over each image's tokens (the model's own mask, applied as given)"),
    VlmCase("gemma4", dict(model_type="gemma4_text", num_hidden_layers=4, sliding_window=8, global_head_dim=32,
                           layer_types=["sliding_attention", "full_attention"] * 2, num_kv_shared_layers=2,
                           vocab_size_per_layer_input=128, hidden_size_per_layer_input=8,
                           use_bidirectional_attention="vision"),
            dict(model_type="gemma4_vision", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                 num_attention_heads=2, num_key_value_heads=2, head_dim=16, patch_size=4, pooling_kernel_size=2,
                 position_embedding_size=64),
            _gemma4_images, top=dict(boi_token_id=101, eoi_token_id=102, video_token_id=103, audio_token_id=104,
                                     boa_token_id=105, eoa_token_index=106, audio_config=None),
            wrap=((101,), (102,)), token_types="mm_token_type_ids", both_ways=True,
            features="bidirectional attention over each image's tokens (`use_bidirectional_attention=\"vision\"`), "
                     "last two layers reuse earlier layers' K/V, per-layer inputs"),
    VlmCase("lfm2_vl", dict(model_type="lfm2", num_hidden_layers=4,
                            layer_types=["conv", "full_attention", "conv", "full_attention"]),
            dict(model_type="siglip2_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                 num_attention_heads=2, patch_size=4, num_patches=64),
            _siglip2_images, top=dict(projector_hidden_size=64, downsample_factor=2),
            features="hybrid language model (short convolutions + attention: recurrent states), SigLIP2 tower"),
    VlmCase("paligemma", dict(model_type="gemma"), SIGLIP, _square_images(28, 16), top=dict(projection_dim=64),
            token_types="token_type_ids", both_ways=True, engine_error=_BIDIRECTIONAL_PREFIX,
            features="bidirectional attention over image and prefix (the model's own mask, applied as given)"),
)


#: The families of `VLMS` that `make test` runs: a prefix hit over the image (llava), one that stops before it with
#: 3D positions (qwen2_vl), and bidirectional attention over an image's tokens (gemma3). The others are marked
#: `models` (`tests/helpers.py` `tiered`): `make test-models` runs them.
MAKE_TEST = frozenset({"llava", "qwen2_vl", "gemma3"})

def tiny_vlm_config(case: VlmCase):
    return AutoConfig.for_model(
        case.model_type, text_config={**TEXT, **case.text}, vision_config=dict(case.vision),
        image_token_id=IMAGE_TOKEN, **case.top,
    )


@functools.cache
def saved_vlm(case: VlmCase, scale: float = 3.0) -> Path:
    """Builds the tiny VLM, scales its weights (peaked logits), saves it and returns the directory."""
    config = tiny_vlm_config(case)
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(scale)
    root = _save_root()
    path = root / re.sub(r"[^\w.-]", "_", f"{case.model_type}-vlm-{len(list(root.iterdir()))}")
    model.save_pretrained(path)
    return path


def load_vlm(path: Path, attention: str, everywhere: bool = False):
    """The saved VLM with `attention` for its language model and sdpa for everything else (`everywhere`: for every
    part, as `from_pretrained(path, attn_implementation=attention)` does)."""
    impl = attention if everywhere else {"text_config": attention, "vision_config": "sdpa", "": "sdpa"}
    return AutoModelForImageTextToText.from_pretrained(path, attn_implementation=impl, dtype=torch.float32).eval()


def prompt(case: VlmCase, text_before: list[int], text_after: list[int], seed: int = 0) -> dict:
    """One prompt row `text_before + image placeholders + text_after` with its image: the processor's output."""
    return prompt_images(case, [text_before, text_after], seed)


def prompt_images(case: VlmCase, texts: list[list[int]], seed: int = 0) -> dict:
    """One prompt row `texts[0] + image 0 + texts[1] + image 1 + ... + texts[-1]` with its `len(texts) - 1` images."""
    count, inputs = case.images(seed, len(texts) - 1)
    before, after = case.wrap
    image = list(before) + [IMAGE_TOKEN] * count + list(after)
    ids = torch.tensor([[t for text in texts[:-1] for t in text + image] + texts[-1]])
    out = {"input_ids": ids, "attention_mask": torch.ones_like(ids), **inputs}
    if case.token_types:
        out[case.token_types] = (ids == IMAGE_TOKEN).long()
    return out

"""ComfyUI's Qwen-Image over several processes: each block takes this rank's share of the image and text tokens
(shards.py), the rotary table split to match; the output projection's output, per token, is gathered.

ComfyUI 0.33's blocks (their forward takes timestep_zero_index) get the rotary table in Flux's layout, tokens on its
third axis (0.3.6x's on its second), and an index into the image tokens from which on they are modulated at timestep
zero (Qwen-Image-Edit-2511's reference images), which each rank takes as the index into its share. Their attention
applies a text mask over this rank's tokens, which the exchange does not lay out over all of them: a call with one is
refused (BadInput), and the caller runs it on one GPU.
"""

from __future__ import annotations

from torch import nn
from torch.utils.hooks import RemovableHandle

from ..errors import BadInput
from .group import gather
from .shards import Shards, argument, parameters, replaced

CLASSES = (("comfy.ldm.qwen_image.model", "QwenImageTransformer2DModel"),)
ATTENTION = ("comfy.ldm.qwen_image.model", "optimized_attention_masked")
HEADS = "Qwen-Image: 24 heads"
ENTRY = "img_in"  # the layer each call starts with
ZERO = "timestep_zero_index"


def heads(model: nn.Module) -> int:
    return model.transformer_blocks[0].attn.heads


def attach(model: nn.Module, shards: Shards) -> list[RemovableHandle]:
    g = shards.g

    def block(module, args, kwargs):
        names = parameters(type(module).forward)
        img, txt, pe, mask = (argument(names, args, kwargs, n) for n in
                              ("hidden_states", "encoder_hidden_states", "image_rotary_emb",
                               "encoder_hidden_states_mask"))
        later = ZERO in names
        if later and mask is not None:
            raise BadInput("a text attention mask is not split over the processes of sequence parallelism (ComfyUI "
                           "0.33's Qwen-Image applies it in its attention).", "Run this call on one GPU.")
        img = shards.tokens(img)
        values = {"hidden_states": img, "encoder_hidden_states": shards.text_tokens(txt),
                  "image_rotary_emb": shards.table(pe, 2 if later else 1)}
        zero = argument(names, args, kwargs, ZERO) if later else None
        if zero is not None:
            share = img.shape[1]
            values[ZERO] = min(max(zero - g.rank * share, 0), share)
        return replaced(names, args, kwargs, **values)

    handles = [model.proj_out.register_forward_hook(lambda _m, _a, out: gather(out, 1, g))]
    for b in model.transformer_blocks:
        handles.append(b.register_forward_pre_hook(block, with_kwargs=True))
        handles += shards.exchanging(b)
    return handles

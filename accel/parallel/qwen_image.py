"""ComfyUI's Qwen-Image over several processes: each block takes this rank's share of the image and text tokens
(shards.py), the rotary table split to match; the output projection's output, per token, is gathered."""

from __future__ import annotations

from torch import nn
from torch.utils.hooks import RemovableHandle

from .group import gather
from .shards import Shards, argument, parameters, replaced

CLASSES = (("comfy.ldm.qwen_image.model", "QwenImageTransformer2DModel"),)
ATTENTION = ("comfy.ldm.qwen_image.model", "optimized_attention_masked")
HEADS = "Qwen-Image: 24 heads"
ENTRY = "img_in"  # the layer each call starts with


def heads(model: nn.Module) -> int:
    return model.transformer_blocks[0].attn.heads


def attach(model: nn.Module, shards: Shards) -> list[RemovableHandle]:
    def block(module, args, kwargs):
        names = parameters(type(module).forward)
        img, txt, pe = (argument(names, args, kwargs, n)
                        for n in ("hidden_states", "encoder_hidden_states", "image_rotary_emb"))
        return replaced(names, args, kwargs, hidden_states=shards.tokens(img),
                        encoder_hidden_states=shards.text_tokens(txt), image_rotary_emb=shards.table(pe, 1))

    handles = [model.proj_out.register_forward_hook(lambda _m, _a, out: gather(out, 1, shards.g))]
    for b in model.transformer_blocks:
        handles.append(b.register_forward_pre_hook(block, with_kwargs=True))
        handles += shards.exchanging(b)
    return handles

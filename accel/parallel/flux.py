"""ComfyUI's Flux and Chroma over several processes: the double blocks take this rank's share of the image and text
tokens (shards.py); the single blocks then get that text followed by that image (the model's own concatenation), and
the model's own slicing after them leaves the image share to the final layer, whose output, per token, is gathered.
The rotary table is split to match."""

from __future__ import annotations

from torch import nn
from torch.utils.hooks import RemovableHandle

from .group import gather
from .shards import Shards, argument, parameters, replaced

CLASSES = (("comfy.ldm.flux.model", "Flux"), ("comfy.ldm.chroma.model", "Chroma"))
ATTENTION = ("comfy.ldm.flux.math", "optimized_attention")  # where both models' blocks find their attention function
HEADS = "Flux and Chroma: 24 heads"
ENTRY = "img_in"  # the layer each call starts with


def heads(model: nn.Module) -> int:
    return model.num_heads


def attach(model: nn.Module, shards: Shards) -> list[RemovableHandle]:
    def double(module, args, kwargs):
        names = parameters(type(module).forward)
        img, txt, pe, mask = (argument(names, args, kwargs, n) for n in ("img", "txt", "pe", "attn_mask"))
        # a mask is laid out over the one-process order, which the exchange keeps only where the text is whole
        return replaced(names, args, kwargs, img=shards.tokens(img), txt=shards.text_tokens(txt, mask is None),
                        pe=shards.table(pe, 2))

    def single(module, args, kwargs):
        names = parameters(type(module).forward)
        return replaced(names, args, kwargs, pe=shards.table(argument(names, args, kwargs, "pe"), 2))

    handles = [model.final_layer.register_forward_hook(lambda _m, _a, out: gather(out, 1, shards.g))]
    for blocks, hook in ((model.double_blocks, double), (model.single_blocks, single)):
        for b in blocks:
            handles.append(b.register_forward_pre_hook(hook, with_kwargs=True))
            handles += shards.exchanging(b)
    return handles

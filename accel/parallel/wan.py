"""ComfyUI's WanModel over several processes: every block runs on this rank's share of the video tokens (no text in
its self-attention: the text enters by cross-attention, which needs no exchange), its rotary table and Wan 2.2's
per-token modulation split to match; the tokens are gathered before the output head, whose modulation may be per
token too."""

from __future__ import annotations

from torch import nn
from torch.utils.hooks import RemovableHandle

from .group import gather
from .shards import Shards, argument, parameters, replaced

CLASSES = (("comfy.ldm.wan.model", "WanModel"),)
ATTENTION = ("comfy.ldm.wan.model", "optimized_attention")  # where its blocks find their attention function
HEADS = "Wan 14B: 40 heads, 1.3B: 12, 5B: 24"
ENTRY = "patch_embedding"  # the layer each call starts with


def heads(model: nn.Module) -> int:
    return model.num_heads


def attach(model: nn.Module, shards: Shards) -> list[RemovableHandle]:
    g = shards.g

    def block(module, args, kwargs):
        names = parameters(type(module).forward)
        x = shards.tokens(argument(names, args, kwargs, "x"))
        values = {"x": x, "freqs": shards.table(argument(names, args, kwargs, "freqs"), 1)}
        e = argument(names, args, kwargs, "e")
        if e is not None and e.dim() == 4 and e.shape[1] > 1:  # Wan 2.2's modulation per frame or token
            values["e"] = shards.rows(e, 1, x.shape[1] * g.world)
        return replaced(names, args, kwargs, **values)

    def head(_module, args):
        return (gather(args[0], 1, g), *args[1:])

    handles = [model.head.register_forward_pre_hook(head)]
    for b in model.blocks:
        handles.append(b.register_forward_pre_hook(block, with_kwargs=True))
        handles += shards.exchanging(b.self_attn)
    return handles

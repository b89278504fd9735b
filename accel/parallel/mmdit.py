"""ComfyUI's SD3/SD3.5 MMDiT over several processes: each joint block takes this rank's share of the image tokens and
of the context (shards.py: SD3.5's 333 text tokens divide no world, and stay whole), in both of its attentions (the
joint one, and MMDiT-X's image-only one); the final layer's output, per token, is gathered. The position embedding is
added before the blocks, so the split tokens carry theirs."""

from __future__ import annotations

from torch import nn
from torch.utils.hooks import RemovableHandle

from .group import gather
from .shards import Shards, argument, replaced

MODULE = "comfy.ldm.modules.diffusionmodules.mmdit"
CLASSES = ((MODULE, "OpenAISignatureMMDITWrapper"), (MODULE, "MMDiT"))
ATTENTION = (MODULE, "optimized_attention")
HEADS = "SD3.5 large: 38 heads, medium: 24"
ENTRY = "x_embedder"  # the layer each call starts with
JOINT = ("context", "x")  # a JointBlock's call (its forward takes *args: block_mixing's)


def heads(model: nn.Module) -> int:
    return model.num_heads


def attach(model: nn.Module, shards: Shards) -> list[RemovableHandle]:
    def joint(_module, args, kwargs):
        return replaced(JOINT, args, kwargs, x=shards.tokens(argument(JOINT, args, kwargs, "x")),
                        context=shards.text_tokens(argument(JOINT, args, kwargs, "context")))

    handles = [model.final_layer.register_forward_hook(lambda _m, _a, out: gather(out, 1, shards.g))]
    for b in model.joint_blocks:
        handles.append(b.register_forward_pre_hook(joint, with_kwargs=True))
        handles += shards.exchanging(b)
    return handles

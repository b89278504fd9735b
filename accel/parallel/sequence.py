"""Sequence parallelism (Ulysses) for ComfyUI's diffusion transformers (Wan, Flux, Chroma, SD3/SD3.5, Qwen-Image):
every rank calls the model with the same full inputs; the transformer blocks run on each rank's share of the tokens,
and the output is the full one on every rank.

Inside a block everything but attention works token by token (modulation, q/k RMSNorm over the channels, the rotary
embedding, cross-attention to the text, the feed-forward), so each rank keeps 1/world of the image tokens and of the
text tokens (all of these where the world does not divide them: shards.py). The attention exchanges tokens for heads
(exchange.py), runs the host's own attention function, or the fused blocks' own attention, on all tokens of 1/world
of the heads, and exchanges back.

How it attaches, and is taken off again: a family module per model (wan.py, flux.py, mmdit.py, qwen_image.py) puts
forward hooks on the blocks, which split the tokens at the call's first block and the per-token tables at every
block, and on the output layer, which gathers the image tokens; the module's attention function is replaced, for as
long as the context lasts, by the exchange around it. Nothing of the model's own code is restated.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

from torch import nn

from ..engine.attention import standing_in
from ..errors import BadInput
from . import flux, mmdit, qwen_image, wan
from .exchange import stand_in
from .group import Group
from .shards import Shards, argument, parameters

FAMILIES = (wan, flux, mmdit, qwen_image)


def _family(model: nn.Module):
    kind = (type(model).__module__, type(model).__name__)
    for family in FAMILIES:
        if kind in family.CLASSES:
            return family
    names = ", ".join(name for family in FAMILIES for _, name in family.CLASSES)
    raise BadInput(f"sequence parallelism takes ComfyUI's {names}; not {type(model).__name__}.",
                   "Run this model on one GPU.")


@contextlib.contextmanager
def sequence_parallel(model: nn.Module, g: Group) -> Iterator[None]:
    """While it lasts, model's calls (the same full inputs on every rank) run its blocks on 1/world of the tokens, in
    ComfyUI's blocks or the torch path's fused ones. BadInput if the model is none of the classes above or the world
    does not divide its heads; a call whose image token count the world does not divide, or that brings ControlNet
    residuals (they are not split), raises BadInput too, and the caller runs it on one GPU. (sd-accel's canonical SD3
    call runs the class forward, past the model's own hooks: its residuals fail on their shape instead.)"""
    family = _family(model)
    heads = family.heads(model)
    if heads % g.world:
        raise BadInput(f"{g.world} processes do not divide the model's {heads} attention heads.",
                       f"Use a number of GPUs that divides the heads ({family.HEADS}).")
    shards = Shards(g)

    def no_control(module, args, kwargs):
        if argument(parameters(type(module).forward), args, kwargs, "control"):
            raise BadInput("ControlNet residuals are not split over the processes of sequence parallelism.",
                           "Run ControlNet workflows on one GPU.")

    module_name, name = family.ATTENTION
    host_module = sys.modules[module_name]
    # A call's start is where its input layer runs: a caller may call the model's class forward, which runs no hook
    # of the model's own (sd-accel's canonical SD3 call does), and a call that failed leaves nothing behind.
    handles = [model.register_forward_pre_hook(no_control, with_kwargs=True),
               getattr(model, family.ENTRY).register_forward_pre_hook(shards.begin), *family.attach(model, shards)]
    try:
        with standing_in(host_module, name, stand_in(getattr(host_module, name), shards)):
            yield
    finally:
        for h in handles:
            h.remove()

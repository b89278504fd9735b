"""Residual add + LayerNorm as one pass in diffusers', ComfyUI's, ldm's and sgm's BasicTransformerBlock (ONNX
Runtime's SkipLayerNorm).

Inside the block the residual stream goes attention -> add -> LayerNorm twice (before cross-attention and
before the feed-forward); each add and each norm reads and writes the whole (tokens, channels) stream.
kernels/layernorm.layer_norm(x, residual=r) returns both the sum and its normalization from one read of x and r.
The block's last residual add goes into the feed-forward's output GEMM: the second sum is written with that
layer's bias already added, and the GEMM accumulates onto it in place (cuBLAS reads it as its C matrix), so
no pass of its own is left. SD1.5 has 16 such blocks, SDXL 70.

Covered: diffusers' plain text-to-image block (norm_type "layer_norm", self- and cross-attention, no positional
embedding, no GLIGEN, feed-forward not chunked) and ComfyUI's (its forward restated for calls without
transformer patches: no ff_in, self-attention in attn1, cross-attention in attn2, residual feed-forward), and
ldm's and sgm's (A1111's classes: self-attention in attn1, cross-attention in attn2) where the Triton kernels run; any other call runs the block's own forward. The attention modules are still called.
"""

from __future__ import annotations

import torch
from torch import nn

from .base import (COMFY_ATTENTION, Undo, changed_host_block, comfy_forward, kernel_module, patch_forward, plain_linear,
                   plain_weights)
from .registry import fusion

# what _comfy_covered and _body read of ComfyUI's block, and the forward _comfy_forward restates
COMFY_ATTRS = ("ff_in", "disable_self_attn", "switch_temporal_ca_to_sa", "is_res", "attn1", "attn2", "norm1", "norm2",
               "norm3", "ff")
COMFY_PARAMS = ("x", "context", "transformer_options")


def _plain_norms(*norms: nn.Module) -> bool:
    return all(isinstance(n, nn.LayerNorm) and n.elementwise_affine and plain_weights(n) for n in norms)


def _covered(m: nn.Module) -> bool:
    return (m.norm_type == "layer_norm" and m.pos_embed is None and m.attn2 is not None
            and not m.only_cross_attention and m._chunk_size is None and _plain_norms(m.norm2, m.norm3))


def _comfy_covered(m: nn.Module) -> bool:
    """ComfyUI's BasicTransformerBlock in the text-to-image form (its forward restated in _comfy_forward)."""
    return (not m.ff_in and not m.disable_self_attn and m.attn2 is not None and not m.switch_temporal_ca_to_sa
            and m.is_res and _plain_norms(m.norm2, m.norm3))


def _forward(self, hidden_states, attention_mask=None, encoder_hidden_states=None, encoder_attention_mask=None,
             timestep=None, cross_attention_kwargs=None, class_labels=None, added_cond_kwargs=None):
    layernorm = kernel_module("layernorm")
    kwargs = dict(cross_attention_kwargs or {})
    if hidden_states.dim() != 3 or "gligen" in kwargs or not _covered(self) or not layernorm.supported(hidden_states):
        return type(self).forward(self, hidden_states, attention_mask, encoder_hidden_states, encoder_attention_mask,
                                  timestep, cross_attention_kwargs, class_labels, added_cond_kwargs)
    return _body(self, hidden_states, dict(encoder_hidden_states=None, attention_mask=attention_mask, **kwargs),
                 dict(encoder_hidden_states=encoder_hidden_states, attention_mask=encoder_attention_mask, **kwargs))


def _comfy_forward(self, x, context=None, transformer_options={}):  # noqa: B006 (ComfyUI's signature)
    # ComfyUI's forward, for calls without transformer patches
    layernorm = kernel_module("layernorm")
    if (x.dim() != 3 or transformer_options.get("patches") or transformer_options.get("patches_replace")
            or not _comfy_covered(self) or not layernorm.supported(x)):
        return type(self).forward(self, x, context, transformer_options)
    return _body(self, x, dict(context=None, value=None, transformer_options=transformer_options),
                 dict(context=context, value=None, transformer_options=transformer_options))


def _ldm_covered(m: nn.Module) -> bool:
    """ldm's or sgm's BasicTransformerBlock (A1111's classes) with a self-attention and a cross-attention."""
    return not m.disable_self_attn and m.attn2 is not None and _plain_norms(m.norm2, m.norm3)


def _ldm_forward(self, x, context=None, *args, **kwargs):
    # ldm's and sgm's _forward (sgm's forward hands _forward only x and context; other inputs take the block's own
    # forward)
    layernorm = kernel_module("layernorm")
    if args or kwargs or x.dim() != 3 or not _ldm_covered(self) or not layernorm.supported(x):
        return type(self).forward(self, x, context, *args, **kwargs)
    return _body(self, x, {"context": None}, {"context": context})


def _is_ldm_block(m: nn.Module) -> bool:
    return (type(m).__module__.startswith(("ldm.", "sgm.")) and hasattr(m, "_forward")
            and all(hasattr(m, a) for a in ("attn1", "attn2", "norm1", "norm2", "norm3", "ff", "disable_self_attn")))


def _body(self, x: torch.Tensor, first: dict, second: dict) -> torch.Tensor:
    """What the three forwards share once the call is covered: attn1 (called with the host's arguments `first`), + x,
    norm2, attn2 (with `second`), + x, norm3, feed-forward, + x."""
    n = self.attn1(_norm1(self, x), **first)
    n2, h = kernel_module("layernorm").layer_norm(n, self.norm2.weight, self.norm2.bias, self.norm2.eps, residual=x)
    return _feed_forward(self, self.attn2(n2, **second), h)


def _norm1(self, x):
    # The block's first norm has no residual to fuse, but torch's LayerNorm kernel reaches about half the copy
    # bandwidth at SD shapes; the Triton one serves it in one read and one write.
    if _plain_norms(self.norm1):
        return kernel_module("layernorm").layer_norm(x, self.norm1.weight, self.norm1.bias, self.norm1.eps)
    return self.norm1(x)


def _feed_forward(self, attn, h):
    """norm3(attn + h), the feed-forward, + (attn + h): with the output bias and residual in the GEMM when it can."""
    layernorm = kernel_module("layernorm")
    out = _plain_output_linear(self.ff, attn.dtype)
    if out is None:
        n3, h = layernorm.layer_norm(attn, self.norm3.weight, self.norm3.bias, self.norm3.eps, residual=h)
        return self.ff(n3) + h
    n3, h = layernorm.layer_norm(attn, self.norm3.weight, self.norm3.bias, self.norm3.eps, residual=h,
                                 sum_bias=out.bias)
    inner = self.ff.net[1](self.ff.net[0](n3))
    return h.view(-1, h.shape[-1]).addmm_(inner.reshape(-1, inner.shape[-1]), out.weight.t()).view(h.shape)


def _plain_output_linear(ff: nn.Module, dtype: torch.dtype) -> nn.Linear | None:
    """The output Linear of a diffusers or ComfyUI FeedForward (act, dropout, Linear) that computes x @ W.T + b and
    nothing else (`plain_linear`), with a bias and the dtype of the block, else None."""
    net = getattr(ff, "net", None)
    if net is None or len(net) != 3 or not isinstance(net[1], nn.Dropout) or (ff.training and net[1].p):
        return None
    out = net[2]
    return out if plain_linear(out) and out.bias is not None and out.weight.dtype == dtype else None


def _is_comfy_block(m: nn.Module) -> bool:
    return (all(hasattr(m, a) for a in ("ff_in", "disable_self_attn", "switch_temporal_ca_to_sa", "is_res"))
            and comfy_forward(m))


@fusion("skip_layernorm")
def apply(model: nn.Module, undo: Undo) -> int:
    n = 0
    for m in model.modules():
        if type(m).__name__ != "BasicTransformerBlock" \
                or changed_host_block(m, "BasicTransformerBlock", COMFY_ATTENTION, COMFY_ATTRS, COMFY_PARAMS):
            continue
        if hasattr(m, "norm_type") and _covered(m):
            patch_forward(m, _forward, undo)
            n += 1
        elif _is_comfy_block(m) and _comfy_covered(m):
            patch_forward(m, _comfy_forward, undo)
            n += 1
        elif _is_ldm_block(m) and _ldm_covered(m):
            patch_forward(m, _ldm_forward, undo)
            n += 1
    return n

"""SD3/SD3.5's joint blocks (ComfyUI's comfy.ldm.modules.diffusionmodules.mmdit) with the DiT kernels.

A JointBlock runs its context and image halves as one forward here: one adaLN pass per stream into its qkv
projection; one pass per stream that writes q, k (RMS-normalized where the model has qk norm, SD3.5) and v at their
place in the joint sequence (no concatenation); the attention (SDPA, or the function ComfyUI chose for the whole host
where it was timed faster: accel/engine/host_attention.py); per stream one pass that adds the gated attention output and
normalizes and modulates the sum for the MLP, the tanh GELU, and an in-place gated residual. MMDiT-X blocks (SD3.5
medium's first 13) add their image-only attention's gated output before that pass. ComfyUI's activation
checkpointing around the block does nothing at inference and is skipped.

Calls it does not cover run the block's own forward: an attention override or another node's attention function in
ComfyUI, Linear layers with per-call weight functions (lowvram), a tensor the kernels cannot run on. The projections
run as fp8 products where accel/engine/fp8.py marked them. Blocks of
other layouts (RMSNorm blocks, scale-only modulation, SwiGLU, LayerNorm qk norm) keep their forward.
"""

from __future__ import annotations

from torch import nn

from .base import Undo, comfy_attention, host_block, kernel_module, patch_forward, reads_comfy_attention
from .registry import fusion
from .. import fp8
from .transformer import (EPS, Joint, gated_mlp, gated_residual_, kernels_run_on, linears, modulated_norm, norm_weight,
                          part, project_part)

MODULE = "comfy.ldm.modules.diffusionmodules.mmdit"

# JointBlock.forward hands (*args, **kwargs) to block_mixing with its two halves: the fused forward restates that call
JOINT_ATTRS = ("context_block", "x_block")
JOINT_PARAMS = ("args", "kwargs")
# what the fused forward reads of each half (a DismantledBlock, whose own forward it does not call)
HALF_ATTRS = ("attn", "adaLN_modulation", "pre_only", "x_block_self_attn", "scale_mod_only", "norm1")
FINAL_ATTRS = ("adaLN_modulation", "linear", "norm_final")


def _attention_layers(a: nn.Module) -> list:
    return [a.qkv] + ([a.proj] if not a.pre_only else [])


def _qk_weights(a: nn.Module, x) -> tuple:
    if type(a.ln_q).__name__ == "Identity":
        return None, None
    return norm_weight(a.ln_q.weight, x), norm_weight(a.ln_k.weight, x)


def _half_covered(b: nn.Module) -> bool:
    """A DismantledBlock of the layout the fused forward restates."""
    own = HALF_ATTRS + (("attn2",) if getattr(b, "x_block_self_attn", False) else ()) \
        + (("mlp",) if not getattr(b, "pre_only", True) else ())
    if not host_block(b, "DismantledBlock", MODULE, own, ("x", "c")):
        return False
    attns = [b.attn] + ([b.attn2] if b.x_block_self_attn else [])
    layers = [b.adaLN_modulation[1]] + [layer for a in attns for layer in _attention_layers(a)]
    if not b.pre_only:
        if type(b.mlp).__name__ != "Mlp" or getattr(b.mlp.act, "approximate", None) != "tanh":
            return False
        layers += [b.mlp.fc1, b.mlp.fc2]
    norms_ok = all(type(a.ln_q).__name__ == "Identity" or (type(a.ln_q).__name__ == "RMSNorm"
                                                            and a.ln_q.weight is not None) for a in attns)
    return (not b.scale_mod_only and isinstance(b.norm1, nn.LayerNorm) and not b.norm1.elementwise_affine
            and norms_ok and linears(*layers))


def _joint_forward(self, context, x, c, use_checkpoint=False, transformer_options={}):  # noqa: B006
    if (comfy_attention(MODULE, transformer_options) is None or not kernels_run_on(x) or context.dtype != x.dtype
            or context.shape[0] != x.shape[0]):
        return type(self).forward(self, context, x, c=c, use_checkpoint=use_checkpoint,
                                  transformer_options=transformer_options)
    cb, xb = self.context_block, self.x_block
    (B, Lx, _), Lc, H = x.shape, context.shape[1], xb.attn.num_heads
    cm = cb.adaLN_modulation(c).chunk(2 if cb.pre_only else 6, dim=1)
    xm = xb.adaLN_modulation(c).chunk(9 if xb.x_block_self_attn else 6, dim=1)
    norms = [_qk_weights(cb.attn, x), _qk_weights(xb.attn, x)]
    joint = Joint(MODULE, B, Lc + Lx, H, x, (cb.attn.qkv, xb.attn.qkv), norms,
                  tuple(b.attn.proj for b in (cb, xb) if not b.attn.pre_only))
    for (block, stream, mods, offset), norm in zip(((cb, context, cm, 0), (xb, x, xm, Lc)), norms):
        joint.write(fp8.project(block.attn.qkv, modulated_norm(stream, mods[1], mods[0], block.attn.qkv)), offset,
                    norm)
    out = joint.attend()
    if not cb.pre_only:
        y, context = gated_mlp(context, project_part(out, 0, Lc, cb.attn.proj), cm[2], cm[4],
                               cm[3], cb.mlp.fc1, cb.mlp.fc2)
        gated_residual_(context, cm[5], y)
    else:
        context = None
    update = project_part(out, Lc, Lc + Lx, xb.attn.proj)
    if xb.x_block_self_attn:  # MMDiT-X: a second, image-only attention from the same norm with its own modulation
        norm = _qk_weights(xb.attn2, x)
        own = Joint(MODULE, B, Lx, H, x, (xb.attn2.qkv,), [norm], (xb.attn2.proj,))
        own.write(fp8.project(xb.attn2.qkv, modulated_norm(x, xm[7], xm[6], xb.attn2.qkv)), 0, norm)
        x = gated_residual_(x.clone(), xm[8], fp8.project(xb.attn2.proj, part(own.attend(), 0, None, xb.attn2.proj)))
    y, x = gated_mlp(x, update, xm[2], xm[4], xm[3], xb.mlp.fc1, xb.mlp.fc2)
    gated_residual_(x, xm[5], y)
    return context, x


def _final_forward(self, x, c):
    if not kernel_module("adaln").supported(x):
        return type(self).forward(self, x, c)
    shift, scale = self.adaLN_modulation(c).chunk(2, dim=1)
    return self.linear(kernel_module("adaln").modulated_layer_norm(x, scale, shift, EPS))


@fusion("mmdit")
def apply(model: nn.Module, undo: Undo) -> int:
    n, joint = 0, False
    for m in model.modules():
        if host_block(m, "JointBlock", MODULE, JOINT_ATTRS, JOINT_PARAMS):
            if not (_half_covered(m.context_block) and _half_covered(m.x_block)) \
                    or m.context_block.x_block_self_attn:
                continue
            patch_forward(m, _joint_forward, undo)
            joint = True
        elif host_block(m, "FinalLayer", MODULE, FINAL_ATTRS, ("x", "c")) and linears(m.linear) \
                and not m.norm_final.elementwise_affine:
            patch_forward(m, _final_forward, undo)
        else:
            continue
        n += 1
    if joint:
        reads_comfy_attention(MODULE)
    return n

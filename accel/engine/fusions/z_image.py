"""Z-Image's blocks and output layer (ComfyUI 0.33's comfy.ldm.lumina.model: NextDiT's JointTransformerBlock and
FinalLayer, as its supported_models.ZImage builds them) with the DiT kernels.

A Z-Image block is a single stream over the text and image tokens, already joined by the model (its context refiner
blocks run over the text alone, its noise refiner blocks over the image alone: the same class), with none of the
shared patterns' adaLN: sandwich RMSNorms with weights before and after the attention and the MLP, a modulation of
scale only (x * (1 + scale)), gates through tanh, and a SiLU-gated MLP of separate w1 and w3 projections. So it is a
pattern of its own (docs/engineering.md), built from the shared pieces: the attention is transformer.Joint (one pass
that RMS-normalizes q and k per head with the norms' weights, rotates them and writes q, k and v in the attention's
layout, where ComfyUI splits, normalizes, rotates and copies k and v once more for grouped heads; then SDPA, the
fastest kernel timed at the shape, ComfyUI's own attention where it was timed faster, or fp8 attention); w1 and w3
are packed into one GEMM (packing.py), SiLU-gated between it and w2 in one pass (kernels/swiglu.py: rounded and
kept finite in float16 as ComfyUI computes it); in a modulated block the attention's pre-norm times (1 + scale) is one
adaLN pass (kernels/adaln.py, RMS with the norm's weight), and so are the attention's post-norm, its gated residual
and the MLP's pre-norm times (1 + scale), each handing its projections 8-bit rows quantized in the same pass where
they make 8-bit products; the MLP's post-norm runs as the host's module, its gated residual added in place (the next
block's pre-norm needs that block's modulation); the output layer's LayerNorm and scale are one adaLN pass. The
context refiner's blocks (no modulation) run their norms as the host's modules. The projections run as fp8 (or int8)
products where accel/engine/fp8.py marked them (the `precision` option), a product per layer.

A call it does not cover runs the block's own forward: an attention mask, Z-Image Omni's reference images
(timestep_zero_index), an attention override or another node's attention function in ComfyUI, a rotary table of
another shape or dtype, a tensor the kernels cannot run on. Blocks with grouped k/v heads (Lumina 2's own form), norms
other than torch's RMSNorm, per-call weight functions (lowvram, a LoRA applied per call), or a class that has changed
(host_block: its attention and MLP classes are read too) keep their forward.
"""

from __future__ import annotations

import torch
from torch import nn

from .. import fp8
from . import packing
from .base import (Undo, comfy_attention, host_block, kernel_module, own_weights, patch_forward,
                   reads_comfy_attention)
from .registry import fusion
from .transformer import (EPS, Joint, gated_residual_, kernels_run_on, linears, modulated_norm, norm_weight, part,
                          plain_layer_norms, project_packed, rms_eps, swiglu)

LUMINA = "comfy.ldm.lumina.model"
ATTENTION = "optimized_attention_masked"  # the function of LUMINA that its JointAttention calls

# what the fused forwards read of each class, and the forms of forward they restate
BLOCK_ATTRS = ("attention", "feed_forward", "attention_norm1", "attention_norm2", "ffn_norm1", "ffn_norm2",
               "modulation")
BLOCK_PARAMS = ("x", "x_mask", "freqs_cis", "adaln_input", "timestep_zero_index", "transformer_options")
ATTENTION_ATTRS = ("qkv", "out", "q_norm", "k_norm", "qk_norm", "n_local_heads", "n_local_kv_heads", "head_dim")
ATTENTION_PARAMS = ("x", "x_mask", "freqs_cis", "transformer_options")
MLP_ATTRS = ("w1", "w2", "w3")
FINAL_ATTRS = ("norm_final", "linear", "adaLN_modulation")
FINAL_PARAMS = ("x", "c", "timestep_zero_index")


def _clamp16(x: torch.Tensor) -> torch.Tensor:
    """ComfyUI's clamp_fp16: float16 values kept finite."""
    return torch.nan_to_num(x, nan=0.0, posinf=65504, neginf=-65504) if x.dtype == torch.float16 else x


def _fused(self: nn.Module, x: torch.Tensor, x_mask, freqs_cis, adaln_input, timestep_zero_index,
           transformer_options: dict | None) -> bool:
    """Whether the kernels serve a block call: no mask, no reference images, the rotary table of these tokens as the
    model makes it ((B|1, L, 1, head_dim / 2, 2, 2), Flux's layout with the heads and tokens axes swapped), a
    modulation input exactly where the block is modulated, one row per sample."""
    a = self.attention
    L = x.shape[1] if x.dim() == 3 else -1
    modulated = self.modulation not in (False, None)
    return (x_mask is None and timestep_zero_index is None and modulated == (adaln_input is not None)
            and (adaln_input is None or (adaln_input.dim() == 2 and adaln_input.shape[0] in (1, x.shape[0])))
            and isinstance(freqs_cis, torch.Tensor) and freqs_cis.dim() == 6
            and freqs_cis.shape[0] in (1, x.shape[0]) and freqs_cis.shape[1:] == (L, 1, a.head_dim // 2, 2, 2)
            and freqs_cis.dtype in (torch.float32, x.dtype) and kernels_run_on(x)
            and comfy_attention(LUMINA, transformer_options, ATTENTION) is not None)


def _attention(a: nn.Module, h: torch.Tensor | fp8.Rows, pe: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """JointAttention's output for its input h (a tensor, or Rows quantized for qkv) of the stream x; pe in Flux's
    layout (B|1, 1, L, head_dim / 2, 2, 2)."""
    B, L, _ = x.shape
    qkv = fp8.project(a.qkv, h)
    norm = ((norm_weight(a.q_norm.weight, qkv), norm_weight(a.k_norm.weight, qkv)) if a.qk_norm else (None, None))
    # ComfyUI's inference path takes q_norm's eps for both, float32's machine epsilon where it has none
    eps = a.q_norm.eps if a.qk_norm and a.q_norm.eps is not None else torch.finfo(torch.float32).eps
    joint = Joint(LUMINA, B, L, a.n_local_heads, x, (a.qkv,), [norm], (a.out,), ATTENTION)
    joint.write(qkv, 0, norm, eps, pe)
    return fp8.project(a.out, part(joint.attend(), 0, None, a.out))


def _mlp(ff: nn.Module, h: torch.Tensor | fp8.Rows) -> torch.Tensor:
    """FeedForward's w2(clamp_fp16(SiLU(w1 h) * w3 h)), w1 and w3 as one GEMM where they are packed."""
    return fp8.project(ff.w2, swiglu(project_packed((ff.w1, ff.w3), h), finite=True))


def _block_forward(self, x, x_mask, freqs_cis, adaln_input=None, timestep_zero_index=None,
                   transformer_options={}):  # noqa: B006 (ComfyUI's signature)
    if not _fused(self, x, x_mask, freqs_cis, adaln_input, timestep_zero_index, transformer_options):
        return type(self).forward(self, x, x_mask, freqs_cis, adaln_input, timestep_zero_index, transformer_options)
    pe = freqs_cis.transpose(1, 2)
    a, ff = self.attention, self.feed_forward
    if adaln_input is None:  # the context refiner's blocks: no modulation, no gates
        x = x + self.attention_norm2(_clamp16(_attention(a, self.attention_norm1(x), pe, x)))
        return x.add_(self.ffn_norm2(_mlp(ff, self.ffn_norm1(x))))
    scale_msa, gate_msa, scale_mlp, gate_mlp = self.adaLN_modulation(adaln_input).chunk(4, dim=1)
    # the pre-norm times (1 + scale), quantized for qkv where it makes 8-bit products: one pass
    h = _pre_norm(x, self.attention_norm1, scale_msa, a.qkv)
    attention = _clamp16(_attention(a, h, pe, x))
    # the post-norm, the gated residual and the MLP's pre-norm: one pass, the stream a new tensor (x is the caller's)
    h, x = _pre_norm(x, self.ffn_norm1, scale_mlp, ff.w1, ff.w3, update=attention, gate=gate_msa.tanh(),
                     update_norm=self.attention_norm2)
    return gated_residual_(x, gate_mlp.tanh(), self.ffn_norm2(_clamp16(_mlp(ff, h))))


def _pre_norm(x: torch.Tensor, norm: nn.Module, scale: torch.Tensor, *consumers: nn.Module, **update):
    """norm(x) * (1 + scale) for `consumers` (kernels/adaln.py: Rows where they make 8-bit products), after
    x + gate * update_norm(update) where given (then with that stream)."""
    return modulated_norm(x, scale, None, *consumers, rms=True, eps=rms_eps(norm, x),
                          weight=norm_weight(norm.weight, x), **update)


def _final_forward(self, x, c, timestep_zero_index=None):
    if timestep_zero_index is not None or not kernel_module("adaln").supported(x):
        return type(self).forward(self, x, c, timestep_zero_index)
    return self.linear(kernel_module("adaln").modulated_layer_norm(x, self.adaLN_modulation(c), None, EPS))


def _rms_norms(*norms: nn.Module) -> bool:
    """torch's RMSNorm modules (ComfyUI's subclass included) with weights: the fused forward calls them, and reads a
    q/k norm's weight and eps."""
    return all(isinstance(n, nn.RMSNorm) and n.weight is not None for n in norms)


def _attention_covered(a: nn.Module) -> bool:
    if not host_block(a, "JointAttention", LUMINA, ATTENTION_ATTRS, ATTENTION_PARAMS):
        return False
    if a.qk_norm:
        norms = _rms_norms(a.q_norm, a.k_norm) and all(
            tuple(n.normalized_shape) == (a.head_dim,) and own_weights(n) for n in (a.q_norm, a.k_norm))
    else:
        norms = type(a.q_norm) is nn.Identity and type(a.k_norm) is nn.Identity
    # grouped k/v heads (Lumina 2's 8 for 24) are not the packed q, k and v of one width the kernel reads
    return (norms and a.n_local_heads == a.n_local_kv_heads and a.head_dim % 2 == 0 and linears(a.qkv, a.out)
            and a.qkv.out_features == 3 * a.n_local_heads * a.head_dim)


def _block_covered(m: nn.Module) -> bool:
    ff = m.feed_forward
    return (_attention_covered(m.attention) and host_block(ff, "FeedForward", LUMINA, MLP_ATTRS, ("x",))
            and linears(ff.w1, ff.w2, ff.w3) and ff.w1.out_features == ff.w3.out_features
            and _rms_norms(m.attention_norm1, m.attention_norm2, m.ffn_norm1, m.ffn_norm2)
            and (m.modulation in (False, None) or hasattr(m, "adaLN_modulation")))


@fusion("z_image")
def apply(model: nn.Module, undo: Undo) -> int:
    n, blocks = 0, False
    for m in model.modules():
        if host_block(m, "JointTransformerBlock", LUMINA, BLOCK_ATTRS, BLOCK_PARAMS):
            if not _block_covered(m):
                continue
            patch_forward(m, _block_forward, undo)
            packing.pack_same_width(model, [m.feed_forward.w1, m.feed_forward.w3], undo)
            blocks = True
        elif host_block(m, "FinalLayer", LUMINA, FINAL_ATTRS, FINAL_PARAMS) and linears(m.linear) \
                and plain_layer_norms(m.norm_final):
            patch_forward(m, _final_forward, undo)
        else:
            continue
        n += 1
    if blocks:
        reads_comfy_attention(LUMINA, ATTENTION)
    return n

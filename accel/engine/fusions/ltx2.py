"""LTX-2's blocks (ComfyUI 0.33's comfy.ldm.lightricks.av_model.BasicAVTransformerBlock, as its supported_models.LTXAV
builds them for LTX-2) with the DiT pieces.

An LTX-2 block runs two streams, video and audio, each with a self-attention, a cross attention to its own text and an
MLP, and between them two cross attentions (audio to video, video to audio). None of the shared patterns fits it:
they normalize with a LayerNorm, where LTX-2 normalizes by the RMS alone, and its attentions are of four kinds per
stream. So it is a pattern of its own (docs/engineering.md), restated in ComfyUI's
order (the streams are updated in place, so the order is the numerics) from the shared pieces and ComfyUI's own:

- the video stream's RMS norms (modulated, as comfy-kitchen's rms_adaln that ComfyUI 0.33 calls, or plain before its
  text attention) are kernels/adaln.py's pass in its RMS form: it adds the residual ComfyUI adds just before (in place),
  and quantizes the output for the fp8 products that read it; the audio stream's (a few hundred tokens) are ComfyUI's;
- a self-attention's q/k RMSNorm (over all heads, as Wan's) and split rotary embedding (a table per token and head that
  pairs each head's halves) are one pass that writes q, k and v in the attention's layout (transformer.Joint,
  kernels/qk_rope.py's qk_row_norm_split_rope), in e4m3 where fp8 attention takes the sequence; an audio-video
  attention's q and k each one such pass (row_norm_split_rope), in 16 bits; the text attentions' norms are ComfyUI's;
- a self-attention's q, k and v are one GEMM and a cross attention's k and v another (packing.pack_same_width), or a
  product each as fp8 products where accel/engine/fp8.py marked the projections (the `precision` option);
- the attention is transformer.comfy_sdpa: the fastest 16-bit kernel timed at the shape (PyTorch's SDPA,
  FlashAttention-4 or -3), or ComfyUI's own attention where it was timed faster; a self-attention's runs in fp8 where
  accel/engine/fp8_attention.py takes it;
- the MLP is transformer.mlp: the tanh GELU in the first product's epilogue (16 bits) or in the pass that quantizes the
  second's input (fp8);
- the other gated residuals (the video MLP's, the audio stream's) are kernels/adaln.py's gated_add_, in place.

A call it does not cover runs the block's own forward: an attention mask (guiding latents' self-attention mask, a text
mask), modulation per token or per frame (a denoise mask, keyframes), a stream switched off or empty (audio-only or
video-only runs, run_vx / run_ax, a2v / v2a cross attention off), STG's perturbed self-attention, an attention override
or another node's attention function in ComfyUI, a tensor the kernels cannot run on. Blocks of LTX-2.3's form (gated
attention, cross-attention adaLN), with per-call weight functions (lowvram, a LoRA applied per call) or whose classes
have changed (host_block: the attention and MLP classes are read too) keep their forward.
"""

from __future__ import annotations

import inspect
import sys

import torch
from torch import nn

from .. import fp8
from . import packing
from .base import (Undo, comfy_attention, host_block, kernel_module, of_class, own_weights, patch_forward,
                   reads_comfy_attention)
from .registry import fusion
from .transformer import (Joint, comfy_sdpa, gated_residual_, linears, mlp, modulated_norm, norm_weight, part,
                          project_packed)

LTX = "comfy.ldm.lightricks"  # the package of its classes
AV_MODEL = "comfy.ldm.lightricks.av_model"
ATTENTION = "comfy.ldm.modules.attention"  # whose optimized_attention its CrossAttention calls

# what the fused forward reads of each class, and the forms of forward it restates
BLOCK_ATTRS = ("attn1", "attn2", "audio_attn1", "audio_attn2", "audio_to_video_attn", "video_to_audio_attn", "ff",
               "audio_ff", "scale_shift_table", "audio_scale_shift_table", "scale_shift_table_a2v_ca_audio",
               "scale_shift_table_a2v_ca_video", "cross_attention_adaln")
BLOCK_PARAMS = ("x", "v_context", "a_context", "attention_mask", "v_timestep", "a_timestep", "v_pe", "a_pe",
                "v_cross_pe", "a_cross_pe", "v_cross_scale_shift_timestep", "a_cross_scale_shift_timestep",
                "v_cross_gate_timestep", "a_cross_gate_timestep", "transformer_options", "self_attention_mask",
                "v_prompt_timestep", "a_prompt_timestep")
ATTENTION_ATTRS = ("heads", "dim_head", "q_norm", "k_norm", "to_q", "to_k", "to_v", "to_out", "to_gate_logits")
ATTENTION_PARAMS = ("x", "context", "mask", "pe", "k_pe", "transformer_options")
MLP_ATTRS = ("net",)
ATTENTIONS = ("attn1", "attn2", "audio_attn1", "audio_attn2", "audio_to_video_attn", "video_to_audio_attn")
# transformer_options entries by which nodes switch parts of a block off or perturb them (ComfyUI's defaults: none)
SWITCHES = ("run_vx", "run_ax", "a2v_cross_attn", "v2a_cross_attn", "stg_skip_self_attn")
# LTXAVModel's method that runs the blocks (CUDA graphs capture it alone: accel/engine/stack_graphs.py), what it takes,
# the arguments that carry the call's tensors, and ComfyUI's class of per-frame timesteps they may hold
STACK_METHOD = "_process_transformer_blocks"
STACK_PARAMS = ("self", "x", "context", "attention_mask", "timestep", "pe", "transformer_options",
                "self_attention_mask", "kwargs")
STACK_TREES = ("x", "context", "timestep", "pe")
SLOTTED = ("CompressedTimestep",)


def _host(name: str):
    """ComfyUI's module `name` as its blocks call it (common_dit's rms_norm, model's rope)."""
    return sys.modules[name]


def _per_sample(t) -> bool:
    """A timestep embedding with one row per sample (a plain call's), (B, 1, n * C): a tensor, or ComfyUI's
    CompressedTimestep holding one."""
    data = getattr(t, "data", t) if type(t).__name__ == "CompressedTimestep" else t
    return isinstance(data, torch.Tensor) and data.dim() == 3 and data.shape[1] == 1 \
        and getattr(t, "patches_per_frame", 1) == 1


def _ada(table: torch.Tensor, t, x: torch.Tensor, indices: slice) -> tuple[torch.Tensor, ...]:
    """The block's modulation values `indices` of table + t, (B, 1, C) each, as ComfyUI's get_ada_values adds them."""
    data = t.data if type(t).__name__ == "CompressedTimestep" else t
    n = table.shape[0]
    rows = data.reshape(x.shape[0], 1, n, -1)[:, :, indices, :]
    return (table[indices].unsqueeze(0).unsqueeze(0).to(device=data.device, dtype=data.dtype) + rows).unbind(dim=2)


def _fused(vx: torch.Tensor, ax: torch.Tensor, attention_mask, self_attention_mask, timesteps,
           transformer_options: dict | None) -> bool:
    """Whether the fused forward serves a block call: both streams present, no mask, modulation per sample, nothing
    switched off or perturbed, ComfyUI's attention chosen for the whole host, tensors the kernels run on (the video
    stream contiguous: its norms update it in place), not training
    (ComfyUI's forward then takes other paths)."""
    options = transformer_options or {}
    mm = _host("comfy.model_management")
    return (attention_mask is None and self_attention_mask is None and not any(k in options for k in SWITCHES)
            and vx.dim() == 3 and ax.dim() == 3 and vx.is_contiguous() and vx.numel() > 0 and ax.numel() > 0
            and vx.shape[0] == ax.shape[0] and all(_per_sample(t) for t in timesteps)
            and not mm.in_training and kernel_module("adaln").supported(vx) and kernel_module("adaln").supported(ax)
            and comfy_attention(ATTENTION, options) is not None)


def _rope(q: torch.Tensor, k: torch.Tensor, pe, k_pe) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k rotated as ComfyUI's CrossAttention rotates them."""
    model = _host(f"{LTX}.model")
    if pe is None:
        return q, k
    if k_pe is None and q.shape == k.shape:
        return model.apply_rotary_emb_qk(q, k, pe)
    return model.apply_rotary_emb(q, pe), model.apply_rotary_emb(k, pe if k_pe is None else k_pe)


def _attention(a: nn.Module, x: torch.Tensor, context: torch.Tensor | None, pe=None, k_pe=None) -> torch.Tensor:
    """ComfyUI's CrossAttention of x (to context; to itself where None) without mask or gates: the projections packed or
    in fp8, the attention comfy_sdpa's; a self-attention rotated by a split table normalizes, rotates and lays out q,
    k and v in one pass (Joint, in fp8 where fp8 attention takes it), an audio-video attention its q and k in one pass
    each (_norm_rope); the text attentions run ComfyUI's norms (they are not rotated)."""
    if context is None:  # self-attention: q, k and v of one input
        projected = project_packed((a.to_q, a.to_k, a.to_v), x)
        q, k, v = projected.chunk(3, dim=-1) if isinstance(projected, torch.Tensor) else projected
        if _split_table(pe, q, a.heads) and kernel_module("qk_rope").supported(q):
            B, L = x.shape[:2]
            norm = tuple(norm_weight(n.weight, q) for n in (a.q_norm, a.k_norm))
            joint = Joint(ATTENTION, B, L, a.heads, q, (a.to_q, a.to_k, a.to_v), [norm], (a.to_out[0],))
            joint.write_split_rows((q, k, v), norm, _eps(a.q_norm, q), pe[0])
            return fp8.project(a.to_out[0], part(joint.attend(), 0, None, a.to_out[0]))
    else:
        q = fp8.project(a.to_q, x)
        projected = project_packed((a.to_k, a.to_v), context)
        k, v = projected.chunk(2, dim=-1) if isinstance(projected, torch.Tensor) else projected
    B, H = q.shape[0], a.heads
    heads = lambda t: t.reshape(B, t.shape[1], H, -1)  # noqa: E731
    if context is not None and pe is not None:  # the audio-video attentions: q and k rotated by tables of their own
        q, k = _norm_rope(q, a.q_norm, pe, H), _norm_rope(k, a.k_norm, pe if k_pe is None else k_pe, H)
    else:
        q, k = _rope(a.q_norm(q), a.k_norm(k), pe, k_pe)
    out = comfy_sdpa(ATTENTION, heads(q), heads(k), heads(v))
    return fp8.project(a.to_out[0], out)


def _norm_rope(t: torch.Tensor, norm: nn.Module, table, heads: int) -> torch.Tensor:
    """A cross attention's q or k normalized (ComfyUI's q_norm / k_norm, over all heads) and rotated by `table`, as
    (B, L, heads, head_dim): in one pass (kernels/qk_rope.py) where the table is LTX-2's split one, else by ComfyUI's
    calls."""
    if _split_table(table, t, heads) and kernel_module("qk_rope").supported(t):
        B, L, C = t.shape
        out = torch.empty(B, L, heads, C // heads, dtype=t.dtype, device=t.device)
        kernel_module("qk_rope").row_norm_split_rope(t, heads, out, norm_weight(norm.weight, t), _eps(norm, t),
                                                     table[0])
        return out
    return _host(f"{LTX}.model").apply_rotary_emb(norm(t), table)


def _eps(norm: nn.Module, t: torch.Tensor) -> float:
    """An RMSNorm's epsilon for inputs like t: its own, or nn.RMSNorm's default where it has none."""
    return norm.eps if norm.eps is not None else torch.finfo(t.dtype).eps


def _split_table(pe, q: torch.Tensor, heads: int) -> bool:
    """Whether pe is LTX-2's split rotary table for q's tokens, (B|1, L, heads, head_dim / 2, 2, 2), in float32 or
    q's dtype (ComfyUI's (table, split) pair)."""
    if not (isinstance(pe, (tuple, list)) and len(pe) == 2 and pe[1] is True and isinstance(pe[0], torch.Tensor)):
        return False
    table = pe[0]
    return (table.dim() == 6 and table.shape[0] in (1, q.shape[0])
            and tuple(table.shape[1:]) == (q.shape[1], heads, q.shape[-1] // heads // 2, 2, 2)
            and table.dtype in (torch.float32, q.dtype) and table.device == q.device)


def _video_norm(vx: torch.Tensor, scale: torch.Tensor | None, shift: torch.Tensor | None, *consumers: nn.Module,
                update: torch.Tensor | None = None, gate: torch.Tensor | None = None):
    """The video stream's RMS norm, modulated as ComfyUI's rms_adaln (plain where scale is None), as one pass of
    kernels/adaln.py that quantizes it for the fp8 products of `consumers` where they take it; with `update`, vx +=
    (gate *) update in place first, as ComfyUI adds a residual before the norm that reads it."""
    out = modulated_norm(vx, scale, shift, *consumers, update=update, gate=gate, rms=True, in_place=update is not None)
    return out if update is None else out[0]


def _audio_norm(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """ComfyUI's modulated RMS norm of the audio stream (its own rms_norm, then the modulation)."""
    return _host("comfy.ldm.common_dit").rms_norm(x) * (1 + scale) + shift


def _text(a: nn.Module, x: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
    """A stream's cross attention to its text (no modulation in LTX-2's form)."""
    return _attention(a, _host("comfy.ldm.common_dit").rms_norm(x), context)


def _block_forward(self, x, v_context=None, a_context=None, attention_mask=None, v_timestep=None, a_timestep=None,
                   v_pe=None, a_pe=None, v_cross_pe=None, a_cross_pe=None, v_cross_scale_shift_timestep=None,
                   a_cross_scale_shift_timestep=None, v_cross_gate_timestep=None, a_cross_gate_timestep=None,
                   transformer_options=None, self_attention_mask=None, v_prompt_timestep=None,
                   a_prompt_timestep=None):
    args = (x, v_context, a_context, attention_mask, v_timestep, a_timestep, v_pe, a_pe, v_cross_pe, a_cross_pe,
            v_cross_scale_shift_timestep, a_cross_scale_shift_timestep, v_cross_gate_timestep, a_cross_gate_timestep,
            transformer_options, self_attention_mask, v_prompt_timestep, a_prompt_timestep)
    vx, ax = x
    timesteps = (v_timestep, a_timestep, v_cross_scale_shift_timestep, a_cross_scale_shift_timestep,
                 v_cross_gate_timestep, a_cross_gate_timestep)
    if not _fused(vx, ax, attention_mask, self_attention_mask, timesteps, transformer_options):
        return type(self).forward(self, *args)
    rms_norm = _host("comfy.ldm.common_dit").rms_norm
    # video: self-attention; its text attention's input normalized in the pass that adds the self-attention's gated
    # output (ComfyUI's addcmul_, then rms_norm); the text attention's output added in the next pass of vx
    shift, scale, gate = _ada(self.scale_shift_table, v_timestep, vx, slice(0, 3))
    a = self.attn1
    attn1 = _attention(a, _video_norm(vx, scale, shift, a.to_q, a.to_k, a.to_v), None, v_pe)
    h = _video_norm(vx, None, None, self.attn2.to_q, update=attn1, gate=gate)
    text = _attention(self.attn2, h, v_context)
    # audio: self-attention, its text
    shift, scale, gate = _ada(self.audio_scale_shift_table, a_timestep, ax, slice(0, 3))
    gated_residual_(ax, gate, _attention(self.audio_attn1, _audio_norm(ax, scale, shift), None, a_pe))
    ax.add_(_text(self.audio_attn2, ax, a_context))
    # audio to video, then video to audio (the audio's norm taken before the first)
    ax_norm = rms_norm(ax)
    a_scale, a_shift, a_scale2, a_shift2 = _ada(self.scale_shift_table_a2v_ca_audio[:4], a_cross_scale_shift_timestep,
                                                ax, slice(None))
    v_scale, v_shift, v_scale2, v_shift2 = _ada(self.scale_shift_table_a2v_ca_video[:4], v_cross_scale_shift_timestep,
                                                vx, slice(None))
    a = self.audio_to_video_attn
    a2v = _attention(a, _video_norm(vx, v_scale, v_shift, a.to_q, update=text), ax_norm * (1 + a_scale) + a_shift,
                     v_cross_pe, a_cross_pe)
    gate = _ada(self.scale_shift_table_a2v_ca_video[4:], v_cross_gate_timestep, vx, slice(None))[0]
    a = self.video_to_audio_attn
    v2a = _attention(a, ax_norm * (1 + a_scale2) + a_shift2,
                     _video_norm(vx, v_scale2, v_shift2, a.to_k, a.to_v, update=a2v, gate=gate), a_cross_pe,
                     v_cross_pe)
    gate = _ada(self.scale_shift_table_a2v_ca_audio[4:], a_cross_gate_timestep, ax, slice(None))[0]
    gated_residual_(ax, gate, v2a)
    # the MLPs
    shift, scale, gate = _ada(self.scale_shift_table, v_timestep, vx, slice(3, 6))
    gated_residual_(vx, gate, _mlp(self.ff, _video_norm(vx, scale, shift, self.ff.net[0].proj)))
    shift, scale, gate = _ada(self.audio_scale_shift_table, a_timestep, ax, slice(3, 6))
    gated_residual_(ax, gate, _mlp(self.audio_ff, _audio_norm(ax, scale, shift)))
    return vx, ax


def _mlp(ff: nn.Module, h: torch.Tensor) -> torch.Tensor:
    """FeedForward's net[2](tanh-GELU(net[0].proj(h)))."""
    return mlp(h, ff.net[0].proj, ff.net[2])


def _attention_covered(a: nn.Module) -> bool:
    """ComfyUI's CrossAttention without per-head gates, with torch's RMSNorms over all heads as its q/k norms."""
    if not host_block(a, "CrossAttention", f"{LTX}.model", ATTENTION_ATTRS, ATTENTION_PARAMS):
        return False
    inner = a.heads * a.dim_head
    return (a.to_gate_logits is None and isinstance(a.to_out, nn.Sequential) and len(a.to_out) == 2
            and linears(a.to_q, a.to_k, a.to_v, a.to_out[0]) and a.to_q.out_features == inner
            and all(isinstance(n, nn.RMSNorm) and n.weight is not None and own_weights(n)
                    and tuple(n.normalized_shape) == (inner,) for n in (a.q_norm, a.k_norm)))


def _mlp_covered(ff: nn.Module) -> bool:
    """ComfyUI's FeedForward: GELU_approx(proj), Dropout, Linear."""
    if not host_block(ff, "FeedForward", f"{LTX}.model", MLP_ATTRS, ("x",)):
        return False
    net = ff.net
    return (isinstance(net, nn.Sequential) and len(net) == 3 and type(net[0]).__name__ == "GELU_approx"
            and hasattr(net[0], "proj") and linears(net[0].proj, net[2]))


def _block_covered(m: nn.Module) -> bool:
    return (not m.cross_attention_adaln and all(_attention_covered(getattr(m, name)) for name in ATTENTIONS)
            and _mlp_covered(m.ff) and _mlp_covered(m.audio_ff))


def _fused_block(m: nn.Module) -> bool:
    forward = vars(m).get("forward")
    return getattr(forward, "__func__", None) is _block_forward


def stack(model: nn.Module):
    """LTXAVModel's block stack as accel/engine/stack_graphs.py captures it, where every block is fused and the
    method takes what ComfyUI 0.33's does; None elsewhere (the model then runs without CUDA graphs)."""
    from ..stack_graphs import Stack

    method = getattr(type(model), STACK_METHOD, None)
    # a wrapper of the method (another node's, on the class or the model) decides per call in Python, which a graph
    # would freeze: only ComfyUI's own method is captured
    if not (of_class(model, "LTXAVModel", AV_MODEL, "transformer_blocks") and callable(method)
            and inspect.unwrap(method) is method and getattr(method, "__module__", None) == AV_MODEL
            and STACK_METHOD not in vars(model)
            and tuple(inspect.signature(method).parameters) == STACK_PARAMS and len(model.transformer_blocks)
            and all(_fused_block(b) for b in model.transformer_blocks)):
        return None
    return Stack(STACK_METHOD, STACK_TREES, SLOTTED, _stack_serves)


def _stack_serves(named: dict) -> bool:
    """Whether a graph may serve a call of the block stack: every block's call one the fused forward serves, no block
    replaced (patches_replace), perturbed (STG) or streamed in by ComfyUI's prefetch."""
    options = named["transformer_options"] or {}
    x, timestep = named["x"], named["timestep"]
    if not (isinstance(x, (list, tuple)) and len(x) == 2 and isinstance(timestep, (list, tuple))
            and len(timestep) == 5 and isinstance(timestep[2], (list, tuple))):
        return False
    return (not options.get("patches_replace", {}).get("dit") and not options.get("stg_self_attn_blocks")
            and not options.get("prefetch_dynamic_vbars")
            and _fused(x[0], x[1], named["attention_mask"], named["self_attention_mask"],
                       (timestep[0], timestep[1], *timestep[2]), options))


@fusion("ltx2", stack=stack)
def apply(model: nn.Module, undo: Undo) -> int:
    n = 0
    for m in model.modules():
        if not host_block(m, "BasicAVTransformerBlock", AV_MODEL, BLOCK_ATTRS, BLOCK_PARAMS) or not _block_covered(m):
            continue
        patch_forward(m, _block_forward, undo)
        for name in ATTENTIONS:
            a = getattr(m, name)
            if name in ("attn1", "audio_attn1"):
                packing.pack_same_width(model, [a.to_q, a.to_k, a.to_v], undo)
            else:
                packing.pack_same_width(model, [a.to_k, a.to_v], undo)
        n += 1
    if n:
        reads_comfy_attention(ATTENTION)
    return n

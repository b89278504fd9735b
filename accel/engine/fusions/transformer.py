"""What the diffusion transformers' fusions (flux, chroma, flux_diffusers, mmdit, wan, qwen_image, z_image, ltx2) share: the
call
conditions, the attention over the joint sequence (in fp8 where accel/engine/fp8_attention.py takes it), the gated
residual / modulated MLP steps of a DiT block, the double-stream block of joint text+image attention (Flux, Chroma,
Qwen-Image) and Flux's single block."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .. import flash3, flash4, fp8, fp8_attention
from ..attention import StandIn, sdpa_name
from . import packing
from .base import (comfy_attend, comfy_attention, comfy_function, host_block, kernel_module, linear_layer,
                   own_weights, plain_linear)

EPS = 1e-6  # the LayerNorms and RMSNorms of Flux and MMDiT
FLUX_ATTENTION = "comfy.ldm.flux.math"  # whose optimized_attention ComfyUI's Flux and Chroma blocks call
FLUX_LAYERS = "comfy.ldm.flux.layers"
# A block MLP's activation between its two projections: tanh GELU (Flux.1, Chroma, SD3, Wan, Qwen-Image), or SiLU of
# the first half of the first projection's output times its second half (Flux.2: ComfyUI's SiLUActivation)
GELU_TANH = "gelu_tanh"
SWIGLU = "swiglu"


def linears(*layers: nn.Module) -> bool:
    """Linear layers (ComfyUI's cast-on-the-fly and mixed-precision ones included: the fused forwards call them) of
    own_weights."""
    return all(linear_layer(layer) for layer in layers) and own_weights(*layers)


def kernels_run_on(x: torch.Tensor) -> bool:
    return kernel_module("adaln").supported(x) and kernel_module("qk_rope").supported(x)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Attention over (B, L, heads, head_dim) q, k and v, as (B, L, heads * head_dim): the fastest at the first call
    at the shape of PyTorch's SDPA with the engine's backend order, FlashAttention-4 (accel/engine/flash4.py) and
    FlashAttention-3 (accel/engine/flash3.py), those installed and covering the call."""
    B, L, H, D = q.shape
    return _sixteen_bit(q, k, v)[0](q, k, v).reshape(B, L, H * D)


def _sixteen_bit(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[Any, str]:
    """(attend, its name): each optional kernel timed against the best of those before it (host_attention keeps each
    choice per shape)."""
    attend, name = _sdpa, ""
    if flash4.serves(q, k, v, attend):
        attend, name = flash4.attention, f"FlashAttention-4 ({flash4.PACKAGE})"
    if flash3.serves(q, k, v, attend):
        attend, name = flash3.attention, f"FlashAttention-3 ({flash3.PACKAGE})"
    return attend, name


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)


def sdpa_label(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str:
    """What sdpa runs for these q, k and v, in words, for a message."""
    return _sixteen_bit(q, k, v)[1] or sdpa_name(*(t.transpose(1, 2) for t in (q, k, v)))


def comfy_sdpa(module_name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               name: str = "optimized_attention") -> torch.Tensor:
    """sdpa for a fused block of ComfyUI's `module_name`, or ComfyUI's attention chosen for the whole host where it was
    timed faster for the shape (base.comfy_attend); through the `around` of a StandIn that takes the place of that
    module's attention function `name` (sequence parallelism's exchange), where one does."""
    fn, host = comfy_function(module_name, name)

    def attend(q, k, v):
        return comfy_attend(host, q, k, v, sdpa, lambda: sdpa_label(q, k, v),
                            lambda q, k, v: host(q.flatten(2), k.flatten(2), v.flatten(2), q.shape[2]))

    return fn.around(attend, q, k, v) if isinstance(fn, StandIn) else attend(q, k, v)


class Joint:
    """One sequence's attention in a fused block: the (B, L, heads, head_dim) buffers that each stream's q, k and v
    are written into (kernels/qk_rope.py), and the attention over them. It runs in fp8 where fp8_attention takes it
    (the streams' `projections` make fp8 products, every stream has q/k norm weights `norms`), else as comfy_sdpa for
    the attention function `name` of ComfyUI's `module_name` (plain sdpa where module_name is None: diffusers)."""

    def __init__(self, module_name: str | None, batch: int, tokens: int, heads: int, like: torch.Tensor,
                 projections: tuple[nn.Module, ...], norms: list[tuple], consumers: tuple[nn.Module, ...],
                 name: str = "optimized_attention") -> None:
        self.module_name, self.name, self.heads = module_name, name, heads
        head_dim = like.shape[-1] // heads
        self.eight = fp8_attention.sequence(module_name, name, batch, tokens, heads, head_dim, like, projections,
                                            norms, consumers) if module_name else None
        self.qkv = self.eight.qkv if self.eight else kernel_module("qk_rope").empty_qkv(batch, tokens, heads,
                                                                                       head_dim, like)

    def write(self, projected: torch.Tensor | tuple[torch.Tensor, ...], offset: int, norm: tuple, eps: float = EPS,
              pe: torch.Tensor | None = None) -> None:
        """A stream's qkv projection (or its q, k and v) at its offset: q and k RMS-normalized per head with norm's
        weights, rotated by pe."""
        kernel_module("qk_rope").qk_norm_rope(projected, self.heads, self.qkv, offset, *norm, eps, pe,
                                              **self._fp8_args())

    def write_rows(self, projected: tuple[torch.Tensor, ...], norm: tuple, eps: float, pe: torch.Tensor) -> None:
        """The whole sequence's q, k and v projections: q and k RMS-normalized over all heads' channels (Wan), rotated
        by pe."""
        kernel_module("qk_rope").qk_row_norm_rope(projected, self.heads, self.qkv, *norm, eps, pe, **self._fp8_args())

    def write_split_rows(self, projected: tuple[torch.Tensor, ...], norm: tuple, eps: float,
                         pe: torch.Tensor) -> None:
        """As write_rows, rotated by LTX-2's split table (a rotation per token and head, pairing each head's halves)."""
        kernel_module("qk_rope").qk_row_norm_split_rope(projected, self.heads, self.qkv, *norm, eps, pe,
                                                        **self._fp8_args())

    def _fp8_args(self) -> dict:
        return self.eight.kernel_args() if self.eight else {}

    def attend(self) -> torch.Tensor | fp8_attention.Output:
        if self.eight:
            return self.eight.attend()
        return comfy_sdpa(self.module_name, *self.qkv, self.name) if self.module_name else sdpa(*self.qkv)


def part(out: torch.Tensor | fp8_attention.Output, start: int, stop: int | None,
         consumer: nn.Module | None, sample: int | None = None) -> torch.Tensor | fp8.Rows:
    """Tokens start..stop (of one sample where given) of an attention output (B, L, heads * head_dim), in the form
    `consumer` takes (fp8 Rows from fp8 attention for a projection making fp8 products; None: 16 bits)."""
    if isinstance(out, fp8_attention.Output):
        return out.part(start, stop, consumer, sample)
    return out[:, start:stop] if sample is None else out[sample:sample + 1, start:stop]


def project_part(out: torch.Tensor | fp8_attention.Output, start: int, stop: int, layer: nn.Module) -> torch.Tensor:
    """layer(tokens start..stop of an attention output): a stream's output projection. Of a batch of several samples
    such a part is no view of rows, and one product over it would copy it first: each sample's rows go through a
    product of their own into one output instead."""
    o = out.o if isinstance(out, fp8_attention.Output) else out
    B = o.shape[0]
    # fp8 products where a part comes as fp8 Rows or as 16 bits for a marked layer (what fp8.project would make)
    eight = fp8.marked(layer) and o.dtype in (fp8.FP8, torch.bfloat16, torch.float16)
    # products into a given output do not record autograd: with gradients on, the layer's own call
    if B == 1 or stop - start == o.shape[1] or torch.is_grad_enabled() or not (eight or plain_linear(layer)):
        return fp8.project(layer, part(out, start, stop, layer))
    y = torch.empty(B, stop - start, layer.out_features, device=o.device,
                    dtype=out.dtype if isinstance(out, fp8_attention.Output) else o.dtype)
    for b, y_b in enumerate(y):
        x = part(out, start, stop, layer, b)
        if eight:
            fp8.matmul(x, layer, out=y_b)
        elif layer.bias is not None:
            torch.addmm(layer.bias, x[0], layer.weight.t(), out=y_b)
        else:
            torch.mm(x[0], layer.weight.t(), out=y_b)
    return y


def modulated_norm(x: torch.Tensor, scale: torch.Tensor | None, shift: torch.Tensor | None, *consumers: nn.Module,
                   update: torch.Tensor | None = None, gate: torch.Tensor | None = None, rms: bool = False,
                   in_place: bool = False, eps: float = EPS, weight: torch.Tensor | None = None,
                   update_norm: nn.Module | None = None):
    """The adaLN pass (kernels/adaln.py; an RMS norm with rms, times `weight` where given, the stream updated in x with
    in_place; the update RMS-normalized by the RMSNorm module update_norm first where given) for the projections
    `consumers` read its output with: when fp8 products serve all of them on CUDA (or int8 ones anywhere), the output
    comes as fp8.Rows, quantized in the same pass."""
    dtype = fp8.rows_dtype(consumers[0]) if consumers else None
    int8 = dtype == fp8.INT8 and fp8.takes_rows(x, *consumers, dtype=dtype)
    e4m3 = x.device.type == "cuda" and fp8.takes_rows(x, *consumers)
    extra = {} if update_norm is None else dict(update_weight=norm_weight(update_norm.weight, x),
                                                update_eps=rms_eps(update_norm, x))
    out = kernel_module("adaln").modulated_layer_norm(x, scale, shift, eps, update=update, gate=gate, out_fp8=e4m3,
                                                      rms=rms, in_place=in_place, weight=weight, out_int8=int8,
                                                      **extra)
    h, s = out if update is not None else (out, None)
    if e4m3 or int8:
        h = fp8.Rows(h[0], h[1], tuple(x.shape[:-1]), x.dtype)
    return h if update is None else (h, s)


def rms_eps(norm: nn.Module, x: torch.Tensor) -> float:
    """The eps torch's RMSNorm module `norm` computes with on x: its own, else x's dtype's machine epsilon."""
    return norm.eps if norm.eps is not None else torch.finfo(x.dtype).eps


def gated_mlp(x: torch.Tensor, update: torch.Tensor, gate: torch.Tensor | None, scale: torch.Tensor,
              shift: torch.Tensor | None, fc1: nn.Module, fc2: nn.Module, act: str = GELU_TANH) -> torch.Tensor:
    """(mlp(LN(s) * (1 + scale) + shift), s) for the stream s = x + gate * update (x + update where gate is None);
    the caller adds the MLP's gated output to s. act SWIGLU: fc1 makes the gate and the up halves (swiglu)."""
    h, x = modulated_norm(x, scale, shift, fc1, update=update, gate=gate)
    return mlp(h, fc1, fc2, act), x


def mlp(h: torch.Tensor | fp8.Rows, fc1: nn.Module, fc2: nn.Module, act: str = GELU_TANH) -> torch.Tensor:
    """fc2(act(fc1(h))), a block's MLP on its normalized input h: the tanh GELU in fc1's product's epilogue after a plain
    16-bit fc1 with a bias (linear_gelu); with fp8 products the activation in the pass that quantizes fc2's input."""
    if act == GELU_TANH and isinstance(h, torch.Tensor) and plain_linear(fc1) and fc1.bias is not None \
            and not fp8.marked(fc1):
        return fp8.project(fc2, linear_gelu(h, fc1.weight, fc1.bias))
    a = fp8.project(fc1, h)
    dtype = fp8.rows_dtype(fc2)
    if dtype is not None and fp8.takes_rows(a, fc2, dtype=dtype):
        return fp8.matmul(fp8.quantized(a, gelu=act == GELU_TANH, swiglu=act == SWIGLU, dtype=dtype), fc2)
    return fc2(activated(a, act))


def linear_gelu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """tanh-GELU(x @ weight.T + bias). On NVIDIA GPUs the GELU runs in the matrix product's epilogue (cuBLASLt's tanh
    GELU on the float32 accumulator, or torch's tanh GELU after the product where cuBLASLt does not take it), not as
    a pass of its own over the MLP's widest activation. torch's CPU version of that call computes the exact GELU:
    elsewhere the two steps run apart."""
    if x.device.type != "cuda" or torch.version.hip is not None:
        return F.gelu(F.linear(x, weight, bias), approximate="tanh")
    out = torch._addmm_activation(bias, x.reshape(-1, x.shape[-1]), weight.t(), use_gelu=True)
    return out.view(*x.shape[:-1], out.shape[-1])


def swiglu(a: torch.Tensor | tuple[torch.Tensor, torch.Tensor], finite: bool = False) -> torch.Tensor:
    """SiLU(gate) * up, for gate and up a's first and second halves along the last dimension (ComfyUI's
    SiLUActivation) or given as two tensors: one pass where the kernel runs (kernels/swiglu.py), rounded as torch's
    SiLU and product round. finite: float16 results kept finite as ComfyUI's clamp_fp16 keeps them (Z-Image)."""
    gate, up = a.chunk(2, dim=-1) if isinstance(a, torch.Tensor) else a
    kernel = kernel_module("swiglu")
    return (kernel.swiglu if kernel.supported(gate) else kernel.swiglu_ref)(gate, up, finite)


def activated(a: torch.Tensor, act: str) -> torch.Tensor:
    """An MLP's activation `act` of its first projection's output a."""
    return swiglu(a) if act == SWIGLU else F.gelu(a, approximate="tanh")


def gated_residual_(x: torch.Tensor, gate: torch.Tensor, update: torch.Tensor,
                    update2: torch.Tensor | None = None) -> torch.Tensor:
    """x += gate * (update (+ update2)) in place (gate per sample: (B, 1, C) or (B, C); or per run of tokens,
    (B, T, C), on a contiguous x: kernels/adaln.py)."""
    if x.is_contiguous() and update.shape == x.shape:
        return kernel_module("adaln").gated_add_(x, gate, update, update2)
    return x.addcmul_(gate if gate.dim() == 3 else gate.unsqueeze(1), update if update2 is None else update + update2)


def plain_layer_norms(*norms: nn.Module) -> bool:
    """LayerNorm modules of the DiTs' adaLN: no affine, eps 1e-6 (what the adaLN kernel computes)."""
    return all(isinstance(n, nn.LayerNorm) and not n.elementwise_affine and n.eps == EPS for n in norms)


def norm_weight(p: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor | None:
    """A q/k RMSNorm weight in x's dtype (a model loaded in fp8 stores these in fp8 too) on x's device, where the
    kernel reads it; the weight itself where it is both already."""
    return None if p is None else p.to(device=x.device, dtype=x.dtype)


# Flux's block layout: ComfyUI's Flux and Chroma classes (fusions/flux.py, fusions/chroma.py).

def _mlp_act(mlp: nn.Module) -> str | None:
    """The activation of an MLP of Linear, activation, Linear in a Sequential: Flux.1's (tanh GELU) or Flux.2's
    (SWIGLU, its first Linear twice as wide as the second's input); None for any other MLP (ComfyUI 0.33's YakMLP)."""
    if not (isinstance(mlp, nn.Sequential) and len(mlp) == 3 and all(linear_layer(mlp[i]) for i in (0, 2))):
        return None
    act = _activation(mlp[1])
    return act if act != SWIGLU or mlp[0].out_features == 2 * mlp[2].in_features else None


def _activation(act: nn.Module) -> str | None:
    """GELU_TANH or SWIGLU for the activation module of a Flux-layout block, None for another."""
    if type(act).__name__ == "GELU" and act.approximate == "tanh":
        return GELU_TANH
    if host_block(act, "SiLUActivation", FLUX_LAYERS, ("gate_fn",), ("x",)) and isinstance(act.gate_fn, nn.SiLU):
        return SWIGLU
    return None


def _single_mlp_covered(m: nn.Module) -> bool:
    """A single block's MLP input is as wide as its output with tanh GELU, twice as wide with SWIGLU (Flux.2); the
    Yak MLP (0.33, nn.SiLU on a doubled input) is not covered."""
    act, first = _activation(m.mlp_act), getattr(m, "mlp_hidden_dim_first", m.mlp_hidden_dim)
    return not getattr(m, "yak_mlp", False) and first == {GELU_TANH: 1, SWIGLU: 2}.get(act, 0) * m.mlp_hidden_dim


def covered(m: nn.Module, *modulation: nn.Module) -> bool:
    """Whether a double or single block of Flux's layout (ComfyUI's Flux, Flux.2 or Chroma classes) takes the fused
    forward: plain or cast-on-the-fly projections (and the block's own modulation projections), tanh GELU or SiLU-gated
    MLPs, q/k RMSNorms that rms_norm_of reads."""
    if hasattr(m, "img_mlp"):
        if _mlp_act(m.img_mlp) is None or _mlp_act(m.txt_mlp) is None:
            return False
        layers = (m.img_attn.qkv, m.img_attn.proj, m.txt_attn.qkv, m.txt_attn.proj, m.img_mlp[0], m.img_mlp[2],
                  m.txt_mlp[0], m.txt_mlp[2])
        norms = (m.img_attn.norm, m.txt_attn.norm)
    else:
        if not _single_mlp_covered(m):
            return False
        layers, norms = (m.linear1, m.linear2), (m.norm,)
    return linears(*layers, *modulation) and flux_rms_norms(*(x for n in norms for x in (n.query_norm, n.key_norm)))


def fused_call(x: torch.Tensor, transformer_options: dict | None, *conditions: bool) -> bool:
    """Whether a Flux-layout block call takes the fused forward (every one of `conditions` false, ComfyUI's attention
    chosen for the whole host and not overridden, tensors the kernels run on)."""
    return (not any(conditions) and comfy_attention(FLUX_ATTENTION, transformer_options) is not None
            and kernels_run_on(x))


class Modulation(NamedTuple):
    """An adaLN modulation's shift, scale and gate ((B, C) or (B, 1, C)), as Flux's ModulationOut names them."""
    shift: torch.Tensor
    scale: torch.Tensor
    gate: torch.Tensor


@dataclass(frozen=True)
class Stream:
    """One stream (text or image) of a block of joint attention, as `joint_block` computes it: its tokens, the
    modulations of its attention and MLP halves (a Modulation, or Flux's ModulationOut), the layers its tokens go
    through with its MLP's activation, and its per-head q/k RMSNorm weights (None: no norm) with their eps."""
    x: torch.Tensor
    attn_mod: Any
    mlp_mod: Any
    qkv: nn.Module | tuple[nn.Module, nn.Module, nn.Module]  # one packed projection, or q, k and v
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    eps: float
    proj: nn.Module
    fc1: nn.Module
    fc2: nn.Module
    act: str = GELU_TANH


def diffusers_stream(x: torch.Tensor, mods: torch.Tensor, qkv: tuple[nn.Module, nn.Module, nn.Module],
                     q_norm: nn.Module, k_norm: nn.Module, proj: nn.Module, ff: nn.Module) -> Stream:
    """A Stream of diffusers' double-block layout (which ComfyUI's Qwen-Image keeps): its modulations the six chunks of
    one (B, 6C) projection (shift, scale and gate of the attention, then of the MLP), q, k and v projected by three
    layers (one GEMM where the fusion packed them: project_qkv), q/k RMSNorm modules, a FeedForward of net[0].proj,
    the GELU, and net[2]."""
    shift, scale, gate, mlp_shift, mlp_scale, mlp_gate = mods.chunk(6, dim=-1)
    return Stream(x, Modulation(shift, scale, gate), Modulation(mlp_shift, mlp_scale, mlp_gate), qkv, q_norm.weight,
                  k_norm.weight, q_norm.eps, proj, ff.net[0].proj, ff.net[2])


def _layers(s: Stream) -> tuple[nn.Module, ...]:
    return s.qkv if isinstance(s.qkv, tuple) else (s.qkv,)


def project_qkv(qkv: nn.Module | tuple[nn.Module, nn.Module, nn.Module],
                h: torch.Tensor | fp8.Rows) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """q, k and v of h in a form qk_norm_rope takes: one layer's (..., 3C) product; three layers' as project_packed
    gives them (packing.pack_qkv)."""
    if not isinstance(qkv, tuple):
        return fp8.project(qkv, h)
    return project_packed(qkv, h)


def project_packed(layers: tuple[nn.Module, ...], h: torch.Tensor | fp8.Rows) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """The products of layers of one input h: side by side from one GEMM where the fusion packed them
    (packing.pack_same_width), the pack still holds every weight and no layer makes fp8 products (their fp8 copies
    are per layer: h is quantized once, for a product each), else a product per layer, as a tuple."""
    pack = packing.packed(*layers)
    if pack is not None and pack.intact() and not any(fp8.marked(layer) for layer in layers):
        return pack.linear(h, 0, len(layers))
    dtype = fp8.rows_dtype(layers[0])
    if isinstance(h, torch.Tensor) and dtype is not None and fp8.takes_rows(h, *layers, dtype=dtype):
        h = fp8.quantized(h, dtype=dtype)
    return tuple(fp8.project(layer, h) for layer in layers)


def joint_block(streams: Sequence[Stream], heads: int, module_name: str | None, pe: torch.Tensor | None,
                name: str = "optimized_attention") -> list[torch.Tensor]:
    """A double-stream block's computation with the kernels (Flux, Chroma, Qwen-Image): the streams' tokens joined in
    their order into one attention over the joint sequence, rotated by pe's rows there (a Joint: the attention
    function `name` of ComfyUI's `module_name`, or fp8 attention in its place; sdpa where module_name is None), then
    each stream's gated residual, modulated MLP and gated residual. Returns the streams' new tokens, in their order."""
    first = streams[0].x
    norms = [(norm_weight(s.q_norm, s.x), norm_weight(s.k_norm, s.x)) for s in streams]
    joint = Joint(module_name, first.shape[0], sum(s.x.shape[1] for s in streams), heads, first,
                  tuple(layer for s in streams for layer in _layers(s)), norms, tuple(s.proj for s in streams), name)
    offset = 0
    for s, norm in zip(streams, norms):
        layers = _layers(s)
        h = modulated_norm(s.x, s.attn_mod.scale, s.attn_mod.shift, *layers)
        joint.write(project_qkv(s.qkv, h), offset, norm, s.eps, pe)
        offset += s.x.shape[1]
    out = joint.attend()
    outs, offset = [], 0
    for s in streams:
        L = s.x.shape[1]
        y, x = gated_mlp(s.x, project_part(out, offset, offset + L, s.proj), s.attn_mod.gate,
                         s.mlp_mod.scale, s.mlp_mod.shift, s.fc1, s.fc2, s.act)
        outs.append(gated_residual_(x, s.mlp_mod.gate, y))
        offset += L
    return outs


def rms_norm_of(norm: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor | None, float]:
    """(weight, eps) of a q/k RMSNorm of Flux's layout for activations like x: ComfyUI's own RMSNorm until 0.3.6x
    (weight `scale`, eps 1e-6), torch's nn.RMSNorm from 0.33 (`weight`; eps None: x's dtype's machine epsilon)."""
    if isinstance(norm, nn.RMSNorm):
        return norm.weight, norm.eps if norm.eps is not None else torch.finfo(x.dtype).eps
    return norm.scale, EPS


def flux_rms_norms(*norms: nn.Module) -> bool:
    """Whether the q/k norms are RMSNorms that rms_norm_of reads: torch's (ComfyUI 0.33's) with a weight of their own
    and no per-call weight functions, or ComfyUI's own of Flux's layout (0.3.6x)."""
    return all((isinstance(n, nn.RMSNorm) and n.weight is not None and own_weights(n))
               or (type(n).__name__ == "RMSNorm" and isinstance(getattr(n, "scale", None), torch.Tensor))
               for n in norms)


def double_block(self: nn.Module, img: torch.Tensor, txt: torch.Tensor, pe: torch.Tensor | None, mods: tuple,
                 flipped: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A double-stream block of Flux's layout; mods = (img_mod1, img_mod2, txt_mod1, txt_mod2), each with shift,
    scale and gate of shape (B, 1, C)."""
    img_mod1, img_mod2, txt_mod1, txt_mod2 = mods

    def stream(x, attn, mlp, mod1, mod2) -> Stream:
        (q_norm, eps), (k_norm, _) = rms_norm_of(attn.norm.query_norm, x), rms_norm_of(attn.norm.key_norm, x)
        return Stream(x, mod1, mod2, attn.qkv, q_norm, k_norm, eps, attn.proj, mlp[0], mlp[2], _mlp_act(mlp))

    streams = [stream(txt, self.txt_attn, self.txt_mlp, txt_mod1, txt_mod2),
               stream(img, self.img_attn, self.img_mlp, img_mod1, img_mod2)]
    if flipped:
        streams.reverse()
    new = joint_block(streams, self.num_heads, FLUX_ATTENTION, pe)
    txt, img = new if not flipped else new[::-1]
    if txt.dtype == torch.float16:
        txt = torch.nan_to_num(txt, nan=0.0, posinf=65504, neginf=-65504)
    return img, txt


def single_block(self: nn.Module, x: torch.Tensor, pe: torch.Tensor | None, mod) -> torch.Tensor:
    """A single-stream block's computation with the kernels; mod has shift, scale and gate of shape (B, 1, C)."""
    (B, L, C), H = x.shape, self.num_heads
    h = modulated_norm(x, mod.scale, mod.shift, self.linear1)
    # linear1 as two products (q, k, v; the MLP's input), so that the activation reads a contiguous tensor
    first = getattr(self, "mlp_hidden_dim_first", self.mlp_hidden_dim)  # ComfyUI 0.33: twice as wide with SWIGLU
    projected, mlp_in = fp8.split_linear(self.linear1, h, (3 * C, first))
    (q_norm, eps), (k_norm, _) = rms_norm_of(self.norm.query_norm, x), rms_norm_of(self.norm.key_norm, x)
    norm = norm_weight(q_norm, x), norm_weight(k_norm, x)
    joint = Joint(FLUX_ATTENTION, B, L, H, x, (self.linear1,), [norm], (self.linear2,))
    joint.write(projected, 0, norm, eps, pe)
    single_output_(x, mod.gate, joint.attend(), mlp_in, self.linear2, _activation(self.mlp_act))
    if x.dtype == torch.float16:
        x = torch.nan_to_num(x, nan=0.0, posinf=65504, neginf=-65504)
    return x


def single_output_(x: torch.Tensor, gate: torch.Tensor, attn: torch.Tensor | fp8_attention.Output,
                   mlp_in: torch.Tensor, linear2: nn.Module, act: str = GELU_TANH) -> None:
    """x += gate * linear2(cat(attention, act(mlp_in))) in place, a single-stream block's output (Flux's, Flux.2's,
    diffusers' Flux's), without writing the concatenation: two products into one output (16-bit: the second
    accumulates on the first) or two outputs the gated residual adds together (fp8, the activation in the pass that
    quantizes its part)."""
    B, L, C = x.shape
    dtype = fp8.rows_dtype(linear2)
    if dtype is not None and fp8.takes_rows(x, linear2, dtype=dtype):
        mlp = fp8.quantized(mlp_in, gelu=act == GELU_TANH, swiglu=act == SWIGLU, dtype=dtype)
        gated_residual_(x, gate, fp8.matmul(part(attn, 0, None, linear2), linear2, cols=slice(0, C)),
                        fp8.matmul(mlp, linear2, cols=slice(C, None), bias=False))
        return
    mlp = activated(mlp_in, act)
    if plain_linear(linear2):
        w, b, a = linear2.weight, linear2.bias, part(attn, 0, None, None).reshape(B * L, C)
        out = torch.mm(a, w[:, :C].t()) if b is None else torch.addmm(b, a, w[:, :C].t())
        out.addmm_(mlp.reshape(B * L, -1), w[:, C:].t())
        gated_residual_(x, gate, out.view(B, L, C))
    else:
        gated_residual_(x, gate, linear2(torch.cat((part(attn, 0, None, None), mlp), 2)))

"""Tiled VAE decode and encode that give the untiled image: GroupNorm statistics are taken over the whole image.

Why tiles give a different picture elsewhere: a GroupNorm normalizes with the mean and variance of a whole channel
group, so a tile decoded on its own is normalized with its own statistics, and neighbouring tiles disagree (seams and
colour shifts) however wide their feathered overlap.

How this module avoids it ("tile by tile, layer-synchronised"): the network is flattened into a short program of
layer passes. A pass computes one activation of the whole image, tile by tile: every tile reads its input region plus
the halo its convolution needs (1 px for a 3x3 conv, through nearest upsampling and strided downsampling as well), so
every output pixel is computed from exactly the inputs the untiled network uses. A GroupNorm sits at the input of a
pass, so the statistics it needs are complete before the pass starts: each tile adds the per-channel sum and sum of
squares of the region it wrote (the tiles do not overlap, so each pixel counts once), and the consumer merges them into
the whole-image mean and variance. Norm, SiLU, the conv and the residual add run on one tile at a time; only the
activations a later pass still reads are kept for the whole image, on the GPU or, when they would not fit, in host
memory. The mid-block attention runs on the whole (latent-resolution) activation, in query chunks when memory is short,
so it is exact as well. The result equals the untiled decode up to float rounding, and tiles never overlap, so there is
nothing to blend: `naive_tiled_decode` (decode each tile on its own and feather the overlap, as ComfyUI's
VAEDecodeTiled does) is kept as the baseline this is measured against.

Units: `tile` and `overlap` are image pixels for both directions, like ComfyUI's tiled VAE nodes.
Inputs: `decode` takes what the VAE's own decode takes (the sampler's latent already divided by the scaling factor, as
diffusers' `vae.decode`); `encode` takes images in [-1, 1], (N, 3, H, W), and returns the mean of the latent
distribution, `vae.encode(x).latent_dist.mean` in diffusers (not yet multiplied by the scaling factor).

Supported VAEs: diffusers `AutoencoderKL` (SD1.x/SD2.x/SDXL: `Encoder`/`Decoder` with `ResnetBlock2D`, `Attention`,
`Upsample2D`, `Downsample2D`) and the ldm/ComfyUI form (`comfy.ldm.modules.diffusionmodules.model.Encoder/Decoder`,
or an object holding them as `encoder`/`decoder` with `quant_conv`/`post_quant_conv`, or a ComfyUI `VAE` with
`first_stage_model`). Weights are read from the modules and cast to the compute dtype at use, so ComfyUI's
manual-cast layers work; per-layer weight patches applied only inside a layer's forward (ComfyUI low-VRAM LoRA) are
not seen.
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .errors import AccelError, BadInput, UnsupportedModel
from .progress import NullProgress, Progress

# Tile side (image px) where no free-memory figure guides the choice (CPU, MPS, ...).
DEFAULT_TILE = 512
MIN_TILE = 64
# Tile side (image px) past which a GPU gains nothing: a 1024 px tile keeps it busy, and larger only costs memory.
TILE_CAP = 1024
# Activations stay on the GPU only when tiles of at least this side still fit beside them.
MIN_DEVICE_TILE = 512
# Part of the free device memory this module plans to use; the rest absorbs allocator slack.
MEMORY_USE = 0.9
# Margin on the estimated tile temporaries for conv workspaces.
WORKSPACE = 1.5
# Widest attention head the fused SDPA kernels (flash, cuDNN) take; wider ones are computed with explicit GEMMs.
FUSED_HEAD_DIM = 256
# Bands computed at once when activations live in host memory (see _Ctx.streams).
BAND_STREAMS = 2
# Bytes of attention scores computed at once by the GEMM path.
SCORE_BYTES = 1 << 29

_OOM = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)


# ---------------------------------------------------------------------------------------------- program structure


@dataclass
class _Term:
    """One summand of a pass: conv(upsample(silu(norm(src)))), or src itself when `conv` is None."""

    src: int
    conv: nn.Conv2d | None = None
    norm: nn.GroupNorm | None = None
    silu: bool = False
    up: int = 1
    pad: tuple[int, int, int, int] = (0, 0, 0, 0)  # zeros (left, right, top, bottom) added before the conv


@dataclass
class _Pass:
    dst: int
    terms: list[_Term]
    scale: float = 1.0  # the sum of the terms is divided by this (diffusers' output_scale_factor)
    what: str = ""


@dataclass
class _Attn:
    """Single- or multi-head self-attention over all pixels, with its GroupNorm and residual (the VAE mid block)."""

    src: int
    dst: int
    norm: nn.GroupNorm
    q: tuple[torch.Tensor, torch.Tensor | None]  # (weight (C_out, C_in), bias) of each projection
    k: tuple[torch.Tensor, torch.Tensor | None]
    v: tuple[torch.Tensor, torch.Tensor | None]
    out: tuple[torch.Tensor, torch.Tensor | None]
    heads: int
    scale: float
    residual: bool = True
    rescale: float = 1.0
    what: str = ""


@dataclass
class _Program:
    steps: list = field(default_factory=list)
    shapes: dict[int, tuple[int, int, int]] = field(default_factory=dict)  # id -> (C, H, W)
    result: int = 0
    take: int | None = None  # keep only the first `take` channels of the result (the mean of the moments)
    tanh: bool = False

    def new(self, shape: tuple[int, int, int]) -> int:
        i = len(self.shapes)
        self.shapes[i] = shape
        return i


def _is_identity(m: nn.Module | None) -> bool:
    return m is None or isinstance(m, nn.Identity)


def _conv(m: nn.Module, what: str) -> nn.Conv2d:
    if not isinstance(m, nn.Conv2d):
        raise UnsupportedModel(f"{what} is a {type(m).__name__}, not a 2D convolution.",
                               "Decode this VAE with its own decode(); the tiled path covers SD-style 2D VAEs.")
    if m.padding_mode != "zeros" or tuple(m.dilation) != (1, 1) or isinstance(m.padding, str):
        raise UnsupportedModel(f"{what} uses padding {m.padding!r} ({m.padding_mode}) with dilation {m.dilation}.",
                               "The tiled VAE supports zero-padded, undilated convolutions only.")
    return m


def _norm(m: nn.Module, what: str) -> nn.GroupNorm:
    if not isinstance(m, nn.GroupNorm):
        raise UnsupportedModel(f"{what} is a {type(m).__name__}, not a GroupNorm.",
                               "Decode this VAE with its own decode(); the tiled path covers SD-style VAEs.")
    return m


def _silu(m: nn.Module, what: str) -> None:
    if not isinstance(m, nn.SiLU):
        raise UnsupportedModel(f"{what} is {type(m).__name__}; the tiled VAE supports SiLU activations only.",
                               "Decode this VAE with its own decode().")


def _conv_len(n: int, conv: nn.Conv2d, axis: int, up: int, pad_lo: int, pad_hi: int) -> int:
    k, s, p = conv.kernel_size[axis], conv.stride[axis], conv.padding[axis]
    return (n * up + 2 * p + pad_lo + pad_hi - k) // s + 1


def _add_pass(prog: _Program, terms: list[_Term], what: str, scale: float = 1.0) -> int:
    shapes = set()
    for t in terms:
        c, h, w = prog.shapes[t.src]
        if t.conv is None:
            shapes.add((c, h, w))
        else:
            if t.conv.in_channels != c:
                raise UnsupportedModel(f"{what}: {c} channels reach a conv expecting {t.conv.in_channels}.",
                                       "This VAE's layout is not one the tiled VAE knows; use its own decode().")
            left, right, top, bottom = t.pad
            shapes.add((t.conv.out_channels, _conv_len(h, t.conv, 0, t.up, top, bottom),
                        _conv_len(w, t.conv, 1, t.up, left, right)))
    if len(shapes) != 1 or min(next(iter(shapes))) < 1:
        raise UnsupportedModel(f"{what}: the branches of a residual block give shapes {sorted(shapes)}.",
                               "This VAE's layout is not one the tiled VAE knows; use its own decode().")
    dst = prog.new(shapes.pop())
    prog.steps.append(_Pass(dst, terms, scale, what))
    return dst


def _resnet(prog: _Program, x: int, norm1, conv1, norm2, conv2, shortcut, scale: float, what: str) -> int:
    h = _add_pass(prog, [_Term(x, _conv(conv1, f"{what}.conv1"), _norm(norm1, f"{what}.norm1"), True)],
                  f"{what}.conv1")
    skip = _Term(x) if _is_identity(shortcut) else _Term(x, _conv(shortcut, f"{what}.shortcut"))
    main = _Term(h, _conv(conv2, f"{what}.conv2"), _norm(norm2, f"{what}.norm2"), True)
    return _add_pass(prog, [main, skip], f"{what}.conv2", scale)


def _linear(m: nn.Module, what: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight as a (C_out, C_in) matrix, bias) of a Linear or of a 1x1 conv."""
    if isinstance(m, nn.Linear):
        return m.weight, m.bias
    if isinstance(m, nn.Conv2d) and tuple(m.kernel_size) == (1, 1) and tuple(m.stride) == (1, 1) and m.groups == 1:
        return m.weight.flatten(1), m.bias
    raise UnsupportedModel(f"{what} is a {type(m).__name__}, not a linear projection.",
                           "Decode this VAE with its own decode().")


def _add_attn(prog: _Program, x: int, step: _Attn) -> int:
    step.src, step.dst = x, prog.new(prog.shapes[x])
    prog.steps.append(step)
    return step.dst


# ----- diffusers form


def _d_resnet(prog: _Program, x: int, r: nn.Module, what: str) -> int:
    if type(r).__name__ != "ResnetBlock2D" or r.upsample is not None or r.downsample is not None:
        raise UnsupportedModel(f"{what} is a {type(r).__name__} that resamples or is not a ResnetBlock2D.",
                               "Decode this VAE with its own decode().")
    _silu(r.nonlinearity, f"{what}.nonlinearity")
    return _resnet(prog, x, r.norm1, r.conv1, r.norm2, r.conv2, r.conv_shortcut, float(r.output_scale_factor), what)


def _d_attn(prog: _Program, x: int, a: nn.Module, what: str) -> int:
    if getattr(a, "spatial_norm", None) is not None or a.group_norm is None:
        raise UnsupportedModel(f"{what} is an attention without its own GroupNorm (or with a spatial norm).",
                               "Decode this VAE with its own decode().")
    return _add_attn(prog, x, _Attn(
        0, 0, _norm(a.group_norm, f"{what}.group_norm"), _linear(a.to_q, f"{what}.to_q"),
        _linear(a.to_k, f"{what}.to_k"), _linear(a.to_v, f"{what}.to_v"), _linear(a.to_out[0], f"{what}.to_out"),
        int(a.heads), float(a.scale), bool(a.residual_connection), float(a.rescale_output_factor), what))


def _d_mid(prog: _Program, x: int, mid: nn.Module, what: str) -> int:
    x = _d_resnet(prog, x, mid.resnets[0], f"{what}.resnets.0")
    for i, (attn, resnet) in enumerate(zip(mid.attentions, mid.resnets[1:])):
        if attn is not None:
            x = _d_attn(prog, x, attn, f"{what}.attentions.{i}")
        x = _d_resnet(prog, x, resnet, f"{what}.resnets.{i + 1}")
    return x


def _d_decoder(prog: _Program, x: int, dec: nn.Module) -> int:
    x = _add_pass(prog, [_Term(x, _conv(dec.conv_in, "decoder.conv_in"))], "decoder.conv_in")
    x = _d_mid(prog, x, dec.mid_block, "decoder.mid_block")
    for i, block in enumerate(dec.up_blocks):
        what = f"decoder.up_blocks.{i}"
        if type(block).__name__ != "UpDecoderBlock2D":
            raise UnsupportedModel(f"{what} is a {type(block).__name__}; the tiled VAE knows UpDecoderBlock2D.",
                                   "Decode this VAE with its own decode().")
        for j, r in enumerate(block.resnets):
            x = _d_resnet(prog, x, r, f"{what}.resnets.{j}")
        for up in block.upsamplers or []:
            if up.use_conv_transpose or up.norm is not None or not up.interpolate or not up.use_conv:
                raise UnsupportedModel(f"{what}.upsamplers is not nearest-2x then conv.",
                                       "Decode this VAE with its own decode().")
            conv = up.conv if up.name == "conv" else up.Conv2d_0
            x = _add_pass(prog, [_Term(x, _conv(conv, f"{what}.upsamplers.conv"), up=2)], f"{what}.upsamplers")
    _silu(dec.conv_act, "decoder.conv_act")
    return _add_pass(prog, [_Term(x, _conv(dec.conv_out, "decoder.conv_out"),
                                  _norm(dec.conv_norm_out, "decoder.conv_norm_out"), True)], "decoder.conv_out")


def _d_encoder(prog: _Program, x: int, enc: nn.Module) -> int:
    x = _add_pass(prog, [_Term(x, _conv(enc.conv_in, "encoder.conv_in"))], "encoder.conv_in")
    for i, block in enumerate(enc.down_blocks):
        what = f"encoder.down_blocks.{i}"
        if type(block).__name__ != "DownEncoderBlock2D":
            raise UnsupportedModel(f"{what} is a {type(block).__name__}; the tiled VAE knows DownEncoderBlock2D.",
                                   "Encode with this VAE's own encode().")
        for j, r in enumerate(block.resnets):
            x = _d_resnet(prog, x, r, f"{what}.resnets.{j}")
        for down in block.downsamplers or []:
            if not down.use_conv or down.norm is not None:
                raise UnsupportedModel(f"{what}.downsamplers is not a strided conv.", "Encode with its own encode().")
            pad = (0, 1, 0, 1) if down.padding == 0 else (0, 0, 0, 0)
            x = _add_pass(prog, [_Term(x, _conv(down.conv, f"{what}.downsamplers.conv"), pad=pad)],
                          f"{what}.downsamplers")
    x = _d_mid(prog, x, enc.mid_block, "encoder.mid_block")
    _silu(enc.conv_act, "encoder.conv_act")
    return _add_pass(prog, [_Term(x, _conv(enc.conv_out, "encoder.conv_out"),
                                  _norm(enc.conv_norm_out, "encoder.conv_norm_out"), True)], "encoder.conv_out")


# ----- ldm / ComfyUI form


def _l_resnet(prog: _Program, x: int, r: nn.Module, what: str) -> int:
    shortcut = None
    if r.in_channels != r.out_channels:
        shortcut = r.conv_shortcut if getattr(r, "use_conv_shortcut", False) else r.nin_shortcut
    return _resnet(prog, x, r.norm1, r.conv1, r.norm2, r.conv2, shortcut, 1.0, what)


def _l_attn(prog: _Program, x: int, a: nn.Module, what: str) -> int:
    c = prog.shapes[x][0]
    return _add_attn(prog, x, _Attn(
        0, 0, _norm(a.norm, f"{what}.norm"), _linear(a.q, f"{what}.q"), _linear(a.k, f"{what}.k"),
        _linear(a.v, f"{what}.v"), _linear(a.proj_out, f"{what}.proj_out"), 1, c ** -0.5, True, 1.0, what))


def _l_mid(prog: _Program, x: int, mid: nn.Module, what: str) -> int:
    x = _l_resnet(prog, x, mid.block_1, f"{what}.block_1")
    x = _l_attn(prog, x, mid.attn_1, f"{what}.attn_1")
    return _l_resnet(prog, x, mid.block_2, f"{what}.block_2")


def _no_level_attn(level: nn.Module, what: str) -> None:
    if len(getattr(level, "attn", ())) > 0:
        raise UnsupportedModel(f"{what} has attention at image resolution, which the tiled VAE does not cover.",
                               "Use this VAE's own decode()/encode().")


def _l_decoder(prog: _Program, x: int, dec: nn.Module) -> int:
    if getattr(dec, "give_pre_end", False):
        raise UnsupportedModel("the decoder stops before its output layers (give_pre_end).", "Use its own decode().")
    x = _add_pass(prog, [_Term(x, _conv(dec.conv_in, "decoder.conv_in"))], "decoder.conv_in")
    x = _l_mid(prog, x, dec.mid, "decoder.mid")
    for i in reversed(range(len(dec.up))):
        level, what = dec.up[i], f"decoder.up.{i}"
        _no_level_attn(level, what)
        for j, r in enumerate(level.block):
            x = _l_resnet(prog, x, r, f"{what}.block.{j}")
        if hasattr(level, "upsample"):
            up = level.upsample
            if not getattr(up, "with_conv", True) or float(getattr(up, "scale_factor", 2.0)) != 2.0:
                raise UnsupportedModel(f"{what}.upsample is not nearest-2x then conv.", "Use its own decode().")
            x = _add_pass(prog, [_Term(x, _conv(up.conv, f"{what}.upsample.conv"), up=2)], f"{what}.upsample")
    prog.tanh = bool(getattr(dec, "tanh_out", False))
    return _add_pass(prog, [_Term(x, _conv(dec.conv_out, "decoder.conv_out"), _norm(dec.norm_out, "decoder.norm_out"),
                                  True)], "decoder.conv_out")


def _l_encoder(prog: _Program, x: int, enc: nn.Module) -> int:
    x = _add_pass(prog, [_Term(x, _conv(enc.conv_in, "encoder.conv_in"))], "encoder.conv_in")
    for i, level in enumerate(enc.down):
        what = f"encoder.down.{i}"
        _no_level_attn(level, what)
        for j, r in enumerate(level.block):
            x = _l_resnet(prog, x, r, f"{what}.block.{j}")
        if hasattr(level, "downsample"):
            if not getattr(level.downsample, "with_conv", True):
                raise UnsupportedModel(f"{what}.downsample is average pooling.", "Use the VAE's own encode().")
            x = _add_pass(prog, [_Term(x, _conv(level.downsample.conv, f"{what}.downsample.conv"), pad=(0, 1, 0, 1))],
                          f"{what}.downsample")
    x = _l_mid(prog, x, enc.mid, "encoder.mid")
    return _add_pass(prog, [_Term(x, _conv(enc.conv_out, "encoder.conv_out"), _norm(enc.norm_out, "encoder.norm_out"),
                                  True)], "encoder.conv_out")


# ----- the VAE's parts


@dataclass
class _Parts:
    encoder: nn.Module | None
    decoder: nn.Module | None
    quant_conv: nn.Module | None
    post_quant_conv: nn.Module | None


def _parts(vae) -> _Parts:
    vae = getattr(vae, "first_stage_model", vae)  # a ComfyUI VAE holds the model here
    if hasattr(vae, "decoder") or hasattr(vae, "encoder"):
        pq, q = getattr(vae, "post_quant_conv", None), getattr(vae, "quant_conv", None)
        return _Parts(getattr(vae, "encoder", None), getattr(vae, "decoder", None),
                      None if _is_identity(q) else q, None if _is_identity(pq) else pq)
    if hasattr(vae, "conv_in") and (hasattr(vae, "up_blocks") or hasattr(vae, "up")):
        return _Parts(None, vae, None, None)
    if hasattr(vae, "conv_in") and (hasattr(vae, "down_blocks") or hasattr(vae, "down")):
        return _Parts(vae, None, None, None)
    raise UnsupportedModel(f"a {type(vae).__name__} is not an SD-style VAE (no encoder/decoder found).",
                           "Pass a diffusers AutoencoderKL, a ComfyUI VAE, or its Encoder/Decoder module.")


def _pointwise(prog: _Program, x: int, m: nn.Module, what: str) -> int:
    conv = _conv(m, what)
    if tuple(conv.kernel_size) != (1, 1) or tuple(conv.stride) != (1, 1):
        raise UnsupportedModel(f"{what} is a {tuple(conv.kernel_size)} conv, not 1x1.", "Use the VAE's own methods.")
    return _add_pass(prog, [_Term(x, conv)], what)


def _first_conv(parts: _Parts, encode: bool) -> nn.Module:
    """The layer the input meets first (its in_channels are what the input needs)."""
    if encode:
        if parts.encoder is None:
            raise UnsupportedModel("this VAE has no encoder.", "Pass the whole VAE (or its Encoder) to encode().")
        return parts.encoder.conv_in
    if parts.decoder is None:
        raise UnsupportedModel("this VAE has no decoder.", "Pass the whole VAE (or its Decoder) to decode().")
    return parts.post_quant_conv if parts.post_quant_conv is not None else parts.decoder.conv_in


def _decode_program(parts: _Parts, shape: tuple[int, int, int]) -> _Program:
    prog = _Program()
    x = prog.new(shape)
    if parts.post_quant_conv is not None:
        x = _pointwise(prog, x, parts.post_quant_conv, "post_quant_conv")
    x = (_d_decoder if hasattr(parts.decoder, "up_blocks") else _l_decoder)(prog, x, parts.decoder)
    prog.result = x
    return prog


def _encode_program(parts: _Parts, shape: tuple[int, int, int]) -> _Program:
    prog = _Program()
    x = prog.new(shape)
    x = (_d_encoder if hasattr(parts.encoder, "down_blocks") else _l_encoder)(prog, x, parts.encoder)
    if parts.quant_conv is not None:
        x = _pointwise(prog, x, parts.quant_conv, "quant_conv")
    prog.result, prog.take = x, prog.shapes[x][0] // 2
    return prog


def _reads(step) -> list[int]:
    return [t.src for t in step.terms] if isinstance(step, _Pass) else [step.src]


def _last_use(prog: _Program) -> dict[int, int]:
    last = {}
    for i, step in enumerate(prog.steps):
        for s in _reads(step):
            last[s] = i
    return last


def _in_place(prog: _Program, i: int, last: dict[int, int]) -> tuple[int, bool] | None:
    """(source a pass may overwrite, whether its writes must wait), or None to write a new activation.

    A source read for the last time, by one term only, with the output's shape, can take the output: at once when
    the term reads it pixel for pixel (the identity skip of a residual block); when a 3x3 conv reads it, a tile's
    output waits until the neighbours that read its region as their halo are done. Without this, the first
    residual block at full resolution would hold input, hidden state and output (68 GB at 8192 px in fp16).
    """
    step = prog.steps[i]
    if not isinstance(step, _Pass):
        return None
    for delayed in (False, True):
        for t in step.terms:
            if (t.src == 0 or last[t.src] != i or sum(u.src == t.src for u in step.terms) != 1
                    or prog.shapes[t.src] != prog.shapes[step.dst]):
                continue
            if t.conv is None and not delayed:
                return t.src, False
            if t.conv is not None and delayed and _same(t) and t.up == 1 and max(t.conv.padding) <= 1:
                return t.src, True
    return None


def _needs_stats(prog: _Program) -> set[int]:
    out = set()
    for step in prog.steps:
        if isinstance(step, _Attn):
            out.add(step.src)
        else:
            out.update(t.src for t in step.terms if t.norm is not None)
    return out


# ---------------------------------------------------------------------------------------------- memory and plan


@dataclass(frozen=True)
class TilePlan:
    """How a tiled decode/encode will run: tile (image px), grid, where activations live, layer passes.

    With the activations in host memory the tiles are bands across the whole width (grid (n, 1), `tile` their
    height): stored channels-last, a band is then one contiguous block, copied in one transfer each way."""

    tile: int
    grid: tuple[int, int]  # tiles down, tiles across
    store: str  # device holding the whole-image activations between passes
    passes: int  # steps of the program; each visits every tile (the attention counts as one)
    bands: bool = False  # tiles are bands of whole rows (activations in host memory)

    @property
    def tiles(self) -> int:
        return self.grid[0] * self.grid[1]


def _step_bytes(prog: _Program, batch: int, elem: int) -> list[tuple[int, float, float, int]]:
    """Per step, following the program's liveness: (bytes of whole-image activations alive during it, tile
    temporaries per image px of tile area, outputs waiting to be written per image px of a band of tiles (see
    _in_place), temporaries that do not depend on the tile)."""
    last = _last_use(prog)
    size = lambda i: batch * elem * math.prod(prog.shapes[i])
    px = lambda i: prog.shapes[i][1] * prog.shapes[i][2] / _image_area(prog)
    live = {0: size(0)}
    out = []
    for i, step in enumerate(prog.steps):
        into = _in_place(prog, i, last)
        if into is None:
            live[step.dst] = size(step.dst)
        c = prog.shapes[step.dst][0]
        if isinstance(step, _Attn):
            scores = min(SCORE_BYTES, size(step.src) // c * prog.shapes[step.src][1] * prog.shapes[step.src][2])
            out.append((sum(live.values()), 0.0, 0.0, 6 * size(step.src) + 2 * scores))  # x, norm, q, k, v, out
            continue
        need = 3 * c * px(step.dst)  # the output, one summand, the copy written out
        for t in step.terms:
            need += 2 * prog.shapes[t.src][0] * px(t.src) * t.up * t.up  # normalized input, upsampled copy
        waiting = c * px(step.dst) if into is not None and into[1] else 0.0
        out.append((sum(live.values()), need * batch * elem * WORKSPACE, waiting * batch * elem, 0))
        for s in _reads(step):
            if last.get(s) == i and s != 0:
                live.pop(s, None)
    return out


def _image_area(prog: _Program) -> int:
    """Pixels of the image side of the program: its output when decoding, its input when encoding."""
    side = 0 if prog.take is not None else prog.result
    return prog.shapes[side][1] * prog.shapes[side][2]


def _peak(steps: list[tuple[int, float, float, int]], tile_hw: tuple[int, int], image_hw: tuple[int, int],
          on_device: bool) -> float:
    """Estimated peak device bytes; with activations in host memory, BAND_STREAMS bands are in flight."""
    th, tw = min(tile_hw[0], image_hw[0]), min(tile_hw[1], image_hw[1])
    inflight = 1 if on_device else BAND_STREAMS
    return max((stored if on_device else 0) + inflight * per_px * th * tw + waiting * th * (image_hw[1] + 2 * tw)
               + fixed for stored, per_px, waiting, fixed in steps)


def _free_bytes(device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def _grid(prog: _Program, image_hw: tuple[int, int], tile_hw: tuple[int, int]) -> tuple[int, int]:
    smallest = [min(prog.shapes[i][a] for i in prog.shapes) for a in (1, 2)]
    return tuple(max(1, min(math.ceil(image_hw[a] / tile_hw[a]), smallest[a])) for a in (0, 1))


def _band(tile: int, width: int) -> int:
    """Height of a band of about a tile's area (at least MIN_TILE // 8 rows)."""
    return max(MIN_TILE // 8, tile * tile // width)


def _plan(prog: _Program, image_hw: tuple[int, int], batch: int, device: torch.device, dtype: torch.dtype,
          tile: int | None, offload: bool | None, memory_gb: float | None = None) -> TilePlan:
    free = _free_bytes(device)
    width = image_hw[1]
    if free is None:
        side = tile or DEFAULT_TILE
        hw = (_band(side, width), width) if offload else (side, side)
        return TilePlan(hw[0], _grid(prog, image_hw, hw), "cpu" if offload else str(device), len(prog.steps),
                        bool(offload))
    steps = _step_bytes(prog, batch, torch.finfo(dtype).bits // 8)
    budget = MEMORY_USE * (free if memory_gb is None else min(free, memory_gb * 1e9))
    if offload is None:
        on_device = _peak(steps, (tile or MIN_DEVICE_TILE,) * 2, image_hw, True) <= budget
    else:
        on_device = not offload
    if on_device:
        if tile is None:
            # The largest tile up to TILE_CAP that fits: beyond it the GPU is busy anyway and memory only grows.
            tile = MIN_TILE
            while (tile < min(TILE_CAP, max(image_hw))
                   and _peak(steps, (tile + MIN_TILE,) * 2, image_hw, True) <= budget):
                tile += MIN_TILE
        return TilePlan(tile, _grid(prog, image_hw, (tile, tile)), str(device), len(prog.steps))
    if tile is None:
        # The tallest band of at most TILE_CAP**2 px that fits beside nothing but the weights. Temporaries that
        # do not depend on the band (the whole-latent attention) are left out: they are what they are.
        rows, step = MIN_TILE // 8, MIN_TILE // 8
        banded = [(0, per_px, waiting, 0) for _, per_px, waiting, _ in steps]
        while (rows < image_hw[0] and (rows + step) * width <= TILE_CAP * TILE_CAP
               and _peak(banded, (rows + step, width), image_hw, False) <= budget):
            rows += step
    else:
        rows = _band(tile, width)
    return TilePlan(rows, _grid(prog, image_hw, (rows, width)), "cpu", len(prog.steps), True)


# ---------------------------------------------------------------------------------------------- execution


class _NonFinite(Exception):
    def __init__(self, what: str) -> None:
        super().__init__(what)
        self.what = what


@dataclass
class _Act:
    data: torch.Tensor | None  # (N, C, H, W) on the store device
    sum: torch.Tensor | None = None  # (N, C) float64 on the compute device, whole image
    sumsq: torch.Tensor | None = None


def tile_stats(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-(N, C) sum and sum of squares of a tile, fp32 (no fp16 overflow: the squares are never stored)."""
    s = y.sum(dim=(2, 3), dtype=torch.float32)
    q = torch.linalg.vector_norm(y, 2, dim=(2, 3), dtype=torch.float32)
    return s, q * q


_BN_EPS = 1e-12


@dataclass
class NormParams:
    """A GroupNorm with whole-image statistics: per-(N, G) mean and rstd, the affine weight and bias (fp32)."""

    mean: torch.Tensor
    rstd: torch.Tensor
    weight: torch.Tensor | None
    bias: torch.Tensor | None
    _per_channel: tuple[torch.Tensor, ...] | None = None

    def per_channel(self, channels: int) -> tuple[torch.Tensor, ...]:
        """Per-(N*C) mean, variance, weight and bias for F.batch_norm, computed once per pass, not per tile."""
        if self._per_channel is None:
            n, per = self.mean.shape[0], channels // self.mean.shape[1]
            mean_c = self.mean.float().repeat_interleave(per, dim=1).reshape(-1)
            # batch_norm adds an eps of its own and refuses 0 on CUDA: hand it var + norm eps less that tiny one.
            var_c = (self.rstd.float().pow(-2) - _BN_EPS).repeat_interleave(per, dim=1).reshape(-1)
            wt = None if self.weight is None else self.weight.float().repeat(n)
            bs = None if self.bias is None else self.bias.float().repeat(n)
            self._per_channel = (mean_c, var_c, wt, bs)
        return self._per_channel


def _triton_groupnorm(x: torch.Tensor):
    """kernels.groupnorm where its Triton kernels run on x's device (a GPU), else None."""
    if x.device.type == "cpu":
        return None
    try:
        from .fusions.base import kernel_module

        groupnorm = kernel_module("groupnorm")
    except ImportError:
        return None
    return groupnorm if groupnorm.supported(x) else None


def norm_apply(x: torch.Tensor, params: NormParams, silu: bool) -> torch.Tensor:
    """GroupNorm of x (a tile, maybe a strided view) with whole-image statistics, then SiLU when asked.

    Computes in fp32 and returns x's dtype, as torch's own GroupNorm does. On a GPU, the Triton kernel of the
    torch path (kernels/groupnorm.py) normalizes, scales and applies SiLU in one pass; elsewhere an eval-mode
    batch norm over (1, N*C, H, W), one kernel that takes given per-channel statistics.
    """
    kernel = _triton_groupnorm(x)
    if kernel is not None:
        return kernel.group_norm_apply(x, params.mean, params.rstd, params.weight, params.bias, silu)
    n, c, h, w = x.shape
    mean_c, var_c, wt, bs = params.per_channel(c)
    y = F.batch_norm(x.reshape(1, n * c, h, w), mean_c, var_c, wt, bs, False, 0.0, _BN_EPS).view(n, c, h, w)
    return F.silu(y, inplace=True) if silu else y


def _norm_params(act: _Act, norm: nn.GroupNorm, count: int, ctx: _Ctx) -> NormParams:
    """NormParams for a GroupNorm of `act`, from the per-channel sums its producer gathered over all tiles."""
    n, c = act.sum.shape
    g = norm.num_groups
    cnt = count * (c // g)
    mean = act.sum.view(n, g, c // g).sum(-1) / cnt
    var = (act.sumsq.view(n, g, c // g).sum(-1) / cnt - mean * mean).clamp_min(0.0)
    return NormParams(mean.float(), torch.rsqrt(var + norm.eps).float(), ctx.param(norm.weight, torch.float32),
                      ctx.param(norm.bias, torch.float32))


@dataclass
class _Ctx:
    device: torch.device
    dtype: torch.dtype
    store: torch.device
    grid: tuple[int, int]
    progress: Progress
    bands: bool = False  # whole-image activations in host memory, channels-last, computed in bands of rows
    spare: list[torch.Tensor] = field(default_factory=list)  # host byte buffers free for reuse in this run
    owned: dict[int, torch.Tensor] = field(default_factory=dict)  # data_ptr -> host byte buffer used in this run
    side: list = field(default_factory=list)  # side streams (see streams())

    def param(self, p: torch.Tensor | None, dtype: torch.dtype | None = None) -> torch.Tensor | None:
        return None if p is None else p.to(self.device, dtype or self.dtype)

    def alloc(self, shape: tuple[int, ...]) -> torch.Tensor:
        if not self.bands:
            return torch.empty(shape, device=self.store, dtype=self.dtype)
        n, c, h, w = shape
        # Channels-last, so that a band of whole rows is one contiguous block.
        size = n * c * h * w * torch.finfo(self.dtype).bits // 8
        buf = _take(self.spare, size)
        if buf is None and self.device.type == "cuda":
            buf = _host_buffer(size)
        if buf is None:
            buf = torch.empty(size, dtype=torch.uint8)
        t = buf[:size].view(self.dtype).view(n, h, w, c)
        self.owned[t.data_ptr()] = buf
        return t.permute(0, 3, 1, 2)

    def streams(self) -> list:
        """The streams tiles alternate between: two side streams for bands on a GPU, so that one band's copies
        to and from host memory overlap the other's compute; [None] (the current stream) otherwise."""
        if not (self.bands and self.device.type == "cuda"):
            return [None]
        if not self.side:
            self.side = [torch.cuda.Stream(self.device) for _ in range(BAND_STREAMS)]
        return self.side

    def keep(self, y: torch.Tensor) -> torch.Tensor:
        """A whole-image activation computed in one piece, moved to the store."""
        if not self.bands:
            return y.to(self.store).contiguous()
        return self.alloc(tuple(y.shape)).copy_(y, non_blocking=True)

    def recycle(self, t: torch.Tensor) -> None:
        """Hand a host activation that no later pass reads back for reuse in this run."""
        buf = self.owned.get(t.data_ptr()) if self.bands else None
        if buf is not None:
            self.spare.append(buf)

    def release(self) -> None:
        """Return this run's page-locked buffers to the process pool (see _host_buffer)."""
        buffers = list({b.data_ptr(): b for b in self.owned.values()}.values())
        self.owned.clear()
        self.spare.clear()
        if self.device.type == "cuda" and buffers:
            torch.cuda.synchronize(self.device)
            _return_host_buffers([b for b in buffers if b.data_ptr() in _PINNED])


def _take(buffers: list[torch.Tensor], size: int) -> torch.Tensor | None:
    """The smallest buffer of at least `size` bytes, removed from `buffers`."""
    fits = [i for i, b in enumerate(buffers) if b.numel() >= size]
    if not fits:
        return None
    return buffers.pop(min(fits, key=lambda i: buffers[i].numel()))


# Page-locked host buffers. Page-locking fresh memory cost ~0.7 s per GB on an H100 host (the kernel faults and
# zeroes every page first), ~12x the copies it speeds up at 4096 px: so buffers are kept for the next run, up to
# HOST_KEEP of the machine's memory. torch's pinned allocator is not used: it rounds sizes up to a power of two.
HOST_KEEP = 1 / 8
_PINNED: set[int] = set()  # data_ptr of every buffer this module registered
_POOL: list[torch.Tensor] = []  # registered buffers no run is using
_POOL_LOCK = threading.Lock()


def _host_buffer(size: int) -> torch.Tensor | None:
    """A page-locked host byte buffer of at least `size` bytes, from the pool or new; None where the runtime
    cannot page-lock (the run then copies through pageable memory: slower)."""
    with _POOL_LOCK:
        buf = _take(_POOL, size)
    if buf is not None:
        return buf
    # Faulting the pages in first, on all of torch's threads, made page-locking 4 GB take 0.5 s instead of 2.1 s.
    buf = torch.empty(size, dtype=torch.uint8).zero_()
    try:
        err = torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), size, 0)
    except (AttributeError, RuntimeError):
        return None
    if int(getattr(err, "value", err)) != 0:
        return None
    _PINNED.add(buf.data_ptr())
    return buf


def _return_host_buffers(buffers: list[torch.Tensor]) -> None:
    limit = HOST_KEEP * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else 0
    with _POOL_LOCK:
        pool = sorted(_POOL + buffers, key=torch.Tensor.numel)
        _POOL.clear()
        kept = 0
        for b in pool:
            if kept + b.numel() <= limit:
                _POOL.append(b)
                kept += b.numel()
            else:
                _unregister(b)


def _unregister(buf: torch.Tensor) -> None:
    torch.cuda.cudart().cudaHostUnregister(buf.data_ptr())
    _PINNED.discard(buf.data_ptr())


def release_host_memory() -> None:
    """Unlock and free the page-locked host buffers kept for later tiled decodes."""
    with _POOL_LOCK:
        if _POOL:
            torch.cuda.synchronize()
        for b in _POOL:
            _unregister(b)
        _POOL.clear()


def _bounds(n: int, parts: int) -> list[tuple[int, int]]:
    return [(i * n // parts, (i + 1) * n // parts) for i in range(parts)]


@dataclass
class _Axis:
    r0: int  # stored rows read
    r1: int
    c0: int  # crop of the (upsampled) rows that the conv reads
    c1: int
    z0: int  # zeros added before / after them
    z1: int
    p: int  # padding the conv itself adds
    o0: int  # crop of the conv's output
    o1: int


def _same(t: _Term) -> bool:
    """A stride-1 conv whose own zero padding keeps the size: it can run on the slice as is and be cropped after."""
    c = t.conv
    return (tuple(c.stride) == (1, 1) and not any(t.pad)
            and all(c.kernel_size[a] == 2 * c.padding[a] + 1 for a in (0, 1)))


def _axis(o0: int, o1: int, n: int, t: _Term, a: int) -> _Axis:
    """What conv outputs [o0, o1) along axis a read, with positions outside the image as the zeros the conv pads."""
    k, s, p = t.conv.kernel_size[a], t.conv.stride[a], t.conv.padding[a]
    up = t.up
    if _same(t):
        # Padding the slice by p where it ends inside the image only spoils the p outputs cropped away.
        a0, a1 = max(o0 - p, 0), min(o1 + p, n * up)
        r0, r1 = a0 // up, -(-a1 // up)
        return _Axis(r0, r1, 0, (r1 - r0) * up, 0, 0, p, o0 - r0 * up, o1 - r0 * up)
    pad_lo = t.pad[2] if a == 0 else t.pad[0]
    lo = o0 * s - p - pad_lo
    hi = (o1 - 1) * s - p - pad_lo + k
    a0, a1 = max(lo, 0), min(hi, n * up)
    r0, r1 = a0 // up, -(-a1 // up)
    return _Axis(r0, r1, a0 - r0 * up, a1 - r0 * up, a0 - lo, hi - a1, 0, 0, o1 - o0)


def _term(t: _Term, act: _Act, box: tuple[int, int, int, int], ctx: _Ctx, prep: dict) -> torch.Tensor:
    y0, y1, x0, x1 = box
    x = act.data
    if t.conv is None:
        return x[:, :, y0:y1, x0:x1].to(ctx.device, non_blocking=True)
    ay, ax = _axis(y0, y1, x.shape[2], t, 0), _axis(x0, x1, x.shape[3], t, 1)
    v = x[:, :, ay.r0:ay.r1, ax.r0:ax.r1].to(ctx.device, non_blocking=True)
    if t.norm is not None:
        v = norm_apply(v, prep["norm"], t.silu)
    elif t.silu:
        v = F.silu(v)
    if t.up > 1:
        v = F.interpolate(v, scale_factor=t.up, mode="nearest")
    if (ay.c0, ay.c1, ax.c0, ax.c1) != (0, v.shape[2], 0, v.shape[3]):
        v = v[:, :, ay.c0:ay.c1, ax.c0:ax.c1]
    if ay.z0 or ay.z1 or ax.z0 or ax.z1:
        v = F.pad(v, (ax.z0, ax.z1, ay.z0, ay.z1))
    y = F.conv2d(v, prep["w"], prep["b"], t.conv.stride, (ay.p, ax.p), 1, t.conv.groups)
    return y[:, :, ay.o0:ay.o1, ax.o0:ax.o1]


def _prepare(t: _Term, env: dict[int, _Act], ctx: _Ctx, count: dict[int, int]) -> dict:
    prep = {}
    if t.conv is not None:
        prep["w"], prep["b"] = ctx.param(t.conv.weight), ctx.param(t.conv.bias)
    if t.norm is not None:
        prep["norm"] = _norm_params(env[t.src], t.norm, count[t.src], ctx)
    return prep


def _run_pass(step: _Pass, env: dict[int, _Act], ctx: _Ctx, shape: tuple[int, int, int],
              into: tuple[int, bool] | None, stats: bool, count: dict[int, int]) -> _Act:
    n = env[step.terms[0].src].data.shape[0]
    rows, cols = _bounds(shape[1], ctx.grid[0]), _bounds(shape[2], ctx.grid[1])
    single = len(rows) * len(cols) == 1  # the one tile's result is the activation: no buffer to copy it into
    out = _Act(None if single else env[into[0]].data if into is not None else ctx.alloc((n, *shape)))
    delayed = into is not None and into[1]
    preps = [_prepare(t, env, ctx, count) for t in step.terms]
    streams = ctx.streams()
    side = [st for st in streams if st is not None]
    sums = [torch.zeros(2, n, shape[0], dtype=torch.float64, device=ctx.device) for _ in streams] if stats else []
    main = torch.cuda.current_stream(ctx.device) if side else None
    for st in side:
        st.wait_stream(main)
    waiting: list[tuple[int, tuple[int, int, int, int], torch.Tensor, Any]] = []
    for i, (y0, y1) in enumerate(rows):
        for j, (x0, x1) in enumerate(cols):
            done = i * len(cols) + j
            st = streams[done % len(streams)]
            with _on(st):
                box = (y0, y1, x0, x1)
                y = _term(step.terms[0], env[step.terms[0].src], box, ctx, preps[0])
                for t, prep in zip(step.terms[1:], preps[1:]):
                    y = y + _term(t, env[t.src], box, ctx, prep)
                if step.scale != 1.0:
                    y = y / step.scale
                if stats:
                    acc = sums[done % len(streams)]
                    s_, q_ = tile_stats(y)
                    acc[0] += s_
                    acc[1] += q_
                ctx.progress.advance(1)
                if single:
                    out.data = ctx.keep(y)
                    continue
                if ctx.bands:  # one contiguous block each way
                    y = y.contiguous(memory_format=torch.channels_last)
                # A tile overwriting its own conv input waits for the last neighbour reading it: (i+1, j+1) in this
                # order. Its copy is then issued on that neighbour's stream, after the neighbour's reads.
                ready = min(i + 1, len(rows) - 1) * len(cols) + min(j + 1, len(cols) - 1) if delayed else -1
                waiting.append((ready, box, y, _event(st)))
                while waiting and waiting[0][0] <= done:
                    _, (a0, a1, b0, b1), ready_y, made = waiting.pop(0)
                    if st is not None:
                        st.wait_event(made)
                        ready_y.record_stream(st)
                    out.data[:, :, a0:a1, b0:b1].copy_(ready_y, non_blocking=True)
    for st in side:
        main.wait_stream(st)
    if stats:
        total = torch.stack(sums).sum(0)
        out.sum, out.sumsq = total[0], total[1]
    return out


def _on(stream):
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def _event(stream):
    if stream is None:
        return None
    ev = torch.cuda.Event()
    ev.record(stream)
    return ev


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, chunk: int | None = None) -> torch.Tensor:
    """Attention over all keys, for query chunks of `chunk` rows (all at once when None): exact either way.

    On out-of-memory the chunk shrinks, so a 1M-token latent (8192 px) still runs where the math kernel is chosen.
    Heads wider than the fused kernels take (the SD VAE's single 512-wide head) go through two GEMMs and a softmax
    per chunk instead: on an H100 SDPA's fallback kernel took 2.2 s for a 4096 px decode's 262k tokens.
    """
    rows = q.shape[2]
    wide = q.is_cuda and q.shape[-1] > FUSED_HEAD_DIM
    if chunk is None and wide:
        chunk = max(64, SCORE_BYTES // (q.shape[0] * q.shape[1] * k.shape[2] * q.element_size()))
    chunk = chunk or rows
    while True:
        try:
            if chunk >= rows and not wide:
                return F.scaled_dot_product_attention(q, k, v, scale=scale)
            out = torch.empty_like(q)
            kt = k.transpose(-1, -2)
            for i in range(0, rows, chunk):
                if wide:
                    out[:, :, i:i + chunk] = torch.matmul(torch.matmul(q[:, :, i:i + chunk] * scale, kt).softmax(-1), v)
                else:
                    out[:, :, i:i + chunk] = F.scaled_dot_product_attention(q[:, :, i:i + chunk], k, v, scale=scale)
            return out
        except _OOM:
            if chunk <= 64:
                raise
            chunk = max(64, min(chunk, rows) // 4)


def _run_attn(step: _Attn, env: dict[int, _Act], ctx: _Ctx, count: dict[int, int], stats: bool) -> _Act:
    src = env[step.src]
    x = src.data.to(ctx.device)
    n, c, h, w = x.shape
    hn = norm_apply(x, _norm_params(src, step.norm, count[step.src], ctx), False)
    tokens = hn.flatten(2).transpose(1, 2)
    del hn
    heads = lambda t: t.view(n, h * w, step.heads, -1).transpose(1, 2)
    proj = lambda t, wb: F.linear(t, ctx.param(wb[0]), ctx.param(wb[1]))
    q, k, v = (heads(proj(tokens, wb)) for wb in (step.q, step.k, step.v))
    del tokens
    o = _sdpa(q, k, v, step.scale)
    del q, k, v
    o = proj(o.transpose(1, 2).reshape(n, h * w, -1), step.out).transpose(1, 2).reshape(n, c, h, w)
    if step.residual:
        o = o + x
    if step.rescale != 1.0:
        o = o / step.rescale
    out = _Act(ctx.keep(o))
    if stats:
        s, sq = tile_stats(o)
        out.sum, out.sumsq = s.double(), sq.double()
    ctx.progress.advance(ctx.grid[0] * ctx.grid[1])
    return out


def _execute(prog: _Program, x: torch.Tensor, ctx: _Ctx, stage: str) -> torch.Tensor:
    last, stats = _last_use(prog), _needs_stats(prog)
    ctx.progress.stage(stage, total=ctx.grid[0] * ctx.grid[1] * len(prog.steps))
    env = {0: _Act(x.to(ctx.store, ctx.dtype))}
    count = {i: s[1] * s[2] for i, s in prog.shapes.items()}
    # Whether each normalized activation was finite, as device flags: read once at the end, to name the layer
    # that overflowed (an Inf or NaN anywhere reaches the output, as the statistics then are not finite).
    finite: list[tuple[str, torch.Tensor]] = []
    for i, step in enumerate(prog.steps):
        if isinstance(step, _Attn):
            env[step.dst] = _run_attn(step, env, ctx, count, step.dst in stats)
        else:
            env[step.dst] = _run_pass(step, env, ctx, prog.shapes[step.dst], _in_place(prog, i, last),
                                      step.dst in stats, count)
        if step.dst in stats:
            act = env[step.dst]
            finite.append((step.what, torch.isfinite(act.sum).all() & torch.isfinite(act.sumsq).all()))
        for s in _reads(step):
            if last[s] == i and s in env:
                gone = env.pop(s).data
                if s != 0 and gone is not None and gone.data_ptr() != env[step.dst].data.data_ptr():
                    ctx.recycle(gone)
    ctx.progress.done()
    out = env[prog.result].data
    if prog.take is not None:
        out = out[:, :prog.take].contiguous()
    out = out.to(ctx.device)
    if prog.tanh:
        out = torch.tanh(out)
    if not bool(torch.isfinite(out).all()):
        raise _NonFinite(next((what for what, ok in finite if not bool(ok)), prog.steps[-1].what))
    return out


# ---------------------------------------------------------------------------------------------- public API


def _check_tile(tile: int | None, overlap: int | None) -> None:
    for name, v in (("tile", tile), ("overlap", overlap)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
            raise BadInput(f"{name} must be a whole number of pixels, got {v!r}.", f"Pass {name} as an int.")
    if tile is not None and tile <= 0:
        raise BadInput(f"tile must be a positive size in pixels, got {tile}.",
                       "Pass a tile of at least 64 px, or None to choose it from free memory.")
    if overlap is not None and overlap < 0:
        raise BadInput(f"overlap must not be negative, got {overlap}.", "Pass an overlap of 0 or more pixels.")
    if tile is not None and overlap is not None and tile <= overlap:
        raise BadInput(f"tile ({tile} px) must be larger than its overlap ({overlap} px).",
                       "Use a larger tile or a smaller overlap (e.g. tile 512, overlap 64).")


def _check_input(x: torch.Tensor, channels: int, name: str, example: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise BadInput(f"{name} must be a torch.Tensor, got {type(x).__name__}.", f"Pass {name} as {example}.")
    if x.dim() != 4:
        fix = f"Add the batch dimension ({name}[None])." if x.dim() == 3 else f"Pass {name} as {example}."
        raise BadInput(f"{name} must have 4 dimensions {example}, got shape {tuple(x.shape)}.", fix)
    if x.shape[1] != channels:
        hint = (f" It looks channels-last: pass {name}.movedim(-1, 1)." if x.shape[-1] == channels else "")
        raise BadInput(f"{name} have {x.shape[1]} channels but this VAE takes {channels} ({example}).",
                       f"Pass {name} made for this VAE.{hint}")
    if x.shape[2] < 1 or x.shape[3] < 1:
        raise BadInput(f"{name} are empty: shape {tuple(x.shape)}.", f"Pass {name} with at least one pixel.")
    if not x.is_floating_point():
        raise BadInput(f"{name} must be floating point, got {x.dtype}.", f"Pass {name}.float().")
    if not bool(torch.isfinite(x).all()):
        bad = "NaN" if bool(torch.isnan(x).any()) else "Inf"
        raise BadInput(f"{name} contain {bad} values; decoding them would give a black or broken image.",
                       "Check the sampler's output (fp16 overflow, a broken LoRA or a too high CFG) before the VAE.")


def _device_dtype(module: nn.Module) -> tuple[torch.device, torch.dtype]:
    p = next(module.parameters())
    return p.device, p.dtype


def _run(prog: _Program, x: torch.Tensor, module: nn.Module, image_hw: tuple[int, int], tile: int | None,
         offload: bool | None, memory_gb: float | None, progress: Progress | None, stage: str) -> torch.Tensor:
    device, dtype = _device_dtype(module)
    progress = progress or NullProgress()
    compute = dtype
    while True:
        plan = _plan(prog, image_hw, x.shape[0], device, compute, tile, offload, memory_gb)
        ctx = _Ctx(device, compute, torch.device(plan.store), plan.grid, progress, bands=plan.bands)
        try:
            return _execute(prog, x, ctx, stage).to(dtype)
        except _NonFinite as e:
            if compute == torch.float32:
                raise AccelError(f"the VAE produced NaN or Inf at {e.what} even in fp32.",
                                 "Check the VAE weights; the input was finite.") from None
            warnings.warn(f"{stage}: {compute} overflowed at {e.what}; running again in fp32.", stacklevel=4)
            compute = torch.float32
            continue
        except _OOM:
            if offload is not None or ctx.store != ctx.device:
                raise
        finally:
            ctx.release()
        # Here, past the except block, the failed attempt's tensors are already freed.
        torch.cuda.empty_cache()
        warnings.warn(f"{stage}: out of GPU memory with the activations on the GPU; keeping them in host memory "
                      "instead (slower).", stacklevel=4)
        offload = True


def tile_plan(vae, x: torch.Tensor, encode: bool = False, tile: int | None = None,
              offload: bool | None = None, memory_gb: float | None = None) -> TilePlan:
    """The plan decode(vae, x) (or encode, with encode=True) would follow: tile, grid, store device, passes."""
    _check_tile(tile, None)
    parts = _parts(vae)
    _first_conv(parts, encode)
    module = parts.encoder if encode else parts.decoder
    prog = (_encode_program if encode else _decode_program)(parts, tuple(x.shape[1:]))
    hw = tuple(x.shape[2:]) if encode else prog.shapes[prog.result][1:]
    device, dtype = _device_dtype(module)
    return _plan(prog, hw, x.shape[0], device, dtype, tile, offload, memory_gb)


@torch.no_grad()
def decode(vae, latents: torch.Tensor, tile: int | None = None, overlap: int | None = None,
           progress: Progress | None = None, *, offload: bool | None = None,
           memory_gb: float | None = None) -> torch.Tensor:
    """Decode latents in tiles to the image the untiled decode gives (N, 3, H*f, W*f), in the VAE's dtype.

    latents: what the VAE's own decode() takes, i.e. the sampler's latent already divided by the scaling factor.
    tile: tile side in image pixels; None picks it from free GPU memory (512 off CUDA). overlap: accepted for the same
    call as `naive_tiled_decode` and checked against tile; exact tiles need no overlap, so it changes nothing.
    progress: gets stage("vae decode", tiles * passes) and one advance per tile per pass.
    offload: keep whole-image activations in host memory (True), on the device (False), or decide from free
    memory (None). memory_gb: GPU memory (GB) the decode may use beyond what is already allocated; None: what is
    free. fp16/bf16 decodes that overflow are run again in fp32, with a warning.
    """
    _check_tile(tile, overlap)
    parts = _parts(vae)
    _check_input(latents, _first_conv(parts, False).in_channels, "latents", "(N, C, h, w)")
    prog = _decode_program(parts, tuple(latents.shape[1:]))
    return _run(prog, latents, parts.decoder, prog.shapes[prog.result][1:], tile, offload, memory_gb, progress,
                "vae decode")


@torch.no_grad()
def encode(vae, images: torch.Tensor, tile: int | None = None, overlap: int | None = None,
           progress: Progress | None = None, *, offload: bool | None = None,
           memory_gb: float | None = None) -> torch.Tensor:
    """Encode images (N, 3, H, W) in [-1, 1] in tiles to the latent mean the untiled encoder gives.

    Returns diffusers' `vae.encode(images).latent_dist.mean` (the first half of the moments; ComfyUI's encode gives
    the same), not yet multiplied by the scaling factor. tile, overlap, progress ("vae encode"), offload and
    memory_gb as in `decode`.
    """
    _check_tile(tile, overlap)
    parts = _parts(vae)
    _check_input(images, _first_conv(parts, True).in_channels, "images", "(N, 3, H, W) in [-1, 1]")
    prog = _encode_program(parts, tuple(images.shape[1:]))
    return _run(prog, images, parts.encoder, tuple(images.shape[2:]), tile, offload, memory_gb, progress,
                "vae encode")


def _ramp(n: int, fade_lo: int, fade_hi: int) -> torch.Tensor:
    """Weights along one axis of a tile: rising over fade_lo pixels, falling over fade_hi, 1 in between."""
    i = torch.arange(n, dtype=torch.float32)
    w = torch.ones(n)
    if fade_lo:
        w = torch.minimum(w, (i + 1) / (fade_lo + 1))
    if fade_hi:
        w = torch.minimum(w, (n - i) / (fade_hi + 1))
    return w


def _starts(n: int, size: int, step: int) -> list[int]:
    if size >= n:
        return [0]
    starts = list(range(0, n - size, step))
    return starts + [n - size]


@torch.no_grad()
def naive_tiled_decode(vae, latents: torch.Tensor, tile: int = 512, overlap: int = 64) -> torch.Tensor:
    """The baseline: decode each tile on its own (its own GroupNorm statistics) and feather-blend the overlaps.

    What ComfyUI's VAEDecodeTiled does; tile and overlap are image pixels. Kept to measure `decode` against.
    """
    _check_tile(tile, overlap)
    parts = _parts(vae)
    _check_input(latents, _first_conv(parts, False).in_channels, "latents", "(N, C, h, w)")
    device, dtype = _device_dtype(parts.decoder)
    z = latents.to(device, dtype)
    prog = _decode_program(parts, tuple(z.shape[1:]))
    f = prog.shapes[prog.result][1] // z.shape[2]
    lt, lo = tile // f, overlap // f
    if lt <= lo or lt < 1:
        raise BadInput(f"tile {tile} px and overlap {overlap} px leave no latent tile at this VAE's {f}x scale.",
                       f"Use a tile of at least {f * (lo + 1)} px.")
    n, _, h, w = z.shape
    out = torch.zeros(n, prog.shapes[prog.result][0], h * f, w * f, device=device, dtype=torch.float32)
    weight = torch.zeros(1, 1, h * f, w * f, device=device)
    ys, xs = _starts(h, lt, lt - lo), _starts(w, lt, lt - lo)
    for y in ys:
        for x in xs:
            zt = z[:, :, y:y + lt, x:x + lt]
            if parts.post_quant_conv is not None:
                zt = parts.post_quant_conv(zt)
            img = parts.decoder(zt).float()
            th, tw = img.shape[2:]
            wy = _ramp(th, overlap if y > 0 else 0, overlap if y + lt < h else 0)
            wx = _ramp(tw, overlap if x > 0 else 0, overlap if x + lt < w else 0)
            wt = (wy[:, None] * wx[None, :]).to(device)
            out[:, :, y * f:y * f + th, x * f:x * f + tw] += img * wt
            weight[:, :, y * f:y * f + th, x * f:x * f + tw] += wt
    return (out / weight).to(dtype)

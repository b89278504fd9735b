"""The VAE as a short program of layer passes, each of which a tile can compute on its own.

A pass writes one whole-image activation as a sum of terms conv(upsample(silu(norm(src)))); a GroupNorm only ever
sits at a term's input, so the statistics it needs are complete (gathered by the producing pass) before the pass
starts. The mid-block attention is the one step that is not a pass: it reads the whole activation at once.
Activations are numbered; `_Program.shapes` gives each one's (C, H, W). The builders here check every layer they
take, so a VAE the tiled path cannot compute exactly is refused up front rather than decoded wrongly; forms.py walks
the two model forms with them, and the liveness helpers at the end tell the planner and the executor what each step
reads and what it may overwrite.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from ..errors import UnsupportedModel


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


# ----- liveness: what each step reads, when an activation is last read, what may be overwritten


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
    residual block at full resolution would hold its input, hidden state and output at once, the largest
    activations of the whole decode.
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


def _same(t: _Term) -> bool:
    """A stride-1 conv whose own zero padding keeps the size: it can run on the slice as is and be cropped after."""
    c = t.conv
    return (tuple(c.stride) == (1, 1) and not any(t.pad)
            and all(c.kernel_size[a] == 2 * c.padding[a] + 1 for a in (0, 1)))

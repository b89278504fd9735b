"""The baseline `decode` is measured against: each tile decoded on its own, overlaps feather-blended.

What ComfyUI's VAEDecodeTiled does. Each tile normalizes with its own GroupNorm statistics, so tiles disagree (seams,
colour shifts) however wide the overlap; kept to show and measure that difference.
"""

from __future__ import annotations

import torch

from ..errors import BadInput
from .execute import _check_input, _check_tile, _device_dtype
from .forms import _decode_program, _first_conv, _parts


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

"""Tiled against untiled VAE decode: time, peak memory above the weights, and PSNR against the untiled image.

The SD VAE is built from its published config with seeded random weights (nothing is downloaded). One size also
compares `decode` and `naive_tiled_decode` (per-tile GroupNorm, what ComfyUI's VAEDecodeTiled does) at the same tile
and overlap, by PSNR against the untiled decode. `bench_video_vae`: ComfyUI's Wan VAEs, their own decode against
`decode_video` limited to half the memory the untiled decode took.
"""

from __future__ import annotations

import math
import statistics
import time
import warnings
from typing import Callable

import torch

from ..errors import BackendUnavailable
from ..models.configs import build_comfy_video_vae, build_vae, COMFY_VIDEO_VAE_CONFIGS
from ..vae import decode, decode_video, naive_tiled_decode, tile_plan, video_plan
from .video_sizes import parse_video_sizes
from ..vae.memory import _OOM

SIZES = (512, 1024, 2048, 4096, 8192)
TINY_SIZES = (64, 128, 256)
PSNR_SIZE = 2048
# The memory limit of the "capped" tiled decode (GB above the weights): the tiled VAE issue's 4096 px target.
CAPPED_GB = 4.0
SEED = 0


def psnr(x: torch.Tensor, ref: torch.Tensor) -> float:
    """PSNR in dB of x against ref, taking ref's value range as the peak (random-weight VAEs leave [-1, 1])."""
    x, ref = x.float(), ref.float()
    mse = float(((x - ref) ** 2).mean())
    peak = float(ref.max() - ref.min())
    return math.inf if mse == 0 else 10 * math.log10(peak * peak / mse)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _measure(fn: Callable[[], torch.Tensor], device: torch.device,
             runs: int | None) -> tuple[float, float | None, torch.Tensor, list[str]]:
    """(median ms of `runs` runs, peak GB above what was allocated before, last output, warnings) after a warm-up.

    runs=None: 3, or 1 where a run takes seconds. Raises the out-of-memory error when the decode does not fit.
    """
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device) if cuda else 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t0 = time.perf_counter()
        out = fn()
        _sync(device)
        first = time.perf_counter() - t0
        runs = runs or (1 if first > 5 else 3)
        times = []
        for _ in range(runs):
            out = None
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                out = fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                out = fn()
                times.append(1000 * (time.perf_counter() - t0))
    peak = (torch.cuda.max_memory_allocated(device) - base) / 1e9 if cuda else None
    notes = sorted({str(w.message) for w in caught})
    return statistics.median(times), peak, out, notes


def _fused_untiled(vae, z: torch.Tensor, ref: torch.Tensor, dev: torch.device, runs: int | None) -> dict:
    """Untiled decode with the torch path's kernels: Triton GroupNorm(+SiLU) on channels_last."""
    from ..engine import fusions

    undo, _ = fusions.apply(vae, ["groupnorm"])
    vae.to(memory_format=torch.channels_last)
    try:
        zc = z.contiguous(memory_format=torch.channels_last)
        ms, peak, out, _ = _measure(lambda: vae.decode(zc).sample, dev, runs)
        err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
        return {"fused_untiled_ms": ms, "fused_untiled_peak_gb": peak, "fused_rel_err": err}
    finally:
        undo()
        vae.to(memory_format=torch.contiguous_format)


def bench_vae(device: str = "cuda", sizes: tuple[int, ...] | None = None, tiny: bool = False,
              runs: int | None = None, memory_gb: float | None = CAPPED_GB) -> list[dict]:
    """One row per image size: untiled and tiled decode time (ms) and peak memory above the weights (GB).

    Full run: the SD VAE in fp16 on `device` at 512..8192 px, the tile chosen from free memory; sizes that do not
    fit read "OOM". On a GPU the tiled decode is timed again with `memory_gb` as its memory limit ("capped_*":
    activations in host memory, bands of rows), unless memory_gb is None. tiny=True: the tiny VAE in fp32 on the
    CPU at small sizes, in 4x4 tiles (no peak memory there).
    At 2048 px (or the largest size) the row also holds the PSNR against the untiled decode of `decode` and of
    `naive_tiled_decode` at the same tile and overlap. runs: timed runs per figure (None: 3, 1 for slow ones).
    """
    if tiny:
        dev, dtype, sizes = torch.device("cpu"), torch.float32, sizes or TINY_SIZES
    else:
        dev, dtype, sizes = torch.device(device), torch.float16, sizes or SIZES
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise BackendUnavailable("the VAE benchmark needs a CUDA GPU and none is visible.",
                                     "Run it on a GPU machine, or pass --tiny for the CPU version.")
    vae = build_vae("tiny" if tiny else "sd", seed=SEED, device=dev, dtype=dtype)
    scale = 2 ** (len(vae.config.block_out_channels) - 1)
    psnr_size = PSNR_SIZE if PSNR_SIZE in sizes else max(sizes)
    rows = []
    for size in sizes:
        g = torch.Generator().manual_seed(SEED)
        z = torch.randn(1, vae.config.latent_channels, size // scale, size // scale, generator=g).to(dev, dtype)
        tile = max(scale, size // 4) if tiny else None
        plan = tile_plan(vae, z, tile=tile)
        row = dict(size=size, dtype=str(dtype).replace("torch.", ""), device=str(dev), untiled_ms=None,
                   untiled_peak_gb=None, tiled_ms=None, tiled_peak_gb=None, tile=plan.tile,
                   grid=f"{plan.grid[0]}x{plan.grid[1]}", store=plan.store, capped_ms=None, capped_peak_gb=None,
                   capped_plan=None, compare_tile=None,
                   psnr_tiled_db=None, psnr_naive_db=None, notes="")
        ref = None
        try:
            row["untiled_ms"], row["untiled_peak_gb"], ref, _ = _measure(lambda: vae.decode(z).sample, dev, runs)
        except _OOM:
            row["untiled_ms"] = row["untiled_peak_gb"] = "OOM"
        if ref is not None and dev.type == "cuda" and size <= 2048:
            row.update(_fused_untiled(vae, z, ref, dev, runs))
        try:
            row["tiled_ms"], row["tiled_peak_gb"], _, notes = _measure(lambda: decode(vae, z, tile=tile), dev, runs)
            row["notes"] = "; ".join(notes)
        except _OOM:
            row["tiled_ms"] = row["tiled_peak_gb"] = "OOM"
        if memory_gb is not None and dev.type == "cuda":
            capped = tile_plan(vae, z, memory_gb=memory_gb)
            row["capped_plan"] = f"{capped.tile} px x {capped.grid[0]}x{capped.grid[1]} on {capped.store}"
            try:
                row["capped_ms"], row["capped_peak_gb"], _, _ = _measure(
                    lambda: decode(vae, z, memory_gb=memory_gb), dev, runs)
            except _OOM:
                row["capped_ms"] = row["capped_peak_gb"] = "OOM"
        if size == psnr_size and ref is not None:
            # ComfyUI's defaults, 512 px tiles with 64 px overlap, at 2048 px; the same proportions elsewhere.
            side = max(scale * 2, size // 4 // scale * scale)
            overlap = max(scale, side // 8 // scale * scale)
            row["compare_tile"] = f"{side}/{overlap}"
            row["psnr_tiled_db"] = psnr(decode(vae, z, tile=side, overlap=overlap), ref)
            row["psnr_naive_db"] = psnr(naive_tiled_decode(vae, z, tile=side, overlap=overlap), ref)
        del ref
        rows.append(row)
    return rows


# The table's columns: (row key, heading, format); a column no row has a figure for (the GPU-only ones on the CPU)
# is left out.
_COLUMNS = (("size", "px", "d"), ("untiled_ms", "untiled ms", ".1f"), ("untiled_peak_gb", "untiled GB", ".2f"),
            ("fused_untiled_ms", "fused ms", ".1f"), ("tiled_ms", "tiled ms", ".1f"),
            ("tiled_peak_gb", "tiled GB", ".2f"), ("tile", "tile", "d"), ("grid", "grid", ""), ("store", "store", ""),
            ("capped_ms", "capped ms", ".1f"), ("capped_peak_gb", "capped GB", ".2f"),
            ("psnr_tiled_db", "tiled dB", ".1f"), ("psnr_naive_db", "naive dB", ".1f"))


def _cell(value: object, spec: str) -> str:
    if value is None:
        return "-"
    return value if isinstance(value, str) else format(value, spec)


def _grid_text(rows: list[dict], columns: tuple, under: Callable[[dict], list[str]] = lambda r: []) -> str:
    """The rows under a heading of `columns` (row key, heading, format), those without a figure in any row left
    out; `under(row)` gives lines to print below a row."""
    cols = [c for c in columns if any(r.get(c[0]) is not None for r in rows)]
    widths = [max(len(head), 8) for _, head, _ in cols]
    head = " ".join(f"{h:>{w}}" for (_, h, _), w in zip(cols, widths))
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(" ".join(f"{_cell(r.get(k), f):>{w}}" for (k, _, f), w in zip(cols, widths)))
        lines += under(r)
    return "\n".join(lines)


def _notes(r: dict) -> list[str]:
    lines = []
    if r.get("capped_plan"):
        lines.append(f"    capped: {r['capped_plan']}")
    if r.get("compare_tile"):
        lines.append(f"    PSNR against the untiled decode at tile/overlap {r['compare_tile']} px: tiled dB = "
                     "sd-accel's tiled decode, naive dB = per-tile GroupNorm (ComfyUI's VAEDecodeTiled)")
    if r.get("notes"):
        lines.append(f"    {r['notes']}")
    return lines


def table(rows: list[dict]) -> str:
    """bench_vae's rows as a table, like the UNet bench's; the plans and notes of a row on lines under it."""
    if not rows:
        return ""
    return "\n".join([f"VAE decode, {rows[0]['dtype']} on {rows[0]['device']}", _grid_text(rows, _COLUMNS, _notes)])


# ----- video: ComfyUI's Wan VAEs

VIDEO_SIZES = "832x480,1280x720"
TINY_VIDEO_SIZES = "16x512"
# Frames of each model's native clip (Wan 2.1: 81; Wan 2.2 TI2V 5B: 121); the tiny ones: one chunk after the first.
VIDEO_FRAMES = {"wan21": 81, "wan22": 121, "tiny-wan21": 5, "tiny-wan22": 5}
# The tiled decode's memory limit, as a part of the untiled decode's measured peak: the aim is half.
VIDEO_CAP = 0.5


def _spatial_factor(name: str) -> int:
    """Output pixels per latent pixel of the Wan VAE `name` (Wan 2.2's: 16, Wan 2.1's: 8)."""
    return 16 if COMFY_VIDEO_VAE_CONFIGS[name][0] == "vae2_2" else 8


def video_sizes(name: str, text: str) -> list[tuple[int, int]]:
    """(width, height) pixels of each "WxH" in `text`, checked against the VAE `name`'s spatial factor."""
    return parse_video_sizes(text, _spatial_factor(name), f"{name} decodes")


def bench_video_vae(models: list[str], comfyui_root: str, sizes: str | None = None, tiny: bool = False,
                    device: str = "cuda", runs: int | None = None) -> list[dict]:
    """One row per model and video size: ComfyUI's own (untiled) decode and `decode_video` limited to VIDEO_CAP of
    the untiled decode's peak: time (ms), peak memory above the weights (GB), the plan (grid, halo, decoded-area
    work, estimated peak) and the tiled video's distance from the untiled one (max abs, PSNR), beside the distance
    of the untiled decode in the VAE's dtype from an fp32 decode (the noise the dtype makes).

    Full run: bf16 on `device`, each model's native frame count. tiny=True: the tiny layouts in fp32 on the CPU (no
    peak memory there: the limit is half the planner's estimate of one tile)."""
    sizes_of = {name: video_sizes(name, sizes or (TINY_VIDEO_SIZES if tiny else VIDEO_SIZES)) for name in models}
    if tiny:
        dev, dtype = torch.device("cpu"), torch.float32
    else:
        dev, dtype = torch.device(device), torch.bfloat16
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise BackendUnavailable("the video VAE benchmark needs a CUDA GPU and none is visible.",
                                     "Run it on a GPU machine, or pass --tiny for the CPU version.")
    rows = []
    for name in models:
        vae = build_comfy_video_vae(name, comfyui_root, seed=SEED, device=dev, dtype=dtype)
        for w, h in sizes_of[name]:
            rows.append(_video_row(name, vae, w, h, dev, dtype, comfyui_root, runs))
        del vae
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def _video_row(name: str, vae, w: int, h: int, dev: torch.device, dtype: torch.dtype, comfyui_root: str,
               runs: int | None) -> dict:
    factor = _spatial_factor(name)
    frames = VIDEO_FRAMES[name]
    g = torch.Generator().manual_seed(SEED)
    z = torch.randn(1, vae.conv2.in_channels, 1 + (frames - 1) // 4, h // factor, w // factor, generator=g)
    z = z.to(dev, dtype)
    row = dict(model=name, size=f"{w}x{h}", frames=frames, dtype=str(dtype).replace("torch.", ""), device=str(dev),
               untiled_ms=None, untiled_peak_gb=None, cap_gb=None, tiled_ms=None, tiled_peak_gb=None,
               est_peak_gb=None, grid=None, halo=None, work=None, max_err=None, psnr_db=None, dtype_psnr_db=None)
    with torch.no_grad():
        row["untiled_ms"], row["untiled_peak_gb"], ref, _ = _measure(lambda: vae.decode(z), dev, runs)
    untiled = row["untiled_peak_gb"] or video_plan(vae, z, tile=max(z.shape[3:]) * factor).peak_gb
    row["cap_gb"] = cap = VIDEO_CAP * untiled
    plan = video_plan(vae, z, memory_gb=cap)
    row.update(est_peak_gb=plan.peak_gb, grid=f"{plan.grid[0]}x{plan.grid[1]}", halo=plan.halo, work=plan.work)
    row["tiled_ms"], row["tiled_peak_gb"], out, _ = _measure(lambda: decode_video(vae, z, memory_gb=cap), dev, runs)
    row["max_err"] = float((out.float() - ref.float()).abs().max())
    row["psnr_db"] = psnr(out, ref)
    del out
    if dtype != torch.float32:
        # The same weights in fp32 (the seeded draw does not depend on the dtype).
        exact = build_comfy_video_vae(name, comfyui_root, seed=SEED, device=dev, dtype=torch.float32)
        with torch.no_grad():
            row["dtype_psnr_db"] = psnr(ref, exact.decode(z.float()))
        del exact
    return row


_VIDEO_COLUMNS = (("model", "model", ""), ("size", "size", ""), ("frames", "frames", "d"),
                  ("untiled_ms", "untiled ms", ".0f"), ("untiled_peak_gb", "untiled GB", ".2f"),
                  ("cap_gb", "cap GB", ".2f"), ("tiled_ms", "tiled ms", ".0f"), ("tiled_peak_gb", "tiled GB", ".2f"),
                  ("est_peak_gb", "est GB", ".2f"), ("grid", "grid", ""), ("halo", "halo", "d"),
                  ("work", "work", ".3f"), ("max_err", "max err", ".2e"), ("psnr_db", "tiled dB", ".1f"),
                  ("dtype_psnr_db", "dtype dB", ".1f"))


def video_table(rows: list[dict]) -> str:
    """bench_video_vae's rows as a table, columns without figures left out."""
    if not rows:
        return ""
    return "\n".join([f"Wan VAE decode, {rows[0]['dtype']} on {rows[0]['device']}: ComfyUI's untiled decode, and "
                      f"decode_video within {VIDEO_CAP:.0%} of its peak",
                      _grid_text(rows, _VIDEO_COLUMNS),
                      "    halo: px a tile reads beyond its core; work: decoded area (halos included) over the "
                      "video's; tiled dB: PSNR "
                      "against the untiled decode; dtype dB: the untiled decode's PSNR against fp32"])

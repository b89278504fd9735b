"""Wan's video VAE (ComfyUI's WanVAE, Wan 2.1 and 2.2) decoded in spatial tiles to exactly the untiled video.

Where the memory goes: the host's decode runs the decoder one latent frame at a time (a chunk: one output frame,
then four), and every causal 3-D conv keeps the last two frames of its input for the next chunk. Most of it is at
the output resolution: those layers' caches, kept through the whole decode, and one conv's working set (its input,
the block input kept for the residual, the concatenation with the cache, its padded copy, the output).

Why tiles usually come out wrong: ComfyUI's tiled decode cuts the latent into overlapping tiles in space and time and
decodes each afresh; a tile that starts later in time has no cached past, the mid-block attention sees only its
tile, and each tile's borders are computed from zero padding where the untiled decode sees the neighbours. Blending
the overlaps hides the differences, it does not remove them.

How this decode avoids that, in two stages:
  whole  conv2 and the decoder up to its first upsampling layer (everything at latent resolution, the attention
         that mixes the whole frame included), over whole frames, one latent frame at a time with one temporal
         cache, through the host's own layers; its output for every frame is kept (latent resolution: small).
         Where that layer is a block that runs latent-resolution convs before it upsamples (Wan 2.2's), the whole
         stage takes it too: its output is then at twice the latent resolution, but the tiles' halo is less than
         half as wide.
  tiled  the rest of the decoder, by the host's own decode() on a shallow twin of the model whose decoder begins at
         that layer, one spatial tile at a time: a tile runs through all the frames in order with a temporal cache
         of its own, so its cache holds what the untiled decode's holds over the tile's region (the host's decode
         feeds it one frame of its input at a time; a causal conv with its cache gives the same frames however
         they are cut into chunks, which is what the cache is for). A tile reads its
         core plus a halo as wide as the stage's spatial reach (video_grid._halo). Zero padding at the tile's inner
         border then spoils only pixels within the halo, and since a cached frame was computed by the same layers
         from the same region, the spoiled band is as wide in every chunk: it does not grow over time. The core is
         the untiled decode's, so cores are written side by side, without overlap or blending.
Only one tile's caches and working set exist at a time (tiles outer, time inner); the grid is chosen from free memory
(video_grid._choose). The host's layers run as they are, so its weight casting and patches apply as in its decode.
"""

from __future__ import annotations

import copy
import inspect
import math
import warnings
from dataclasses import dataclass

import torch
from torch import nn

from ..errors import AccelError, BadInput, UnsupportedModel
from ..progress import NullProgress, Progress
from .execute import _check_input, _check_tile, _device_dtype
from .memory import _OOM
from .video_grid import _choose, _Costs, _elements_per_px, _halo, _Op, _plan, _spans, _walk, VideoPlan


class _Given(nn.Module):
    """Stands in for the decoder's first conv in the tiled stage, whose input the whole stage has computed already.

    It holds the conv it replaces because the host sizes a decode's temporal cache by counting the causal convs in
    its decoder, and the decoder's forward still gives this layer a cache slot."""

    def __init__(self, conv: nn.Module) -> None:
        super().__init__()
        self.conv = conv

    def forward(self, x: torch.Tensor, *cache) -> torch.Tensor:
        return x


def _twin(module: nn.Module, **children: nn.Module) -> nn.Module:
    """A shallow copy of `module` with some children replaced: it runs the host's own forward over the same layers,
    and the model itself is left as it was."""
    twin = copy.copy(module)
    twin._modules = {**module._modules, **children}
    return twin


@dataclass
class _Stages:
    """The two stages. "Tile pixels" are those of the whole stage's output, which the tiles cut up: the latent's,
    or twice as many each way where the whole stage ends with an upsampling block."""

    model: nn.Module  # the host's WanVAE
    whole: nn.Module  # its decoder up to where the tiles begin, without the head
    tiled: nn.Module  # a twin of the model whose decoder begins there and whose conv2 passes its input on
    whole_ops: list[_Op]
    tiled_ops: list[_Op]
    whole_scale: int  # tile pixels per latent pixel
    whole_frames: int  # frames of the whole stage's output per latent frame after the first
    halo: int  # tile pixels
    scale: int  # output pixels per tile pixel
    frames: int  # output frames per latent frame after the first
    channels: int  # of the output
    first_chunk: bool  # the decoder's forward takes first_chunk (Wan 2.2's), which the host's decode sets on chunk 0


def _stages(vae) -> _Stages:
    model = getattr(vae, "first_stage_model", vae)  # a ComfyUI VAE holds the model here
    dec = getattr(model, "decoder", None)
    if (type(dec).__name__ != "Decoder3d" or not hasattr(model, "conv2")
            or not all(hasattr(dec, a) for a in ("conv1", "middle", "upsamples", "head"))):
        raise UnsupportedModel(f"a {type(model).__name__} is not a Wan video VAE (a Decoder3d of causal 3-D convs).",
                               "Pass ComfyUI's Wan 2.1 or 2.2 VAE (comfy.ldm.wan), or decode with its own decode().")
    if hasattr(dec, "run_up"):
        raise UnsupportedModel(f"this ComfyUI's Wan decoder ({type(dec).__module__}.Decoder3d) runs its up blocks "
                               "chunk by chunk (run_up, ComfyUI 0.33 and later), which the tiled video decode does "
                               "not take yet.", "Decode this VAE with its own decode().")
    first = _tiles_begin(dec.upsamples)
    rest = dec.upsamples[first:]
    ops, whole_scale, whole_frames = [], 1, 1
    for part, what in ((dec.conv1, "conv1"), (dec.middle, "middle"), (dec.upsamples[:first], "upsamples")):
        more, whole_scale, whole_frames = _walk(part, whole_scale, whole_frames, f"decoder.{what}")
        ops += more
    tiled_ops, scale, frames = _walk(rest, 1, 1, f"decoder.upsamples.{first}-")
    tiled_ops += _walk(dec.head, scale, frames, "decoder.head")[0]
    whole = _twin(dec, upsamples=dec.upsamples[:first], head=nn.Sequential())
    tiled = _twin(model, conv2=nn.Identity(),
                  decoder=_twin(dec, conv1=_Given(dec.conv1), middle=nn.Sequential(), upsamples=rest))
    # Wan 2.2's decoder ends in 12 channels that its decode rearranges into 2x2 pixels of RGB.
    patch = math.isqrt(tiled_ops[-1].c_out // 3)
    return _Stages(model, whole, tiled, ops, tiled_ops, whole_scale, whole_frames, _halo(tiled_ops, "decoder"),
                   scale * patch, whole_frames * frames, tiled_ops[-1].c_out // patch ** 2,
                   "first_chunk" in inspect.signature(dec.forward).parameters)


def _tiles_begin(upsamples: nn.Sequential) -> int:
    """Where in the decoder's up blocks the tiles begin: at the first layer that upsamples, or past it where it
    also runs convs at latent resolution before upsampling (their reach would widen the halo by a latent pixel
    each, where the upsampled output costs the whole stage only memory)."""
    for i, layer in enumerate(upsamples):
        if any(isinstance(m, nn.Upsample) for m in layer.modules()):
            ops = _walk(layer, 1, 1, f"decoder.upsamples.{i}")[0]
            before = ops[:next(j for j, op in enumerate(ops) if op.kind == "up")]
            return i + 1 if any(op.radius for op in before) else i
    return len(upsamples)


def _slots(decoder: nn.Module) -> int:
    """Temporal cache entries for a run of the decoder: one per causal conv, as the host counts them."""
    return sum(type(m).__name__ == "CausalConv3d" for m in decoder.modules())


def _run_whole(st: _Stages, z: torch.Tensor) -> torch.Tensor:
    """The whole stage over every latent frame in turn, as the host's decode runs those layers: one frame out of
    the first chunk, whole_frames out of each other."""
    x = st.model.conv2(z)
    cache = [None] * _slots(st.model.decoder)
    out, at = None, 0
    for i in range(x.shape[2]):
        y = st.whole(x[:, :, i:i + 1], feat_cache=cache, feat_idx=[0], **({"first_chunk": i == 0}
                                                                         if st.first_chunk else {}))
        if out is None:
            out = y.new_empty(*y.shape[:2], 1 + st.whole_frames * (x.shape[2] - 1), *y.shape[3:])
        if y.shape[2] != (1 if i == 0 else st.whole_frames):
            raise AccelError(f"chunk {i} of the decoder's first layers gave {y.shape[2]} frames, not the "
                             f"{1 if i == 0 else st.whole_frames} its layers make.",
                             "Decode this VAE with its own decode(); please report the model.")
        out[:, :, at:at + y.shape[2]] = y
        at += y.shape[2]
    return out


def _costs(st: _Stages, shape: tuple[int, ...], elem: int, out_on_device: bool) -> _Costs:
    """Bytes of the decode of latents of `shape`; per_px per tile pixel."""
    n, _, t, h, w = shape
    frames_out = 1 + st.frames * (t - 1)
    tile_px = h * w * st.whole_scale ** 2
    stored = n * elem * st.tiled_ops[0].c_in * (1 + st.whole_frames * (t - 1)) * tile_px
    last = st.tiled_ops[-1]
    output = n * elem * last.c_out * frames_out * tile_px * last.scale ** 2 if out_on_device else 0
    whole = n * elem * _elements_per_px(st.whole_ops) * h * w + stored
    return _Costs(stored + output, whole, n * elem * _elements_per_px(st.tiled_ops, frames_out))


def _tile_hw(st: _Stages, latents: torch.Tensor) -> tuple[int, int]:
    return latents.shape[3] * st.whole_scale, latents.shape[4] * st.whole_scale


def _prepare(vae, latents: torch.Tensor, tile: int | None, memory_gb: float | None,
             out_device: torch.device | str | None) -> tuple[_Stages, torch.device, torch.dtype, torch.device, _Costs]:
    _check_tile(tile, None)
    st = _stages(vae)
    _check_input(latents, st.model.conv2.in_channels, "latents", "(N, C, T, h, w)", dims=5)
    if memory_gb is not None and memory_gb <= 0:
        raise BadInput(f"memory_gb must be positive, got {memory_gb}.", "Pass the GB the decode may use, or None.")
    device, dtype = _device_dtype(st.model.decoder)
    out_device = torch.device(device if out_device is None else out_device)
    costs = _costs(st, tuple(latents.shape), torch.finfo(dtype).bits // 8, out_device == device)
    return st, device, dtype, out_device, costs


def video_plan(vae, latents: torch.Tensor, tile: int | None = None, memory_gb: float | None = None,
               out_device: torch.device | str | None = None) -> VideoPlan:
    """The plan decode_video(vae, latents, ...) would follow: grid, halo, largest tile, work and estimated peak."""
    st, device, _, _, costs = _prepare(vae, latents, tile, memory_gb, out_device)
    return _plan(_tile_hw(st, latents), st.halo, st.scale, costs, device, tile, memory_gb)


def _decode_tile(st: _Stages, a: torch.Tensor) -> torch.Tensor:
    """The host's decode of one tile of the whole stage's output, through all its frames."""
    return st.tiled.decode(a.contiguous())


def _run_tiles(st: _Stages, a: torch.Tensor, plan: VideoPlan, out: torch.Tensor, progress: Progress) -> None:
    s = st.scale
    for y0, y1, ys, ye in _spans(a.shape[3], plan.grid[0], st.halo):
        for x0, x1, xs, xe in _spans(a.shape[4], plan.grid[1], st.halo):
            video = _decode_tile(st, a[:, :, :, ys:ye, xs:xe])
            if tuple(video.shape[2:]) != (out.shape[2], (ye - ys) * s, (xe - xs) * s):
                raise AccelError(f"a tile decoded to {tuple(video.shape)}, not the {out.shape[2]} frames of "
                                 f"{(ye - ys) * s}x{(xe - xs) * s} px its latent makes.",
                                 "Decode this VAE with its own decode(); please report the model.")
            out[..., y0 * s:y1 * s, x0 * s:x1 * s] = video[..., (y0 - ys) * s:(y1 - ys) * s,
                                                           (x0 - xs) * s:(x1 - xs) * s]
            del video
            progress.advance()


@torch.no_grad()
def decode_video(vae, latents: torch.Tensor, tile: int | None = None, progress: Progress | None = None, *,
                 memory_gb: float | None = None, out_device: torch.device | str | None = None) -> torch.Tensor:
    """Decode video latents (N, C, T, h, w) in spatial tiles to the video the untiled decode gives,
    (N, 3, 1 + 4 (T - 1), H, W) in the VAE's dtype, on out_device (default: the VAE's device).

    vae: ComfyUI's Wan 2.1 or 2.2 VAE (comfy.sd.VAE or its first_stage_model). latents: what its decode() takes.
    tile: core tile side in output pixels; None chooses the grid from free GPU memory, or from memory_gb (GB the
    decode may use beyond what is already allocated), tiles of 512 px off CUDA unless memory_gb is given.
    progress: stage("vae decode", tiles + 1), one step for the whole stage and one per tile. A tile that runs out of
    GPU memory makes the decode start its tiles again, smaller (half the memory each), with a warning.
    """
    st, device, dtype, out_device, costs = _prepare(vae, latents, tile, memory_gb, out_device)
    hw = _tile_hw(st, latents)
    plan = _plan(hw, st.halo, st.scale, costs, device, tile, memory_gb)
    progress = progress or NullProgress()
    z = latents.to(device, dtype)
    if plan.tiles == 1:
        progress.stage("vae decode", 1)
        video = st.model.decode(z).to(out_device)
        progress.done()
        return video
    progress.stage("vae decode", plan.tiles + 1)
    a = _run_whole(st, z)
    progress.advance()
    n, t = latents.shape[0], latents.shape[2]
    out = torch.empty(n, st.channels, 1 + st.frames * (t - 1), hw[0] * st.scale, hw[1] * st.scale,
                      device=out_device, dtype=dtype)
    while True:
        try:
            _run_tiles(st, a, plan, out, progress)
            break
        except _OOM:
            # Half the memory the estimate gave each tile (the estimate was short by an unknown amount).
            smaller = _choose(hw, st.halo, st.scale, costs, costs.fixed + (plan.peak_gb * 1e9 - costs.fixed) / 2)
            if smaller.peak_gb >= plan.peak_gb:
                raise
        # Past the except block the failed tile's tensors are freed.
        torch.cuda.empty_cache()
        warnings.warn(f"vae decode: a {plan.tile[0]}x{plan.tile[1]} px tile ran out of GPU memory; decoding in "
                      f"{smaller.grid[0]}x{smaller.grid[1]} tiles instead.", stacklevel=3)
        plan = smaller
        progress.stage("vae decode", plan.tiles + 1)
        progress.advance()
    progress.done()
    return out

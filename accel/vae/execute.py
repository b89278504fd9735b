"""Running a VAE tiled: check the input, build the program, plan it, run its steps, retry where that helps.

decode/encode: VAE -> program (forms.py) -> plan (plan.py) -> steps (passes.py) -> image or latent. A run in fp16/bf16
that overflows is run again in fp32; one that runs out of GPU memory with the activations on the GPU is run again
with them in host memory.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from ..errors import AccelError, BadInput
from ..progress import NullProgress, Progress
from .forms import _decode_program, _encode_program, _first_conv, _parts
from .memory import _OOM
from .passes import _Act, _Ctx, _run_attn, _run_pass
from .plan import _plan, TilePlan
from .program import _Attn, _in_place, _last_use, _needs_stats, _Program, _reads


class _NonFinite(Exception):
    def __init__(self, what: str) -> None:
        super().__init__(what)
        self.what = what


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


def _check_input(x: torch.Tensor, channels: int, name: str, example: str, dims: int = 4) -> None:
    if not isinstance(x, torch.Tensor):
        raise BadInput(f"{name} must be a torch.Tensor, got {type(x).__name__}.", f"Pass {name} as {example}.")
    if x.dim() != dims:
        fix = f"Add the batch dimension ({name}[None])." if x.dim() == dims - 1 else f"Pass {name} as {example}."
        raise BadInput(f"{name} must have {dims} dimensions {example}, got shape {tuple(x.shape)}.", fix)
    if x.shape[1] != channels:
        hint = (f" It looks channels-last: pass {name}.movedim(-1, 1)." if x.shape[-1] == channels else "")
        raise BadInput(f"{name} have {x.shape[1]} channels but this VAE takes {channels} ({example}).",
                       f"Pass {name} made for this VAE.{hint}")
    if min(x.shape[2:]) < 1:
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

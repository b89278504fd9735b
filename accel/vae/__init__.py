"""Tiled VAE decode and encode that give the untiled image: GroupNorm statistics are taken over the whole image.

Why tiles give a different picture elsewhere: a GroupNorm normalizes with the mean and variance of a whole channel
group, so a tile decoded on its own is normalized with its own statistics, and neighbouring tiles disagree (seams and
colour shifts) however wide their feathered overlap.

How this package avoids it ("tile by tile, layer-synchronised"): the network is flattened into a short program of
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

The modules, in the order data flows through them:
  forms.py      the VAE (diffusers or ldm/ComfyUI form) -> a program of passes (program.py)
  plan.py       program + free memory -> TilePlan: tile size, grid, activations on the GPU or in host memory
  execute.py    input checks, then the program's steps run on the plan (retried in fp32 / host memory where that helps)
  passes.py     one step over the whole image: a pass tile by tile with its halos, or the mid-block attention
  norm.py       the GroupNorm from whole-image statistics that each tile's input goes through
  attention.py  exact attention in query chunks
  memory.py     the page-locked host-memory pool for activations that do not fit on the GPU
  naive.py      the per-tile baseline

Wan's video VAE (causal 3-D convolutions, a temporal cache, RMS norms per pixel) takes another route, as its layers
need no whole-frame statistics: the host's own layers run on spatial tiles with halos, each tile through all frames
with a temporal cache of its own (video.py: `decode_video`; video_grid.py: the halo, memory per tile and the grid).

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

from .execute import decode, encode, tile_plan
from .memory import release_host_memory
from .naive import naive_tiled_decode
from .plan import TilePlan
from .video import decode_video, video_plan
from .video_grid import VideoPlan

__all__ = ["decode", "encode", "tile_plan", "naive_tiled_decode", "TilePlan", "release_host_memory", "decode_video",
           "video_plan", "VideoPlan"]

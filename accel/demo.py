"""`python -m accel demo`: the main job on the default model, end to end.

Detect the GPU, choose a plan, build the accelerated UNet, run the same short sampling loop on the plain
and on the accelerated UNet, check that they agree, decode and save a PNG, and print a one-screen report.
Without --checkpoint the models are the published SD1.5 architecture (a tiny one on the CPU) with seeded
random weights, so the picture is noise-like: the point is the speed and the agreement.
"""

from __future__ import annotations

import argparse
import time

import torch

from .accelerate import accelerate
from .bench import rel_l2
from .configs import SHAPES, build_unet, build_vae
from .device import describe, detect
from .errors import BadInput
from .policy import check_preference
from .progress import TqdmProgress
from .unet import CanonicalUNet


def sample(unet, x: torch.Tensor, context: torch.Tensor, y: torch.Tensor | None, steps: int,
           guidance: float = 7.5) -> tuple[torch.Tensor, float]:
    """Euler sampling with classifier-free guidance (batch 2: unconditional, conditional). Returns the final
    latent and seconds per step."""
    from diffusers import EulerDiscreteScheduler

    sched = EulerDiscreteScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear")
    sched.set_timesteps(steps, device=x.device)
    x = x * sched.init_noise_sigma
    start = None
    for i, t in enumerate(sched.timesteps):
        if i == 1:  # the first step pays for graph capture; the speed is that of the steps after it
            _sync(x)
            start = time.perf_counter()
        inp = sched.scale_model_input(torch.cat([x, x]), t)
        eps = unet(inp, t.expand(2).to(inp.dtype), context, y)
        uncond, cond = eps.chunk(2)
        x = sched.step(uncond + guidance * (cond - uncond), t, x).prev_sample
    _sync(x)
    return x, (time.perf_counter() - start) / max(1, steps - 1)


def _sync(t: torch.Tensor) -> None:
    if t.is_cuda:
        torch.cuda.synchronize()


def _check(args: argparse.Namespace) -> None:
    """Every argument and setting, before the models are built and sampled: a typo costs no minutes."""
    check_preference(args.backend)
    if args.steps is not None and args.steps < 2:
        raise BadInput(f"--steps {args.steps} is too few: the speed is timed over the steps after the first.",
                       "Use --steps 2 or more.")
    if args.size is not None and args.size < 64:
        raise BadInput(f"--size {args.size} is too small for the UNet.", "Use --size 64 or more.")
    if args.checkpoint:
        from .checkpoint import check_checkpoint

        check_checkpoint(args.checkpoint)


def main(args: argparse.Namespace) -> int:
    _check(args)
    gpu = detect()
    device = torch.device(gpu.device if gpu.device.startswith("cuda") else "cpu")
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    steps = args.steps or (20 if device.type == "cuda" else 8)
    if args.checkpoint:
        from .checkpoint import load_checkpoint

        name, unet, vae = load_checkpoint(args.checkpoint, device, dtype)
    else:
        name = "sd15" if device.type == "cuda" else "tiny-sd15"
        unet = build_unet(name, seed=args.seed, device=device, dtype=dtype)
        vae = build_vae("sd" if device.type == "cuda" else "tiny", seed=args.seed, device=device, dtype=dtype)
    size = args.size or (SHAPES.get(name, (77, 64))[1] * 8 if device.type == "cuda" else 128)
    if size % 64:
        print(f"--size {size} is not a multiple of 64: the plain model will serve it. Use e.g. {size // 64 * 64 or 64}.")
    plain = CanonicalUNet(unet)
    g = torch.Generator().manual_seed(args.seed)
    c = unet.config
    # No text encoder ships with the demo: a seeded random conditioning stands in for the prompt.
    context = torch.randn(2, 77, c["cross_attention_dim"], generator=g).to(device, dtype)
    y = None
    if plain.spec.adm_channels:
        y = torch.randn(2, plain.spec.adm_channels, generator=g).to(device, dtype)
    latent = torch.randn(1, c["in_channels"], size // 8, size // 8, generator=g).to(device, dtype)

    print(describe(gpu))
    with torch.inference_mode():
        ref, plain_s = sample(plain, latent, context, y, steps)
        t0 = time.perf_counter()
        acc = accelerate(plain, preference=args.backend, progress=TqdmProgress(), gpu=gpu)
        build_s = time.perf_counter() - t0
        out, acc_s = sample(acc, latent, context, y, steps)
        err = rel_l2(out, ref)
        image = vae.decode(out / vae.config.scaling_factor, return_dict=False)[0]
    _save_png(image[0], args.out)
    ok = err < (1e-2 if dtype == torch.float16 else 1e-4)
    print("\n".join([
        f"model:       {name} ({plain.spec.describe()}), {size}x{size}, {steps} steps, CFG batch 2",
        f"path:        {acc.backend}" + (f" (plan: {acc.plan.backend})" if acc.plan.backend != acc.backend else ""),
        *[f"             - {r}" for r in acc.plan.reasons],
        f"build:       {build_s:.1f} s (cache: not used by the torch path; graphs are captured on the first step)",
        f"plain:       {plain_s * 1e3:.1f} ms/step",
        f"accelerated: {acc_s * 1e3:.1f} ms/step  (x{plain_s / acc_s:.2f})",
        f"agreement:   final latent rel. L2 error {err:.1e}: {'OK' if ok else 'TOO LARGE'}",
        f"image:       {args.out}",
    ]))
    acc.release()
    return 0 if ok else 1


def _save_png(image: torch.Tensor, path: str) -> None:
    from PIL import Image

    arr = ((image.float().clamp(-1, 1) + 1) * 127.5).round().byte().permute(1, 2, 0).cpu().numpy()
    Image.fromarray(arr).save(path)

"""`python -m sd_accel demo`: the main job on the default model, end to end.

Detect the GPU, choose a plan, build the accelerated UNet, run the same short sampling loop on the plain
and on the accelerated UNet, check that they agree, decode and save a PNG, and print a one-screen report.
Without --checkpoint the models are the published SD1.5 architecture (a tiny one on the CPU) with seeded
random weights, so the picture is noise-like: the point is the speed and the agreement.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from ..accelerate import AcceleratedUNet, accelerate
from ..errors import BadInput
from ..models.configs import SHAPES, build_unet, build_vae
from ..models.spec import CanonicalUNet
from ..plan.device import describe, detect
from ..plan.policy import check_preference
from ..progress import TqdmProgress
from .bench import rel_l2


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
        from ..models.checkpoint import check_checkpoint

        check_checkpoint(args.checkpoint)


def main(args: argparse.Namespace) -> int:
    _check(args)
    gpu = detect()
    device = torch.device(gpu.device if gpu.device.startswith("cuda") else "cpu")
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    steps = args.steps or (20 if device.type == "cuda" else 8)
    if args.checkpoint:
        from ..models.checkpoint import load_checkpoint

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
    path = _save_png(image[0], args.out)
    ok = err < (1e-2 if dtype == torch.float16 else 1e-4)
    print("\n".join([
        f"model:       {name} ({plain.spec.describe()}), {size}x{size}, {steps} steps, CFG batch 2",
        f"path:        {acc.backend}" + (f" (plan: {acc.plan.backend})" if acc.plan.backend != acc.backend else ""),
        *[f"             - {r}" for r in acc.plan.reasons],
        f"build:       {build_s:.1f} s ({cache_note(acc)}; {graphs_note(acc)})",
        *timing_lines(acc, device, plain_s, acc_s),
        f"agreement:   final latent rel. L2 error {err:.1e}: {'OK' if ok else 'TOO LARGE'}",
        f"image:       {path}",
        f"             {image_note(image, latent)}",
    ]))
    acc.release()
    return 0 if ok else 1


def _save_png(image: torch.Tensor, path: str) -> str:
    """Saves the image; returns the file's absolute path (a relative --out is otherwise hard to find)."""
    from PIL import Image

    arr = ((image.float().clamp(-1, 1) + 1) * 127.5).round().byte().permute(1, 2, 0).cpu().numpy()
    Image.fromarray(arr).save(path)
    return os.path.abspath(path)


def cache_note(acc: AcceleratedUNet) -> str:
    """What the engine cache did for the path that ran."""
    if acc.engine is None:
        return "nothing built, no cache used"
    result = getattr(acc.engine, "cache_result", None)
    if result is None:
        return f"no cache used: the {acc.backend} path works on the model in memory and saves no engine"
    return f"the {acc.backend} engine was {result.describe()}"


def graphs_note(acc: AcceleratedUNet) -> str:
    """Whether graphs are captured, as the engine that ran was built: for the torch path, the plan's cuda_graphs
    (kept only on a GPU); ONNX Runtime has its own cuda_graph option."""
    if acc.engine is None:
        return "no graphs"
    if acc.backend == "torch":
        on, option = acc.engine.graphs is not None, "cuda_graphs is off in the plan"
    else:
        on, option = acc.engine.options.cuda_graph, "ONNX Runtime's cuda_graph option is off"
    return "graphs are captured on the first step, which is not timed" if on else f"no graphs: {option}"


def timing_lines(acc: AcceleratedUNet, device: torch.device, plain_s: float, acc_s: float) -> list[str]:
    """The plain model's time, and the accelerated path's with its speed-up where that path computes differently
    from the plain model. Elsewhere both runs are the same computation: a second time, or a ratio of the two,
    would only show how busy the machine was (x0.1 to x6.8 on a CPU), so neither is printed."""
    plain = f"plain:       {plain_s * 1e3:.1f} ms/step"
    if acc.engine is None:
        return [plain, "accelerated: none: acceleration is off, so both runs are the plain model and no speed-up "
                       "is claimed."]
    if acc.backend == "torch" and device.type != "cuda":
        return [plain, "accelerated: none on the CPU: the torch path runs the plain model there, so no speed-up "
                       "is claimed (the torch path's kernels and graphs need a GPU)."]
    return [plain, f"accelerated: {acc_s * 1e3:.1f} ms/step  (speed-up x{plain_s / acc_s:.2f})"]


def image_note(image: torch.Tensor, latent: torch.Tensor) -> str:
    """What the saved file is: the VAE's decode of the final latent, at the size that VAE gives."""
    h, w = image.shape[-2:]
    what = f"the decoded image, {w}x{h}"
    factor = w // latent.shape[-1]
    if factor == 8:
        return what + "."
    return (what + f": the demo's tiny VAE upsamples the {latent.shape[-1]}x{latent.shape[-2]} latent x{factor}, "
            "not x8 like SD's, so the file is smaller than the sampled size.")

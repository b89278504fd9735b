"""The bench's diffusion transformers: Flux.1, Chroma and SD3.5 from their published configs with seeded,
well-conditioned random weights (models/configs.py seed_dit_parameters), at 1024x1024 in bf16: Flux batch 1
(guidance-distilled, no CFG batch), Chroma and SD3.5 batch 2 (CFG). Besides the usual rows: the model's FLOP count per
step (torch's FLOP counter) and the floor it implies at this GPU's bf16 GEMM rate, measured in the same run.
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from ..engine import flash4
from ..models.configs import build_dit, cfg_batch, dit_example_inputs, round_comfy_dit
from ..models.dit import CanonicalDiT
from .bench import Row, _sync, time_ms, time_variants
from .comfy_attention import eager_variant, exact_attention

GEMM_SIDE = 8192  # a square bf16 GEMM this large runs at the GPU's sustained tensor-core rate


def gemm_tflops(device: torch.device, dtype: torch.dtype = torch.bfloat16, iters: int = 20) -> float:
    """This GPU's measured dense GEMM rate (TFLOP/s) in `dtype`."""
    n = GEMM_SIDE if device.type == "cuda" else 512
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    ms = time_ms(lambda: a @ b, device, iters)
    return 2 * n ** 3 / (ms * 1e-3) / 1e12


def step_flops(fn: Callable[[], object]) -> float:
    """FLOPs of one call, as torch's FLOP counter counts them (matrix products and attention)."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter, torch.inference_mode():
        fn()
    return float(counter.get_total_flops())


def bench_dit(name: str, device: torch.device, iters: int, compile_modes: list[str], paths: list[str],
              log: Callable[[str], None] = print, profile: bool = False,
              host: tuple[str, str] | None = None) -> list[Row]:
    """Rows for one DiT: diffusers' class, or with host ("comfyui", folder) ComfyUI's own (the form the fused kernels
    cover; bench.model_names refuses another host's)."""
    form = "comfy" if host else "diffusers"
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    batch = cfg_batch(name)
    t0 = time.perf_counter()
    # The fp32 reference first, then the same weights rounded to bf16 in place: a full-size Flux in fp32 takes 48 GB,
    # and a second copy would not fit beside it.
    model = build_dit(name, form, seed=0, device=device, dtype=torch.float32,
                      comfyui_root=host[1] if host else None)
    inputs = dit_example_inputs(name, batch, device=device)
    canon = CanonicalDiT(model)
    with torch.inference_mode(), exact_attention():
        ref = canon(**inputs)
    if form == "comfy":
        round_comfy_dit(model, name, dtype)
        model.dtype = dtype  # ComfyUI's classes cast some inputs to the dtype they were built for
    else:
        model.to(dtype)
    _sync(device)
    label = f"{name}/{form}"
    log(f"[{label}] {canon.spec.describe()}; built and fp32 reference in {time.perf_counter() - t0:.1f}s")
    fa4, why = flash4.available(device)
    log(f"[{label}] the fused blocks' 16-bit attention: " + (f"FlashAttention-4, {why}" if fa4 else
                                                              f"PyTorch's SDPA (FlashAttention-4: {why})"))
    y = inputs.get("y")  # Chroma has none
    args = (inputs["x"].to(dtype), inputs["timesteps"], inputs["context"].to(dtype), None if y is None else y.to(dtype),
            None, inputs.get("guidance"))
    flops = step_flops(lambda: canon(*args))
    rate = gemm_tflops(device)
    floor_ms = flops / (rate * 1e12) * 1e3
    log(f"[{label}] {flops / 1e12:.1f} TFLOP per step; GEMM rate {rate:.0f} TFLOP/s; floor {floor_ms:.1f} ms")
    fp8_weights = "torch-fp8weights" in paths
    rows = time_variants(label, canon, args, ref, device, iters, compile_modes,
                         [p for p in paths if p != "torch-fp8weights"], log, profile, eager=eager_variant(host))
    if fp8_weights:
        del model, canon
        rows += _fp8_weights(name, label, device, iters, args, ref, log, profile, host)
    for r in rows:
        r.extra.update(tflop=round(flops / 1e12, 2), gemm_tflops=round(rate, 1), floor_ms=round(floor_ms, 2),
                       batch=batch, tokens=inputs["context"].shape[1])
        if r.ms:
            r.extra["x_floor"] = round(r.ms / floor_ms, 3)
    rows.append(Row(label, f"floor: {flops / 1e12:.3g} TFLOP at {rate:.3g} TFLOP/s", floor_ms, note="floor"))
    return rows


def _fp8_weights(name: str, label: str, device: torch.device, iters: int, args: tuple, ref: torch.Tensor,
                 log: Callable[[str], None], profile: bool, host: tuple[str, str] | None) -> list[Row]:
    """The same weights stored in fp8 as ComfyUI loads them (weight dtype fp8_e4m3fn, cast-on-the-fly layers): its
    own forward, and sd-accel's torch path on it (precision auto: fp8 products for fp8 weights)."""
    if not host:
        log(f"[{label}] torch-fp8weights: needs --comfyui (ComfyUI's cast-on-the-fly layers); skipped")
        return []
    model = build_dit(name, "comfy", seed=0, device=device, dtype=torch.float8_e4m3fn, comfyui_root=host[1])
    model.dtype = args[0].dtype
    canon = CanonicalDiT(model)
    rows = time_variants(f"{label}/fp8-weights", canon, args, ref, device, iters, [], ["torch"], log, profile,
                         eager=eager_variant(host))
    del model, canon
    return rows

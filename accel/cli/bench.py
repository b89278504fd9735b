"""`python -m sd_accel bench`: SD1.5 and SDXL UNets from their published configs with seeded random weights,
timed against stock-PyTorch baselines in the same run.

Rows: eager (diffusers' way: fp16, PyTorch SDPA), eager + channels_last + CUDA graph, torch.compile default
and "reduce-overhead" (with compile times), and each available sd-accel path. Per row: ms per UNet step
(batch 2 = classifier-free guidance), speed-up over eager, peak memory and relative L2 error against an
fp32 reference of the same weights.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch

from ..errors import BadInput
from ..models.configs import (DIFFUSERS_DIT_CONFIGS, DIT_NAMES, SHAPES, build_host_unet, build_unet, example_inputs,
                              ldm_example_inputs)
from ..models.spec import CanonicalUNet
from ..progress import StageLog
from .comfy_attention import eager_variant, exact_attention


@dataclass
class Row:
    model: str
    variant: str
    ms: float | None = None
    speedup: float | None = None
    peak_gb: float | None = None
    rel_err: float | None = None
    setup_s: float | None = None
    note: str = ""
    extra: dict = field(default_factory=dict)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _speedup(base_ms: float, ms: float, device: torch.device) -> float | None:
    """base_ms / ms on a GPU. None on the CPU, where no speed-up is claimed (CPU_NOTE)."""
    return base_ms / ms if device.type == "cuda" else None


def _x(ratio: float | None) -> str:
    """A progress line's ratio, where there is one."""
    return "" if ratio is None else f", x{ratio:.2f}"


def time_ms(fn: Callable[[], object], device: torch.device, iters: int, warmup: int = 3) -> float:
    """Median milliseconds per call, after warm-up (CUDA events on the GPU)."""
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def rel_l2(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.float(), ref.float()
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out - ref).norm() / ref.norm()).item()


def _peak_reset(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _peak_gb(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None


def _graphed(fn: Callable, args: tuple) -> Callable[[], torch.Tensor]:
    """Stock CUDA-graph capture of fn(*args), the way a user would do it by hand."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn(*args)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g), torch.device(args[0].device):  # as GraphCache captures (host constants made on device)
        out = fn(*args)

    def replay() -> torch.Tensor:
        g.replay()
        return out
    return replay


def bench_unet(name: str, device: torch.device, dtype: torch.dtype, iters: int, compile_modes: list[str],
               paths: list[str], log: Callable[[str], None] = print, profile: bool = False,
               host: tuple[str, str] | None = None) -> list[Row]:
    """Rows for one UNet: diffusers' model, or with `host` ("comfyui" | "a1111" | "forge", folder) that host's own
    UNet class (models/configs.py build_host_unet)."""
    tokens, latent = SHAPES[name]
    t0 = time.perf_counter()
    if host:
        ref_model = build_host_unet(name, *host, seed=0, device=device, dtype=torch.float32)
        x, t, ctx, y = (None if a is None else a.to(device) for a in ldm_example_inputs(name))
        name = f"{name}/{'comfy' if host[0] == 'comfyui' else host[0]}"
    else:
        ref_model = build_unet(name, seed=0, device=device, dtype=torch.float32)
        x, t, ctx, y = example_inputs(ref_model, batch=2, latent=latent, tokens=tokens, device=device)
    with torch.inference_mode(), exact_attention():
        ref = CanonicalUNet(ref_model)(x, t, ctx, y)
    model = copy.deepcopy(ref_model).to(dtype)
    del ref_model
    build_s = time.perf_counter() - t0
    log(f"[{name}] built from config in {build_s:.1f}s")
    # A1111 runs its half-precision UNet under autocast (ldm's GroupNorm32 computes in float32 with the weights as
    # loaded); every variant of its classes runs so, sd-accel's too, as inside A1111.
    amp = (lambda: torch.autocast(device.type, dtype)) if host and host[0] == "a1111" and dtype != torch.float32 \
        else contextlib.nullcontext
    xh, ch = x.to(dtype), ctx.to(dtype)
    yh = None if y is None else y.to(dtype)
    canon = CanonicalUNet(model)
    dit_only = [p for p in paths if p in DIT_PATHS]
    if dit_only:
        log(f"[{name}] {', '.join(dit_only)}: for diffusion transformers only; not timed for a UNet")
    rows = time_variants(name, canon, (xh, t, ch, yh), ref, device, iters, compile_modes,
                         [p for p in paths if p not in DIT_PATHS], log, profile, amp, channels_last=True,
                         eager=eager_variant(host))
    del model, canon
    _peak_reset(device)
    return rows


def time_variants(name: str, canon: torch.nn.Module, args: tuple, ref: torch.Tensor, device: torch.device, iters: int,
                  compile_modes: list[str], paths: list[str], log: Callable[[str], None], profile: bool = False,
                  amp: Callable = contextlib.nullcontext, channels_last: bool = False,
                  eager: str = "eager (SDPA)") -> list[Row]:
    """The rows of one model in the same run: eager (named `eager`), eager + CUDA graph (+ channels_last for UNets),
    each torch.compile mode, each sd-accel path; canon(*args) is the model's canonical call."""
    rows: list[Row] = []
    model = canon.unet

    def add(variant: str, fn: Callable[[], torch.Tensor], setup_s: float | None = None, note: str = "", **extra) -> None:
        _peak_reset(device)
        with torch.inference_mode(), amp():
            out = fn()
            ms = time_ms(fn, device, iters)
        err = rel_l2(out, ref)
        ratio = _speedup(rows[0].ms if rows else ms, ms, device)
        rows.append(Row(name, variant, ms, ratio, _peak_gb(device), err, setup_s, note, extra))
        log(f"[{name}] {variant}: {ms:.2f} ms/step{_x(ratio)}, err {err:.2e}")

    add(eager, lambda: canon(*args))
    if profile and device.type == "cuda":
        _profile(rows[-1], lambda: canon(*args), log)
    if device.type == "cuda":
        graph_args = args
        if channels_last:
            model.to(memory_format=torch.channels_last)
            graph_args = (args[0].contiguous(memory_format=torch.channels_last), *args[1:])
        with torch.inference_mode(), amp():
            replay = _graphed(canon, graph_args)
        add("eager + channels_last + CUDA graph" if channels_last else "eager + CUDA graph", replay)
        del replay
        if channels_last:
            model.to(memory_format=torch.contiguous_format)
    for mode in compile_modes:
        torch._dynamo.reset()
        compiled = torch.compile(canon, mode=None if mode == "default" else mode)
        start = time.perf_counter()
        with torch.inference_mode():
            compiled(*args)
            compiled(*args)
        _sync(device)
        add(f"torch.compile {mode}", lambda: compiled(*args), setup_s=time.perf_counter() - start)
        del compiled
        torch._dynamo.reset()
    for path in paths:
        rows.extend(_bench_path(name, path, canon, args, ref, device, iters, rows[0].ms, log, profile, amp))
    return rows


def _profile(row: Row, fn: Callable[[], object], log: Callable[[str], None]) -> None:
    """Kernel time of one step by operator class and its top kernels, into row.extra and the log."""
    from . import profile

    with torch.inference_mode():
        kernels = profile.kernel_times(fn)
    row.extra["profile_ms"] = {k: round(v, 3) for k, v in profile.by_class(kernels).items()}
    row.extra["top_kernels"] = profile.top(kernels)
    log(f"[{row.model}] {row.variant} profile (ms/step): {row.extra['profile_ms']}")
    for name, ms, n in row.extra["top_kernels"]:
        log(f"[{row.model}]     {profile.top_line(name, ms, n)}")


# --paths that only a diffusion transformer's bench takes: fp8 products (precision fp8), and its weights stored in fp8
# as ComfyUI loads them (dit_bench).
DIT_PATHS = ("torch-fp8", "torch-fp8weights")
# Path variants of --paths ("<backend>-<variant>"): the options they build with, and their label.
VARIANTS = {"compile": ({"compile": True}, " + regional compile"),
            "graph": ({"cuda_graph": True}, " + CUDA graph"),
            "cudnn-search": ({"cudnn_benchmark": True}, " + cuDNN search"),
            "fp8": ({"precision": "fp8"}, " fp8 products"),
            # after the path's own row, another checkpoint of the model built from its cached graph
            "refit": (None, "")}


def _bench_path(name, path, canon, args, ref, device, iters, base_ms, log, profile=False,
                amp=contextlib.nullcontext) -> list[Row]:
    from ..accelerate import accelerate

    _peak_reset(device)
    start = time.perf_counter()
    backend, _, variant = path.partition("-")
    options, label = VARIANTS.get(variant, (None, ""))
    acc = accelerate(canon, preference=backend, options=options,
                     progress=StageLog(log, f"[{name}] sd-accel {path} build stage "))
    if acc.backend != backend:
        log(f"[{name}] sd-accel {path}: not available here ({' '.join(acc.plan.reasons)})")
        acc.release()
        return [Row(name, f"sd-accel {path}", note="not available: " + " ".join(acc.plan.reasons))]
    with torch.inference_mode(), amp():
        out = acc(*args)
        _sync(device)
        first_s = time.perf_counter() - start
        acc(*args)  # the second call at a shape captures its graph
        _sync(device)  # its work done before the next call is timed (a video DiT's step queues seconds of it)
        # Another shape, then the first again: the first must be served from what was built, not rebuilt.
        # (half the height, down to a size the path accelerates: Qwen-Image's 166 latent rows halve to an odd 83)
        half = args[0].shape[-2] // 2
        x2 = args[0][..., : half - half % acc.unet.size_multiple, :].contiguous()
        new = time.perf_counter()
        acc(x2, *args[1:])
        _sync(device)
        new_shape_s = time.perf_counter() - new
        again = time.perf_counter()
        acc(*args)
        _sync(device)
        seen_s = time.perf_counter() - again
        ms = time_ms(lambda: acc(*args), device, iters)
    err = rel_l2(out, ref)
    note = "setup = build + first call at a new shape"
    if acc.fallback_calls:  # the figures are then not the path's own
        note = f"{acc.fallback_calls} calls fell back to the torch path: {acc.fallback_reason}"
        log(f"[{name}] sd-accel {path}: {note}")
    ratio = _speedup(base_ms, ms, device)
    row = Row(name, f"sd-accel {backend}{label}", ms, ratio, _peak_gb(device), err, first_s,
              note, {"seen_shape_s": seen_s, "new_shape_s": new_shape_s, "reasons": acc.plan.reasons})
    log(f"[{name}] sd-accel {path}: {ms:.2f} ms/step{_x(ratio)}, err {err:.2e}, "
        f"first call {first_s:.1f}s, new shape {new_shape_s:.2f}s, seen shape {seen_s * 1e3:.0f} ms")
    if profile and device.type == "cuda":
        _profile(row, lambda: acc(*args), log)
    acc.release()
    if variant != "refit":
        return [row]
    return [row, _second_checkpoint(name, backend, canon, args, device, iters, base_ms, log, amp)]


def another_checkpoint(canon: CanonicalUNet, seed: int = 1) -> CanonicalUNet:
    """A fine-tune's stand-in: the same architecture, dtype and device, every weight moved by seeded noise of a tenth
    of its own spread."""
    other = copy.deepcopy(canon.unet)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in other.parameters():
            if p.is_floating_point() and p.numel() > 1:
                p.add_(torch.randn(p.shape, generator=g).to(p.device, p.dtype) * (0.1 * p.float().std().item()))
    return CanonicalUNet(other)


def _second_checkpoint(name, backend, canon, args, device, iters, base_ms, log, amp) -> Row:
    """Another checkpoint of the model just built, through the same path: for ONNX Runtime, its graph from the cache
    with these weights put in (a refit) rather than an export. Its error is against its own fp32 output."""
    from ..accelerate import accelerate

    other = another_checkpoint(canon)
    with torch.inference_mode(), amp():
        fp32 = CanonicalUNet(copy.deepcopy(other.unet).float())
        ref = fp32(*(a.float() if a is not None and a.is_floating_point() else a for a in args))
        del fp32
    _peak_reset(device)
    start = time.perf_counter()
    acc = accelerate(other, preference=backend, progress=StageLog(log, f"[{name}] sd-accel {backend} second "
                                                                       "checkpoint build stage "))
    with torch.inference_mode(), amp():
        out = acc(*args)
        _sync(device)
        setup_s = time.perf_counter() - start
        ms = time_ms(lambda: acc(*args), device, iters)
    err = rel_l2(out, ref)
    result = getattr(acc.engine, "cache_result", None)
    how = result.describe() if result is not None else "built"
    log(f"[{name}] sd-accel {backend} second checkpoint: {how}; setup {setup_s:.1f} s, {ms:.2f} ms/step, "
        f"err {err:.2e}")
    row = Row(name, f"sd-accel {backend}, 2nd checkpoint", ms, _speedup(base_ms, ms, device), _peak_gb(device), err,
              setup_s, f"setup = build ({how}) + first call", {"reasons": acc.plan.reasons})
    acc.release()
    return row


def model_names(models: list[str], tiny: bool, host: tuple[str, str] | None = None) -> list[str]:
    """The models `run` times, as it names them ("tiny-" before each with tiny); BadInput for one it cannot build
    with this host (None: diffusers' classes), before any is built."""
    names = [("tiny-" + name) if tiny else name for name in models]
    known = [n for n in (*SHAPES, *DIT_NAMES) if n.startswith("tiny-") == tiny]
    for given, name in zip(models, names):
        if name not in known:
            raise BadInput(f"--models: no {name!r} model to time.",
                           f"Choose from {', '.join(known)} (names given without 'tiny-').")
        if name in DIT_NAMES and host and host[0] != "comfyui":
            raise BadInput(f"--models {given}: diffusion transformers are built in diffusers' or ComfyUI's form, not "
                           f"{host[0]}'s.", f"Leave --{host[0]} out for them, or time them with --comfyui DIR.")
        if name in DIT_NAMES and not host and name not in DIFFUSERS_DIT_CONFIGS:
            raise BadInput(f"--models {given}: {name} is built in ComfyUI's form only.", "Pass --comfyui DIR.")
    return names


def run(models: list[str], tiny: bool, iters: int, compile_modes: list[str], paths: list[str],
        log: Callable[[str], None] = print, profile: bool = False, host: tuple[str, str] | None = None) -> list[Row]:
    """Rows for each named model: UNets (sd15, sd21, sdxl) in fp16, diffusion transformers (flux-dev, flux-schnell,
    sd35-large, sd35-medium) in bf16 (dit_bench)."""
    from .dit_bench import bench_dit

    names = model_names(models, tiny, host)
    device = torch.device("cpu" if tiny or not torch.cuda.is_available() else "cuda")
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    rows: list[Row] = []
    for name in names:
        if name in DIT_NAMES:
            rows += bench_dit(name, device, iters, compile_modes, paths, log, profile, host)
        else:
            rows += bench_unet(name, device, dtype, iters, compile_modes, paths, log, profile, host)
    return rows


# "seen shape" is in the progress lines and the JSON (extra.seen_shape_s), not in a column of the table.
LEGEND = ("setup s = build + first call at a new shape; new shape (progress lines, JSON) = the first call at a second "
          "shape (half the height, to a multiple the path accelerates) in the same process; seen shape = a call at a "
          "shape already captured, made after a call at another shape (nothing rebuilt).")


# Said where the table has no speedup column (the CPU), in the demo's words.
CPU_NOTE = ("speedup: none on the CPU, so no speed-up is claimed: the torch path runs the plain model there (its "
            "kernels and graphs need a GPU), and a ratio of CPU times would show how busy the machine was; the times "
            "are for reference.")


def table(rows: list[Row]) -> str:
    ratios = any(r.speedup is not None for r in rows)
    head = f"{'model':<20} {'variant':<36} {'ms/step':>8} " + (f"{'speedup':>8} " if ratios else "") + \
        f"{'peak GB':>8} {'rel err':>9} {'setup s':>8}"
    lines = [head, "-" * len(head)]
    fmt = lambda v, f: format("-", ">" + f.partition(".")[0]) if v is None else format(v, f)
    for r in rows:
        lines.append(f"{r.model:<20} {r.variant:<36} {fmt(r.ms, '8.2f')} "
                     + (f"{fmt(r.speedup, '8.2f')} " if ratios else "")
                     + f"{fmt(r.peak_gb, '8.2f')} {fmt(r.rel_err, '9.1e')} {fmt(r.setup_s, '8.1f')}")
        if r.note.startswith("not available") or "fell back" in r.note:
            lines.append(f"{'':<20} {r.note}")
    lines.append(LEGEND)
    if not ratios and rows:
        lines.append(CPU_NOTE)
    return "\n".join(lines)


def as_dicts(rows: list[Row]) -> list[dict]:
    return [asdict(r) for r in rows]

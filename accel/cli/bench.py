"""`python -m sd_accel bench`: SD1.5 and SDXL UNets from their published configs with seeded random weights,
timed against stock-PyTorch baselines in the same run.

Rows: eager (diffusers' way: fp16, PyTorch SDPA), eager + channels_last + CUDA graph, torch.compile default
and "reduce-overhead" (with compile times), and each available sd-accel path. Per row: ms per UNet step
(batch 2 = classifier-free guidance), its median and range, speed-up over eager, peak memory and relative L2 error
against an fp32 reference of the same weights.

Every row after eager is timed interleaved with eager (eager call, the row's call, eager, ...; accel/cli/timing.py),
and its speed-up is the ratio of the two medians over those runs: a drift of the clocks or of the host's load falls on
both. The rows that change the model in place switch it between their calls, untimed and without a second copy of
the weights: an sd-accel path is suspended for eager's call and resumed for its own (TorchEngine.suspend keeps its
CUDA graphs, fp8 copies and packed weights, and puts every weight back where the graphs read it), and the CUDA graph
baseline's channels_last weights are restrided in their own storage.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch

from ..errors import BadInput
from ..models.configs import (DIFFUSERS_DIT_CONFIGS, DIT_NAMES, SHAPES, build_host_unet, build_unet, example_inputs,
                              ldm_example_inputs)
from ..models.spec import CanonicalUNet
from ..progress import StageLog
from . import timing
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
    timed: dict | None = None  # this row's timed calls (timing.Spread.record): ms is their median
    baseline: dict | None = None  # eager's calls interleaved with them, where the row is not eager's own


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _speedup(base_ms: float, ms: float, device: torch.device) -> float | None:
    """base_ms / ms on a GPU. None on the CPU, where no speed-up is claimed (CPU_NOTE)."""
    return base_ms / ms if device.type == "cuda" else None


def _x(ratio: float | None) -> str:
    """A progress line's ratio, where there is one."""
    return "" if ratio is None else f", x{ratio:.2f}"


def call_ms(fn: Callable[[], object], device: torch.device) -> float:
    """Milliseconds of one call of fn, its GPU work included (CUDA events on the GPU; the caller synchronised)."""
    if device.type == "cuda":
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        return a.elapsed_time(b)
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def time_calls(fn: Callable[[], object], device: torch.device, iters: int, warmup: int = 3) -> timing.Spread:
    """Milliseconds of `iters` calls of fn, after warm-up."""
    for _ in range(warmup):
        fn()
    _sync(device)
    return timing.Spread.of(call_ms(fn, device) for _ in range(iters))


def time_ms(fn: Callable[[], object], device: torch.device, iters: int, warmup: int = 3) -> float:
    """Median milliseconds per call, after warm-up."""
    return time_calls(fn, device, iters, warmup).median


def _unchanged() -> None:
    """The switch of a side that leaves the model as it is."""


def time_pair(base: Callable[[], object], fn: Callable[[], object], device: torch.device, iters: int,
              to_base: Callable[[], None] = _unchanged, to_fn: Callable[[], None] = _unchanged,
              warmup: int = 3) -> tuple[timing.Spread, timing.Spread]:
    """Milliseconds of `iters` calls of base and of fn, made alternately (base first) after `warmup` untimed pairs.
    Before each call its side's switch puts the model in the state that side runs (to_base, to_fn: idempotent),
    untimed and outside inference mode, as the model was when the path was built."""
    def side(switch: Callable[[], None], call: Callable[[], object]) -> Callable[[], float]:
        def timed() -> float:
            with torch.inference_mode(False):
                switch()
            _sync(device)
            return call_ms(call, device)
        return timed

    base_side, fn_side = side(to_base, base), side(to_fn, fn)
    for _ in range(warmup):  # the switches too: a first resume may capture or compile what later ones replay
        base_side()
        fn_side()
    base_ms, fn_ms = timing.interleaved(base_side, fn_side, iters)
    return timing.Spread.of(base_ms), timing.Spread.of(fn_ms)


def timed_row(model: str, variant: str, own: timing.Spread, base: timing.Spread | None, device: torch.device,
              **fields) -> Row:
    """A timed row: ms is own's median; on a GPU its speed-up is base's median over it (eager's own row: 1)."""
    ratio = _speedup(base.median if base is not None else own.median, own.median, device)
    return Row(model, variant, own.median, ratio, timed=own.record(),
               baseline=None if base is None else base.record(), **fields)


def _timed_text(row: Row) -> str:
    """A progress line's times: the row's median and range, and on a GPU its ratio against the eager runs
    interleaved with it."""
    text = f"{row.ms:.2f} ms/step ({row.timed['min']:.2f}-{row.timed['max']:.2f})"
    if row.speedup is None or row.baseline is None:
        return text + _x(row.speedup)
    b = row.baseline
    return text + f", x{row.speedup:.2f} against eager {b['median']:.2f} ms ({b['min']:.2f}-{b['max']:.2f}) interleaved"


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
    each torch.compile mode, each sd-accel path; canon(*args) is the model's canonical call. Every row after eager's
    is timed interleaved with eager (time_pair)."""
    rows: list[Row] = []
    model = canon.unet

    def plain() -> torch.Tensor:
        return canon(*args)

    def add(variant: str, fn: Callable[[], torch.Tensor], setup_s: float | None = None, note: str = "",
            to_eager: Callable[[], None] = _unchanged, to_fn: Callable[[], None] = _unchanged) -> None:
        _peak_reset(device)
        with torch.inference_mode(), amp():
            out = fn()
            peak = _peak_gb(device)  # the row's own: eager's calls interleaved with its timed ones are not its
            if rows:
                base, own = time_pair(plain, fn, device, iters, to_eager, to_fn)
            else:
                base, own = None, time_calls(fn, device, iters)
            with torch.inference_mode(False):
                to_eager()  # the next row starts from the plain model
        err = rel_l2(out, ref)
        row = timed_row(name, variant, own, base, device, peak_gb=peak, rel_err=err, setup_s=setup_s, note=note)
        rows.append(row)
        log(f"[{name}] {variant}: {_timed_text(row)}, err {err:.2e}")

    add(eager, plain)
    if profile and device.type == "cuda":
        _profile(rows[-1], plain, log)
    if device.type == "cuda" and getattr(canon, "uncapturable", None):
        log(f"[{name}] eager + CUDA graph: not timed ({canon.uncapturable})")
    elif device.type == "cuda":
        graph_args, to_eager, to_graphed = args, _unchanged, _unchanged
        if channels_last:
            to_eager, to_graphed = channels_last_switches(model)
            graph_args = (args[0].contiguous(memory_format=torch.channels_last), *args[1:])
        with torch.inference_mode(), amp():
            replay = _graphed(canon, graph_args)
        add("eager + channels_last + CUDA graph" if channels_last else "eager + CUDA graph", replay,
            to_eager=to_eager, to_fn=to_graphed)
        del replay
    for mode in compile_modes:
        torch._dynamo.reset()
        compiled = torch.compile(canon, mode=None if mode == "default" else mode)
        start = time.perf_counter()
        with torch.inference_mode():
            compiled(*args)
            compiled(*args)
        _sync(device)
        # no switch: compiling leaves the model as eager runs it
        add(f"torch.compile {mode}", lambda: compiled(*args), setup_s=time.perf_counter() - start)
        del compiled
        torch._dynamo.reset()
    for path in paths:
        rows.extend(_bench_path(name, path, canon, args, ref, device, iters, log, profile, amp))
    return rows


def channels_last_switches(model: torch.nn.Module) -> tuple[Callable[[], None], Callable[[], None]]:
    """The model's 4-D weights made channels_last now, and two idempotent switches: back to contiguous strides (for
    eager's calls), and to channels_last again (for the graph's replays). Each rewrites the weights in their own
    storage, as the torch path does: a graph captured on them reads them where they were, and no second copy of the
    weights is made."""
    from ..engine.backends.torch_fused import restride, restride_tensors

    weights = restride(model, torch.channels_last)
    now = [torch.channels_last]

    def to(memory_format: torch.memory_format) -> Callable[[], None]:
        def switch() -> None:
            if now[0] != memory_format:
                restride_tensors(weights, memory_format)
                now[0] = memory_format
        return switch
    return to(torch.contiguous_format), to(torch.channels_last)


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


# --paths that only a diffusion transformer's bench takes: fp8 or int8 products (precision fp8, int8), and its weights
# stored in fp8 as ComfyUI loads them (dit_bench).
DIT_PATHS = ("torch-fp8", "torch-int8", "torch-fp8weights")
# Path variants of --paths ("<backend>-<variant>"): the options they build with, and their label.
VARIANTS = {"compile": ({"compile": True}, " + regional compile"),
            "graph": ({"cuda_graph": True}, " + CUDA graph"),
            "cudnn-search": ({"cudnn_benchmark": True}, " + cuDNN search"),
            "fp8": ({"precision": "fp8"}, " fp8 products"),
            "int8": ({"precision": "int8"}, " int8 products"),
            # after the path's own row, another checkpoint of the model built from its cached graph
            "refit": (None, "")}


def _bench_path(name, path, canon, args, ref, device, iters, log, profile=False,
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
        peak = _peak_gb(device)
        captured = _captures(acc)
        # eager's calls run the plain model: the path is suspended for them and resumed for its own (its graphs kept)
        base, own = time_pair(lambda: canon(*args), lambda: acc(*args), device, iters, acc.suspend, acc.resume)
        recaptured = _captures(acc) - captured
    err = rel_l2(out, ref)
    note = "setup = build + first call at a new shape"
    if recaptured:  # a resume that moved a weight: the timed calls then include captures
        note = f"{recaptured} CUDA graph captures while timed against eager (suspend/resume lost the graphs)"
        log(f"[{name}] sd-accel {path}: {note}")
    if acc.fallback_calls:  # the figures are then not the path's own
        note = f"{acc.fallback_calls} calls fell back to the torch path: {acc.fallback_reason}"
        log(f"[{name}] sd-accel {path}: {note}")
    row = timed_row(name, f"sd-accel {backend}{label}", own, base, device, peak_gb=peak, rel_err=err, setup_s=first_s,
                    note=note, extra={"seen_shape_s": seen_s, "new_shape_s": new_shape_s, "reasons": acc.plan.reasons})
    log(f"[{name}] sd-accel {path}: {_timed_text(row)}, err {err:.2e}, "
        f"first call {first_s:.1f}s, new shape {new_shape_s:.2f}s, seen shape {seen_s * 1e3:.0f} ms")
    if profile and device.type == "cuda":
        _profile(row, lambda: acc(*args), log)
    acc.release()
    if variant != "refit":
        return [row]
    return [row, _second_checkpoint(name, backend, canon, args, device, iters, log, amp)]


def _captures(acc) -> int:
    """CUDA graphs the path's torch engine has captured so far (0 for another engine, or without graphs)."""
    graphs = getattr(acc.engine, "graphs", None)
    return graphs.captures if graphs is not None else 0


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


def _second_checkpoint(name, backend, canon, args, device, iters, log, amp) -> Row:
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
        peak = _peak_gb(device)
        # against this checkpoint's own eager calls, interleaved as the path's first row is
        base, own = time_pair(lambda: other(*args), lambda: acc(*args), device, iters, acc.suspend, acc.resume)
    err = rel_l2(out, ref)
    result = getattr(acc.engine, "cache_result", None)
    how = result.describe() if result is not None else "built"
    row = timed_row(name, f"sd-accel {backend}, 2nd checkpoint", own, base, device, peak_gb=peak, rel_err=err,
                    setup_s=setup_s, note=f"setup = build ({how}) + first call", extra={"reasons": acc.plan.reasons})
    log(f"[{name}] sd-accel {backend} second checkpoint: {how}; setup {setup_s:.1f} s, {_timed_text(row)}, "
        f"err {err:.2e}")
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
    if device.type == "cuda" and iters < timing.MIN_RUNS:
        log(f"--iters {iters}: a speed-up is printed from at least {timing.MIN_RUNS} interleaved runs of each side; "
            f"timing {timing.MIN_RUNS}")
        iters = timing.MIN_RUNS
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    rows: list[Row] = []
    for name in names:
        if name in DIT_NAMES:
            rows += bench_dit(name, device, iters, compile_modes, paths, log, profile, host)
        else:
            rows += bench_unet(name, device, dtype, iters, compile_modes, paths, log, profile, host)
    return rows


# How the ms/step and min-max columns are made (time_pair), and the eager ms and speedup columns where there are.
TIMING = ("ms/step = median of the row's timed calls, min-max their range; each row after a model's first (eager) is "
          "timed interleaved with eager (eager call, the row's call, alternately, --iters of each after 3 warm-up "
          "pairs; an sd-accel path suspended for eager's calls, its graphs kept; eager's times: the JSON's baseline).")
RATIO = "eager ms = eager's median over the runs interleaved with the row; speedup = eager ms / ms/step."
# "seen shape" is in the progress lines and the JSON (extra.seen_shape_s), not in a column of the table.
LEGEND = ("setup s = build + first call at a new shape; new shape (progress lines, JSON) = the first call at a second "
          "shape (half the height, to a multiple the path accelerates) in the same process; seen shape = a call at a "
          "shape already captured, made after a call at another shape (nothing rebuilt).")


# Said where the table has no speedup column (the CPU), in the demo's words.
CPU_NOTE = ("speedup: none on the CPU, so no speed-up is claimed: the torch path runs the plain model there (its "
            "kernels and graphs need a GPU), and a ratio of CPU times would show how busy the machine was; the times "
            "are for reference.")


def host_line(cpu: str, load: float | None) -> str:
    """The host the times were taken on: its CPU, which eager's launches wait on, and how busy it was."""
    return f"host: CPU {cpu}, load {timing.load_text(load)} (1-minute average, after the timed runs)"


def table(rows: list[Row], host: str = "") -> str:
    """The rows as a table, the legends under it, and `host` (host_line) last where given."""
    ratios = any(r.speedup is not None for r in rows)
    head = f"{'model':<20} {'variant':<36} {'ms/step':>8} {'min-max':>15} " + \
        (f"{'eager ms':>8} {'speedup':>8} " if ratios else "") + f"{'peak GB':>8} {'rel err':>9} {'setup s':>8}"
    lines = [head, "-" * len(head)]
    fmt = lambda v, f: format("-", ">" + f.partition(".")[0]) if v is None else format(v, f)
    for r in rows:
        spread = "-" if r.timed is None else f"{r.timed['min']:.2f}-{r.timed['max']:.2f}"
        base = None if r.baseline is None else r.baseline["median"]
        lines.append(f"{r.model:<20} {r.variant:<36} {fmt(r.ms, '8.2f')} {spread:>15} "
                     + (f"{fmt(base, '8.2f')} {fmt(r.speedup, '8.2f')} " if ratios else "")
                     + f"{fmt(r.peak_gb, '8.2f')} {fmt(r.rel_err, '9.1e')} {fmt(r.setup_s, '8.1f')}")
        if r.note.startswith("not available") or "fell back" in r.note or "captures while timed" in r.note:
            lines.append(f"{'':<20} {r.note}")
    lines += [TIMING, RATIO, LEGEND] if ratios else [TIMING, LEGEND]
    if not ratios and rows:
        lines.append(CPU_NOTE)
    if host:
        lines.append(host)
    return "\n".join(lines)


def as_dicts(rows: list[Row]) -> list[dict]:
    return [asdict(r) for r in rows]

"""`python -m sd_accel bench --gpus 1,2,4`: one sampling step of a diffusion transformer spread over several GPUs
(accel/parallel/), against the same step on one GPU. The layouts are the ones the ComfyUI node's workers run
(accel/parallel/layout.py), each entered around every call as the node enters it.

For each world size W a fresh set of W processes (NCCL, one GPU each; gloo on the CPU with --tiny) builds each model
once, in ComfyUI's form with the seeded weights every rank draws alike, on sd-accel's torch path, and times every
layout whose factors divide W: W=1 the baseline; "sequence" (Ulysses over all W); "CFG" (the two halves of the CFG
batch on two GPUs) for W=2; "CFG x sequence" (CFG over 2 groups, sequence parallel inside each) for larger even W. A
layout the model refuses (heads or tokens the world does not divide, a model the sequence split does not take)
is a row that says why. Per row: median ms per step (the CFG batch included) of the slowest rank, the peak GPU memory
of the busiest rank, and the relative L2 distance from the W=1 output in fp32. A layout's speed-up is timed within its
own world (issue 58): the same processes run the 1-GPU call (each rank the whole step on its own GPU) and the layout's
call alternately, --iters of each, each timed call after an untimed one of its own side (a switch captures the CUDA
graphs of that shape again: they serve the attention functions they captured, the exchange or the host's), and the
speed-up is the ratio of the two medians, so that a drift of the clocks or of the host's load falls on both. With
`--paths torch-fp8` the step runs under precision fp8 (fp8 products, and fp8 attention where it runs: sequence
parallelism's too), its rows against the 1-GPU fp8 output, each saying which fp8 attention kernel served it at which
shape (or that the attention stayed 16-bit).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..engine import fp8_attention
from ..errors import BadInput
from ..models.configs import COMFY_DIT_CONFIGS, DIT_SHAPES, cfg_batch
from ..parallel.layout import Layout, candidates, make_layouts
from ..parallel.rendezvous import NO_MULTICAST, cpu_threads, free_port, join
from ..parallel.spread import SPREAD_OPTIONS
from .bench import _peak_gb, _peak_reset, _sync, rel_l2
from .timing import MIN_RUNS, interleaved
from .profile import by_class, kernel_times, top, top_line
from .video_sizes import parse_video_sizes

# How long a rank waits for the others, at start-up and in any collective, before it fails rather than hangs. Ranks
# meet once per step, so the longest wait is about one step of the largest model on one GPU, or one model build.
COLLECTIVE_TIMEOUT_S = 180
WARMUP = 2  # the first call at a shape (cuDNN plans, Triton kernels, NCCL's communicators), then a graph's capture
# The VAE's spatial factor: the latent is the video's pixel size over it (Wan 2.2 5B's VAE: 16, Wan 2.1's: 8).
SPATIAL = {"wan22-5b": 16}


@dataclass
class Result:
    model: str
    size: str  # pixels, width x height
    gpus: int
    layout: str
    ms: float | None = None
    speedup: float | None = None
    ms_range: tuple[float, float] | None = None  # the fastest and slowest timed call, each the largest over the ranks
    one_gpu_ms: float | None = None  # W > 1: the 1-GPU call's median on the slowest rank, timed alternately with the row's
    one_gpu_range: tuple[float, float] | None = None
    peak_gb: float | None = None
    rel_err: float | None = None
    noise: float | None = None  # the 1-GPU row's: how far its output moves with its input moved by one bf16 rounding
    kernels: dict[str, float] | None = None  # with --profile: rank 0's GPU ms per step by operator class
    top_kernels: list | None = None  # with --profile: rank 0's costliest kernels, (name, ms per step, launches)
    note: str = ""
    precision: str = "auto"  # the engine's: "fp8" with --paths torch-fp8
    attention: str | None = None  # precision fp8: rank 0's fp8 attention kernels and shapes ("" where 16-bit)


@dataclass(frozen=True)
class Job:
    """What every process of one world is given."""

    world: int
    port: int
    models: tuple[str, ...]
    sizes: dict[str, tuple[tuple[str, tuple[int, int]], ...]]  # model -> (label, latent (h, w)) per size
    iters: int
    cuda: bool
    comfyui: str
    folder: str  # the W=1 outputs, each world's rows and any rank's error
    profile: bool = False
    precisions: tuple[str, ...] = ("auto",)  # the engine's precision of each set of rows, in turn


def parse_gpus(text: str) -> list[int]:
    """--gpus "1,2,4" -> [1, 2, 4]: distinct world sizes, ascending, 1 always (the baseline)."""
    worlds = set()
    for part in text.split(","):
        if not part.strip().isdigit() or int(part) < 1:
            raise BadInput(f"--gpus {text!r}: {part.strip()!r} is not a number of GPUs.",
                           "Give whole numbers of 1 or more, comma-separated, e.g. --gpus 1,2,4.")
        worlds.add(int(part))
    return sorted(worlds | {1})


def model_names(models: list[str], tiny: bool) -> list[str]:
    """The models to build: ComfyUI-form DiTs; with tiny, the tiny model of each one's family."""
    # not HunyuanVideo 1.5 or LTX-2, whose classes sequence parallelism does not take (accel/parallel/sequence.py)
    full = [n for n in COMFY_DIT_CONFIGS
            if not n.startswith("tiny-") and COMFY_DIT_CONFIGS[n][0] not in ("hunyuan-video", "ltx2")]
    names: list[str] = []
    for name in models:
        if name not in full:
            raise BadInput(f"the multi-GPU bench has no model {name!r}.",
                           f"Choose from {', '.join(full)} (with --tiny: the tiny model of the same family).")
        name = f"tiny-{COMFY_DIT_CONFIGS[name][0]}" if tiny else name
        if name not in names:
            names.append(name)
    return names


def model_sizes(name: str, video_sizes: str) -> tuple[tuple[str, tuple[int, int]], ...]:
    """(label, latent (h, w)) of each size `name` runs at: a video model every one of video_sizes ("832x480,...",
    width x height in pixels), an image model the single-GPU bench's size (DIT_SHAPES)."""
    family = COMFY_DIT_CONFIGS[name][0]
    if family != "wan":
        latent = DIT_SHAPES[name][1]
        return ((f"{8 * latent}x{8 * latent}", (latent, latent)),)
    factor = SPATIAL.get(name, 8)
    sizes = parse_video_sizes(video_sizes, 2 * factor, f"{name} takes",
                              f" (the VAE's factor {factor} times the 2x2 patch)")
    return tuple((f"{w}x{h}", (h // factor, w // factor)) for w, h in sizes)


def layouts(world: int, batch: int, spread: dict[str, Layout]) -> list[tuple[str, str | None]]:
    """(row name, accel/parallel/layout.py layout or None for the 1-GPU call) of each layout of `world` processes
    (spread: their layouts, make_layouts) for a model run at `batch`: those the ComfyUI node's workers try, sequence
    first."""
    if world == 1:
        return [("1 GPU", None)]
    names = {"sequence": "sequence", "cfg": "CFG" if world == 2 else "CFG x sequence"}
    return [(names[key], key) for key in sorted(candidates(batch, spread), key=lambda key: key != "sequence")]


def check(models: list[str], gpus: str, video_sizes: str | None, tiny: bool, comfyui: str | None,
          profile: bool = False) -> tuple[list[int], list[str], dict[str, tuple[tuple[str, tuple[int, int]], ...]]]:
    """The world sizes, the models and each model's sizes (labels and latents) bench_parallel runs; BadInput for what
    the user can fix, before any process starts."""
    worlds = parse_gpus(gpus)
    names = model_names(models, tiny)
    if profile and tiny:
        raise BadInput("--profile reads the GPUs' kernel times, and --tiny runs on the CPU.", "Drop one of them.")
    if not tiny:
        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if worlds[-1] > have:
            raise BadInput(f"--gpus asks for {_gpus(worlds[-1])}, and this machine has {_gpus(have)}.",
                           f"Give world sizes of at most {have}." if have else "Run it on a machine with GPUs, or "
                           "add --tiny to run tiny models in processes on the CPU.")
    if not comfyui:
        raise BadInput("the multi-GPU bench builds ComfyUI's own model classes, and no ComfyUI was given.",
                       "Pass --comfyui DIR (a ComfyUI checkout).")
    return worlds, names, {name: model_sizes(name, video_sizes or ("64x64" if tiny else "832x480")) for name in names}


def precisions(paths: list[str]) -> tuple[str, ...]:
    """The engine precisions --paths asks of the multi-GPU bench: "auto" for torch, "fp8" for torch-fp8, "int8" for
    torch-int8 (the others it does not time); auto where it names none of them."""
    found = tuple(p for path, p in (("torch", "auto"), ("torch-fp8", "fp8"), ("torch-int8", "int8")) if path in paths)
    return found or ("auto",)


def bench_parallel(models: list[str], gpus: str, video_sizes: str | None, iters: int, tiny: bool,
                   comfyui: str | None, log: Callable[[str], None] = print, profile: bool = False,
                   precisions: tuple[str, ...] = ("auto",)) -> list[Result]:
    """Rows for every model, size, world size and layout (see the module's docstring), for each of `precisions` in
    turn; with profile, each row's GPU time by operator class (collectives apart). BadInput for what the user can fix
    (check); RuntimeError with a rank's own message when a process failed."""
    worlds, names, sizes = check(models, gpus, video_sizes, tiny, comfyui, profile)
    if not tiny and iters < MIN_RUNS:
        log(f"--iters {iters}: a speed-up is printed from at least {MIN_RUNS} alternate runs of each side; timing "
            f"{MIN_RUNS}")
        iters = MIN_RUNS
    for key, value in NO_MULTICAST.items():
        os.environ.setdefault(key, value)
    rows: list[Result] = []
    with tempfile.TemporaryDirectory(prefix="sd-accel-parallel-") as folder:
        for world in worlds:
            how = "gloo, on the CPU" if tiny else "NCCL, one GPU each"
            log(f"[{world} GPU{'s' if world > 1 else ''}] starting {world} process{'es' if world > 1 else ''} ({how})")
            job = Job(world, free_port(), tuple(names), sizes, iters, not tiny, str(comfyui), folder, profile,
                      tuple(precisions))
            rows += _run_world(job)
    return rows


def _gpus(n: int) -> str:
    return f"{n or 'no'} CUDA GPU{'' if n == 1 else 's'}"


def _run_world(job: Job) -> list[Result]:
    """Start job.world processes, wait for them, and return rank 0's rows; RuntimeError with the first failing
    rank's message (the others are stopped) when one fails."""
    context = mp.start_processes(_worker, args=(job,), nprocs=job.world, join=False, start_method="spawn")
    try:
        while not context.join(timeout=5, grace_period=10):
            pass
    except (mp.ProcessExitedException, mp.ProcessRaisedException) as e:
        errors = sorted(Path(job.folder).glob(f"error-{job.world}-*"), key=lambda p: p.stat().st_mtime_ns)
        raise RuntimeError(errors[0].read_text() if errors else f"{job.world} processes: {e}") from None
    rows = json.loads(Path(job.folder, f"rows-{job.world}.json").read_text())
    return [Result(**r) for r in rows]


def _worker(rank: int, job: Job) -> None:
    """One rank: join the world, run every model, size and layout, and leave it; a failure is written where the
    parent reads it, and the process exits with 1."""
    sys.stdout = sys.stderr  # with --json, the parent's stdout carries the JSON alone
    where = ["joining the others"]  # what this rank is doing, for its error message
    try:
        if job.cuda:
            torch.cuda.set_device(rank)
        else:
            torch.set_num_threads(cpu_threads(job.world))
        join("nccl" if job.cuda else "gloo", job.port, rank, job.world, COLLECTIVE_TIMEOUT_S,
             torch.device("cuda", rank) if job.cuda else None)
        rows = _measure(rank, job, where)
        where[0] = "leaving"
        dist.destroy_process_group()
    except Exception as e:  # noqa: BLE001 - every failure ends the bench with this rank's words, not a traceback
        what = str(e) if isinstance(e, BadInput) else f"{type(e).__name__}: {e}"
        Path(job.folder, f"error-{job.world}-{rank}").write_text(f"rank {rank} of {job.world}, {where[0]}: {what}")
        raise SystemExit(1) from None
    if rank == 0:
        Path(job.folder, f"rows-{job.world}.json").write_text(json.dumps(as_dicts(rows)))


def _measure(rank: int, job: Job, where: list[str]) -> list[Result]:
    """Every model, size and layout on this rank; the rows on rank 0 (each with a progress line as it is measured).
    where[0] says what the rank is doing."""
    from ..accelerate import accelerate
    from ..models.configs import build_dit, dit_example_inputs
    from ..plan.device import cpu_info, detect

    device = torch.device("cuda", rank) if job.cuda else torch.device("cpu")
    dtype = torch.bfloat16 if job.cuda else torch.float32
    # Every process calls new_group alike, so the layouts' groups are made once, before any model.
    spread = make_layouts() if job.world > 1 else {}
    rows = []
    for name in job.models:
        where[0] = f"building {name}"
        start = time.perf_counter()
        model = build_dit(name, "comfy", seed=0, device=device, dtype=dtype, comfyui_root=job.comfyui)
        for precision in job.precisions:
            label = name if precision == "auto" else f"{name} {precision}"
            # The torch path as the node's workers run it, with CUDA graphs (cut at the collectives of a
            # sequence-parallel call: accel/engine/graphs.py).
            options = {**SPREAD_OPTIONS, **({} if precision == "auto" else {"precision": precision})}
            acc = accelerate(model, preference="torch", options=options, gpu=detect(rank) if job.cuda else cpu_info())
            _sync(device)
            if rank == 0:
                _say(f"[{label}] built and prepared in {time.perf_counter() - start:.1f}s")
            batch = cfg_batch(name)
            for size, latent in job.sizes[name]:
                inputs = dit_example_inputs(name, batch, latent, device=device, dtype=dtype)
                args = (inputs["x"], inputs["timesteps"], inputs["context"], inputs.get("y"), None,
                        inputs.get("guidance"))
                for layout, key in layouts(job.world, batch, spread):
                    where[0] = f"{label} {size}, {layout}"
                    row, out = _layout_row(job, model, acc, args, spread.get(key), layout, device, precision)
                    row.model, row.size = name, size
                    if rank == 0:
                        _compare(row, out, job)
                        _say(f"[{label} {size}] {_line(row)}")
                        for kernel in row.top_kernels or ():
                            _say(f"[{label} {size}]     {top_line(*kernel)}")
                        rows.append(row)
                    del out
            acc.release()
            del acc
            start = time.perf_counter()
        del model
        _peak_reset(device)
    return rows


def _layout_row(job: Job, model: torch.nn.Module, acc: Callable[..., torch.Tensor], args: tuple,
                spread: Layout | None, layout: str, device: torch.device,
                precision: str = "auto") -> tuple[Result, torch.Tensor | None]:
    """One layout timed on every rank, run as the node's workers run it (spread None: the 1-GPU call): its row (the
    ms of the slowest rank, the peak of the busiest; under precision fp8 the fp8 attention its warm-up calls took)
    and this rank's output (None when the layout was refused). A spread layout's calls alternate with the 1-GPU
    call's in the same processes (one_gpu_ms: its median), after the layout's peak memory is read: the 1-GPU call's
    is not the layout's."""
    row = Result("", "", job.world, layout, precision=precision)
    one_gpu = lambda: acc(*args)  # noqa: E731
    call = one_gpu if spread is None else (lambda: spread.run(model, acc, *args))
    out = None

    def timed_call() -> float:  # the row's output is its last timed call's: no extra step for it
        def run() -> None:
            nonlocal out
            out = call()
        return _step_ms(run, device)

    _peak_reset(device)
    fp8_attention.served_clear()
    try:
        with torch.inference_mode():
            for _ in range(WARMUP):
                call()
            peak = _peak_gb(device) or 0.0
            if precision == "fp8":
                row.attention = "; ".join(fp8_attention.served())
            if spread is None:
                times, one_gpu_times = [timed_call() for _ in range(job.iters)], []
            else:
                for _ in range(WARMUP):
                    one_gpu()
                one_gpu_times, times = interleaved(_settled(one_gpu, lambda: _step_ms(one_gpu, device)),
                                                   _settled(call, timed_call), job.iters)
    except BadInput as e:  # the model or the world cannot take this layout; every rank finds the same
        row.note = f"refused: {e}"
        return row, None
    # each figure the slowest rank's: a step ends when its last rank does
    medians = [statistics.median(t) if t else 0.0 for t in (times, one_gpu_times)]
    worst = torch.tensor([peak, medians[0], min(times), max(times), medians[1], min(one_gpu_times, default=0.0),
                          max(one_gpu_times, default=0.0)], dtype=torch.float64, device=device)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    figures = worst.tolist()
    row.peak_gb = figures[0] if job.cuda else None
    row.ms, row.ms_range = figures[1], (figures[2], figures[3])
    if one_gpu_times:
        row.one_gpu_ms, row.one_gpu_range = figures[4], (figures[5], figures[6])
    if job.world == 1:
        row.noise = _noise(acc, args, out)
    if job.profile:  # every rank runs the profiled calls (their collectives); rank 0's kernels are the row's
        with torch.inference_mode():
            times = kernel_times(call, runs=2)
        row.kernels, row.top_kernels = by_class(times), top(times)
    return row, out


def _settled(call: Callable[[], object], timed: Callable[[], float]) -> Callable[[], float]:
    """timed() after one untimed call: the other side ran last. A spread call reads its exchange where the 1-GPU call
    reads the host's attention function, so the engine's CUDA graphs of that shape are captured again at every switch
    (they serve only the functions they captured); the capture falls on the untimed call, the timed one replays."""
    def go() -> float:
        call()
        return timed()
    return go


def _step_ms(call: Callable[[], torch.Tensor], device: torch.device) -> float:
    """Milliseconds of one call, the ranks starting it together."""
    dist.barrier()
    _sync(device)
    t0 = time.perf_counter()
    call()
    _sync(device)
    return (time.perf_counter() - t0) * 1e3


def _noise(acc: Callable[..., torch.Tensor], args: tuple, out: torch.Tensor) -> float:
    """The yardstick a spread output's distance is read against: the 1-GPU output's distance when its input x moves by
    one bf16 rounding, x (1 + 2^-8 r) with r ~ N(0, 1) (seeded): the difference any other order of bf16 rounding may
    make."""
    x = args[0]
    r = torch.randn(x.shape, generator=torch.Generator().manual_seed(7)).to(x.device, torch.float32)
    moved = (x.float() * (1 + r / 256)).to(x.dtype)
    with torch.inference_mode():
        other = acc(moved, *args[1:])
    return rel_l2(other.float().cpu(), out.float().cpu())


def _compare(row: Result, out: torch.Tensor | None, job: Job) -> None:
    """Rank 0: the W=1 output saved for the later worlds, or a later world's compared with it (in fp32), and the
    speed-up over the 1-GPU call timed alternately with it."""
    if out is None:
        return
    ref = Path(job.folder, f"output-{row.model}-{row.precision}-{row.size}.pt")
    if job.world == 1:
        torch.save(out.float().cpu(), ref)
        row.speedup = 1.0
        return
    row.rel_err = rel_l2(out.float().cpu(), torch.load(ref))
    row.speedup = row.one_gpu_ms / row.ms


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _line(r: Result) -> str:
    where = "1 GPU" if r.gpus == 1 else f"{r.gpus} GPUs, {r.layout}"
    if r.ms is None:
        return f"{where}: {r.note}"
    peak = "" if r.peak_gb is None else f", peak {r.peak_gb:.1f} GB"
    err = f"bf16 noise {r.noise:.1e}" if r.noise is not None else f"err {_fmt(r.rel_err, '.1e')}"
    kernels = ""
    if r.kernels:
        parts = ", ".join(f"{k} {v:.1f}" for k, v in sorted(r.kernels.items(), key=lambda kv: -kv[1])
                          if k not in ("busy total", "launches"))
        kernels = (f"; rank 0's GPU: busy {r.kernels['busy total']:.1f} ms ({parts}), "
                   f"{r.kernels['launches']:.0f} kernels")
    against = "" if r.one_gpu_ms is None else \
        f" against 1 GPU {r.one_gpu_ms:.1f} ms ({_range(r.one_gpu_range)}) timed alternately"
    return (f"{where}: {r.ms:.1f} ms/step ({_range(r.ms_range)}), x{r.speedup:.2f}{against}{peak}, {err}{kernels}"
            + ("" if r.attention is None else f"; {_attention(r)}"))


def _attention(r: Result) -> str:
    """What served a precision-fp8 row's attention, in words."""
    return f"fp8 attention: {r.attention}" if r.attention else "fp8 attention: none, the attention ran in 16 bits"


def _range(low_high: tuple[float, float] | None) -> str:
    return "-" if low_high is None else f"{low_high[0]:.1f}-{low_high[1]:.1f}"


def _fmt(value: float | None, spec: str) -> str:
    """value in spec, or "-" as wide."""
    return format("-", ">" + spec.partition(".")[0]) if value is None else format(value, spec)


LEGEND = ("ms/step = one sampling step of the whole batch (both CFG halves), median of the timed calls on the slowest "
          "rank, min-max their range (each the largest over the ranks); 1 GPU ms = the 1-GPU call's median in the "
          "row's processes; speedup = the 1-GPU call's median over the row's, the two timed alternately in the same processes "
          "(--iters of each, each after an untimed call of its own side: a switch captures the CUDA graphs again; "
          "each rank runs the whole step on its own GPU for the 1-GPU call); peak GB = the most any rank allocated; "
          "rel err = relative L2 distance of the output from the 1-GPU output, in fp32; on the 1-GPU row, in brackets, "
          "its bf16 noise: its own distance when its input moves by one bf16 rounding (x (1 + 2^-8 r)), the yardstick "
          "for the others. CUDA graphs in every row; a sequence-parallel call's are cut at its exchanges, which run "
          "between them.")


def table(rows: list[Result], host: str = "") -> str:
    """The rows as a table, the legend under it, and `host` (bench.host_line) last where given."""
    head = f"{'model':<14} {'size':<10} {'GPUs':>4} {'layout':<15} {'ms/step':>9} {'min-max':>15} {'1 GPU ms':>9} " \
           f"{'speedup':>8} {'peak GB':>8} {'rel err':>9}"
    lines = [head, "-" * len(head)]
    for r in rows:
        model = r.model if r.precision == "auto" else f"{r.model} {r.precision}"
        lines.append(f"{model:<14} {r.size:<10} {r.gpus:>4} {r.layout:<15} {_fmt(r.ms, '9.1f')} "
                     f"{_range(r.ms_range):>15} {_fmt(r.one_gpu_ms, '9.1f')} {_fmt(r.speedup, '8.2f')} "
                     f"{_fmt(r.peak_gb, '8.1f')} "
                     + (f"({r.noise:.1e})" if r.noise is not None else _fmt(r.rel_err, '9.1e')))
        if r.note:
            lines.append(f"{'':<14} {r.note}")
        if r.attention is not None and r.ms is not None:
            lines.append(f"{'':<14} {_attention(r)}")
    lines.append(LEGEND)
    if host:
        lines.append(host)
    return "\n".join(lines)


def as_dicts(rows: list[Result]) -> list[dict]:
    return [asdict(r) for r in rows]

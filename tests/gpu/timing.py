"""How the GPU suite times the node against plain ComfyUI (issue 58).

Plain ComfyUI's eager run is bound by kernel launches on the CPU, and its time moves from run to run and from machine
to machine (SDXL 1024, 20 steps: 1.17-1.88 s over 12 runs on one H200, where the node took 0.62 s every time, and
2.30-2.69 s on another), so a single sample of it can put the ratio anywhere between. Both sides therefore run warm and alternately (node, plain,
node, plain, ...: a drift of the clocks or of other tenants' load falls on both alike), RUNS times each, and each side
is its median with its range, beside the host's CPU and load. One more run of each under torch's profiler says how
long the GPU was busy within it: how much of a speed-up is GPU work and how much is the launch overhead that CUDA
graphs remove; and that busy time by class of kernel (the bench's classes: GEMM, attention, norm, collective, ...,
with memory copies and sets apart) and its longest kernels by name, so that two runs whose GPU work differs (one model
in two ComfyUI versions) say where. One more run of each under torch's sync debug mode says where the CPU waited for
the GPU (each wait leaves the GPU idle while the CPU prepares what follows it): the idle time that two runs of the same
GPU work differ by. A non-blocking copy from pageable memory is not among them (the mode flags torch's own syncs);
its time shows among the copies.

The statistics and the lines are plain functions of the timers' samples, which tests/test_gpu_timing.py checks on
the CPU; the statistics and the host's CPU and load are the bench's own (accel/cli/timing.py).
"""

from __future__ import annotations

import math
import os
import traceback
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# One implementation of the statistics and the host's CPU and load, the bench's too; the suite reads them from here.
from sd_accel.accel.cli.profile import classify
from sd_accel.accel.cli.timing import (MIN_RUNS, Spread, cpu_model, figure, host_cpu, interleaved,  # noqa: F401
                                       load, load_text)



def timed_runs(environ: dict) -> int:
    """Timed runs of each side on a GPU: MIN_RUNS, or more where SD_ACCEL_GPU_TIMED_RUNS asks (a closer median where
    two figures that differ by less than their samples' spread are compared, as one model's ratio in two ComfyUIs)."""
    text = environ.get("SD_ACCEL_GPU_TIMED_RUNS", "")
    if not text:
        return MIN_RUNS
    if not text.isdigit() or int(text) < MIN_RUNS:
        raise ValueError(f"SD_ACCEL_GPU_TIMED_RUNS={text!r}: give a whole number of at least {MIN_RUNS}")
    return int(text)


RUNS = timed_runs(os.environ)
CPU_RUNS = 1  # without one (tiny models, tests/test_gpu_*.py) the timed runs check the harness, and no figure is meant
KERNELS = 3  # the longest kernels by name each side's profiled run lists in each of its longest classes and copies
CLASSES = 4  # those classes (a fourth: norm, where the DiTs' fused q/k row-norm passes fall by their names)
NAME = 60  # characters of a kernel's name in a line, its boilerplate dropped (templated names run to thousands)
# Words of PyTorch's and CUDA's kernel names that say nothing of which kernel it is: dropped before a name is cut
BOILERPLATE = ("void ", "at::native::", "(anonymous namespace)::", "c10::", "std::", "at::")


@dataclass(frozen=True)
class Busy:
    """How long the GPU was busy during one profiled run, against the side's median wall time."""

    wall: float
    seconds: float | None = None  # None: not measured, `why` says why
    why: str = ""
    classes: tuple[tuple[str, float], ...] = ()  # the GPU's time by class of kernel, the longest first
    # per class of the CLASSES longest, and copies: its KERNELS longest kernels by name, summed over their calls
    kernels: tuple[tuple[str, tuple[tuple[str, float], ...]], ...] = ()

    def text(self, side: str, unit: str) -> str:
        if self.seconds is None:
            return f"{side}: GPU busy not measured ({self.why})"
        share = f" ({100 * self.seconds / self.wall:.0f}%)" if self.wall > 0 else ""
        return f"{side}: GPU busy {figure(self.seconds)} {unit} of {figure(self.wall)} {unit} wall{share}"

    def by_class(self, side: str, unit: str) -> str:
        return f"{side}: " + ", ".join(f"{name} {figure(seconds)}" for name, seconds in self.classes) + f" {unit}"

    def by_kernel(self, side: str, unit: str) -> str:
        return f"{side}'s longest kernels ({unit}): " + "; ".join(
            f"{kind}: " + ", ".join(f"{short(name)} {figure(seconds)}" for name, seconds in names)
            for kind, names in self.kernels)


def short(name: str) -> str:
    """A kernel's name for a line: its boilerplate dropped, cut to NAME characters."""
    for words in BOILERPLATE:
        name = name.replace(words, "")
    return name if len(name) <= NAME else name[:NAME - 3] + "..."


SYNC_WARNING = "called a synchronizing CUDA operation"  # torch's warning at each wait in sync debug mode "warn"
SITES = 3  # the places that waited most, each side
SITE_FRAMES = 2  # frames of each place, the innermost first


@dataclass(frozen=True)
class Waits:
    """Where one run made the CPU wait for the GPU: each place (its innermost frames outside torch) and its count."""

    count: int | None  # None: not measured, `why` says why
    sites: tuple[tuple[str, int], ...] = ()  # the most first
    why: str = ""

    def text(self, side: str) -> str:
        if self.count is None:
            return f"{side} not measured ({self.why})"
        return f"{side} {self.count}" + (" (" + "; ".join(f"{where} x{n}" for where, n in self.sites[:SITES]) + ")"
                                         if self.sites else "")


def site(stack: traceback.StackSummary) -> str:
    """The place a wait came from: its innermost frames outside torch, the warnings machinery and this module."""
    import torch

    torch_dir = str(Path(torch.__file__).parent)
    frames = [f for f in stack if not f.filename.startswith(torch_dir)
              and Path(f.filename).name not in ("warnings.py", Path(__file__).name)]
    return " < ".join(f"{Path(f.filename).parent.name}/{Path(f.filename).name}:{f.lineno} {f.name}"
                      for f in reversed(frames[-SITE_FRAMES:])) or "?"


def host_waits(run: Callable[[], object], set_mode: Callable[[str], None] | None = None) -> Waits:
    """Where one call of `run` made the CPU wait for the GPU, by torch's sync debug mode (set_mode: its setter,
    torch.cuda.set_sync_debug_mode); a mode that cannot be set is said in the table, never a failed suite."""
    import torch

    set_mode = set_mode or torch.cuda.set_sync_debug_mode
    sites: dict[str, int] = {}

    def note(message, category, filename, lineno, file=None, line=None):
        if SYNC_WARNING in str(message):
            where = site(traceback.extract_stack()[:-1])
            sites[where] = sites.get(where, 0) + 1

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = note
            set_mode("warn")
            try:
                run()
            finally:
                set_mode("default")
    except Exception as e:  # noqa: BLE001 (a torch without CUDA, or without the mode: the timing stands)
        text = str(e).strip().splitlines()
        return Waits(None, why=f"{type(e).__name__}{': ' + text[0] if text else ''}")
    return Waits(sum(sites.values()), tuple(sorted(sites.items(), key=lambda kv: -kv[1])))


@dataclass(frozen=True)
class Timed:
    """The timed pair: the node's runs and plain ComfyUI's, interleaved, and where each one's time went."""

    node: Spread
    plain: Spread
    ratio: float  # plain's median over the node's
    cpu: str
    load: float | None  # the host's 1-minute load average right after the timed runs
    node_busy: Busy
    plain_busy: Busy
    unit: str = "s"
    beside: Spread | None = None  # a third side run after the two in each round, for context (not profiled)
    beside_label: str = ""
    plain_waits: Waits | None = None  # where one more run of each made the CPU wait for the GPU
    node_waits: Waits | None = None

    def lines(self) -> list[str]:
        timed = (f"timed: node median {self.node.text(self.unit)}, plain {self.plain.text(self.unit)} over "
                 f"{len(self.node.samples)} interleaved warm runs each: {self.ratio:.2f}x; CPU {self.cpu}, "
                 f"load {load_text(self.load)}")
        lines = [timed, f"{self.plain_busy.text('plain', self.unit)}; {self.node_busy.text('node', self.unit)}"]
        if self.plain_busy.classes and self.node_busy.classes:
            lines.append("GPU time by kernel class (summed, streams overlapping counted apart), "
                         f"{self.plain_busy.by_class('plain', self.unit)}; "
                         f"{self.node_busy.by_class('node', self.unit)}")
        lines += [b.by_kernel(side, self.unit) for side, b in (("plain", self.plain_busy), ("node", self.node_busy))
                  if b.kernels]
        if self.beside is not None:
            lines.append(f"{self.beside_label}, run third in the same rounds: median {self.beside.text(self.unit)}, "
                         f"{self.beside.median / self.node.median:.2f}x the node's, "
                         f"{self.beside.median / self.plain.median:.2f}x plain's")
        if self.plain_waits and self.node_waits:
            lines.append("the CPU waited for the GPU, in one more run: " + self.plain_waits.text("plain") + "; "
                         + self.node_waits.text("node"))
        return lines


def union_length(spans: Iterable[tuple[float, float]]) -> float:
    """The length of the union of (start, end) spans: kernels and copies on several streams overlap, and time with
    two of them running is busy once."""
    total, end = 0.0, -math.inf
    for start, stop in sorted(spans):
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total


def kernel_class(name: str) -> str:
    """The class of a GPU event by its name: a copy or a memory set (DynamicVRAM's weights moving would show there),
    else the bench's class of the kernel."""
    if name.startswith("Memcpy"):
        return "copy"
    if name.startswith("Memset"):
        return "memset"
    return classify(name)


def device_busy(events: Iterable[Any]) -> tuple[float, dict[str, float], dict[str, float]]:
    """Seconds the busiest GPU was busy (a kernel, copy or memset running) among torch profiler's events (its
    FunctionEvents; those of the CPU, such as the launch calls, are not GPU work), and its events' seconds summed by
    kernel_class and by name; RuntimeError where none ran on a GPU."""
    from torch.autograd import DeviceType

    spans: dict[int, list[tuple[float, float]]] = {}
    names: dict[int, list[str]] = {}
    for event in events:
        if event.device_type == DeviceType.CUDA:
            spans.setdefault(event.device_index, []).append((event.time_range.start, event.time_range.end))
            names.setdefault(event.device_index, []).append(event.name)
    if not spans:
        raise RuntimeError("the profiler recorded no GPU activity")
    busiest = max(spans, key=lambda d: union_length(spans[d]))
    classes: dict[str, float] = {}
    kernels: dict[str, float] = {}
    for name, (start, end) in zip(names[busiest], spans[busiest]):
        kind = kernel_class(name)
        classes[kind] = classes.get(kind, 0.0) + (end - start) / 1e6
        kernels[name] = kernels.get(name, 0.0) + (end - start) / 1e6
    return union_length(spans[busiest]) / 1e6, classes, kernels  # the profiler's times are microseconds


def gpu_busy(run: Callable[[], object]) -> tuple[float, dict[str, float], dict[str, float]]:
    """device_busy of one call of `run`."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    # Kineto finalizes CUPTI when a profile ends only with this set (before its later default for CUDA 12.6+): a CUPTI
    # left attached has slowed programs by 10-20% after their profile ended (pytorch/pytorch#144455), which would fall
    # on the suite's later timed runs
    os.environ.setdefault("TEARDOWN_CUPTI", "1")
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    return device_busy(prof.events())


def busy(run: Callable[[], object], wall: float, per: int = 1) -> Busy:
    """gpu_busy of one more call of `run` (divided by `per`), or why it could not be measured: a profiler that fails
    is said in the table, never a failed suite."""
    try:
        seconds, classes, kernels = gpu_busy(run)

        def longest(times: dict[str, float], count: int | None = None) -> tuple[tuple[str, float], ...]:
            return tuple(sorted(((k, v / per) for k, v in times.items()), key=lambda kv: -kv[1])[:count])

        by_class, in_class = longest(classes), {}
        for name, t in kernels.items():
            in_class.setdefault(kernel_class(name), {})[name] = t
        # copies by name wherever they ran, longest or not: their names say which way (weights that DynamicVRAM or
        # a host moves each run show as host-to-device copies)
        named = tuple((kind, longest(in_class[kind], KERNELS)) for i, (kind, _) in enumerate(by_class)
                      if i < CLASSES or kind == "copy")
        return Busy(wall, seconds / per, classes=by_class, kernels=named)
    except Exception as e:  # noqa: BLE001 (CUPTI missing, a profiler error of this torch: the timing stands)
        text = str(e).strip().splitlines()
        return Busy(wall, None, f"{type(e).__name__}{': ' + text[0] if text else ''}")


def measure(node: Callable[[], float], plain: Callable[[], float], gpu: bool, runs: int | None = None, per: int = 1,
            unit: str = "s", beside: tuple[str, Callable[[], float]] | None = None) -> Timed:
    """Interleaved warm runs of node and plain (each call returns its wall seconds, its GPU work synchronised), `runs`
    of each (RUNS on a GPU, CPU_RUNS without), then one more run of each under the profiler where `gpu`; every figure
    divided by `per` (steps, for seconds a step). beside: (label, a third side) run after the two in each round, so
    that a drift falls on it alike."""
    if runs is None:
        runs = RUNS if gpu else CPU_RUNS
    beside_s: list[float] = []

    def plain_then_beside() -> float:
        seconds = plain()
        beside_s.append(beside[1]())
        return seconds

    node_s, plain_s = interleaved(node, plain_then_beside if beside else plain, runs)
    host_load = load()  # before the profiled runs, which are no part of the timed ones
    node_t, plain_t = Spread.of(s / per for s in node_s), Spread.of(s / per for s in plain_s)
    waits: tuple[Waits | None, Waits | None] = (None, None)
    if gpu:
        node_busy, plain_busy = busy(node, node_t.median, per), busy(plain, plain_t.median, per)
        waits = host_waits(plain), host_waits(node)
    else:
        node_busy, plain_busy = (Busy(side.median, None, "no CUDA device") for side in (node_t, plain_t))
    return Timed(node_t, plain_t, plain_t.median / node_t.median, host_cpu(), host_load, node_busy, plain_busy, unit,
                 Spread.of(s / per for s in beside_s) if beside else None, beside[0] if beside else "", *waits)

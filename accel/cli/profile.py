"""Where the time of one UNet step goes, by operator class (attention, GEMM, conv, norm, elementwise)."""

from __future__ import annotations

import re
from collections import defaultdict
from typing import Callable

import torch

# Kernel names differ by library version; the first class whose pattern matches wins.
_CLASSES = [
    # NCCL's kernels run for as long as a collective waits for its peers too: the exchange plus any imbalance
    ("collective", re.compile(r"nccl", re.I)),
    ("attention", re.compile(r"fmha|flash|attention|sdpa|softmax", re.I)),
    ("norm", re.compile(r"norm|welford|moments|ComputeFusedParams|_stats_nhwc|_stats_nchw|_apply_nhwc|_apply_nchw"
                        r"|_finalize_kernel", re.I)),
    ("conv", re.compile(r"conv|fprop|dgrad|implicit_gemm|winograd", re.I)),
    # _geglu_linear: the GEGLU projection's GEMM with the GEGLU in its epilogue, mostly GEMM work
    ("gemm", re.compile(r"nvjet|gemm|cutlass|cublas|matmul|sm90_xmma|Kernel2|s16816|h16816|wgmma|_geglu_linear",
                        re.I)),
]


def classify(kernel: str) -> str:
    for name, pattern in _CLASSES:
        if pattern.search(kernel):
            return name
    return "elementwise/other"


def kernel_times(fn: Callable[[], object], runs: int = 5) -> dict[str, tuple[float, float]]:
    """GPU kernel -> (milliseconds, launches) per call of fn, averaged over `runs` calls."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(runs):
            fn()
        torch.cuda.synchronize()
    kernels: dict[str, tuple[float, float]] = {}
    for evt in prof.key_averages():
        us = getattr(evt, "device_time_total", None) or getattr(evt, "cuda_time_total", 0)
        if us and evt.key and not evt.key.startswith(("aten::", "cuda", "Memcpy", "Memset")):
            kernels[evt.key] = (us / 1e3 / runs, evt.count / runs)
    return kernels


def by_class(kernels: dict[str, tuple[float, float]]) -> dict[str, float]:
    """Milliseconds by operator class, with the busy total and the kernel launches per call: in a CUDA graph
    each launch still costs about a microsecond of idle GPU, so the count bounds how close the step gets to the
    busy time."""
    totals: dict[str, float] = defaultdict(float)
    for name, (ms, _) in kernels.items():
        totals[classify(name)] += ms
    totals["busy total"] = sum(totals.values())
    totals["launches"] = sum(n for _, n in kernels.values())
    return dict(totals)


def top(kernels: dict[str, tuple[float, float]], n: int = 12, width: int = 90) -> list[tuple[str, float, float]]:
    """The n kernels that take the most time: (name cut to width, ms per call, launches per call)."""
    rows = sorted(kernels.items(), key=lambda kv: -kv[1][0])[:n]
    return [(name[:width], round(ms, 3), n_) for name, (ms, n_) in rows]


def top_line(name: str, ms: float, launches: float) -> str:
    """One of top()'s kernels, as the benches print it."""
    return f"{ms:7.3f} ms  x{launches:<5g} {name}"

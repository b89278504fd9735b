"""Where the time of one UNet step goes, by operator class (attention, GEMM, conv, norm, elementwise)."""

from __future__ import annotations

import re
from collections import defaultdict
from typing import Callable

import torch

# Kernel names differ by library version; the first class whose pattern matches wins.
_CLASSES = [
    ("attention", re.compile(r"fmha|flash|attention|sdpa|softmax", re.I)),
    ("norm", re.compile(r"norm|welford|moments|ComputeFusedParams|_stats_nhwc|_stats_nchw|_apply_nhwc|_apply_nchw", re.I)),
    ("conv", re.compile(r"conv|fprop|dgrad|implicit_gemm|winograd", re.I)),
    ("gemm", re.compile(r"nvjet|gemm|cutlass|cublas|matmul|sm90_xmma|Kernel2|s16816|h16816|wgmma", re.I)),
]


def classify(kernel: str) -> str:
    for name, pattern in _CLASSES:
        if pattern.search(kernel):
            return name
    return "elementwise/other"


def profile_step(fn: Callable[[], object], runs: int = 5) -> dict[str, float]:
    """Milliseconds of GPU kernel time per call of fn, by class, averaged over `runs` calls."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(runs):
            fn()
        torch.cuda.synchronize()
    totals: dict[str, float] = defaultdict(float)
    for evt in prof.key_averages():
        us = getattr(evt, "device_time_total", None) or getattr(evt, "cuda_time_total", 0)
        if us and evt.key and not evt.key.startswith(("aten::", "cuda", "Memcpy", "Memset")):
            totals[classify(evt.key)] += us / 1e3 / runs
    totals["busy total"] = sum(totals.values())
    return dict(totals)

"""Timing two sides against each other (issue 58), shared by the bench and the GPU suite (tests/gpu/timing.py).

A side's time moves from run to run (plain eager PyTorch is bound by kernel launches on the CPU, which other tenants
and the clocks slow), so a single sample, or one side's runs all before the other's, can put the ratio anywhere. Both
sides therefore run warm and alternately, at least MIN_RUNS times each (a drift falls on both alike), and each side is
its median with its range, beside the host's CPU model and load.
"""

from __future__ import annotations

import math
import os
import platform
import statistics
from collections.abc import Callable, Iterable
from dataclasses import dataclass

MIN_RUNS = 5  # timed runs of each side behind a printed ratio


@dataclass(frozen=True)
class Spread:
    """One side's timed runs: the median, the fastest and slowest, and every sample in the order run."""

    median: float
    low: float
    high: float
    samples: tuple[float, ...]

    @classmethod
    def of(cls, samples: Iterable[float]) -> Spread:
        values = tuple(samples)
        if not values:
            raise ValueError("no timed runs")
        return cls(statistics.median(values), min(values), max(values), values)

    def text(self, unit: str) -> str:
        return f"{figure(self.median)} {unit} ({figure(self.low)}-{figure(self.high)})"

    def record(self) -> dict:
        """The JSON form: median, min, max and every time in the order run."""
        return {"median": self.median, "min": self.low, "max": self.high, "times": list(self.samples)}


def figure(value: float) -> str:
    """Three significant digits, trailing zeros kept (0.700, 3.26, 12.3, 123): a run of the tiny models on the CPU
    takes milliseconds, one of Wan 14B tens of seconds."""
    if value <= 0 or not math.isfinite(value):
        return f"{value:g}"
    decimals = max(0, 2 - math.floor(math.log10(value)))
    return f"{value:.{decimals}f}"


def load_text(load: float | None) -> str:
    return "unknown" if load is None else f"{load:.2f}"


def interleaved(first: Callable[[], float], second: Callable[[], float],
                runs: int = MIN_RUNS) -> tuple[list[float], list[float]]:
    """The times of `runs` calls of each, made first, second, first, second, ...; each call returns its own time."""
    first_s: list[float] = []
    second_s: list[float] = []
    for _ in range(runs):
        first_s.append(first())
        second_s.append(second())
    return first_s, second_s


def cpu_model(cpuinfo: str) -> str:
    """/proc/cpuinfo's first "model name" ("" where there is none, as on some ARM kernels)."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name":
            return " ".join(value.split())
    return ""


def host_cpu() -> str:
    """The host's CPU model and the cores this process may use: an eager run's launches wait on one of them."""
    try:
        with open("/proc/cpuinfo") as f:
            model = cpu_model(f.read())
    except OSError:
        model = ""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{model or platform.processor() or 'unknown'} ({cores} cores)"


def load() -> float | None:
    """The host's 1-minute load average (None where the system has none)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None

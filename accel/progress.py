"""One progress interface for long work (builds, tiled decodes), reported by stage and fraction.

Hosts adapt it: tqdm in the CLI, comfy.utils.ProgressBar in ComfyUI, gradio's progress in A1111.
"""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Protocol


class Progress(Protocol):
    def stage(self, name: str, total: int = 1) -> None: ...
    def advance(self, n: int = 1) -> None: ...
    def done(self) -> None: ...


class NullProgress:
    def stage(self, name: str, total: int = 1) -> None:
        pass

    def advance(self, n: int = 1) -> None:
        pass

    def done(self) -> None:
        pass


@dataclass
class CallbackProgress:
    """Calls `callback(stage, fraction, eta_seconds)` on every step; the base for host adapters."""

    callback: Callable[[str, float, float | None], None]
    _name: str = ""
    _total: int = 1
    _count: int = 0
    _start: float = field(default_factory=time.perf_counter)

    def stage(self, name: str, total: int = 1) -> None:
        self._name, self._total, self._count = name, max(1, total), 0
        self._start = time.perf_counter()
        self.callback(name, 0.0, None)

    def advance(self, n: int = 1) -> None:
        self._count = min(self._total, self._count + n)
        frac = self._count / self._total
        elapsed = time.perf_counter() - self._start
        eta = elapsed * (1 - frac) / frac if frac > 0 else None
        self.callback(self._name, frac, eta)

    def done(self) -> None:
        self.callback(self._name, 1.0, 0.0)


class TqdmProgress:
    """Progress on the terminal for the CLI. Bars are drawn only on a terminal (a pipe or a log file would keep
    every redraw), and each is erased when its stage ends."""

    def __init__(self) -> None:
        self._bar = None

    def stage(self, name: str, total: int = 1) -> None:
        from tqdm import tqdm

        self.done()
        self._bar = tqdm(total=total, desc=name, leave=False, disable=None)

    def advance(self, n: int = 1) -> None:
        if self._bar is not None:
            self._bar.update(n)

    def done(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


@dataclass
class StageLog:
    """Writes one line per finished stage with its duration (benchmark logs: where a build spends its time)."""

    write: Callable[[str], None]
    prefix: str = ""
    _name: str | None = None
    _start: float = 0.0

    def stage(self, name: str, total: int = 1) -> None:
        self.done()
        self._name, self._start = name, time.perf_counter()

    def advance(self, n: int = 1) -> None:
        pass

    def done(self) -> None:
        if self._name is not None:
            self.write(f"{self.prefix}{self._name}: {time.perf_counter() - self._start:.1f} s")
            self._name = None


def _open_bars() -> list:
    """The tqdm bars open in this process (a host sampler's among them); none when tqdm was never imported."""
    tqdm = sys.modules.get("tqdm.std")
    return list(getattr(getattr(tqdm, "tqdm", None), "_instances", ()))


def print_off_bars(message: str) -> None:
    """message on a console line of its own while tqdm bars are open: they are erased first and redrawn after."""
    bars = _open_bars()
    for bar in bars:
        bar.clear()
    print(message, flush=True)
    for bar in bars:
        bar.refresh()


class _ClearBars(logging.Filter):
    """Erases the open tqdm bars before a record is written, so the line starts on its own rather than after a
    bar's text (a host sampler's bar is open while the first step builds the engine); each bar redraws itself at
    its next update."""

    def filter(self, record: logging.LogRecord) -> bool:
        for bar in _open_bars():
            bar.clear()
        return True


def keep_logs_off_bars(logger: logging.Logger) -> None:
    """Make `logger`'s lines start on a line of their own while tqdm bars are open (once per logger)."""
    if not any(isinstance(f, _ClearBars) for f in logger.filters):
        logger.addFilter(_ClearBars())

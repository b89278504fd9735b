"""Compile the Triton kernels a call needs in parallel, before it runs.

Triton compiles a kernel when it is first launched, one after another: a UNet's first step on a fresh machine waits
for some 40 compilations in a row (most of its first call). `call(fn, ...)` first runs `fn` with every launch of one
of our kernels that this process has not loaded left out, each such kernel handed to a thread pool to compile (or
load from Triton's disk cache) and load as soon as it is met (ptxas, the launchers' C compilations and much of the
compiler run outside the GIL); when one was met, it waits for the pool and runs `fn` again for the result. When
nothing was missing, the first run was a real one and is the result. The left-out run's values are thrown away, so
`fn` must be a pure function of its inputs (a model's forward) whose control flow does not depend on values a kernel
computes.

Other code's Triton kernels (torch.compile's, a host's) compile as usual, as do ours on other threads, under the
CPU interpreter, and with a Triton that lacks the hooks this needs (before 3.4).
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

import torch

from .common import triton

log = logging.getLogger(__name__)

_PACKAGE = __name__.rpartition(".")[0] + "."
_lock = threading.Lock()


@dataclass
class Totals:
    """What compiling ahead has cost in this process, for a benchmark's breakdown."""

    kernels: int = 0  # kernels compiled (or loaded from disk) ahead
    compile_s: float = 0.0  # waiting for them
    skipped_run_s: float = 0.0  # runs that left a launch out (their results thrown away)


totals = Totals()


@functools.lru_cache(maxsize=None)
def _hooks_supported() -> bool:
    """Whether this Triton has the JIT cache hook and JITFunction.preload (3.4 and later); asked once, as a graph-less
    engine asks at every step."""
    if triton is None:
        return False
    try:
        from triton import knobs
        from triton.runtime.jit import JITFunction
    except ImportError:
        return False
    return hasattr(knobs.runtime, "jit_cache_hook") and hasattr(JITFunction, "preload")


class _Skipped:
    """Stands in a kernel cache for a kernel that is being compiled ahead: what Triton's launch reads of a compiled
    kernel, doing nothing, so the rest of the recording run launches it at no cost. Never left in a cache."""

    function = packed_metadata = None

    def launch_metadata(self, *_args: Any) -> None:
        return None

    def run(self, *_args: Any) -> None:
        return None


_SKIPPED = _Skipped()


class _Recorder:
    """A jit_cache_hook for the recording run: our kernels launched on this thread that are not compiled yet start
    compiling on the pool at once and are skipped (their launches do nothing); every other compile goes on, through
    the hook that was installed before, if any."""

    def __init__(self, previous: Callable | None) -> None:
        self.previous = previous
        self.thread = threading.get_ident()
        self.pool: ThreadPoolExecutor | None = None
        self.jobs: list[Future] = []
        self.placeholders: list[tuple[dict, Any]] = []
        self.met: set[tuple[int, str]] = set()

    def __call__(self, *, key: Any, fn: Any, compile: dict, is_manual_warmup: bool = False, **kwargs: Any) -> Any:
        spec = compile.get("specialization_data")
        kernel = getattr(fn, "jit_function", None)
        if (threading.get_ident() == self.thread and not is_manual_warmup and spec is not None
                and kernel is not None and str(getattr(fn, "module", "")).startswith(_PACKAGE)):
            device = compile.get("device", 0)
            if (id(kernel), repr(key)) in self.met:  # where no placeholder could be left
                return True
            self.met.add((id(kernel), repr(key)))
            if self.pool is None:
                self.pool = ThreadPoolExecutor(workers(), thread_name_prefix="sd-accel-compile")
            self.jobs.append(self.pool.submit(_compile, kernel, spec, device))
            cache = _kernel_cache(kernel, device)
            if cache is not None and key not in cache:
                cache[key] = _SKIPPED
                self.placeholders.append((cache, key))
            return True
        if self.previous is None:
            return None
        return self.previous(key=key, fn=fn, compile=compile, is_manual_warmup=is_manual_warmup, **kwargs)

    def remove_placeholders(self) -> None:
        for cache, key in self.placeholders:
            if cache.get(key) is _SKIPPED:
                del cache[key]
        self.placeholders = []


def _kernel_cache(kernel: Any, device: int) -> dict | None:
    """The JIT function's in-memory kernel cache for `device` (Triton 3.4+ keeps it first in device_caches)."""
    caches = getattr(kernel, "device_caches", None)
    entry = caches.get(device) if isinstance(caches, dict) else None
    return entry[0] if isinstance(entry, tuple) and entry and isinstance(entry[0], dict) else None


def _compile(kernel: Any, spec: str, device: int) -> None:
    """Compile one kernel into Triton's caches and load it, as its first launch would."""
    with torch.cuda.device(device):
        compiled = kernel.preload(spec)
        # Loading the binary and making its launcher (a C compilation in some Triton versions) is the other half of a
        # first launch's wait; private API, hence optional.
        init = getattr(compiled, "_init_handles", None)
        if init is not None:
            init()


def workers() -> int:
    """Compile threads: one per core, at most 16."""
    return max(1, min(16, os.cpu_count() or 1))


def recording() -> bool:
    """Whether this thread is in a recording run of `call`, where launches of our kernels not compiled yet do nothing:
    a time taken then is not theirs."""
    if not _hooks_supported():
        return False
    from triton import knobs

    hook = knobs.runtime.jit_cache_hook
    return isinstance(hook, _Recorder) and hook.thread == threading.get_ident()


def call(fn: Callable[..., Any], *args: Any, on_compile: Callable[[int], None] | None = None, **kwargs: Any) -> Any:
    """fn(*args, **kwargs), with the kernels of ours it launches for the first time compiled in parallel first.

    on_compile(n) is told how many kernels are compiling when the recording run has ended (to say why the call
    waits)."""
    if not _hooks_supported():
        return fn(*args, **kwargs)
    from triton import knobs

    start = time.perf_counter()
    failed: Exception | None = None
    with _lock:
        recorder = _Recorder(knobs.runtime.jit_cache_hook)
        knobs.runtime.jit_cache_hook = recorder
        try:
            out = fn(*args, **kwargs)
        except Exception as e:  # noqa: BLE001
            if recorder.pool is None:  # nothing was skipped: the call's own error
                raise
            out, failed = None, e  # perhaps from a skipped launch; the run below says
        except BaseException:
            if recorder.pool is not None:
                recorder.pool.shutdown(wait=True, cancel_futures=True)
            raise
        finally:
            knobs.runtime.jit_cache_hook = recorder.previous
            recorder.remove_placeholders()
    if recorder.pool is None:
        return out
    del out
    if failed is not None:
        log.debug("the recording run failed (the plain run below compiles what it lacks): %s", failed)
        failed = None  # its traceback holds the run's tensors
    compiling = time.perf_counter()
    totals.skipped_run_s += compiling - start
    totals.kernels += len(recorder.jobs)
    if on_compile is not None:
        on_compile(len(recorder.jobs))
    with recorder.pool:
        for job in recorder.jobs:
            try:
                job.result()
            except Exception as e:  # noqa: BLE001  the run below compiles it again and raises its error
                log.debug("compiling a kernel ahead failed: %s", e)
    totals.compile_s += time.perf_counter() - compiling
    return fn(*args, **kwargs)


__all__ = ["Totals", "call", "recording", "totals", "workers"]

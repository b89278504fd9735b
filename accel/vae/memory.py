"""Host memory for whole-image activations that do not fit on the GPU: a pool of page-locked buffers.

Only large images need it (the planner puts activations in host memory when they do not fit beside a useful tile).
Page-locked buffers let the band copies run asynchronously beside the compute; they are expensive to create, so the
pool keeps them from one decode to the next. `_OOM` is the out-of-memory error the callers catch to fall back to
smaller chunks or to host memory.
"""

from __future__ import annotations

import os
import threading

import torch


_OOM = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)


def _take(buffers: list[torch.Tensor], size: int) -> torch.Tensor | None:
    """The smallest buffer of at least `size` bytes, removed from `buffers`."""
    fits = [i for i, b in enumerate(buffers) if b.numel() >= size]
    if not fits:
        return None
    return buffers.pop(min(fits, key=lambda i: buffers[i].numel()))


# Page-locked host buffers. Page-locking fresh memory is slow (the kernel faults and zeroes every page first),
# much slower than the copies it speeds up: so buffers are kept for the next run, up to HOST_KEEP of the
# machine's memory. torch's pinned allocator is not used: it rounds sizes up to a power of two.
HOST_KEEP = 1 / 8
_PINNED: set[int] = set()  # data_ptr of every buffer this module registered
_POOL: list[torch.Tensor] = []  # registered buffers no run is using
_POOL_LOCK = threading.Lock()


def _host_buffer(size: int) -> torch.Tensor | None:
    """A page-locked host byte buffer of at least `size` bytes, from the pool or new; None where the runtime
    cannot page-lock (the run then copies through pageable memory: slower)."""
    with _POOL_LOCK:
        buf = _take(_POOL, size)
    if buf is not None:
        return buf
    # Faulting the pages in first, on all of torch's threads, makes page-locking several times faster.
    buf = torch.empty(size, dtype=torch.uint8).zero_()
    try:
        err = torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), size, 0)
    except (AttributeError, RuntimeError):
        return None
    if int(getattr(err, "value", err)) != 0:
        return None
    _PINNED.add(buf.data_ptr())
    return buf


def _return_host_buffers(buffers: list[torch.Tensor]) -> None:
    limit = HOST_KEEP * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else 0
    with _POOL_LOCK:
        pool = sorted(_POOL + buffers, key=torch.Tensor.numel)
        _POOL.clear()
        kept = 0
        for b in pool:
            if kept + b.numel() <= limit:
                _POOL.append(b)
                kept += b.numel()
            else:
                _unregister(b)


def _unregister(buf: torch.Tensor) -> None:
    torch.cuda.cudart().cudaHostUnregister(buf.data_ptr())
    _PINNED.discard(buf.data_ptr())


def release_host_memory() -> None:
    """Unlock and free the page-locked host buffers kept for later tiled decodes."""
    with _POOL_LOCK:
        if _POOL:
            torch.cuda.synchronize()
        for b in _POOL:
            _unregister(b)
        _POOL.clear()

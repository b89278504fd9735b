"""FlashAttention-4 (the optional `flash-attn-4` package: CuTe DSL kernels, import name `flash_attn.cute`) for the
fused DiT blocks' 16-bit attention, where it is installed and covers the call.

On an H200 its Hopper forward ran the DiTs' attention 1.16-1.27x faster than cuDNN's through PyTorch's SDPA, the
engine's choice without it, at SD3.5's, Qwen-Image's and Wan's shapes, about even at Flux's (BENCHMARKS.md), with the
same error against fp32. Its kernels compile at the first call of a head size and dtype in
a process (about 2 s), not per sequence length, and replay in CUDA graphs.

Only the fused blocks' own attention takes it (transformer.sdpa), and only where it was timed faster than PyTorch's
SDPA at the first call at a shape (host_attention.choose, as a host's attention function is timed): a host's
attention function, ComfyUI's own modules and the UNets keep theirs. Without the package, on other GPUs, in fp32, or
at a head size it does not take, PyTorch's SDPA runs as before.
"""

from __future__ import annotations

import functools
import logging
import warnings
from typing import Callable

import torch

from . import host_attention

log = logging.getLogger("sd-accel")

PACKAGE = "flash-attn-4"


@functools.cache
def _kernel() -> tuple[Callable | None, str]:
    """(flash_attn_func, "") or (None, why): imported on first use (the CuTe DSL takes seconds to import)."""
    try:
        from flash_attn.cute import flash_attn_func
    except Exception as e:  # a broken install can raise more than ImportError; either way SDPA runs
        if isinstance(e, ModuleNotFoundError) and e.name in ("flash_attn", "flash_attn.cute"):
            return None, f"the {PACKAGE} package is not installed (python install.py --with flash-attn-4 installs it)"
        return None, f"the {PACKAGE} package does not import ({type(e).__name__}: {e})"
    # Its compiler says at every compile that an argument it treats as a constant is not a JIT argument.
    warnings.filterwarnings("ignore", message=r"Argument aux_data .* cannot be converted to a JitArgument")
    return flash_attn_func, ""


def available(device: torch.device) -> tuple[bool, str]:
    """Whether FlashAttention-4 can run the fused blocks' attention on `device`, and in words why not (or what
    runs it)."""
    if device.type != "cuda" or torch.version.hip is not None:
        return False, "it runs on NVIDIA GPUs only"
    major, minor = _capability(device)
    if major not in (9, 10):
        return False, f"its kernels here are for Hopper and Blackwell (compute capability 9.0, 10.x); this GPU is " \
                      f"{major}.{minor}"
    fn, why = _kernel()
    if fn is None:
        return False, why
    return True, f"{PACKAGE} (FlashAttention-4's CuTe DSL kernels)"


@functools.cache
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def takes(device: torch.device, head_dim: int) -> bool:
    """Whether FlashAttention-4 can run on `device` and has kernels for heads of `head_dim` channels."""
    return available(device)[0] and _head_size(_capability(device)[0], head_dim)


def _head_size(major: int, head_dim: int) -> bool:
    return head_dim % 8 == 0 and head_dim <= (256 if major == 9 else 128)


def covers(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether FlashAttention-4 takes these (B, L, heads, head_dim) q, k and v: installed, on Hopper or Blackwell,
    16-bit, a head size its kernels have (multiples of 8 up to 256 on Hopper, 128 on Blackwell), each head's channels
    contiguous."""
    if not q.is_cuda or q.dtype not in (torch.float16, torch.bfloat16) or torch.version.hip is not None:
        return False
    if not (k.dtype == v.dtype == q.dtype and q.dim() == k.dim() == v.dim() == 4):
        return False
    major = _capability(q.device)[0]
    head_dim = q.shape[-1]
    if major not in (9, 10) or not _head_size(major, head_dim) or head_dim != k.shape[-1] or head_dim != v.shape[-1]:
        return False
    if any(t.stride(-1) != 1 for t in (q, k, v)):
        return False
    return _kernel()[0] is not None


def serves(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sdpa: Callable) -> bool:
    """Whether FlashAttention-4 runs this call: it covers it and was timed faster than sdpa(q, k, v), PyTorch's
    attention in the same layout, at the first call at these shapes."""
    if not covers(q, k, v):
        return False
    choice = host_attention.choose(("flash4", tuple(q.shape), tuple(k.shape), q.dtype, q.device), q, k, v, sdpa,
                                   attention)
    if choice is None or not choice.host:
        return False
    _say()
    return True


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(head_dim)) v for (B, L, heads, head_dim) q, k and v that `covers` took, as
    (B, L, heads, head_dim)."""
    out = _kernel()[0](q, k, v)
    return out[0] if isinstance(out, tuple) else out


@functools.cache
def _say() -> None:  # once per process, at the first call it serves (not at the calls that time it)
    log.info("sd-accel: the fused transformer blocks' attention runs FlashAttention-4 (%s).", PACKAGE)

"""FlashAttention-3 (the optional `fa3-fwd` package: FlashAttention-3's Hopper forward kernels alone, bf16 and fp8
e4m3, import name `fa3_fwd_interface`) for the fused DiT blocks' attention, where it is installed and was timed
faster than what would run without it.

On an H200 its fp8 kernel (bf16 output) ran the DiTs' attention 4-12% faster than cuDNN's fp8 kernel at Wan's,
Qwen-Image's and SD3.5's shapes, about even at Flux's, and its bf16 kernel 1.2-1.3x cuDNN's 16-bit one through
PyTorch's SDPA (BENCHMARKS.md). Both are compiled into the package (no compile at run time) and replay in CUDA graphs.

It links libtorch and CUDA 13: a build of torch other than the one it was made for fails at its import, which is then
said once, and the attention runs as without it. Only the fused blocks' own attention takes it, and only where it
was timed faster at the first call at a shape (host_attention.choose for 16 bits, fp8_attention for fp8).
"""

from __future__ import annotations

import functools
import logging
from typing import Callable

import torch

from . import host_attention

log = logging.getLogger("sd-accel")

PACKAGE = "fa3-fwd"
# What the package was built against (its wheel's libraries: libtorch, libcudart.so.13); install.py refuses others.
TORCH_CUDA = 13
TORCH_MIN = (2, 10)


@functools.cache
def _module():
    """(the fa3_fwd_interface module, "") or (None, why): imported on first use."""
    try:
        import fa3_fwd_interface
    except Exception as e:  # a torch it was not built for fails with OSError or ImportError (undefined symbol)
        if isinstance(e, ModuleNotFoundError) and e.name in ("fa3_fwd_interface", "fa3_fwd"):
            return None, f"the {PACKAGE} package is not installed (python install.py --with fa3-fwd installs it)"
        return None, f"the {PACKAGE} package does not import ({type(e).__name__}: {str(e).strip()[:200]}); it " \
                     f"needs torch {TORCH_MIN[0]}.{TORCH_MIN[1]} or later built for CUDA {TORCH_CUDA}"
    return fa3_fwd_interface, ""


def available(device: torch.device) -> tuple[bool, str]:
    """Whether FlashAttention-3 can run the fused blocks' attention on `device`, and in words why not (or what runs
    it)."""
    if device.type != "cuda" or torch.version.hip is not None:
        return False, "it runs on NVIDIA GPUs only"
    major, minor = _capability(device)
    if major != 9:
        return False, f"its kernels are for Hopper (compute capability 9.0); this GPU is {major}.{minor}"
    module, why = _module()
    if module is None:
        return False, why
    return True, f"{PACKAGE} (FlashAttention-3's Hopper kernels)"


@functools.cache
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def takes(device: torch.device, head_dim: int) -> bool:
    """Whether FlashAttention-3 runs on `device` and has kernels for heads of `head_dim` channels."""
    return head_dim % 8 == 0 and head_dim <= 256 and available(device)[0]


def covers(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether FlashAttention-3's 16-bit kernel takes these (B, L, heads, head_dim) q, k and v: installed, on Hopper,
    bf16 (the package leaves fp16 out), a head size it has, each head's channels contiguous."""
    if not q.is_cuda or q.dtype != torch.bfloat16 or not (k.dtype == v.dtype == q.dtype):
        return False
    if not (q.dim() == k.dim() == v.dim() == 4) or not q.shape[-1] == k.shape[-1] == v.shape[-1]:
        return False
    if any(t.stride(-1) != 1 for t in (q, k, v)):
        return False
    return takes(q.device, q.shape[-1])


def serves(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ours: Callable) -> bool:
    """Whether FlashAttention-3 runs this 16-bit call: it covers it and was timed faster than ours(q, k, v), what
    would run without it, at the first call at these shapes."""
    if not covers(q, k, v):
        return False
    choice = host_attention.choose(("flash3", tuple(q.shape), tuple(k.shape), q.dtype, q.device), q, k, v, ours,
                                   attention)
    if choice is None or not choice.host:
        return False
    say("16-bit")
    return True


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(head_dim)) v for (B, L, heads, head_dim) bf16 q, k and v that `covers` took, as
    (B, L, heads, head_dim)."""
    out = _module()[0].flash_attn_func(q, k, v)
    return out[0] if isinstance(out, tuple) else out


def fp8_attention(q8: torch.Tensor, k8: torch.Tensor, v8: torch.Tensor, descale_q: torch.Tensor,
                  descale_k: torch.Tensor, descale_v: torch.Tensor, out: torch.Tensor) -> None:
    """softmax(q k^T / sqrt(head_dim)) v over (B, L, heads, head_dim) e4m3 q, k and v times their descales (one
    float32 each, on the device), written into `out` (bf16, same layout): the fp8 kernel, called through the
    package's operator so that it writes into `out` (its Python function returns a new tensor)."""
    B, _, H, _ = q8.shape
    d_q, d_k, d_v = (d.reshape(1, 1).expand(B, H) for d in (descale_q, descale_k, descale_v))
    _module()  # registers the operator
    torch.ops.fa3_fwd.fwd(q8, k8, v8, None, None, None, out, None, None, None, None, None, None, None, None, None,
                          None, None, None, None, d_q, d_k, d_v, None, False, -1, -1, 0, 0.0, True, None, 1, None, 0)


def runs(device: torch.device) -> tuple[bool, str]:
    """Whether both kernels run on `device` and match PyTorch's attention on a small input (doctor's check), and in
    words what ran or what failed."""
    q, k, v = (torch.randn(1, 256, 2, 128, device=device, dtype=torch.bfloat16) for _ in range(3))
    exact = torch.nn.functional.scaled_dot_product_attention(*(t.float().transpose(1, 2) for t in (q, k, v)))
    exact = exact.transpose(1, 2)
    one = torch.ones(1, device=device)
    try:
        sixteen = attention(q, k, v).float()
        eight = torch.empty_like(q)
        fp8_attention(*(t.to(torch.float8_e4m3fn) for t in (q, k, v)), one, one, one, eight)
    except Exception as e:  # what failed is the answer
        return False, f"{PACKAGE} imports but its kernels fail here ({type(e).__name__}: {str(e).strip()[:200]})"
    errors = [float((out.float() - exact).norm() / exact.norm()) for out in (sixteen, eight)]
    if errors[0] > 2e-2 or errors[1] > 1e-1:
        return False, f"{PACKAGE} runs but its output is off PyTorch's attention (bf16 {errors[0]:.1e}, fp8 " \
                      f"{errors[1]:.1e})"
    return True, f"{PACKAGE}: bf16 and fp8 kernels ran, {errors[0]:.1e} and {errors[1]:.1e} off PyTorch's attention"


@functools.cache
def say(what: str) -> None:
    """Once per process and precision ("16-bit", "fp8"), at the first call FlashAttention-3 serves."""
    log.info("sd-accel: the fused transformer blocks' %s attention runs FlashAttention-3 (%s).", what, PACKAGE)

"""Micro-benchmark (bench --kernels): the diffusion transformers' attention at Flux.1-dev's, SD3.5-large's and Wan 2.1
14B's shapes, each way it can run here: PyTorch's SDPA in bf16 with cuDNN first (the torch path's 16-bit attention),
cuDNN's fp8 attention (accel/engine/fp8_attention.py) alone and with the pass that quantizes v (q and k come in e4m3
from the pass that writes them anyway), FlashAttention-3 in bf16 and fp8 (accel/engine/flash3.py; its fp8 output is
bf16, which the output projection then quantizes: timed with that too), FlashAttention-4 in bf16
(accel/engine/flash4.py) and SageAttention where they are installed; each with its error against float32 attention on the first query rows.

q and k are what an RMS norm gives (unit RMS per head), v Gaussian with a few channels eight times larger (its scale
follows its largest value).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from ...kernels import attention, quant
from ..engine import flash3, flash4, fp8_attention
from ..engine.attention import sdpa_kernels
from ..engine.fp8 import FP8, quantized
from .bench import rel_l2
from .kernel_bench import _timer

# (batch, tokens, heads, head_dim) at 1024x1024 (Flux batch 1, SD3.5 with CFG's two), 1328x1328 (Qwen-Image, 6,889 image
# and 512 text tokens, CFG's two), 832x480x81 (Wan 2.1, one half) and 1280x704x121 (Wan 2.2 5B, one half)
SHAPES = {"flux-dev 1024": (1, 4608, 24, 128), "sd35-large 1024 cfg": (2, 4429, 38, 64),
          "qwen-image 1328 cfg": (2, 7401, 24, 128), "wan21-14b 480p": (1, 32760, 40, 128),
          "wan22-5b 704p": (1, 27280, 24, 128)}
TINY = {"tiny": (1, 96, 2, 64)}
ERROR_ROWS = 256


def _inputs(shape: tuple[int, int, int, int], device: torch.device) -> tuple[torch.Tensor, ...]:
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(shape, generator=g, device=device).to(torch.bfloat16) for _ in range(3))
    v[..., :4] *= 8
    return q, k, v


def _exact(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """float32 attention of the first query rows."""
    return attention.attention_ref(q[:, :ERROR_ROWS].float(), k.float(), v.float())


def _err(out: torch.Tensor, exact: torch.Tensor) -> float:
    return float(f"{rel_l2(out[:, :ERROR_ROWS], exact):.3g}")


def _sdpa_bf16(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    with sdpa_kernels("cudnn"):
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)


def _fp8(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, run: fp8_attention.Kernel, out_dtype: torch.dtype,
         quantize_output: bool = False) -> tuple[Callable[[], tuple[torch.Tensor, torch.Tensor]], Callable[[], object]]:
    """(attention with v's quantization -> (output, its descale), attention alone) through the fp8 kernel `run`
    (fp8_attention.Kernel) writing out_dtype; with quantize_output, the first also quantizes a 16-bit output as the
    output projection's fp8 product then does."""
    (q8, dq, _), (k8, dk, _) = (quant.quantize_tensor(t, t.float().abs().amax().reshape(1)) for t in (q, k))
    amax = v.float().abs().amax().reshape(1)
    v8, dv, sv = quant.quantize_tensor(v, amax)
    out = torch.empty(q.shape, device=q.device, dtype=out_dtype)

    def with_v() -> tuple[torch.Tensor, torch.Tensor]:  # v's quantization timed with the attention
        v8, dv, sv = quant.quantize_tensor(v, amax)
        run(q8, k8, v8, dq, dk, dv, sv, out)
        if quantize_output:
            quantized(out.flatten(2))
        return out, dv if out_dtype == FP8 else torch.ones_like(dv)

    return with_v, lambda: run(q8, k8, v8, dq, dk, dv, sv, out)


def _fp8_rows(row: Callable, exact: torch.Tensor, way: str, with_v: Callable, alone: Callable) -> list[dict]:
    timer = _timer(exact.device)
    o, descale = with_v()
    err = _err(o.float() * descale, exact)
    return [row(f"{way} + v quantization", timer(with_v), err),
            row(f"{way} alone", timer(alone), err, "q, k and v already in e4m3")]


def _sage() -> Callable | None:
    try:
        from sageattention import sageattn
    except Exception:  # absent or broken: no row
        return None
    return lambda q, k, v: sageattn(q, k, v, tensor_layout="NHD")


def bench_dit_attention(device: str = "cuda", tiny: bool = False) -> list[dict]:
    """One row per shape and way: ms (median), TFLOP/s, error against float32, speed-up over bf16 cuDNN. On a CPU
    (tiny) a smoke run of the rows that run there."""
    dev = torch.device(device)
    timer = _timer(dev)
    rows = []
    for name, shape in (TINY if tiny else SHAPES).items():
        q, k, v = _inputs(shape, dev)
        exact = _exact(q, k, v)
        B, L, H, D = shape
        flops = 4 * B * H * L * L * D
        base = timer(lambda: _sdpa_bf16(q, k, v))

        def row(way: str, ms: float | None, err: float | None, note: str = "") -> dict:
            return {"case": name, "shape": list(shape), "way": way, "ms": None if ms is None else round(ms, 4),
                    "tflops": None if not ms else round(flops / ms / 1e9, 1),
                    "speedup": None if not ms else round(base / ms, 3), "err_vs_fp32": err, "note": note}

        rows.append(row("bf16 cuDNN (SDPA)", base, _err(_sdpa_bf16(q, k, v), exact)))
        run = fp8_attention.kernel(tuple(q.shape), q.device, FP8) if dev.type == "cuda" else None
        if run is None:
            why = fp8_attention.available(dev)[1]
            rows.append(row("fp8 cuDNN", None, None, f"cannot run: {why or 'cuDNN refused the shape'}"))
        else:
            rows += _fp8_rows(row, exact, "fp8 cuDNN", *_fp8(q, k, v, run, FP8))
        if flash3.takes(dev, D):
            rows.append(row("bf16 FlashAttention-3", timer(lambda: flash3.attention(q, k, v)),
                            _err(flash3.attention(q, k, v), exact)))
            rows += _fp8_rows(row, exact, "fp8 FlashAttention-3", *_fp8(q, k, v, fp8_attention._flash3, q.dtype))
            with_out, _ = _fp8(q, k, v, fp8_attention._flash3, q.dtype, quantize_output=True)
            rows.append(row("fp8 FlashAttention-3 + v, out quant.", timer(with_out), None,
                            "with the quantization of its bf16 output that cuDNN's e4m3 output needs not"))
        if flash4.covers(q, k, v):
            rows.append(row("bf16 FlashAttention-4", timer(lambda: flash4.attention(q, k, v)),
                            _err(flash4.attention(q, k, v), exact)))
        sage = _sage() if dev.type == "cuda" else None
        if sage is not None:
            rows.append(row("SageAttention", timer(lambda: sage(q, k, v)), _err(sage(q, k, v), exact)))
        del q, k, v
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def table(rows: list[dict]) -> str:
    lines = [f"{'case':22s} {'way':38s} {'ms':>9s} {'TFLOP/s':>8s} {'x bf16':>7s} {'err':>9s}"]
    for r in rows:
        if r["ms"] is None:
            lines.append(f"{r['case']:22s} {r['way']:38s} {r['note']}")
            continue
        lines.append(f"{r['case']:22s} {r['way']:38s} {r['ms']:9.3f} {r['tflops']:8.1f} {r['speedup']:7.2f} "
                     + (f"{r['err_vs_fp32']:9.2e}" if r["err_vs_fp32"] is not None else f"{'-':>9s}") + (f"  ({r['note']})" if r["note"] else ""))
    return "\n".join(lines)


__all__ = ["bench_dit_attention", "table", "SHAPES"]

"""Micro-benchmark: each Triton kernel against the torch ops it replaces, on Stable Diffusion shapes (Flux.2's for
the SwiGLU kernels, Wan 2.1 1.3B's and Flux.1's for the fp8 row quantization). (geglu_linear, a GEMM, against
cuBLAS's GEMM and the GEGLU kernel, and attention against cuDNN's, also in TFLOP/s.)

Reports median ms, achieved GB/s over the compulsory traffic (every input read once, every output written once; the
same byte count for both sides, so the GB/s compare like the ms do), and the device's copy bandwidth (a large
x.clone(), timed the same way) to show how close each side gets to what the memory can do.

Two timings per side on a GPU: `triton.testing.do_bench` (each call launched from Python: at the UNet's small
shapes the launches, not the memory, set that time) and per call inside a CUDA graph over enough input sets to
exceed the L2 cache (how the torch path runs the kernels: its UNet step is one graph replay). In the graph a copy of
the case's own byte count is timed too (`copy_graph_ms`): at small shapes no kernel can beat it, since one launch
costs microseconds whatever the size, and `triton_graph_of_same_copy` says how close the kernel gets to it.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from ...kernels import attention as at
from ...kernels import geglu as gg
from ...kernels import groupnorm as gn
from ...kernels import layernorm as ln
from ...kernels import quant
from ...kernels import swiglu as sw
from ...kernels import upsample as up
from ..engine.attention import sdpa_kernels
from ..errors import BackendUnavailable

COPY_BYTES = 1 << 30
# Input sets a graph cycles through: their bytes together exceed this, so that no call finds its inputs in L2
# (50 MB on an H100).
GRAPH_BYTES = 256 << 20
MAX_GRAPH_SETS = 64


@dataclass
class Case:
    kernel: str
    name: str
    shape: tuple[int, ...]
    inputs: Callable[[int], tuple]  # seed -> the arguments of one call
    triton: Callable[..., object]
    torch: Callable[..., object]
    bytes: int
    flops: int = 0  # for the GEMM and attention cases: reported as TFLOP/s too


def _timer(device: torch.device) -> Callable[[Callable[[], object]], float]:
    if device.type == "cuda":
        from triton.testing import do_bench

        return lambda fn: do_bench(fn, warmup=25, rep=100, return_mode="median")

    def wall(fn: Callable[[], object], reps: int = 3) -> float:
        # CPU (Triton's interpreter): a smoke run, not a measurement.
        fn()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times) * 1e3

    return wall


def graph_ms(fn: Callable[..., object], sets: list[tuple], reps: int = 20) -> float:
    """Median ms per call of `fn` captured in one CUDA graph that calls it once on each input set."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compile and warm up outside the capture
        for args in sets:
            fn(*args)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for args in sets:
            fn(*args)
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / len(sets))
    return statistics.median(times)


def _rand(shape: tuple[int, ...], device: torch.device, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(shape, generator=g, device=device).to(dtype)


def _inputs(shapes: list[tuple[int, ...]], device: torch.device, dtype: torch.dtype,
            channels_last: bool = False) -> Callable[[int], tuple]:
    """seed -> one seeded random tensor per shape (the first in channels_last when asked): a call's arguments."""
    def make(seed: int) -> tuple:
        ts = [_rand(s, device, dtype, len(shapes) * seed + i) for i, s in enumerate(shapes)]
        if channels_last:
            ts[0] = ts[0].to(memory_format=torch.channels_last)
        return tuple(ts)
    return make


def _group_norm_case(name: str, shape: tuple[int, ...], nhwc: bool, device: torch.device, dtype: torch.dtype,
                     eps: float) -> Case:
    return Case("group_norm+silu", f"{name} {'NHWC' if nhwc else 'NCHW'}", shape,
                _inputs([shape, shape[1:2], shape[1:2]], device, dtype, channels_last=nhwc),
                lambda x, w, b: gn.group_norm(x, 32, w, b, eps, silu=True),
                lambda x, w, b: gn.group_norm_ref(x, 32, w, b, eps, silu=True),
                2 * torch.Size(shape).numel() * dtype.itemsize)


def _geglu_case(name: str, shape: tuple[int, ...], device: torch.device, dtype: torch.dtype) -> Case:
    return Case("geglu+bias", name, shape, _inputs([shape, shape[-1:]], device, dtype), gg.geglu, gg.geglu_ref,
                torch.Size(shape).numel() * dtype.itemsize * 3 // 2)


def _geglu_linear_case(name: str, tokens: int, k: int, d: int, device: torch.device, dtype: torch.dtype) -> Case:
    # Against what runs without it: cuBLAS's GEMM, then the GEGLU kernel (with the bias).
    return Case("geglu_linear", name, (tokens, k, 2 * d),
                _inputs([(tokens, k), (2 * d, k), (2 * d,)], device, dtype), gg.geglu_linear,
                lambda x, w, b: gg.geglu(F.linear(x, w), b),
                (tokens * k + 2 * d * k + tokens * d) * dtype.itemsize, flops=2 * tokens * k * 2 * d)


def _swiglu_case(name: str, shape: tuple[int, ...], device: torch.device, dtype: torch.dtype) -> Case:
    """shape: the MLP's first projection output (rows, 2 x hidden), [gate | up] halves read in place."""
    return Case("swiglu", name, shape, _inputs([shape], device, dtype),
                lambda a: sw.swiglu(*a.chunk(2, dim=-1)), lambda a: sw.swiglu_ref(*a.chunk(2, dim=-1)),
                torch.Size(shape).numel() * dtype.itemsize * 3 // 2)


def _quantize_case(name: str, shape: tuple[int, ...], device: torch.device, dtype: torch.dtype,
                   activation: str = "") -> Case:
    """Rows to e4m3 with their scales, each fp8 product's input; after the MLP's activation where given ("gelu", or
    "swiglu": rows [gate | up], the output half as wide). Against its torch reference in float32 (activation, row
    maximum, scaling, conversion); with SwiGLU, the torch ops that quantized rows this wide before, but for the SiLU
    and product then run in 16 bits."""
    rows, width = shape
    flags = {activation: True} if activation else {}
    out_width = width // 2 if activation == "swiglu" else width
    kernel = "quantize_rows" + (f"+{activation}" if activation else "")
    return Case(kernel, name, shape, _inputs([shape], device, dtype),
                lambda a: quant.quantize_rows(a, **flags), lambda a: quant.quantize_rows_ref(a, **flags),
                rows * width * dtype.itemsize + rows * out_width + rows * 4)


def _layer_norm_case(name: str, shape: tuple[int, ...], device: torch.device, dtype: torch.dtype) -> Case:
    return Case("skip_layer_norm", name, shape, _inputs([shape, shape, shape[-1:], shape[-1:]], device, dtype),
                lambda x, r, w, b: ln.layer_norm(x, w, b, residual=r),
                lambda x, r, w, b: ln.layer_norm_ref(x, w, b, residual=r),
                4 * torch.Size(shape).numel() * dtype.itemsize)


def _bias_residual_case(name: str, shape: tuple[int, ...], device: torch.device, dtype: torch.dtype) -> Case:
    return Case("add_bias_residual", name, shape, _inputs([shape, shape[-1:], shape], device, dtype),
                ln.add_bias_residual, ln.add_bias_residual_ref, 3 * torch.Size(shape).numel() * dtype.itemsize)


def _upsample_case(name: str, shape: tuple[int, ...], device: torch.device, dtype: torch.dtype) -> Case:
    return Case("upsample_nearest2x", name, shape, _inputs([shape], device, dtype, channels_last=True),
                up.upsample_nearest2x, up.upsample_nearest2x_ref, 5 * torch.Size(shape).numel() * dtype.itemsize)


def _upsample_conv_case(name: str, shape: tuple[int, ...], device: torch.device, dtype: torch.dtype) -> Case:
    # Against what runs without it: the nearest-2x kernel, then cuDNN's 3x3 convolution of the upsampled image.
    n, c, h, w = shape
    make = _inputs([shape, (c, c, 3, 3), (c,)], device, dtype, channels_last=True)

    def inputs(seed: int) -> tuple:
        x, weight, bias = make(seed)
        return x, (weight / (9 * c) ** 0.5).contiguous(memory_format=torch.channels_last), bias

    return Case("upsample_conv3x3", name, shape, inputs, up.upsample_conv3x3,
                lambda x, weight, bias: F.conv2d(up.upsample_nearest2x(x), weight, bias, padding=1),
                (5 * n * c * h * w + 9 * c * c) * dtype.itemsize, flops=2 * n * 4 * h * w * c * c * 9)


def _attention_case(name: str, batch: int, queries: int, keys: int, heads: int, d: int, device: torch.device,
                    dtype: torch.dtype) -> Case:
    """Cross-attention as the UNet runs it: q a (batch, queries, heads * d) projection, k and v per-head views of the
    shared K/V projection of the text context; against SDPA with cuDNN first, the torch path's choice."""
    def inputs(seed: int) -> tuple:
        q, kv = _inputs([(batch, queries, heads * d), (batch, keys, 2 * heads * d)], device, dtype)(seed)
        return (q.view(batch, queries, heads, d), kv[..., :heads * d].view(batch, keys, heads, d),
                kv[..., heads * d:].view(batch, keys, heads, d))

    def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        with sdpa_kernels("cudnn"):
            return at.attention_ref(q, k, v)

    return Case("attention", name, (batch, queries, keys, heads, d), inputs, at.attention, sdpa,
                (2 * queries + 2 * keys) * batch * heads * d * dtype.itemsize,
                flops=4 * batch * heads * queries * keys * d)


def cases(device: torch.device, dtype: torch.dtype, tiny: bool) -> list[Case]:
    """The shapes: SD1.5 / SDXL UNet at batch 2 (classifier-free guidance) and the SD VAE decoder at batch 1."""
    if tiny:
        return [_group_norm_case("tiny", (1, 64, 8, 8), True, device, dtype, 1e-5),
                _group_norm_case("tiny", (1, 64, 8, 8), False, device, dtype, 1e-5),
                _geglu_case("tiny", (1, 16, 128), device, dtype),
                _geglu_linear_case("tiny", 16, 32, 32, device, dtype),
                _swiglu_case("tiny", (16, 2 * 96), device, dtype),
                _quantize_case("tiny", (16, 2 * 96), device, dtype, "swiglu"),
                _quantize_case("tiny rows past one block", (4, 2 * 9000), device, dtype, "swiglu"),
                _quantize_case("tiny", (16, 96), device, dtype),
                _quantize_case("tiny rows walked in steps", (4, 300), device, dtype, "gelu"),
                _layer_norm_case("tiny", (1, 16, 64), device, dtype),
                _bias_residual_case("tiny", (1, 16, 64), device, dtype),
                _upsample_case("tiny", (1, 16, 4, 4), device, dtype),
                _upsample_conv_case("tiny", (1, 16, 4, 4), device, dtype),
                _attention_case("tiny", 1, 16, 77, 2, 64, device, dtype)]
    out = []
    for name, shape, eps in [("sd15 unet 64x64", (2, 320, 64, 64), 1e-5), ("sd15 unet 32x32", (2, 640, 32, 32), 1e-5),
                             ("sd15 unet 8x8", (2, 1280, 8, 8), 1e-5), ("sdxl unet 128x128", (2, 320, 128, 128), 1e-5),
                             ("sdxl unet 32x32 up", (2, 2560, 32, 32), 1e-5),
                             ("vae 1024px 256x256", (1, 512, 256, 256), 1e-6),
                             ("vae 1024px 1024x1024", (1, 128, 1024, 1024), 1e-6)]:
        out.append(_group_norm_case(name, shape, True, device, dtype, eps))
    out.append(_group_norm_case("sd15 unet 64x64", (2, 320, 64, 64), False, device, dtype, 1e-5))
    out.append(_group_norm_case("vae 1024px 1024x1024", (1, 128, 1024, 1024), False, device, dtype, 1e-6))
    for name, shape in [("sd15 64x64 C=320", (2, 4096, 2560)), ("sdxl 64x64 C=640", (2, 4096, 5120)),
                        ("sdxl 32x32 C=1280", (2, 1024, 10240))]:
        out.append(_geglu_case(name, shape, device, dtype))
    for name, tokens, k, d in [("sd15 64x64 C=320", 8192, 320, 1280), ("sd15 32x32 C=640", 2048, 640, 2560),
                               ("sdxl 64x64 C=640", 8192, 640, 2560), ("sdxl 32x32 C=1280", 2048, 1280, 5120)]:
        out.append(_geglu_linear_case(name, tokens, k, d, device, dtype))
    # Flux.2-dev at 1024 px, batch 1: the double blocks' image and text MLPs, the single blocks' (both streams)
    for name, rows in [("flux2 double img", 4096), ("flux2 double txt", 512), ("flux2 single", 4608)]:
        out.append(_swiglu_case(name, (rows, 2 * 18432), device, dtype))
        out.append(_quantize_case(name, (rows, 2 * 18432), device, dtype, "swiglu"))
    # Wan 2.1 1.3B's 17-frame 480p clip and Flux.1-dev at 1024 px, CFG's batch of 2 for Wan: a block's attention output
    # rows and its MLP's hidden rows
    for name, rows, width, hidden in [("wan21 1.3b", 15600, 1536, 8960), ("flux1", 5120, 3072, 12288)]:
        out.append(_quantize_case(name, (rows, width), device, dtype))
        out.append(_quantize_case(name, (rows, hidden), device, dtype, "gelu"))
    for name, shape in [("sd15 64x64", (2, 4096, 320)), ("sdxl 64x64", (2, 4096, 640)),
                        ("sdxl 32x32", (2, 1024, 1280))]:
        out.append(_layer_norm_case(name, shape, device, dtype))
        out.append(_bias_residual_case(name, shape, device, dtype))
    for name, shape in [("sd15 up 16x16", (2, 1280, 16, 16)), ("sd15 up 32x32", (2, 640, 32, 32)),
                        ("sdxl up 32x32", (2, 1280, 32, 32)), ("sdxl up 64x64", (2, 640, 64, 64))]:
        out.append(_upsample_case(name, shape, device, dtype))
        out.append(_upsample_conv_case(name, shape, device, dtype))
    for name, queries, heads in [("sdxl cross 64x64", 4096, 10), ("sdxl cross 32x32", 1024, 20)]:
        out.append(_attention_case(name, 2, queries, 77, heads, 64, device, dtype))
    return out


def _max_rel_err(a: object, b: object) -> float:
    a = a if isinstance(a, tuple) else (a,)
    b = b if isinstance(b, tuple) else (b,)
    return max(((p.float() - q.float()).abs().max() / q.float().abs().max().clamp_min(1e-12)).item()
               for p, q in zip(a, b))


def _copy_gbps(device: torch.device, timer: Callable[[Callable[[], object]], float], nbytes: int) -> float:
    """The device's copy bandwidth, read plus write, the yardstick for a memory-bound kernel."""
    src = torch.empty(nbytes // 2, device=device, dtype=torch.float16)
    return 2 * nbytes / timer(src.clone) / 1e6


def bench_kernels(device: str = "cuda", tiny: bool = False, dtype: torch.dtype = torch.float16) -> list[dict]:
    """Time every case; one dict per case. On a CPU (TRITON_INTERPRET=1) only a smoke run with tiny shapes."""
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise BackendUnavailable("bench --kernels needs a CUDA or ROCm GPU, and torch sees none.",
                                 "Run it on a GPU machine (for a CPU smoke run: TRITON_INTERPRET=1 and "
                                 "bench_kernels('cpu', tiny=True)).")
    timer = _timer(dev)
    copy_gbps = _copy_gbps(dev, timer, (8 << 20) if tiny else COPY_BYTES)
    graphs = dev.type == "cuda"
    # cuDNN chooses its convolution algorithms as the torch path has it do (backends/torch_fused.py)
    with torch.backends.cudnn.flags(enabled=True, benchmark=True, benchmark_limit=0):
        return [_bench_case(case, dtype, timer, copy_gbps, graphs) for case in cases(dev, dtype, tiny)]


def _bench_case(case: Case, dtype: torch.dtype, timer: Callable[[Callable[[], object]], float], copy_gbps: float,
                graphs: bool) -> dict:
    args = case.inputs(0)
    err = _max_rel_err(case.triton(*args), case.torch(*args))
    t_ms, r_ms = timer(lambda: case.triton(*args)), timer(lambda: case.torch(*args))
    t_gbps, r_gbps = case.bytes / t_ms / 1e6, case.bytes / r_ms / 1e6
    row = {"kernel": case.kernel, "case": case.name, "shape": list(case.shape), "dtype": str(dtype),
           "triton_ms": round(t_ms, 4), "torch_ms": round(r_ms, 4), "speedup": round(r_ms / t_ms, 2),
           "triton_gbps": round(t_gbps, 1), "torch_gbps": round(r_gbps, 1),
           "copy_gbps": round(copy_gbps, 1), "triton_of_copy": round(t_gbps / copy_gbps, 3),
           "torch_of_copy": round(r_gbps / copy_gbps, 3), "max_rel_err": float(f"{err:.3g}")}
    if case.flops:
        row.update({"triton_tflops": round(case.flops / t_ms / 1e9, 1),
                    "torch_tflops": round(case.flops / r_ms / 1e9, 1)})
    if graphs:
        sets = [case.inputs(i) for i in range(min(MAX_GRAPH_SETS, max(2, -(-GRAPH_BYTES // case.bytes))))]
        tg, rg = graph_ms(case.triton, sets), graph_ms(case.torch, sets)
        copies = [(torch.empty(max(1, case.bytes // 4), device=args[0].device, dtype=torch.float16),) for _ in sets]
        cg = graph_ms(torch.clone, copies)
        del sets, copies
        # against the same copy bandwidth as above: a clone captured in a graph measures lower than one launched
        # from Python, which would flatter the kernels
        if case.flops:
            row.update({"triton_graph_tflops": round(case.flops / tg / 1e9, 1),
                        "torch_graph_tflops": round(case.flops / rg / 1e9, 1)})
        row.update({"triton_graph_ms": round(tg, 4), "torch_graph_ms": round(rg, 4), "copy_graph_ms": round(cg, 4),
                    "triton_graph_of_same_copy": round(cg / tg, 3),
                    "triton_graph_of_copy": round(case.bytes / tg / 1e6 / copy_gbps, 3),
                    "torch_graph_of_copy": round(case.bytes / rg / 1e6 / copy_gbps, 3)})
    return row

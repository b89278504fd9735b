"""fp8 attention for the fused DiT blocks: cuDNN's fp8 SDPA (the optional `nvidia-cudnn-frontend` package, import
name `cudnn`) on e4m3 q, k and v, where the block's projections make fp8 products (accel/engine/fp8.py: precision
fp8, or auto for weights stored in fp8).

The inputs cost no pass of their own beyond v's: the pass that writes q, k and v in SDPA's layout (kernels/qk_rope.py)
writes q and k in e4m3 under descales bounded by their RMSNorm weights and gathers v's largest magnitude; one pass
quantizes v by it (kernels/quant.py). cuDNN takes one descale per tensor, kept on the device (no host sync: the
engine's CUDA graphs replay all of it). On Hopper cuDNN writes the output in e4m3 only (16-bit output needs Blackwell
and cuDNN 9.13): it goes to the output projection, an fp8 product already, as fp8.Rows with no pass between; where
something needs 16 bits it is widened. v's descale maps max|v| to 448, and every output row is a convex combination of
v's rows, so the output never overflows.

Under sequence parallelism (a StandIn of the exchange, accel/parallel/exchange.py, in the place of ComfyUI's PyTorch
attention) it stays fp8: q and k cross the exchange as e4m3 bytes, v in 16 bits with each rank's largest |v|, and each
rank quantizes the v rows it received by the largest of all ranks' (the one process's scale); the kernel is chosen at
the gathered shape (all tokens, the rank's heads), and its output goes back as it came out of the kernel.

Where ComfyUI's attention for the whole host is another of its own (--use-sage-attention, --use-flash-attention,
...), fp8 attention is timed against it at the shape's first call on the GPU and serves where faster (host_attention's
rule and message; on the CPU nothing is timed and fp8 serves); where the other is faster, the 16-bit path runs and
chooses between its attention and that one as before. Blocks without qk norm (SD3.0), heads cuDNN does not take, a
function in ComfyUI's place that is not one of its own choices, a host attention other than the PyTorch one behind
the exchange, any other stand-in, a missing package or an older GPU: 16-bit attention as before, said once per
reason. So too where FlashAttention-4 is installed, at a head size it takes where cuDNN's fp8 kernel was not
measured faster than its 16-bit one (BENCHMARKS.md, on an H200; Blackwell not measured): 128 (Flux, Chroma,
Qwen-Image, Wan) keeps fp8 attention, SD3.5's 64 does not.
"""

from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import nn

from . import flash3, flash4, fp8, host_attention
from .attention import StandIn
from .fusions.base import comfy_choice, comfy_function, comfy_host, comfy_pytorch, kernel_module

log = logging.getLogger("sd-accel")

PACKAGE = "nvidia-cudnn-frontend"
# The head sizes at which cuDNN's fp8 attention (with v's quantization) was measured faster than FlashAttention-4's
# 16-bit attention (BENCHMARKS.md): where that is installed, other head sizes it takes stay 16-bit.
AHEAD_OF_FLASH4 = (128,)
# (q8, k8, v8, descale_q, descale_k, descale_v, scale_o, out): fills out, (B, L, heads, head_dim) like q
Kernel = Callable[..., None]


def available(device: torch.device) -> tuple[bool, str]:
    """Whether cuDNN's fp8 attention can run on `device`, and in words why not (or what runs it)."""
    if device.type != "cuda" or torch.version.hip is not None:
        return False, "it runs on NVIDIA GPUs only (cuDNN)"
    major, minor = torch.cuda.get_device_capability(device)
    if major < 9:
        return False, f"it needs Hopper or later (compute capability 9.0); this GPU is {major}.{minor}"
    cudnn, why = _cudnn()
    if cudnn is None:
        return False, why
    return True, f"cuDNN {cudnn.backend_version_string()}, {PACKAGE} {cudnn.__version__}"


@functools.cache
def _cudnn():
    """(the cudnn module, "") or (None, why): imported on first use, after torch, whose cuDNN library it uses. The
    answer is kept: a missing package would otherwise be searched for on every fused block's call (a test that
    changes what imports calls _cudnn.cache_clear())."""
    try:
        import cudnn
    except Exception as e:  # a broken install can raise more than ImportError; either way 16-bit attention runs
        if isinstance(e, ModuleNotFoundError) and e.name == "cudnn":
            return None, f"the {PACKAGE} package is not installed (python install.py installs it on Hopper and " \
                         "Blackwell GPUs)"
        return None, f"the {PACKAGE} package does not import ({type(e).__name__}: {e})"
    return cudnn, ""


def sixteen_bit_output(device: torch.device) -> bool:
    """Whether cuDNN writes the fp8 attention's output in 16 bits here (Blackwell, cuDNN 9.13 or later); Hopper
    writes e4m3 only."""
    cudnn, _ = _cudnn()
    return (cudnn is not None and device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 10
            and cudnn.backend_version() >= 91300)


def sdpa_fp8_ref(q8: torch.Tensor, k8: torch.Tensor, v8: torch.Tensor, descale_q: torch.Tensor,
                 descale_k: torch.Tensor, descale_v: torch.Tensor, scale_o: torch.Tensor,
                 out_dtype: torch.dtype = torch.float8_e4m3fn) -> torch.Tensor:
    """What cuDNN's fp8 attention computes, in torch (tests; the bench's check): softmax(q k^T / sqrt(head_dim)) v
    over (B, L, heads, head_dim) e4m3 q, k and v times their descales, the probabilities before normalization
    (in [0, 1]) rounded to e4m3 at 448 full scale as cuDNN's scale_s has them, the output times scale_o, in
    out_dtype (e4m3 saturated)."""
    q, k, v = (t.float().transpose(1, 2) * d.float().reshape(()) for t, d in ((q8, descale_q), (k8, descale_k),
                                                                              (v8, descale_v)))
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    p = torch.exp(s - s.amax(dim=-1, keepdim=True))
    p8 = (p * fp8.FP8_MAX).to(fp8.FP8).float() / fp8.FP8_MAX
    o = (p8 @ v) / p.sum(dim=-1, keepdim=True) * scale_o.float().reshape(())
    if out_dtype == fp8.FP8:
        o = o.clamp(-fp8.FP8_MAX, fp8.FP8_MAX)
    return o.to(out_dtype).transpose(1, 2).contiguous()


# ---- cuDNN's graphs: one per shape, built before the pass that writes the inputs (so a refusal leaves time to write
# them in 16 bits), never inside a CUDA graph capture

@dataclass
class _Graph:
    graph: object
    tensors: tuple  # the graph's q, k, v, descales of q, k, v and s, scale_s, scale_o, o, amax_s, amax_o
    constants: tuple  # descale_s, scale_s: P in [0, 1] to e4m3's range and back
    amaxes: tuple  # amax_s, amax_o: outputs cuDNN insists on, read by nobody
    workspace: torch.Tensor
    handle: object


_HANDLES: dict[int, object] = {}
_KERNELS: dict[tuple, Kernel | str] = {}  # shape key -> kernel, or why cuDNN refused the shape
# scale_o of a 16-bit output, one per device: made with a kernel, outside any CUDA graph capture (one made inside would
# hold nothing until its graph replays), and read by every call after
_ONE: dict[torch.device, torch.Tensor] = {}
_SAID: set[str] = set()
# (shape the kernel runs at, processes exchanged over: None without the exchange) -> the kernel's name, for every
# sequence that took fp8 attention in this process since served_clear() (the multi-GPU bench prints them)
_SERVED: dict[tuple, str] = {}


def _build(shape: tuple[int, int, int, int], device: torch.device, out_dtype: torch.dtype) -> Kernel:
    """cuDNN's fp8 attention over contiguous (B, L, heads, head_dim) e4m3 q, k, v, writing a tensor of that layout
    in out_dtype; raises where cuDNN refuses it."""
    cudnn, _ = _cudnn()
    with torch.cuda.device(device):
        handle = _HANDLES.get(device.index)
        if handle is None:
            handle = _HANDLES[device.index] = cudnn.create_handle()
        B, L, H, D = shape
        bhsd = torch.empty(shape, device="meta").transpose(1, 2)  # BSHD storage, BHSD logical: SDPA's view
        dims, strides = list(bhsd.shape), list(bhsd.stride())
        g = cudnn.pygraph(io_data_type=cudnn.data_type.FP8_E4M3, intermediate_data_type=cudnn.data_type.FLOAT,
                          compute_data_type=cudnn.data_type.FLOAT, handle=handle)
        q, k, v = (g.tensor(dim=dims, stride=strides, data_type=cudnn.data_type.FP8_E4M3) for _ in range(3))
        scalars = [g.tensor(dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=cudnn.data_type.FLOAT) for _ in range(6)]
        o, _stats, amax_s, amax_o = g.sdpa_fp8(q=q, k=k, v=v, descale_q=scalars[0], descale_k=scalars[1],
                                               descale_v=scalars[2], descale_s=scalars[3], scale_s=scalars[4],
                                               scale_o=scalars[5], is_inference=True, attn_scale=1.0 / math.sqrt(D),
                                               use_causal_mask=False)
        o_type = {fp8.FP8: cudnn.data_type.FP8_E4M3, torch.bfloat16: cudnn.data_type.BFLOAT16,
                  torch.float16: cudnn.data_type.HALF}[out_dtype]
        o.set_output(True).set_dim(dims).set_stride(strides).set_data_type(o_type)
        for t in (amax_s, amax_o):
            t.set_output(True).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1]).set_data_type(cudnn.data_type.FLOAT)
        g.validate()
        g.build_operation_graph()
        g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        g.check_support()
        g.build_plans()
        # each scalar in an allocation of its own: cuDNN takes its tensors 16-byte aligned
        scale_s = torch.full((1, 1, 1, 1), fp8.FP8_MAX, device=device)
        entry = _Graph(g, (q, k, v, *scalars, o, amax_s, amax_o), (1.0 / scale_s, scale_s),
                       tuple(torch.empty(1, 1, 1, 1, device=device) for _ in range(2)),
                       torch.empty(max(g.get_workspace_size(), 1), device=device, dtype=torch.uint8), handle)

    def run(q8, k8, v8, descale_q, descale_k, descale_v, scale_o, out) -> None:
        data = (q8, k8, v8, descale_q, descale_k, descale_v, *entry.constants, scale_o, out, *entry.amaxes)
        cudnn.set_stream(entry.handle, torch.cuda.current_stream(device).cuda_stream)
        entry.graph.execute(dict(zip(entry.tensors, data)), entry.workspace, handle=entry.handle)

    return run


def kernel(shape: tuple[int, int, int, int], device: torch.device, out_dtype: torch.dtype,
           quiet: bool = False) -> Kernel | None:
    """cuDNN's fp8 attention for (B, L, heads, head_dim) inputs on `device` with output in out_dtype (e4m3, or 16 bits
    where `sixteen_bit_output`), built at its shape's first call; None where it cannot run (said once per reason,
    unless `quiet`: another kernel runs) or would first be built inside a CUDA graph capture."""
    key = (shape, device, out_dtype)
    found = _KERNELS.get(key)
    if found is None:
        ok, why = available(device)
        if ok:
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                return None
            try:
                found = _build(shape, device, out_dtype)
            except Exception as e:  # cuDNN refuses a shape with one of several error types
                found = f"cuDNN does not take attention over {shape[2]} heads of {shape[3]} ({type(e).__name__}: " \
                        f"{str(e).strip().splitlines()[0] if str(e).strip() else ''})"
            else:
                _ONE.setdefault(device, torch.ones(1, device=device, dtype=torch.float32))
        else:
            found = why
        _KERNELS[key] = found
    if isinstance(found, str):
        if not quiet:
            _say(f"fp8 attention cannot run: {found}; the attention runs in 16 bits", logging.WARNING)
        return None
    return found


# (shape, device, cuDNN's output dtype, the blocks' 16-bit dtype) -> (kernel, its output dtype), where FlashAttention-3
# takes the shape: which of it and cuDNN was timed faster at the shape's first call
_CHOSEN: dict[tuple, tuple[Kernel | None, torch.dtype]] = {}


def choose(shape: tuple[int, int, int, int], device: torch.device, out_dtype: torch.dtype, dtype16: torch.dtype,
           three: bool, fp8_consumers: bool,
           agree: Callable[[list[float], torch.device], list[float]] | None = None
           ) -> tuple[Kernel | None, torch.dtype]:
    """The fp8 attention for (B, L, heads, head_dim) inputs on `device`, and the dtype it writes: cuDNN's (`kernel`,
    writing out_dtype), or where `three` (FlashAttention-3 takes the head size) whichever of it and FlashAttention-3's
    (writing dtype16, the blocks' 16-bit dtype) was timed faster at the shape's first call, FlashAttention-3 with the
    quantization of its output that the output projections then make where they make fp8 products
    (`fp8_consumers`). (None, _) where neither runs, or the choice would first be made inside a CUDA graph capture.
    FlashAttention-3's fp8 kernel writes bf16 alone, so blocks that compute in float16 (ComfyUI picks it for some
    quantized checkpoints) get cuDNN's. `agree` (sequence parallelism's Eight.agree): the times are the largest over
    the processes that attend together, so that each chooses the same kernel; a rank whose cuDNN refuses the shape
    times it as infinite, and all take FlashAttention-3. Without FlashAttention-3 in the choice, cuDNN's answer is
    taken to be the same on each (GPUs of one kind, one Python). An agreed choice holds for the processes' group
    (forget_agreed)."""
    if not three or dtype16 != torch.bfloat16:
        return kernel(shape, device, out_dtype), out_dtype
    key = (shape, device, out_dtype, dtype16) if agree is None else (shape, device, out_dtype, dtype16, "agreed")
    found = _CHOSEN.get(key)
    if found is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None, out_dtype
        _ONE.setdefault(device, torch.ones(1, device=device, dtype=torch.float32))
        cudnn = kernel(shape, device, out_dtype, quiet=True)
        found = (_flash3, dtype16)
        if cudnn is not None:
            ms_cudnn = _ms(cudnn, shape, device, out_dtype, False)
            ms_three = _ms(_flash3, shape, device, dtype16, fp8_consumers)
            if agree is not None:
                ms_cudnn, ms_three = agree([ms_cudnn, ms_three], device)
            if math.isfinite(ms_cudnn):
                _say(f"fp8 attention over {shape[2]} heads of {shape[3]} at {shape[1]} tokens runs "
                     f"{'FlashAttention-3' if ms_three < ms_cudnn else 'cuDNN'}: {min(ms_three, ms_cudnn):.2f} ms "
                     f"against {max(ms_three, ms_cudnn):.2f} ms for "
                     f"{'cuDNN' if ms_three < ms_cudnn else 'FlashAttention-3'}", logging.INFO)
            if ms_cudnn <= ms_three:
                found = (cudnn, out_dtype)
        elif agree is not None:  # the others wait for this rank's times: cuDNN's never the faster
            agree([math.inf, 0.0], device)
        _CHOSEN[key] = found
    return found


def forget_agreed() -> None:
    """Drop the choices agreed with other processes. A new group (a worker pool started again beside ComfyUI's
    process, which kept its choices) has made none: a rank that kept one would go straight to the exchange while the
    new ranks wait for its times in the agreement, and neither collective would ever complete."""
    for key in [k for k in _CHOSEN if k[-1] == "agreed"]:
        del _CHOSEN[key]


def _flash3(q8, k8, v8, descale_q, descale_k, descale_v, scale_o, out) -> None:
    """FlashAttention-3's fp8 attention as a Kernel: its output is 16-bit and needs no scale_o."""
    flash3.fp8_attention(q8, k8, v8, descale_q, descale_k, descale_v, out)


def _ms(run: Kernel, shape: tuple[int, int, int, int], device: torch.device, out_dtype: torch.dtype,
        quantize_output: bool) -> float:
    """Milliseconds per call of `run` on random e4m3 inputs of `shape` (the time does not depend on the values), with
    fp8.quantized of its 16-bit output where `quantize_output`."""
    q8 = torch.randn(shape, device=device, dtype=torch.bfloat16).to(fp8.FP8)
    call = _on(run, q8, out_dtype, quantize_output)
    return host_attention.call_ms(lambda *_: call(), q8, q8, q8)


def _on(run: Kernel, x8: torch.Tensor, out_dtype: torch.dtype, quantize_output: bool) -> Callable[[], None]:
    """A call of `run` with the e4m3 tensor x8 as q, k and v (the time does not depend on the values), with
    fp8.quantized of its 16-bit output where `quantize_output`: what one fp8 attention costs."""
    shape, device = tuple(x8.shape), x8.device
    scalars = [torch.ones(1, device=device) for _ in range(4)]  # each its own allocation: cuDNN takes them aligned
    out = torch.empty(shape, device=device, dtype=out_dtype)

    def call() -> None:
        run(x8, x8, x8, *scalars, out)
        if quantize_output:
            fp8.quantized(out.view(shape[0], shape[1], -1))

    return call


def _say(what: str, level: int) -> None:
    if what not in _SAID:
        _SAID.add(what)
        log.log(level, "sd-accel: %s.", what)


# ---- the fused blocks' side

def wanted(module_name: str, name: str, x: torch.Tensor, *projections: nn.Module) -> bool:
    """Whether a fused block of ComfyUI's `module_name`, whose attention is that module's function `name`, may take
    fp8 attention for the sequence its `projections` (the q, k and v projections of every stream) write: all of them
    make fp8 products, the activations are 16-bit, and the attention the block would run is one of ComfyUI's own
    choices for the whole host (its PyTorch one, sage, ...: `sequence` times another against fp8), or ComfyUI's
    PyTorch one through sequence parallelism's exchange (no other stand-in)."""
    if not (x.dtype in (torch.bfloat16, torch.float16) and all(fp8.marked(p) for p in projections)):
        return False
    fn, host = comfy_function(module_name, name)
    if fn is host:
        return comfy_choice(host) is not None
    return comfy_pytorch(host) and _exchange(fn) is not None


def _exchange(fn) -> object | None:
    """The exchange of a stand-in that takes fp8 attention (StandIn.eight: sequence parallelism's), else None."""
    return fn.eight if isinstance(fn, StandIn) else None


@dataclass
class Output:
    """The fp8 attention's output, (B, L, heads * head_dim) in e4m3 times `descale` (or in 16 bits), handed to each
    consumer in the form it takes."""
    o: torch.Tensor
    descale: torch.Tensor  # (1,) float32
    dtype: torch.dtype  # the blocks' 16-bit dtype

    def part(self, start: int, stop: int | None, consumer: Optional[nn.Module],
             sample: int | None = None) -> torch.Tensor | fp8.Rows:
        """Tokens start..stop (of one sample where given): fp8.Rows for a consumer that makes fp8 products (no pass:
        the rows are the output, its descale theirs), else a 16-bit tensor."""
        o = self.o[:, start:stop] if sample is None else self.o[sample:sample + 1, start:stop]
        if self.o.dtype != fp8.FP8:
            return o
        if consumer is not None and fp8.takes_e4m3(consumer):
            rows = o.reshape(-1, o.shape[-1])  # a view, but for a part of a batch of several
            return fp8.Rows(rows, self._row_descales[:rows.shape[0]], tuple(o.shape[:2]), self.dtype)
        return (o.float() * self.descale).to(self.dtype)

    @functools.cached_property
    def _row_descales(self) -> torch.Tensor:
        """The descale once per row of the whole output, (B * L, 1): made at the first consumer, and every part's
        rows take its first rows (a row-wise scale of fp8 products is a contiguous tensor of the rows', not a
        broadcast)."""
        return self.descale.view(1, 1).expand(self.o.shape[0] * self.o.shape[1], 1).contiguous()


@dataclass
class Sequence:
    """The buffers `qk_norm_rope` writes one joint sequence's fp8 attention inputs into, and what attends over
    them."""
    qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # e4m3 q and k, 16-bit v: (B, L, heads, head_dim)
    descales: torch.Tensor  # (2, 4) float32: q's and k's descales in column 0 (rows 16 bytes apart, for cuDNN)
    v_amax: torch.Tensor  # v's largest magnitude as partial maxima (kernels/qk_rope.py new_v_amax)
    run: Kernel
    out_dtype: torch.dtype
    # sequence parallelism's exchange (accel/parallel/exchange.py Eight) and how many of the rows are alike on every
    # rank, where the attention runs over all ranks' tokens of this rank's heads; None: over these rows, all heads
    exchange: object | None = None
    whole: int = 0

    def kernel_args(self) -> dict:
        """qk_norm_rope's arguments for each stream's rows."""
        return {"descales": self.descales, "v_amax": self.v_amax}

    def attend(self) -> Output:
        """Attention over the sequence once every stream's rows are written (under the exchange over every rank's rows
        of this rank's heads: tokens traded for heads on the way in, back on the way out)."""
        q8, k8, v = self.qkv
        if self.exchange is None:
            out, descale_v = self._run(q8, k8, v, self.v_amax)
            B, L, H, D = out.shape
            return Output(out.view(B, L, H * D), descale_v, v.dtype)
        B, L, H, D = q8.shape
        q8, k8, v, maxima = self.exchange.to_heads(q8, k8, v, self.v_amax, self.whole)
        if maxima.numel() > kernel_module("quant").MAX_AMAX:
            maxima = maxima.amax().reshape(1)
        out, descale_v = self._run(q8, k8, v, maxima)
        return Output(self.exchange.to_tokens(out, self.whole).view(B, L, H * D), descale_v, v.dtype)

    def _run(self, q8: torch.Tensor, k8: torch.Tensor, v: torch.Tensor,
             amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the kernel's output, v's descale): v quantized by the largest of amax (under the exchange, all ranks'
        maxima: the same scale on every rank, so the output's rows need no other on the way back), then attended."""
        v8, descale_v, scale_v = kernel_module("quant").quantize_tensor(v, amax)
        out = torch.empty(q8.shape, device=q8.device, dtype=self.out_dtype)
        scale_o = scale_v if self.out_dtype == fp8.FP8 else _ONE[q8.device]
        self.run(q8, k8, v8, self.descales[0, :1], self.descales[1, :1], descale_v, scale_o, out)
        return out, descale_v


def sequence(module_name: str, name: str, batch: int, tokens: int, heads: int, head_dim: int, like: torch.Tensor,
             projections: tuple[nn.Module, ...], norms: list[tuple[torch.Tensor | None, torch.Tensor | None]],
             consumers: tuple[nn.Module, ...]) -> Sequence | None:
    """fp8 attention's buffers for a joint sequence of `tokens` whose streams have q/k RMSNorm weights `norms` (per
    head, or over all heads' channels), written by `projections`, its output read by `consumers`, in a block whose
    attention is the function `name` of ComfyUI's `module_name`; None where it stays 16-bit (`wanted` says no, a stream
    has no qk norm to bound q and k, or no kernel runs: said once). The output is e4m3 where every consumer makes fp8
    products or the GPU writes no 16-bit output, else 16-bit. Under sequence parallelism's exchange the kernel runs at
    the gathered shape (batch, the rows alike on every rank + world x the others, heads / world, head_dim)."""
    if not wanted(module_name, name, like, *projections) or any(w is None for pair in norms for w in pair):
        return None
    three = flash3.takes(like.device, head_dim)
    if not three and head_dim not in AHEAD_OF_FLASH4 and available(like.device)[0] \
            and flash4.takes(like.device, head_dim):
        _say(f"at head size {head_dim} the attention stays 16-bit under fp8: FlashAttention-4 is installed, and its "
             "16-bit kernel was measured faster there than cuDNN's fp8 one", logging.INFO)
        return None
    eight_bit_consumers = all(fp8.takes_e4m3(c) for c in consumers)
    sixteen_bit = not eight_bit_consumers and sixteen_bit_output(like.device)
    shape, exchange = (batch, tokens, heads, head_dim), _exchange(comfy_function(module_name, name)[0])
    whole = exchange.whole(tokens) if exchange is not None else None
    if whole is None:
        exchange = None
    else:  # all ranks' tokens, this rank's heads
        shape = (batch, whole + exchange.world * (tokens - whole), heads // exchange.world, head_dim)
    run, out_dtype = choose(shape, like.device, like.dtype if sixteen_bit else fp8.FP8, like.dtype, three,
                            eight_bit_consumers, exchange.agree if exchange is not None else None)
    if run is None:
        return None
    host = comfy_function(module_name, name)[1]
    if not comfy_pytorch(host) and not _ahead_of_host(host, shape, like.device, like.dtype, run, out_dtype,
                                                      run is _flash3 and eight_bit_consumers):
        return None
    if run is _flash3:
        flash3.say("fp8")
    _served(shape, exchange, run)
    rope = kernel_module("qk_rope")
    return Sequence(rope.empty_qkv(batch, tokens, heads, head_dim, like, qk_fp8=True),
                    rope.qk_descales([q for q, _ in norms], [k for _, k in norms]),
                    rope.new_v_amax(like.device), run, out_dtype, exchange, whole or 0)


# (shape, device, 16-bit dtype, the host's function) -> whether fp8 attention serves there rather than the host's
_AHEAD: dict[tuple, bool] = {}


def _ahead_of_host(host: Callable, shape: tuple[int, int, int, int], device: torch.device, dtype16: torch.dtype,
                   run: Kernel, out_dtype: torch.dtype, quantize_output: bool) -> bool:
    """Whether fp8 attention (`run`, writing out_dtype) serves `shape` where `host`, another of ComfyUI's own
    attention functions than its PyTorch one, is its choice for the whole host: host_attention's choice between the
    two, timed at the shape's first call on the GPU on one random tensor (fp8 where nothing is timed), said once;
    16-bit where the timing runs out of memory. Unchosen and fp8 in the compile-ahead run (kernels/ahead.py: it
    compiles the fp8 path's kernels, the real run chooses); False, unchosen, in a capture: the 16-bit path serves
    that call."""
    key = (shape, device, dtype16, host)
    found = _AHEAD.get(key)
    if found is not None:
        return found
    from ...kernels import ahead

    if ahead.recording():
        return True
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return False
    kernel_name = f"fp8 attention ({'FlashAttention-3' if run is _flash3 else 'cuDNN'})"
    theirs = comfy_host(host, lambda q, k, v: host(q.flatten(2), k.flatten(2), v.flatten(2), q.shape[2]))
    try:
        q = torch.randn(shape, device=device, dtype=dtype16)
        call = _on(run, q.to(fp8.FP8), out_dtype, quantize_output)
        choice = host_attention.choose((*key, "fp8"), q, q, q, lambda *_: call(), theirs.attend)
    except torch.OutOfMemoryError:
        _say(f"{theirs.why}: fp8 attention at {shape[1]} tokens could not be timed against it (out of memory); the "
             "fused blocks' attention stays 16-bit there", logging.WARNING)
        _AHEAD[key] = False
        return False
    if choice is None:
        return False
    if choice.host:
        _say(f"{theirs.why}: {theirs.name} {choice.host_ms:.2f} ms against {choice.ours_ms:.2f} ms for {kernel_name} "
             f"at {shape[1]} tokens; the fused blocks' attention stays 16-bit there", logging.WARNING)
    else:
        host_attention.say(choice, kernel_name, theirs, q, q, topic="fp8")
    _AHEAD[key] = not choice.host
    return not choice.host


def _served(shape: tuple[int, int, int, int], exchange, run: Kernel) -> None:
    """Note which kernel serves a sequence at `shape`, the first time; under the exchange also say it once."""
    key = (shape, exchange.world if exchange is not None else None)
    if key in _SERVED:
        return
    _SERVED[key] = "FlashAttention-3" if run is _flash3 else "cuDNN"
    if exchange is not None:
        _say(f"fp8 attention under sequence parallelism over {exchange.world} processes: {shape[2]} heads of "
             f"{shape[3]} at {shape[1]} tokens on each, {_SERVED[key]}'s kernel, q and k exchanged in e4m3",
             logging.INFO)


def served() -> list[str]:
    """Which kernel served the fp8 attention of each shape since served_clear(), in words (the multi-GPU bench prints
    them): empty where every attention was 16-bit."""
    return [f"{name} at {'x'.join(map(str, shape))}"
            + ("" if world is None else f" exchanged over {world} process{'es' if world > 1 else ''}")
            for (shape, world), name in _SERVED.items()]


def served_clear() -> None:
    """Start served()'s record afresh (before a row of the bench)."""
    _SERVED.clear()

"""FlashAttention-3 (accel/engine/flash3.py, the fa3-fwd package) in the fused DiT blocks. On the CPU its kernels are
stood in for (the 16-bit one by PyTorch's attention, the fp8 one by the emulation of fp8 attention with a bf16
output): which kernel serves, chosen by time against what would run without it, the fused blocks' output with it,
the words where it cannot run and install.py's refusal. On a Hopper GPU with the package, its kernels against float32
attention, in a CUDA graph too."""

from __future__ import annotations

import logging
import sys

import pytest
import torch
import torch.nn.functional as F

import comfy_helpers as H
from sd_accel.accel.engine import flash3, flash4, fp8_attention
from sd_accel.accel.engine.fusions import transformer
from test_dit import DEVICE, _bf16_inputs, _dit_bf16, _fused_output, rel

FP8 = torch.float8_e4m3fn
needs_comfy = pytest.mark.skipif(H.comfy_unavailable() is not None, reason=str(H.comfy_unavailable()))


def _reference(q, k, v):
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)


def test_the_16_bit_attention_is_the_fastest_of_those_installed(host_attention, monkeypatch):
    """PyTorch's SDPA, FlashAttention-4 and FlashAttention-3 each timed once per shape against the best before it; the
    fastest serves (a kernel must be 3% faster to take a shape), and the message names it."""
    ran, times = [], {}

    def kernel(name):
        def attend(q, k, v):
            ran.append(name)
            return _reference(q, k, v)
        attend.kernel = name
        return attend

    monkeypatch.setattr(flash4, "covers", lambda q, k, v: True)
    monkeypatch.setattr(flash3, "covers", lambda q, k, v: True)
    monkeypatch.setattr(flash4, "attention", kernel("fa4"))
    monkeypatch.setattr(flash3, "attention", kernel("fa3"))
    monkeypatch.setattr(transformer, "_sdpa", kernel("sdpa"))
    monkeypatch.setattr(host_attention, "_may_time", lambda q: True)
    monkeypatch.setattr(host_attention, "call_ms", lambda fn, q, k, v: times[q.shape[1]][fn.kernel])
    cases = [(8, 0.8, 0.7, "fa3", "FlashAttention-3 (fa3-fwd)"),  # FA3 the fastest
             (9, 0.8, 0.9, "fa4", "FlashAttention-4 (flash-attn-4)"),  # FA4 the fastest
             (10, 0.8, 0.79, "fa4", "FlashAttention-4 (flash-attn-4)"),  # FA3 faster by less than the margin
             (11, 1.2, 0.9, "fa3", "FlashAttention-3 (fa3-fwd)"),  # FA4 slower than SDPA, FA3 faster
             (12, 1.2, 1.1, "sdpa", None)]  # SDPA the fastest: its backend named
    for tokens, fa4_ms, fa3_ms, serving, label in cases:
        times[tokens] = {"sdpa": 1.0, "fa4": fa4_ms, "fa3": fa3_ms}
        x = torch.randn(1, tokens, 2, 16)
        ran.clear()
        out = transformer.sdpa(x, x, x)
        assert ran[-1] == serving, (tokens, ran)
        assert torch.allclose(out, _reference(x, x, x).flatten(2))
        named = transformer.sdpa_label(x, x, x)
        assert named == label if label else "FlashAttention" not in named


@pytest.fixture()
def fp8_choice(monkeypatch):
    """fp8_attention with no choice made, nothing said, cuDNN's kernel and FlashAttention-3's stood in for by the
    emulation (cuDNN's writing e4m3, FlashAttention-3's bf16), and the times each takes set by the test; returns
    (the kernels' calls, times)."""
    calls, times = [], {"cudnn": 1.0, "fa3": 2.0}

    def cudnn(shape, device, out_dtype, quiet=False):
        def run(q8, k8, v8, dq, dk, dv, scale_o, out):
            calls.append(("cudnn", tuple(q8.shape)))
            out.copy_(fp8_attention.sdpa_fp8_ref(q8, k8, v8, dq, dk, dv, scale_o, out.dtype))
        return run

    def fa3(q8, k8, v8, dq, dk, dv, out):
        assert out.dtype == torch.bfloat16 and all(t.dtype == FP8 for t in (q8, k8, v8))
        calls.append(("fa3", tuple(q8.shape)))
        out.copy_(fp8_attention.sdpa_fp8_ref(q8, k8, v8, dq, dk, dv, torch.ones(1), out.dtype))

    monkeypatch.setattr(fp8_attention, "kernel", cudnn)
    monkeypatch.setattr(fp8_attention, "available", lambda device: (True, "emulated"))
    monkeypatch.setattr(flash3, "fp8_attention", fa3)
    monkeypatch.setattr(flash3, "takes", lambda device, head_dim: True)
    monkeypatch.setattr(fp8_attention, "_ms", lambda run, shape, device, out_dtype, quantize_output: times[
        "fa3" if run is fp8_attention._flash3 else "cudnn"])
    for name, value in (("_CHOSEN", {}), ("_SAID", set()), ("_ONE", {})):
        monkeypatch.setattr(fp8_attention, name, value)
    flash3.say.cache_clear()
    return calls, times


def test_fp8_attention_is_the_faster_of_cudnns_and_flashattention_3s(fp8_choice, caplog):
    """At a shape's first call each kernel is timed once (FlashAttention-3's with the quantization of its bf16 output
    where the output projections make fp8 products), the faster kept and said; a shape FlashAttention-3 takes with
    cuDNN missing is FlashAttention-3's untimed."""
    calls, times = fp8_choice
    cpu = torch.device("cpu")
    with caplog.at_level(logging.INFO, logger="sd-accel"):
        run, dtype = fp8_attention.choose((1, 64, 2, 128), cpu, FP8, torch.bfloat16, True, True)
        assert (run, dtype) != (fp8_attention._flash3, torch.bfloat16) and dtype == FP8
        times["fa3"] = 0.5
        assert fp8_attention.choose((1, 64, 2, 128), cpu, FP8, torch.bfloat16, True, True)[1] == FP8  # kept
        assert fp8_attention.choose((1, 96, 2, 128), cpu, FP8, torch.bfloat16, True, True) == \
            (fp8_attention._flash3, torch.bfloat16)
    said = [r.getMessage() for r in caplog.records]
    assert said[:2] == ["sd-accel: fp8 attention over 2 heads of 128 at 64 tokens runs cuDNN: 1.00 ms against 2.00 ms "
                        "for FlashAttention-3.",
                        "sd-accel: fp8 attention over 2 heads of 128 at 96 tokens runs FlashAttention-3: 0.50 ms "
                        "against 1.00 ms for cuDNN."]
    assert said[2:] == []  # that FlashAttention-3's fp8 kernel runs is said where it serves a block (below)
    # where FlashAttention-3 does not take the head size, cuDNN's kernel serves untimed
    assert fp8_attention.choose((1, 96, 2, 72), cpu, FP8, torch.bfloat16, False, True)[1] == FP8
    # blocks computing in float16: FlashAttention-3's kernel cannot write their output, cuDNN's serves untimed
    for out_dtype in (FP8, torch.float16):
        run, dtype = fp8_attention.choose((1, 160, 2, 128), cpu, out_dtype, torch.float16, True, out_dtype == FP8)
        assert run is not fp8_attention._flash3 and dtype == out_dtype
    # cuDNN missing: FlashAttention-3's, untimed
    fp8_attention.kernel = lambda shape, device, out_dtype, quiet=False: None
    times.clear()
    assert fp8_attention.choose((1, 128, 2, 128), cpu, FP8, torch.bfloat16, True, True) == \
        (fp8_attention._flash3, torch.bfloat16)


@needs_comfy
@pytest.mark.parametrize("name", ["tiny-flux", "tiny-sd3"])
@pytest.mark.fp8_products(DEVICE)
def test_fused_blocks_with_flashattention_3s_fp8_attention(comfy_pytorch_attention, fp8_choice, monkeypatch, name,
                                                            caplog):
    """Under precision fp8 with FlashAttention-3 chosen, every fused block's attention runs its fp8 kernel (SD3.5's
    head size too, where FlashAttention-4 alone would keep it 16-bit), its bf16 output handed on, said once: the
    model's output as close to the 16-bit attention's as with cuDNN's kernel."""
    calls, times = fp8_choice
    times["fa3"] = 0.5
    monkeypatch.setattr(flash4, "takes", lambda device, head_dim: True)
    model, inp = _dit_bf16(name), _bf16_inputs(name)
    with caplog.at_level(logging.INFO, logger="sd-accel"):
        eight, counts = _fused_output(model, inp, "fp8")
    assert counts["fp8"] > 0 and calls and {c[0] for c in calls} == {"fa3"}
    assert [r.getMessage() for r in caplog.records if "runs FlashAttention-3 (" in r.getMessage()] == \
        ["sd-accel: the fused transformer blocks' fp8 attention runs FlashAttention-3 (fa3-fwd)."]
    with monkeypatch.context() as m:
        m.setattr(fp8_attention, "wanted", lambda *args: False)
        sixteen, _ = _fused_output(model, inp, "fp8")
    times["fa3"] = 2.0
    fp8_attention._CHOSEN.clear()
    calls.clear()
    monkeypatch.setattr(flash4, "takes", lambda device, head_dim: False)
    cudnn, _ = _fused_output(model, inp, "fp8")
    assert {c[0] for c in calls} == {"cudnn"}
    assert 0 < rel(eight, sixteen) <= 5e-2
    assert rel(eight, sixteen) <= 1.5 * rel(cudnn, sixteen) + 1e-3


def test_a_missing_or_broken_package_is_said_in_words(monkeypatch, tmp_path):
    flash3._module.cache_clear()
    monkeypatch.setitem(sys.modules, "fa3_fwd_interface", None)
    try:
        assert flash3._module() == (None, "the fa3-fwd package is not installed (python install.py --with fa3-fwd "
                                          "installs it)")
        flash3._module.cache_clear()
        # a torch other than the one it was built for: its library fails to load
        (tmp_path / "fa3_fwd_interface.py").write_text(
            "raise ImportError('fa3_fwd/_C.abi3.so: undefined symbol: _ZN3c1017RegisterOperatorsD1Ev')\n")
        monkeypatch.delitem(sys.modules, "fa3_fwd_interface")
        monkeypatch.syspath_prepend(str(tmp_path))
        assert flash3._module() == (None, "the fa3-fwd package does not import (ImportError: fa3_fwd/_C.abi3.so: "
                                          "undefined symbol: _ZN3c1017RegisterOperatorsD1Ev); it needs torch 2.10 "
                                          "or later built for CUDA 13")
        assert not flash3.covers(*[torch.randn(1, 8, 2, 64, dtype=torch.bfloat16)] * 3)
    finally:
        flash3._module.cache_clear()
    assert flash3.available(torch.device("cpu")) == (False, "it runs on NVIDIA GPUs only")
    if torch.cuda.is_available():
        monkeypatch.setattr(flash3, "_capability", lambda device: (10, 0))
        assert flash3.available(torch.device("cuda")) == (
            False, "its kernels are for Hopper (compute capability 9.0); this GPU is 10.0")


def test_install_offers_it_only_where_it_imports():
    sys.path.insert(0, str(H.REPO))
    import install

    have = {"triton": True, "cudnn_frontend": True, "diffusers": True, "filelock": True}

    def plan(family="hopper", cuda=13, torch_version="2.11.0+cu130", system="Linux", extras=("fa3-fwd",)):
        return install.plan_installs("nvidia", system, have, set(extras), [], family, cuda, torch_version)

    assert [(s.packages, s.options) for s in plan().steps] == [(["fa3-fwd"], ["--no-deps"])]
    assert plan(extras=()).steps == [] and plan(extras=()).notes == []
    assert plan(torch_version="2.10.0").steps  # a build without a local version is taken at its word
    for refused, why in [
            (plan(cuda=12, torch_version="2.11.0+cu128"),
             "fa3-fwd needs torch 2.10 or later built for CUDA 13 (its library links them); this torch is "
             "2.11.0+cu128 built for CUDA 12; not installed."),
            (plan(torch_version="2.9.1+cu130"),
             "fa3-fwd needs torch 2.10 or later built for CUDA 13 (its library links them); this torch is "
             "2.9.1+cu130 built for CUDA 13; not installed."),
            (plan(family="blackwell"), "fa3-fwd runs on NVIDIA Hopper GPUs (H100, H200) under Linux only; not "
                                       "installed."),
            (plan(system="Windows"), "fa3-fwd runs on NVIDIA Hopper GPUs (H100, H200) under Linux only; not "
                                     "installed.")]:
        assert refused.steps == [] and refused.notes == [why]
    assert install.plan_installs("nvidia", "Linux", {**have, "fa3_fwd": True}, {"fa3-fwd"}, [], "hopper", 13,
                                 "2.11.0+cu130").steps == []


cuda_fa3 = pytest.mark.skipif(not torch.cuda.is_available() or not flash3.available(torch.device("cuda"))[0],
                              reason="needs a Hopper GPU and the fa3-fwd package")


@cuda_fa3
@pytest.mark.parametrize("shape", [(1, 4608, 24, 128), (2, 1000, 6, 64), (1, 333, 3, 256)])
def test_flashattention_3_against_float32(shape):
    """Both kernels against float32 attention: bf16 as close as PyTorch's bf16 attention, fp8 (bf16 output) as close
    as the emulation of fp8 attention; the fp8 kernel replays in a CUDA graph."""
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(shape, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(3))
    exact = _reference(q.float(), k.float(), v.float())
    assert flash3.covers(q, k, v)
    assert rel(flash3.attention(q, k, v), exact) <= 1.5 * rel(_reference(q, k, v), exact) + 1e-3
    from sd_accel.kernels import quant

    (q8, dq, _), (k8, dk, _), (v8, dv, _) = (quant.quantize_tensor_ref(t) for t in (q, k, v))
    out = torch.empty_like(q)
    flash3.fp8_attention(q8, k8, v8, dq, dk, dv, out)
    emulated = fp8_attention.sdpa_fp8_ref(q8, k8, v8, dq, dk, dv, torch.ones(1, device="cuda"), torch.bfloat16)
    assert rel(out, exact) <= 1.5 * rel(emulated, exact) + 1e-3
    graph, replayed = torch.cuda.CUDAGraph(), torch.empty_like(q)
    with torch.cuda.graph(graph):
        flash3.fp8_attention(q8, k8, v8, dq, dk, dv, replayed)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(replayed, out)
    assert flash3.runs(torch.device("cuda"))[0]

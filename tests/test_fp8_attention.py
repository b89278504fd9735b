"""fp8 attention in the fused DiT blocks (accel/engine/fp8_attention.py) on the CPU, cuDNN's kernel emulated in torch
(sdpa_fp8_ref): which blocks take it, what they hand the kernel and take from it, against ComfyUI's own forward with
an attention of the same quantization; the 16-bit attention and its one message where no kernel runs. On a GPU with
the nvidia-cudnn-frontend package, cuDNN's kernel itself against the emulation, in a CUDA graph too."""

from __future__ import annotations

import logging
import math

import pytest
import torch

import comfy_helpers as H
from sd_accel.accel.engine import fp8_attention
from sd_accel.accel.models import configs
from sd_accel.accel.models.dit import CanonicalDiT
from test_dit import DEVICE, _bf16_inputs, _dit_bf16, _fused_output, rel

FP8 = torch.float8_e4m3fn
pytestmark = pytest.mark.skipif(H.comfy_unavailable() is not None, reason=str(H.comfy_unavailable()))


@pytest.fixture(autouse=True)
def cudnn_only(monkeypatch):
    """cuDNN's kernel the only fp8 attention, as without the fa3-fwd package (tests/test_flash3.py has the choice
    between them)."""
    monkeypatch.setattr(fp8_attention.flash3, "takes", lambda device, head_dim: False)


@pytest.fixture()
def emulated(monkeypatch):
    """cuDNN's fp8 attention emulated in torch wherever it is asked for; returns the shapes it was called with."""
    calls = []

    def build(shape, device, out_dtype):
        def run(q8, k8, v8, descale_q, descale_k, descale_v, scale_o, out):
            assert all(t.dtype == FP8 and t.shape == shape and t.is_contiguous() for t in (q8, k8, v8))
            assert out.shape == shape and out.dtype == out_dtype
            assert all(t.numel() == 1 and t.dtype == torch.float32 for t in (descale_q, descale_k, descale_v, scale_o))
            calls.append(shape)
            out.copy_(fp8_attention.sdpa_fp8_ref(q8, k8, v8, descale_q, descale_k, descale_v, scale_o, out_dtype))
        return run

    monkeypatch.setattr(fp8_attention, "available", lambda device: (True, "emulated"))
    # the tiny models' head sizes would keep FlashAttention-4's 16-bit attention where it is installed
    monkeypatch.setattr(fp8_attention.flash4, "takes", lambda device, head_dim: False)
    monkeypatch.setattr(fp8_attention, "_build", build)
    monkeypatch.setattr(fp8_attention, "_KERNELS", {})
    monkeypatch.setattr(fp8_attention, "_SAID", set())
    return calls


def _tiny_flux_128(monkeypatch) -> None:
    """configs' "tiny-flux-128": tiny Flux with two heads of 128 channels (the head size of cuDNN's fp8 kernels)."""
    cfg = {**configs.COMFY_DIT_CONFIGS["tiny-flux"][1], "hidden_size": 256, "num_heads": 2, "axes_dim": [16, 56, 56]}
    monkeypatch.setitem(configs.COMFY_DIT_CONFIGS, "tiny-flux-128", ("flux", cfg))
    monkeypatch.setitem(configs.DIT_SHAPES, "tiny-flux-128", configs.DIT_SHAPES["tiny-flux"])


def quantized_attention(q, k, v, heads, mask=None, skip_reshape=False, skip_output_reshape=False, **kwargs):
    """ComfyUI's attention function with q, k and v quantized per tensor to e4m3 and the attention emulated as cuDNN
    runs it (output in e4m3, widened): the unfused reference of fp8 attention."""
    assert mask is None
    from sd_accel.kernels import quant

    if skip_reshape:
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    else:
        q, k, v = (t.reshape(t.shape[0], t.shape[1], heads, -1) for t in (q, k, v))
    (q8, dq, _), (k8, dk, _), (v8, dv, sv) = (quant.quantize_tensor_ref(t.contiguous()) for t in (q, k, v))
    o = (fp8_attention.sdpa_fp8_ref(q8, k8, v8, dq, dk, dv, sv).float() * dv).to(q.dtype)
    return o.transpose(1, 2) if skip_output_reshape else o.flatten(2)


@pytest.mark.parametrize("name,sequences", [("tiny-flux", 4), ("tiny-sd3", 3), ("tiny-chroma", 4),
                                            ("tiny-qwen-image", 2)])
@pytest.mark.fp8_products(DEVICE)
def test_fused_blocks_take_fp8_attention_under_precision_fp8(comfy_pytorch_attention, emulated, monkeypatch, name,
                                                             sequences):
    """Flux's double and single blocks, Chroma's, SD3.5's joint blocks and its MMDiT-X image-only attention,
    Qwen-Image's joint attention: each attention in fp8 under precision fp8,
    its inputs what the 16-bit path writes within e4m3's rounding, its output the 16-bit attention's within fp8
    attention's error, handed to the output projections as fp8 rows; the model's output close to the 16-bit
    attention's and to ComfyUI's own forward with an attention of the same quantization."""
    from sd_accel.accel.engine import fp8, fusions
    from sd_accel.accel.engine.fusions.transformer import EPS, Joint, sdpa
    from sd_accel.kernels import qk_rope

    model, inp = _dit_bf16(name), _bf16_inputs(name)
    plain, counts = _fused_output(model, inp, "auto")
    assert counts["fp8"] == 0 and not emulated  # 16-bit weights under auto: 16-bit
    # each sequence written in 16 bits too, from the same projections: what the 16-bit path would attend over
    shadows, compared, parts = {}, [], []
    write, attend, part = Joint.write, Joint.attend, fp8_attention.Output.part

    def shadowed_write(self, projected, offset, norm, eps=EPS, pe=None):
        write(self, projected, offset, norm, eps, pe)
        shadow = shadows.setdefault(self, qk_rope.empty_qkv(*self.qkv[2].shape, self.qkv[2]))
        qk_rope.qk_norm_rope(projected, self.heads, shadow, offset, *norm, eps, pe)

    def compared_attend(self):
        out = attend(self)
        (q8, k8, _), descales = self.qkv, self.eight.descales[:, 0]
        compared.append(([q8.float() * descales[0], k8.float() * descales[1], out.o.float() * out.descale],
                         [t.float() for t in shadows[self][:2]] + [sdpa(*shadows[self]).float()]))
        return out

    def recorded_part(self, start, stop, consumer, sample=None):
        rows, widened = part(self, start, stop, consumer, sample), part(self, start, stop, None, sample)
        parts.append(rows)
        assert torch.equal((rows.q.float() * rows.scale).to(rows.dtype).view(widened.shape), widened)
        return rows

    with monkeypatch.context() as m:
        m.setattr(Joint, "write", shadowed_write)
        m.setattr(Joint, "attend", compared_attend)
        m.setattr(fp8_attention.Output, "part", recorded_part)
        eight, _ = _fused_output(model, inp, "fp8")
    assert len(emulated) == len(compared) == sequences
    assert parts and all(isinstance(p, fp8.Rows) and p.q.dtype == FP8 for p in parts)
    for (q8, k8, o8), (q, k, o) in compared:
        for got, want in ((q8, q), (k8, k)):  # e4m3 rounds to nearest: half a step, 1/16 of the value
            assert ((got - want).abs() <= want.abs() * (1 / 16 + 2 ** -8) + want.abs().amax() * 2 ** -9).all()
        assert rel(o8, o) <= 6e-2

    with monkeypatch.context() as m:
        m.setattr(fp8_attention, "wanted", lambda *args: False)
        sixteen, _ = _fused_output(model, inp, "fp8")
    # fp8 attention moves the output less than the fp8 products already do
    assert 1e-4 < rel(eight, sixteen) <= rel(sixteen, plain)

    with monkeypatch.context() as m:
        H.put_comfy_attention(quantized_attention, m.setattr)
        marks = fusions.Undo()
        fp8.apply(model, "fp8", marks)
        try:
            with torch.no_grad():
                own = CanonicalDiT(model)(**inp)
        finally:
            marks()
    assert rel(eight, own) <= 2e-2


@pytest.mark.fp8_products(DEVICE)
def test_wans_self_attention_takes_fp8_attention_under_fp8(comfy_pytorch_attention, emulated):
    """Under precision fp8 Wan's self-attention runs in fp8 (one kernel call per block), close to the fp8 products'
    output with 16-bit attention; the cross-attention to the text stays ComfyUI's module."""
    model, inp = _dit_bf16("tiny-wan"), _bf16_inputs("tiny-wan")
    eight, counts = _fused_output(model, inp, "fp8")
    assert counts["fp8"] > 0 and len(emulated) == len(model.blocks)
    with torch.no_grad():
        own = CanonicalDiT(model)(**inp)
    assert 0 < rel(eight, own) <= 5e-2


@pytest.mark.fp8_products(DEVICE)
def test_ltx2s_self_attentions_take_fp8_attention_under_fp8(comfy_pytorch_attention, emulated, monkeypatch):
    """Under precision fp8 LTX-2's video and audio self-attentions run in fp8 (q and k written in e4m3 by the pass of
    its split rotary table), close to ComfyUI's own forward; its cross attentions stay 16-bit."""
    import comfy.supported_models

    if not hasattr(comfy.supported_models, "LTXAV"):
        pytest.skip(f"ComfyUI {H.comfy_version()} has no LTX-2 (supported_models.LTXAV, 0.33 and later)")
    model, inp = _dit_bf16("tiny-ltx2"), _bf16_inputs("tiny-ltx2")
    eight, counts = _fused_output(model, inp, "fp8")
    assert counts["fp8"] > 0 and len(emulated) == 2 * len(model.transformer_blocks)
    with monkeypatch.context() as m:
        m.setattr(fp8_attention, "wanted", lambda *args: False)
        sixteen, _ = _fused_output(model, inp, "fp8")
    with torch.no_grad():
        own = CanonicalDiT(model)(**inp)
    assert 0 < rel(eight, own) <= 5e-2 and 0 < rel(eight, sixteen) <= 5e-2


@pytest.mark.fp8_products(DEVICE)
def test_weights_stored_in_fp8_take_fp8_attention_under_auto(comfy_pytorch_attention, emulated):
    """ComfyUI's fp8_e4m3fn weight dtype: precision auto makes the projections fp8 products, and the attention
    follows; "16bit" keeps both 16-bit."""
    model = _dit_bf16("tiny-flux", dtype=torch.float8_e4m3fn)
    model.dtype = torch.bfloat16
    inp = _bf16_inputs("tiny-flux")
    with torch.no_grad():
        own = CanonicalDiT(model)(**inp)
    out, _ = _fused_output(model, inp, "auto")
    assert len(emulated) == 4 and rel(out, own) <= 5e-2
    emulated.clear()
    _fused_output(model, inp, "16bit")
    assert not emulated


@pytest.mark.fp8_products(DEVICE)
def test_where_no_kernel_runs_the_attention_is_16_bit_and_says_why_once(comfy_pytorch_attention, monkeypatch,
                                                                       caplog):
    """Where no kernel runs (here: said to be missing), the fused blocks under precision fp8 attend in 16 bits, exactly
    as without fp8 attention, and say why once."""
    monkeypatch.setattr(fp8_attention, "available", lambda device: (False, "no cuDNN here"))
    monkeypatch.setattr(fp8_attention, "_KERNELS", {})
    monkeypatch.setattr(fp8_attention, "_SAID", set())
    model, inp = _dit_bf16("tiny-flux"), _bf16_inputs("tiny-flux")
    with caplog.at_level(logging.WARNING, logger="sd-accel"):
        out, _ = _fused_output(model, inp, "fp8")
        again, _ = _fused_output(model, inp, "fp8")
    said = [r.getMessage() for r in caplog.records if "fp8 attention" in r.getMessage()]
    assert said == ["sd-accel: fp8 attention cannot run: no cuDNN here; the attention runs in 16 bits."]
    with monkeypatch.context() as m:
        m.setattr(fp8_attention, "wanted", lambda *args: False)
        sixteen, _ = _fused_output(model, inp, "fp8")
    assert torch.equal(out, sixteen) and torch.equal(again, sixteen)


@pytest.mark.fp8_products(DEVICE)
def test_with_flashattention_4_only_head_size_128_takes_fp8_attention(comfy_pytorch_attention, emulated, monkeypatch,
                                                                     caplog):
    """Where FlashAttention-4 is installed, SD3.5's head size (64) keeps the 16-bit attention under precision fp8,
    exactly as without fp8 attention, said once (unless cuDNN's kernel cannot run: that is said); a head size of 128
    (Flux's) still takes fp8 attention."""
    monkeypatch.setattr(fp8_attention.flash4, "takes", lambda device, head_dim: True)
    model, inp = _dit_bf16("tiny-sd3"), _bf16_inputs("tiny-sd3")
    with caplog.at_level(logging.INFO, logger="sd-accel"):
        out, counts = _fused_output(model, inp, "fp8")
        _fused_output(model, inp, "fp8")
    assert counts["fp8"] > 0 and not emulated
    said = [r.getMessage() for r in caplog.records if "fp8" in r.getMessage()]
    assert said == ["sd-accel: at head size 64 the attention stays 16-bit under fp8: FlashAttention-4 is installed, "
                    "and its 16-bit kernel was measured faster there than cuDNN's fp8 one."]
    with monkeypatch.context() as m:
        m.setattr(fp8_attention, "wanted", lambda *args: False)
        sixteen, _ = _fused_output(model, inp, "fp8")
    assert torch.equal(out, sixteen)

    # where cuDNN's kernel cannot run, that is what is said
    caplog.clear()
    with monkeypatch.context() as m, caplog.at_level(logging.INFO, logger="sd-accel"):
        m.setattr(fp8_attention, "available", lambda device: (False, "no cuDNN here"))
        m.setattr(fp8_attention, "_KERNELS", {})
        _fused_output(model, inp, "fp8")
    assert [r.getMessage() for r in caplog.records if "fp8" in r.getMessage()] == \
        ["sd-accel: fp8 attention cannot run: no cuDNN here; the attention runs in 16 bits."]

    _tiny_flux_128(monkeypatch)
    _fused_output(_dit_bf16("tiny-flux-128"), _bf16_inputs("tiny-flux-128"), "fp8")
    assert emulated and all(shape[3] == 128 for shape in emulated)


def test_a_missing_package_or_an_older_gpu_is_said_in_words(monkeypatch):
    try:
        import cudnn  # noqa: F401
    except ImportError:
        assert fp8_attention._cudnn() == (None, "the nvidia-cudnn-frontend package is not installed (python "
                                                "install.py installs it on Hopper and Blackwell GPUs)")
    if torch.cuda.is_available():
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 9))
        assert fp8_attention.available(torch.device("cuda")) == (
            False, "it needs Hopper or later (compute capability 9.0); this GPU is 8.9")
    assert fp8_attention.available(torch.device("cpu")) == (False, "it runs on NVIDIA GPUs only (cuDNN)")


def test_the_package_is_imported_once(monkeypatch):
    """A missing package is not searched for again at each fused block's call."""
    import builtins

    tries, real = [], builtins.__import__

    def counted(name, *args, **kwargs):
        if name == "cudnn":
            tries.append(name)
            raise ModuleNotFoundError("No module named 'cudnn'", name="cudnn")
        return real(name, *args, **kwargs)

    fp8_attention._cudnn.cache_clear()
    monkeypatch.setattr(builtins, "__import__", counted)
    try:
        assert fp8_attention._cudnn()[0] is None and fp8_attention._cudnn()[0] is None
        assert not fp8_attention.sixteen_bit_output(torch.device("cpu"))
    finally:
        monkeypatch.undo()
        fp8_attention._cudnn.cache_clear()
    assert tries == ["cudnn"]


def test_only_comfyuis_own_attention_and_fp8_projections_take_it(comfy_pytorch_attention, emulated, monkeypatch):
    """ComfyUI's PyTorch attention, or another of its own choices for the whole host (sub_quad here; sage, ...: timed
    against fp8 on the GPU, below), for the function the block calls (Qwen-Image's optimized_attention_masked) take
    it; a function of another node's in its place, a stand-in other than sequence parallelism's exchange (or the
    exchange standing in for another attention than ComfyUI's PyTorch one), projections without fp8 products, 32-bit
    activations or a stream without q/k norm (SD3.0): the 16-bit attention."""
    import comfy.ldm.flux.math as flux_math
    import comfy.ldm.modules.attention as attention
    import comfy.ldm.qwen_image.model as qwen
    from sd_accel.accel.engine import fp8
    from sd_accel.accel.engine.attention import StandIn
    from sd_accel.accel.engine.fusions import Undo

    module, name = "comfy.ldm.flux.math", "optimized_attention"
    layer = torch.nn.Linear(16, 48).to(torch.bfloat16)
    x = torch.zeros(1, 4, 16, dtype=torch.bfloat16)
    assert not fp8_attention.wanted(module, name, x, layer)
    undo = Undo()  # the mark fp8.apply gives a projection it takes
    fp8._MARKED[layer] = fp8.Copies()
    undo.add(lambda: fp8._MARKED.pop(layer, None))
    try:
        assert fp8_attention.wanted(module, name, x, layer)
        assert not fp8_attention.wanted(module, name, x.float(), layer)
        norms = [(torch.ones(4), torch.ones(4))]
        assert fp8_attention.sequence(module, name, 1, 4, 4, 4, x, (layer,), norms, (layer,)) is not None
        assert fp8_attention.sequence(module, name, 1, 4, 4, 4, x, (layer,), [(None, None)], (layer,)) is None
        masked = (qwen.__name__, "optimized_attention_masked")
        assert fp8_attention.wanted(*masked, x, layer)
        monkeypatch.setattr(qwen, "optimized_attention_masked", attention.attention_sub_quad)
        assert fp8_attention.wanted(*masked, x, layer) and fp8_attention.wanted(module, name, x, layer)
        monkeypatch.setattr(flux_math, "optimized_attention", attention.attention_sub_quad)
        assert fp8_attention.wanted(module, name, x, layer)

        def nodes_own(q, k, v, heads, **kwargs):  # another node's function in ComfyUI's place
            return attention.attention_pytorch(q, k, v, heads, **kwargs)

        monkeypatch.setattr(flux_math, "optimized_attention", nodes_own)
        assert not fp8_attention.wanted(module, name, x, layer)
        monkeypatch.setattr(flux_math, "optimized_attention",
                            StandIn(attention.attention_pytorch, attention.attention_pytorch, lambda *a: None))
        assert not fp8_attention.wanted(module, name, x, layer)
        # sequence parallelism's exchange, standing in for ComfyUI's PyTorch attention: fp8 attention goes through it
        # (tests/test_parallel_fp8_attention.py); standing in for another, not
        for host, takes in ((attention.attention_pytorch, True), (attention.attention_sub_quad, False)):
            monkeypatch.setattr(flux_math, "optimized_attention", StandIn(host, host, lambda *a: None, eight=object()))
            assert fp8_attention.wanted(module, name, x, layer) == takes
    finally:
        undo()


@pytest.mark.fp8_products(DEVICE)
def test_under_another_comfyui_attention_choice_fp8_attention_serves_where_faster(emulated, monkeypatch, caplog):
    """ComfyUI's attention for the whole host is another of its own than PyTorch's (sage on a GPU; sub_quad here):
    where nothing is timed (the CPU) fp8 attention serves, the output the one under PyTorch's choice; timed (a faked
    clock here, each function still called), fp8 attention serves where faster, with the same output; where the host's
    function is faster the 16-bit path serves, the output that path's under the same host. Each said once."""
    import itertools

    from sd_accel.accel.engine import host_attention

    model, inp = _dit_bf16("tiny-wan"), _bf16_inputs("tiny-wan")
    tokens = emulated_tokens(model, inp)

    def fresh():
        for name, empty in (("_CHOICES", {}), ("_SAID", set())):
            monkeypatch.setattr(host_attention, name, empty)
        monkeypatch.setattr(fp8_attention, "_AHEAD", {})
        monkeypatch.setattr(fp8_attention, "_SAID", set())
        emulated.clear()
        caplog.clear()

    def fp8_lines():
        return [r.getMessage() for r in caplog.records if "fp8 attention" in r.getMessage()]

    def clock(ours_ms, host_ms, m):
        """host_attention times ours, then the host's (_timed): each function runs once, then the scripted time."""
        times = itertools.cycle([ours_ms, host_ms])

        def call_ms(fn, q, k, v):
            fn(q, k, v)
            return next(times)

        m.setattr(host_attention, "_may_time", lambda q: True)
        m.setattr(host_attention, "call_ms", call_ms)

    with monkeypatch.context() as m:
        H.use_comfy_attention("pytorch", m.setattr)
        under_pytorch, _ = _fused_output(model, inp, "fp8")
    assert len(emulated) == len(model.blocks)
    with monkeypatch.context() as m, caplog.at_level(logging.WARNING, logger="sd-accel"):
        sub_quad = H.use_comfy_attention("sub_quad", m.setattr)
        fresh()
        untimed, _ = _fused_output(model, inp, "fp8")
        assert len(emulated) == len(model.blocks) and torch.equal(untimed, under_pytorch)
        assert fp8_lines() == ["sd-accel: ComfyUI's attention is sub_quad; on the cpu nothing is timed: the fused "
                               "blocks run fp8 attention (cuDNN)."]
        fresh()
        clock(0.5, 1.0, m)
        faster, _ = _fused_output(model, inp, "fp8")  # the kernel's calls: the timing's, then one a block
        assert len(emulated) == 1 + len(model.blocks) and torch.equal(faster, under_pytorch)
        assert fp8_lines() == ["sd-accel: ComfyUI's attention is sub_quad; the fused blocks run fp8 attention (cuDNN): "
                               f"0.50 ms against 1.00 ms for sub_quad at {tokens} tokens."]
        fresh()
        clock(1.0, 0.5, m)
        sub_quad.clear()
        slower, _ = _fused_output(model, inp, "fp8")
        assert len(emulated) == 1 and sub_quad  # fp8 attention timed alone; the host's function timed and serving
        assert fp8_lines() == ["sd-accel: ComfyUI's attention is sub_quad: sub_quad 0.50 ms against 1.00 ms for fp8 "
                               f"attention (cuDNN) at {tokens} tokens; the fused blocks' attention stays 16-bit there."]
        fresh()
        m.setattr(fp8_attention, "wanted", lambda *args: False)
        sixteen, _ = _fused_output(model, inp, "fp8")
        assert torch.equal(slower, sixteen)


def emulated_tokens(model, inp) -> int:
    """The image tokens of tiny-wan's input: its self-attention's sequence length."""
    x = inp["x"]
    return x.shape[2] * (x.shape[3] // model.patch_size[1]) * (x.shape[4] // model.patch_size[2])


def test_the_outputs_scales_are_made_once(emulated, monkeypatch):
    """A 16-bit output (Blackwell's) is scaled by one tensor of ones made with the kernel, not one per call; an e4m3
    output's row descales are made once for all its consumers, each part taking its rows' share."""
    from sd_accel.accel.engine import fp8
    from sd_accel.kernels import qk_rope

    like = torch.zeros(2, 6, 16, dtype=torch.bfloat16, device=DEVICE)
    g = torch.Generator().manual_seed(0)
    scales_o = []

    def sequence(out_dtype):
        kernel = fp8_attention.kernel((2, 6, 2, 8), like.device, out_dtype)

        def run(*args):
            scales_o.append(args[6])
            kernel(*args)

        q8, k8, v = qk_rope.empty_qkv(2, 6, 2, 8, like, qk_fp8=True)
        q8.zero_()
        k8.zero_()
        v.copy_(torch.randn(v.shape, generator=g))
        ones = torch.ones(8, device=DEVICE)
        return fp8_attention.Sequence((q8, k8, v), qk_rope.qk_descales([ones], [ones]),
                                      v.float().abs().amax().reshape(1), run, out_dtype)

    sixteen = [sequence(torch.bfloat16).attend() for _ in range(2)]
    assert scales_o[0] is scales_o[1] and torch.equal(scales_o[0], torch.ones(1, device=DEVICE))
    assert all(torch.equal(o.part(0, 3, None), o.o[:, :3]) and o.o.dtype == torch.bfloat16 for o in sixteen)

    out = sequence(FP8).attend()
    layer = torch.nn.Linear(16, 16)
    monkeypatch.setitem(fp8._MARKED, layer, fp8.Copies())
    parts = [out.part(0, 4, layer), out.part(4, None, layer)]
    for p, tokens in zip(parts, (4, 2)):
        assert p.scale.shape == (2 * tokens, 1) and p.scale.is_contiguous() and (p.scale == out.descale).all()
        assert p.scale.data_ptr() == parts[0].scale.data_ptr()


def test_the_emulation_is_attention_within_fp8s_error():
    """sdpa_fp8_ref, the stand-in for cuDNN in these tests and the bench's check, against float32 attention."""
    from sd_accel.kernels import quant

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 64, 3, 32, generator=g) for _ in range(3))
    (q8, dq, _), (k8, dk, _), (v8, dv, sv) = (quant.quantize_tensor_ref(t) for t in (q, k, v))
    want = torch.nn.functional.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v))).transpose(1, 2)
    o8 = fp8_attention.sdpa_fp8_ref(q8, k8, v8, dq, dk, dv, sv)
    assert o8.dtype == FP8 and o8.shape == q.shape
    assert 1e-3 < rel(o8.float() * dv, want) < 6e-2
    # a 16-bit output (Blackwell's) keeps the error of the inputs' and the probabilities' rounding only
    o16 = fp8_attention.sdpa_fp8_ref(q8, k8, v8, dq, dk, dv, torch.ones(1), torch.bfloat16)
    assert rel(o16, want) < rel(o8.float() * dv, want)


# ---- on a GPU with the nvidia-cudnn-frontend package: cuDNN's kernel itself

def _cudnn_runs() -> bool:
    return torch.cuda.is_available() and fp8_attention.available(torch.device("cuda"))[0]


cuda_fp8 = pytest.mark.skipif(not _cudnn_runs(), reason="needs an NVIDIA Hopper or later GPU and nvidia-cudnn-frontend")


@cuda_fp8
@pytest.mark.parametrize("shape", [(1, 333, 3, 128), (2, 4429 // 8, 4, 64)])
def test_cudnn_fp8_attention_is_the_emulation(shape):
    """cuDNN's fp8 attention against sdpa_fp8_ref on the same e4m3 inputs, launched and replayed in a CUDA graph (as
    the engine runs it), with the inputs' quantization kernels."""
    from sd_accel.kernels import quant

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    q, k, v = (torch.randn(shape, generator=g, device=dev, dtype=torch.bfloat16) for _ in range(3))
    v[..., :2] *= 8  # outliers: v's scale follows its amax
    (q8, dq, _), (k8, dk, _) = (quant.quantize_tensor(t, t.float().abs().amax().reshape(1)) for t in (q, k))
    run = fp8_attention.kernel(shape, dev, FP8)
    assert run is not None

    def attend():
        v8, dv, sv = quant.quantize_tensor(v, v.float().abs().amax().reshape(1))
        out = torch.empty(shape, device=dev, dtype=FP8)
        run(q8, k8, v8, dq, dk, dv, sv, out)
        return out, v8, dv, sv

    out, v8, dv, sv = attend()
    want = fp8_attention.sdpa_fp8_ref(q8, k8, v8, dq, dk, dv, sv)
    exact = torch.nn.functional.scaled_dot_product_attention(
        *(t.float().transpose(1, 2) for t in (q, k, v))).transpose(1, 2)
    assert rel(out.float(), want.float()) < 3e-2
    assert rel(out.float() * dv, exact) < 8e-2
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        attend()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = attend()
    v.mul_(0.5)  # the replay reads the new values, and v's scale follows them on the device
    graph.replay()
    torch.cuda.synchronize()
    replayed, v8, dv, sv = captured
    want = fp8_attention.sdpa_fp8_ref(q8, k8, v8, dq, dk, dv, sv)
    assert rel(replayed.float(), want.float()) < 3e-2


@cuda_fp8
def test_a_fused_flux_takes_cudnns_fp8_attention_on_the_gpu(comfy_pytorch_attention, monkeypatch):
    """A small Flux of head size 128 (cuDNN's) under precision fp8: every attention through cuDNN, the output close
    to the 16-bit attention's."""
    _tiny_flux_128(monkeypatch)
    model, inp = _dit_bf16("tiny-flux-128"), _bf16_inputs("tiny-flux-128")
    built = []
    build = fp8_attention._build
    monkeypatch.setattr(fp8_attention, "_build", lambda *a: built.append(a) or build(*a))
    monkeypatch.setattr(fp8_attention, "_KERNELS", {})
    eight, _ = _fused_output(model, inp, "fp8")
    assert built and all(shape[3] == 128 for shape, _, _ in built)
    with monkeypatch.context() as m:
        m.setattr(fp8_attention, "wanted", lambda *args: False)
        sixteen, _ = _fused_output(model, inp, "fp8")
    assert 1e-4 < rel(eight, sixteen) <= 2e-2 and math.isfinite(eight.float().sum().item())

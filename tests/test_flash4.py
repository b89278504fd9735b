"""FlashAttention-4 in the fused DiT blocks (accel/engine/flash4.py). On the CPU the kernel is stood in for by
PyTorch's attention in the same (B, L, heads, head_dim) layout: every fused block's own attention goes through it and
the output stays the fused output; nothing else does. On a Hopper or Blackwell GPU with the flash-attn-4 package,
the kernel itself against float32 attention, and a fused transformer with it against the fused one without it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import comfy_helpers as H
from sd_accel.accel.engine import flash4, fusions
from sd_accel.accel.engine.fusions import transformer
from sd_accel.accel.models import configs
from sd_accel.accel.models.dit import CanonicalDiT
from sd_accel.accel.plan.device import has_package, has_subpackage
from test_dit import DEVICE, FUSED_TOL, rel


def _reference(q, k, v):
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)


@pytest.fixture()
def stand_in(monkeypatch):
    """flash4 serving every call, run by PyTorch's attention; returns the (q, k, v) shapes it was called with."""
    calls = []

    def attention(q, k, v):
        assert q.dim() == 4 and q.shape[0] == k.shape[0] and q.shape[2:] == k.shape[2:] == v.shape[2:]
        calls.append(tuple(q.shape))
        return _reference(q, k, v)

    monkeypatch.setattr(flash4, "serves", lambda q, k, v, sdpa: True)
    monkeypatch.setattr(flash4, "attention", attention)
    return calls


def test_flash_attention_4_serves_a_shape_only_where_it_was_timed_faster(host_attention, monkeypatch):
    """Timed once per shape against PyTorch's attention (where a time can be taken), the faster kept."""
    timed = []

    def fake_timed(q, k, v, ours, theirs):
        timed.append(tuple(q.shape))
        return host_attention.Choice(host=q.shape[1] > 32, ours_ms=1.0, host_ms=2.0 if q.shape[1] <= 32 else 0.5)

    monkeypatch.setattr(flash4, "covers", lambda q, k, v: True)
    monkeypatch.setattr(host_attention, "_may_time", lambda q: True)
    monkeypatch.setattr(host_attention, "_timed", fake_timed)
    short, long = torch.randn(1, 16, 2, 8), torch.randn(1, 64, 2, 8)
    assert [flash4.serves(t, t, t, _reference) for t in (short, long, short, long)] == [False, True, False, True]
    assert timed == [(1, 16, 2, 8), (1, 64, 2, 8)]
    monkeypatch.setattr(host_attention, "_may_time", lambda q: False)  # the CPU: nothing timed, PyTorch's serves
    assert not flash4.serves(torch.randn(1, 8, 2, 8), *[torch.randn(1, 8, 2, 8)] * 2, _reference)


# calls: one per block's own attention (SD3's first block has a second one over the image tokens alone; Wan's blocks
# a second one, their text cross-attention)
@pytest.mark.parametrize("form,name,heads,calls", [("comfy", "tiny-flux", 4, 4), ("comfy", "tiny-sd3", 2, 3),
                                                   ("comfy", "tiny-wan", 4, 4), ("comfy", "tiny-qwen-image", 4, 2),
                                                   ("diffusers", "tiny-flux", 4, 4), ("diffusers", "tiny-sd3", 2, 3)])
def test_fused_blocks_run_their_attention_through_flash_attention_4(request, stand_in, form, name, heads, calls):
    pytest.importorskip("triton")
    if form == "comfy":
        request.getfixturevalue("comfy_pytorch_attention")
    else:
        pytest.importorskip("diffusers")
    model = configs.build_dit(name, form, comfyui_root=H.comfy_root(), device=DEVICE)
    inp = configs.dit_example_inputs(name, batch=2, latent=(8, 10), device=DEVICE)
    canon = CanonicalDiT(model)
    with torch.no_grad():
        ref = canon(**inp)
        undo, counts = fusions.apply(model)
        try:
            out = canon(**inp)
        finally:
            undo()
    assert sum(counts.values()) > 0 and len(stand_in) == calls
    assert all(shape[0] == 2 and shape[2] == heads for shape in stand_in)
    assert rel(out, ref) <= FUSED_TOL


def test_without_the_package_or_a_gpu_pytorch_attention_runs():
    q = torch.randn(1, 16, 2, 8)
    assert not flash4.covers(q, q, q)
    assert flash4.available(torch.device("cpu")) == (False, "it runs on NVIDIA GPUs only")
    assert torch.allclose(transformer.sdpa(q, q, q), _reference(q, q, q).reshape(1, 16, 16))


def test_flash_attention_4_alone_leaves_no_flash_attention_2_behind(tmp_path, monkeypatch):
    """flash-attn-4 installs flash_attn/cute/ without flash_attn/__init__.py: FlashAttention-2 (the UNets'
    flash_attn option) is not there, FlashAttention-4 is. (A made-up name: flash_attn itself may be installed.)"""
    package = "sd_accel_test_fa"
    (tmp_path / package / "cute").mkdir(parents=True)
    (tmp_path / package / "cute" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert not has_package(package) and has_subpackage(package, "cute") and not has_subpackage(package, "other")
    (tmp_path / package / "__init__.py").write_text("")
    assert has_package(package)


cuda_fa4 = pytest.mark.skipif(not torch.cuda.is_available() or not flash4.available(torch.device("cuda"))[0],
                              reason="needs a Hopper or Blackwell GPU and the flash-attn-4 package")


@cuda_fa4
@pytest.mark.parametrize("shape", [(1, 4608, 24, 128), (2, 1000, 6, 64), (1, 333, 3, 256)])
def test_flash_attention_4_against_float32(shape):
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(shape, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(3))
    if shape[-1] > 128 and torch.cuda.get_device_capability()[0] != 9:
        assert not flash4.covers(q, k, v)
        return
    assert flash4.covers(q, k, v)
    exact = _reference(q.float(), k.float(), v.float())
    assert rel(flash4.attention(q, k, v), exact) <= 1e-2
    assert rel(flash4.attention(q, k, v), exact) <= 1.5 * rel(_reference(q, k, v), exact) + 1e-3


@cuda_fa4
def test_a_fused_transformer_with_flash_attention_4_matches_it_without(comfy_pytorch_attention, monkeypatch):
    model = configs.build_dit("tiny-flux", "comfy", comfyui_root=H.comfy_root(), device="cuda", dtype=torch.bfloat16)
    inp = configs.dit_example_inputs("tiny-flux", batch=2, latent=(16, 16), device="cuda")
    inp = {k: v.to(torch.bfloat16) if k in ("x", "context", "y") else v for k, v in inp.items()}
    canon = CanonicalDiT(model)
    undo, _ = fusions.apply(model)
    try:
        with torch.no_grad():
            with_fa4 = canon(**inp)
            monkeypatch.setattr(flash4, "covers", lambda q, k, v: False)
            without = canon(**inp)
    finally:
        undo()
    assert rel(with_fa4, without) <= 2e-2

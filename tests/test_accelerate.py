"""The user-facing entry point: the right path, the same images, and clear words instead of crashes."""

from __future__ import annotations

import logging

import pytest
import torch

from sd_accel.accel.accelerate import AcceleratedUNet, accelerate
from sd_accel.accel.models.configs import build_unet, example_inputs
from sd_accel.accel.plan.device import GpuInfo
from sd_accel.accel.errors import BackendUnavailable, BadInput, UnsupportedModel
from sd_accel.accel.models.spec import CanonicalUNet


@pytest.fixture(scope="module")
def tiny():
    unet = CanonicalUNet(build_unet("tiny-sd15", seed=11))
    return unet, example_inputs(unet.unet, latent=16, seed=12)


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def test_cpu_gets_torch_path_and_same_output(tiny):
    unet, (x, t, ctx, y) = tiny
    acc = accelerate(unet, preference="auto")
    assert acc.backend == "torch" and not acc.plan.torch.triton_kernels  # the CPU's own plan: plain torch
    assert rel(acc(x, t, ctx, y), unet(x, t, ctx, y)) <= 1e-5
    assert any("torch path" in r for r in acc.plan.reasons)
    acc.release()


def test_fused_kernels_asked_for_on_the_cpu_give_the_same_output(tiny):
    """Triton's interpreter (tests/conftest.py) runs the fused kernels on the CPU: the whole entry point, with the
    kernels a GPU would run, against the plain UNet."""
    unet, (x, t, ctx, y) = tiny
    ref = unet(x, t, ctx, y)
    acc = accelerate(unet, preference="torch", options={"triton_kernels": True})
    counts = acc.engine.fusion_counts
    assert all(counts.get(k) for k in ("groupnorm", "geglu", "resnet", "qkv", "skip_layernorm")), counts
    assert rel(acc(x, t, ctx, y), ref) <= 1e-5
    acc.release()
    assert torch.equal(unet(x, t, ctx, y), ref)


def test_latent_not_multiple_of_8_runs_plain_and_says_why(tiny, caplog):
    unet, (_, t, ctx, y) = tiny
    x = torch.randn(2, 4, 12, 20)
    acc = accelerate(unet)
    with caplog.at_level(logging.WARNING, logger="sd-accel"):
        out = acc(x, t, ctx, y)
        acc(x, t, ctx, y)
    assert torch.equal(out, unet(x, t, ctx, y))
    said = [r.message for r in caplog.records if "multiple of 8" in r.message]
    assert len(said) == 1 and "multiples of 64" in said[0]
    assert "width x height 20x12" in said[0] and "image 160x96 px" in said[0]  # as ComfyUI's nodes give sizes


def test_not_a_unet_is_refused_with_what_to_do():
    with pytest.raises(UnsupportedModel, match="not a supported UNet.*SD1.x, SD2.x or SDXL"):
        accelerate(torch.nn.Linear(4, 4))


def test_wrong_latent_channels_named(tiny):
    unet, (_, t, ctx, y) = tiny
    with pytest.raises(BadInput, match=r"takes \(batch, 4, height, width\)"):
        accelerate(unet)(torch.randn(2, 3, 16, 16), t, ctx, y)


def test_missing_backend_falls_back_to_torch_with_install_hint(tiny, monkeypatch):
    import sd_accel.accel.plan.policy

    unet, (x, t, ctx, y) = tiny
    monkeypatch.setattr(sd_accel.accel.plan.policy, "probe_packages", lambda: {"onnxruntime": False})
    acc = accelerate(unet, preference="onnxruntime")
    assert acc.backend == "torch"
    assert any("onnxruntime was asked for" in r and "pip install onnxruntime" in r for r in acc.plan.reasons)
    assert rel(acc(x, t, ctx, y), unet(x, t, ctx, y)) <= 1e-5


def test_off_runs_the_plain_model(tiny, monkeypatch):
    unet, (x, t, ctx, y) = tiny
    monkeypatch.setenv("SD_ACCEL_BACKEND", "off")
    acc = accelerate(unet)
    assert acc.backend == "off"
    assert torch.equal(acc(x, t, ctx, y), unet(x, t, ctx, y))


def test_bad_preference_lists_the_choices(tiny):
    with pytest.raises(BadInput, match="auto.*torch.*onnxruntime.*off"):
        accelerate(tiny[0], preference="fastest")


def test_dtype_the_gpu_cannot_run_uses_plain_model(tiny, caplog):
    unet, (x, t, ctx, y) = tiny
    fp32_only = GpuInfo("cpu", "cpu", dtypes=("float32",))
    bf16 = CanonicalUNet(build_unet("tiny-sd15", seed=11, dtype=torch.bfloat16))
    with caplog.at_level(logging.WARNING, logger="sd-accel"):
        acc = accelerate(bf16, gpu=fp32_only)
    assert acc.backend == "off"
    assert any("bfloat16" in r.message and "float32" in r.message for r in caplog.records)


class _Refusing:
    backend = "onnxruntime"

    def __call__(self, *args, **kwargs):
        raise BackendUnavailable("this engine was exported without ControlNet inputs.")

    def release(self):
        pass


def test_call_an_engine_cannot_serve_goes_to_torch_once(tiny, caplog):
    from sd_accel.accel.engine.backends import torch_fused
    from sd_accel.accel.plan.policy import choose

    unet, (x, t, ctx, y) = tiny
    gpu = GpuInfo("cpu", "cpu")
    acc = AcceleratedUNet(unet, choose(gpu, "torch"), gpu, _Refusing(), torch_fused.build(unet))
    with caplog.at_level(logging.WARNING, logger="sd-accel"):
        out = acc(x, t, ctx, y)
        acc(x, t, ctx, y)
    assert rel(out, unet(x, t, ctx, y)) <= 1e-5
    assert sum("ControlNet" in r.message for r in caplog.records) == 1

"""The fusions put the Triton kernels into diffusers and ldm UNets without changing what they compute, and
undo leaves the modules exactly as they were (the same parameter names, the same forward)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from accel import fusions
from accel.configs import build_unet, example_inputs
from accel.unet import CanonicalUNet
from kernels import groupnorm
from ldm_unet import tiny_ldm_unet

pytestmark = pytest.mark.skipif(not groupnorm.supported(torch.zeros(1)) and not torch.cuda.is_available(),
                                reason="Triton kernels cannot run here (no GPU and no TRITON_INTERPRET=1)")


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def _models():
    diff = CanonicalUNet(build_unet("tiny-sd15", seed=21))
    x, t, ctx, _ = example_inputs(diff.unet, latent=16, seed=22)
    yield "diffusers", diff, (x, t, ctx, None)
    ldm = CanonicalUNet(tiny_ldm_unet(seed=23))
    yield "ldm", ldm, (x, t, torch.randn(2, 77, ldm.spec.context_dim), None)


@pytest.mark.parametrize("form", ["diffusers", "ldm"])
def test_fused_unet_same_function_and_undo_restores(form):
    _, unet, (x, t, ctx, y) = next(m for m in _models() if m[0] == form)
    x = x.contiguous(memory_format=torch.channels_last)
    keys = list(unet.unet.state_dict())
    kinds = [type(m) for m in unet.unet.modules()]
    ref = unet(x, t, ctx, y)
    undo, counts = fusions.apply(unet.unet, ["layout", "groupnorm", "geglu"])
    n_norms = sum(isinstance(m, nn.GroupNorm) for m in unet.unet.modules())
    n_geglu = sum(type(m).__name__ == "GEGLU" for m in unet.unet.modules())
    n_transformers = sum(type(m).__name__ == "Transformer2DModel" for m in unet.unet.modules())
    assert counts == {"layout": n_transformers, "groupnorm": n_norms, "geglu": n_geglu} and n_geglu > 0
    assert list(unet.unet.state_dict()) == keys  # LoRA keys still address the same tensors
    assert rel(unet(x, t, ctx, y), ref) <= 1e-5
    undo()
    assert not any(set(vars(m)) & {"forward", "_get_output_for_continuous_inputs"} for m in unet.unet.modules())
    assert [type(m) for m in unet.unet.modules()] == kinds
    assert torch.equal(unet(x, t, ctx, y), ref)


def test_time_embedding_keeps_its_silu():
    """diffusers shares one SiLU between the norms and the time embedding: only the norms' use is fused."""
    unet = CanonicalUNet(build_unet("tiny-sd15", seed=24))
    x, t, ctx, _ = example_inputs(unet.unet, latent=16, seed=25)
    t2 = torch.tensor([10.0, 990.0])
    ref = unet(x, t, ctx) - unet(x, t2, ctx)
    undo, _ = fusions.apply(unet.unet, ["groupnorm"])
    assert rel(unet(x, t, ctx) - unet(x, t2, ctx), ref) <= 1e-4
    undo()


def test_kernels_load_when_another_package_owns_the_name(monkeypatch):
    """Hugging Face's `kernels` package can shadow ours inside ComfyUI; the fusions must still find ours."""
    import sys
    import types

    from accel.fusions.base import kernel_module

    monkeypatch.setitem(sys.modules, "kernels", types.ModuleType("kernels"))
    gn = kernel_module("groupnorm")
    assert hasattr(gn, "group_norm") and gn.__name__ != "kernels.groupnorm"

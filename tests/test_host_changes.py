"""A ComfyUI whose classes have changed (an attribute a fusion reads renamed, a forward taking another parameter) keeps
its own forward: every fusion that restates a ComfyUI class declines such a class with one console line naming it and
ComfyUI's version, and the model computes exactly what it computes unfused. Inside the real ComfyUI, on the CPU (Triton's
interpreter)."""

from __future__ import annotations

import functools
import inspect
import logging
from typing import Callable

import pytest
import torch
from torch import nn

import comfy_helpers as H

pytestmark = pytest.mark.skipif(H.comfy_unavailable() is not None, reason=H.comfy_unavailable() or "")

RENAMED = "_renamed_by_the_host"


def _move(m: nn.Module, old: str, new: str) -> None:
    for store in (m._modules, m._parameters, m._buffers, m.__dict__):
        if old in store:
            store[new] = store.pop(old)
            return
    raise AssertionError(f"{type(m).__name__} has no {old}")


def _renamed(cls: type, attr: str) -> type:
    """cls as a host that keeps `attr` under another name: outside its forward the block has no `attr`; its forward
    (the same signature) computes what cls's does."""
    own = cls.forward

    @functools.wraps(own)
    def forward(self, *args, **kwargs):
        _move(self, attr + RENAMED, attr)
        try:
            return own(self, *args, **kwargs)
        finally:
            _move(self, attr, attr + RENAMED)

    return type(cls.__name__, (cls,), {"__module__": cls.__module__, "__qualname__": cls.__qualname__,
                                       "forward": forward})


def _one_more_parameter(cls: type) -> type:
    """cls as a host whose forward takes one more (keyword) parameter and otherwise computes what cls's does."""
    own = cls.forward

    def forward(self, *args, new_option=None, **kwargs):
        return own(self, *args, **kwargs)

    params = list(inspect.signature(own).parameters.values())
    extra = inspect.Parameter("new_option", inspect.Parameter.KEYWORD_ONLY, default=None)
    at = next((i for i, p in enumerate(params) if p.kind is inspect.Parameter.VAR_KEYWORD), len(params))
    forward.__signature__ = inspect.Signature([*params[:at], extra, *params[at:]])
    return type(cls.__name__, (cls,), {"__module__": cls.__module__, "__qualname__": cls.__qualname__,
                                       "forward": forward})


def _unet() -> tuple[nn.Module, Callable[[], torch.Tensor]]:
    model = H.tiny_model(seed=3).model.diffusion_model
    g = torch.Generator().manual_seed(4)
    x = torch.randn(1, 4, 16, 16, generator=g).contiguous(memory_format=torch.channels_last)
    t, ctx = torch.tensor([500.0]), torch.randn(1, 77, 768, generator=g)
    return model, lambda: model(x, timesteps=t, context=ctx)


def _dit(name: str) -> Callable[[], tuple[nn.Module, Callable[[], torch.Tensor]]]:
    def build():
        from sd_accel.accel.models import configs
        from sd_accel.accel.models.dit import CanonicalDiT

        model = configs.build_dit(name, "comfy", comfyui_root=H.comfy_root(), device="cpu")
        inp = configs.dit_example_inputs(name, batch=1, latent=(8, 10), device="cpu")
        canon = CanonicalDiT(model)
        return model, lambda: canon(**inp)
    return build


def _flux2() -> tuple[nn.Module, Callable[[], torch.Tensor]]:
    import comfy.ldm.flux.model

    if "global_modulation" not in comfy.ldm.flux.model.FluxParams.__dataclass_fields__:
        pytest.skip(f"ComfyUI {H.comfy_version()}'s Flux class has no Flux.2 form")
    return _dit("tiny-flux2")()


def _z_image() -> tuple[nn.Module, Callable[[], torch.Tensor]]:
    import comfy.supported_models

    if not hasattr(comfy.supported_models, "ZImage"):
        pytest.skip(f"ComfyUI {H.comfy_version()} has no Z-Image (supported_models.ZImage)")
    return _dit("tiny-z-image")()


def _hunyuan_video15() -> tuple[nn.Module, Callable[[], torch.Tensor]]:
    import comfy.supported_models

    if not hasattr(comfy.supported_models, "HunyuanVideo15"):
        pytest.skip(f"ComfyUI {H.comfy_version()} has no HunyuanVideo 1.5 (supported_models.HunyuanVideo15)")
    return _dit("tiny-hunyuan-video15")()


def _ltx2() -> tuple[nn.Module, Callable[[], torch.Tensor]]:
    import comfy.supported_models

    if not hasattr(comfy.supported_models, "LTXAV"):
        pytest.skip(f"ComfyUI {H.comfy_version()} has no LTX-2 (supported_models.LTXAV)")
    return _dit("tiny-ltx2")()


# Per family: the model, the fusions applied (None: all of the model's kind), and per host class the attribute its
# fusion reads that the changed host renames. A class a fusion reaches through another (Wan's self-attention, through
# its block) is a family of its own, so that the block that holds it is not declined first.
FAMILIES = {
    "layout": (_unet, ["layout"], {"SpatialTransformer": "proj_out"}),
    "groupnorm": (_unet, ["groupnorm"], {"ResBlock": "out_layers"}),
    "geglu": (_unet, ["geglu"], {"GEGLU": "proj"}),
    "resnet": (_unet, ["resnet"], {"ResBlock": "emb_layers"}),
    "skip_layernorm": (_unet, ["skip_layernorm"], {"BasicTransformerBlock": "norm2"}),
    "upsample": (_unet, ["upsample"], {"Upsample": "dims"}),
    "qkv+cross_attention": (_unet, ["qkv", "cross_attention"], {"CrossAttention": "to_out"}),
    "flux": (_dit("tiny-flux"), None, {"DoubleStreamBlock": "img_attn", "SingleStreamBlock": "linear1",
                                       "LastLayer": "adaLN_modulation"}),
    # Flux.2's blocks are Flux's; what is its own is the SiLU-gated MLP's activation, which the fused blocks restate
    "flux2": (_flux2, None, {"SiLUActivation": "gate_fn", "LastLayer": "adaLN_modulation"}),
    "chroma": (_dit("tiny-chroma"), None, {"DoubleStreamBlock": "img_mlp", "SingleStreamBlock": "pre_norm",
                                           "LastLayer": "norm_final"}),
    "mmdit": (_dit("tiny-sd3"), None, {"JointBlock": "context_block", "FinalLayer": "linear"}),
    "wan": (_dit("tiny-wan"), None, {"WanAttentionBlock": "ffn", "Head": "head"}),
    "wan self-attention": (_dit("tiny-wan"), None, {"WanSelfAttention": "norm_q", "Head": "head"}),
    "qwen_image": (_dit("tiny-qwen-image"), None, {"QwenImageTransformerBlock": "txt_mlp", "LastLayer": "linear"}),
    # Z-Image's block reads its attention's and MLP's classes too: families of their own, as Wan's self-attention
    "z_image": (_z_image, None, {"JointTransformerBlock": "ffn_norm2", "FinalLayer": "norm_final"}),
    "z_image attention": (_z_image, None, {"JointAttention": "qkv", "FinalLayer": "adaLN_modulation"}),
    "z_image mlp": (_z_image, None, {"FeedForward": "w3", "FinalLayer": "linear"}),
    # HunyuanVideo 1.5's blocks are Flux's classes, which the flux fusion checks as it does in Flux
    "hunyuan_video15": (_hunyuan_video15, None, {"DoubleStreamBlock": "txt_attn", "LastLayer": "linear"}),
    # LTX-2's block reads its attention's and MLP's classes too (the text connectors' blocks use them as well)
    "ltx2": (_ltx2, None, {"BasicAVTransformerBlock": "audio_ff"}),
    "ltx2 attention": (_ltx2, None, {"CrossAttention": "to_v"}),
    "ltx2 mlp": (_ltx2, None, {"FeedForward": "net"}),
}


def _check(family: str, change: Callable[[type, str], type], caplog) -> None:
    pytest.importorskip("triton")
    from sd_accel.accel.engine import fusions
    from sd_accel.accel.engine.fusions import base

    build, names, renames = FAMILIES[family]
    model, run = build()
    with torch.no_grad():
        ref = run()
        changed: dict[type, type] = {}
        blocks = []
        for m in model.modules():
            cls = type(m)
            if cls.__name__ in renames and cls.__module__.startswith("comfy.ldm"):
                if cls not in changed:
                    changed[cls] = change(cls, renames[cls.__name__])
                m.__class__ = changed[cls]
                if change is _renamed:
                    _move(m, renames[cls.__name__], renames[cls.__name__] + RENAMED)
                blocks.append(m)
        assert {c.__name__ for c in changed} == set(renames)
        with caplog.at_level(logging.WARNING, logger="sd-accel"):
            undo, _ = fusions.apply(model, names)
            out = run()
        undo()
    assert not any("forward" in vars(m) or m in base._SHORT_KEYS for m in blocks)
    said = [r.getMessage() for r in caplog.records if r.name == "sd-accel" and "is not the block" in r.getMessage()]
    assert len(said) == len(changed), said
    for cls in changed.values():
        assert sum(f"{cls.__module__}.{cls.__name__} of ComfyUI" in s for s in said) == 1, said
    if family == "groupnorm":
        # the ResBlocks keep their SiLUs; their GroupNorms, torch's class, take the plain GroupNorm kernel
        assert all(isinstance(layers[1], nn.SiLU) for m in blocks for name, layers in m._modules.items()
                   if name.startswith(("in_layers", "out_layers")))
        assert ((out - ref).norm() / ref.norm()).item() <= 1e-5
    else:
        assert torch.equal(out, ref)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_block_without_an_attribute_the_fusion_reads_keeps_comfyuis_forward(comfy_pytorch_attention, caplog,
                                                                             family):
    _check(family, _renamed, caplog)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_block_whose_forward_takes_another_parameter_keeps_comfyuis_forward(comfy_pytorch_attention, caplog,
                                                                             family):
    _check(family, lambda cls, _: _one_more_parameter(cls), caplog)

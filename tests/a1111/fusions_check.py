"""The torch path's fusions on A1111's own UNet classes (ldm for SD1.x/SD2.x, sgm for SDXL) or Forge's
(backend.nn.unet), against the same module unfused. Run with the Python of an A1111 (or Forge) environment, its
repositories (or Forge's folder) and a folder holding this checkout as `sd_accel` on PYTHONPATH; without a GPU, with TRITON_INTERPRET=1 (the
kernels then run in Triton's interpreter). Prints one JSON line per model found: fused-vs-unfused relative error,
fusion counts, and whether undo restored the forward exactly.
"""

from __future__ import annotations

import json
import sys

import torch

from sd_accel.accel.engine import fusions
from sd_accel.accel.models.spec import CanonicalUNet

TINY = dict(in_channels=4, out_channels=4, model_channels=32, attention_resolutions=[2, 1], num_res_blocks=1,
            channel_mult=[1, 2], num_heads=2, use_spatial_transformer=True, transformer_depth=1,
            use_checkpoint=False, legacy=False)


XL = dict(context_dim=64, adm_in_channels=96, num_classes="sequential", use_linear_in_transformer=True,
          **{**TINY, "num_heads": -1, "num_head_channels": 16})


def _models():
    try:
        from ldm.modules.diffusionmodules.openaimodel import UNetModel as LdmUNet
        from sgm.modules.diffusionmodules.openaimodel import UNetModel as SgmUNet
    except ImportError:
        pass
    else:
        yield "ldm (SD1.x)", LdmUNet(image_size=32, context_dim=768, **TINY), 768, None
        yield "sgm (SDXL)", SgmUNet(**XL), 64, 96
    try:
        from backend.nn.unet import IntegratedUNet2DConditionModel as ForgeUNet
    except ImportError:
        return
    # Forge takes ComfyUI's form of the config: depths per level.
    forge = dict(in_channels=4, out_channels=4, model_channels=32, num_res_blocks=[1, 1], channel_mult=[1, 2],
                 use_spatial_transformer=True, transformer_depth=[1, 1], transformer_depth_output=[1, 1, 1, 1],
                 transformer_depth_middle=1)
    for name, cfg, ctx, adm in (("forge (SD1.x)", dict(context_dim=768, num_heads=2), 768, None),
                                ("forge (SDXL)", dict(context_dim=64, adm_in_channels=96, num_classes="sequential",
                                                      num_head_channels=16, use_linear_in_transformer=True), 64, 96)):
        yield name, _forge_layers(ForgeUNet, {**forge, **cfg}), ctx, adm


def _forge_layers(cls, cfg: dict) -> torch.nn.Module:
    """The UNet with Forge's own layer classes (its loader builds it inside using_forge_operations, whose Linear
    gets its weight when a state dict is loaded), weights from the same class built with torch's layers."""
    from backend.operations import using_forge_operations

    plain = cls(**cfg)
    with using_forge_operations():
        unet = cls(**cfg)
    unet.load_state_dict(_nonzero(plain).state_dict())
    return unet


def _nonzero(unet: torch.nn.Module) -> torch.nn.Module:
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in unet.parameters():
            if not p.any():  # ldm zero-initialises output convs: an all-zero output proves nothing
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return unet


def check(name: str, unet: torch.nn.Module, context_dim: int, adm: int | None) -> dict:
    _nonzero(unet).eval()
    g = torch.Generator().manual_seed(1)
    canonical = CanonicalUNet(unet)
    x = torch.randn(2, 4, 16, 16, generator=g).contiguous(memory_format=torch.channels_last)
    t = torch.tensor([10.0, 700.0])
    ctx = torch.randn(2, 77, context_dim, generator=g)
    y = torch.randn(2, adm, generator=g) if adm else None
    with torch.no_grad():
        ref = canonical(x, t, ctx, y)
        undo, counts = fusions.apply(unet)  # every fusion, in the registry's order, as the torch path runs them
        out = canonical(x, t, ctx, y)
        undo()
        again = canonical(x, t, ctx, y)
    rel = ((out - ref).norm() / ref.norm()).item()
    return {"model": name, "rel": rel, "counts": counts, "undo_exact": bool(torch.equal(again, ref))}


def main() -> None:
    for name, unet, ctx, adm in _models():
        print(json.dumps(check(name, unet, ctx, adm)), flush=True)


if __name__ == "__main__":
    sys.exit(main())

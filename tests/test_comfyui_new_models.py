"""The models people moved to since late 2025, which ComfyUI 0.33 runs (issue 56): Flux.2, Z-Image, LTX-2 (video with
audio) and HunyuanVideo 1.5, through the Accelerated UNet node, on tiny seeded models of ComfyUI's own classes (model
configs from comfy.supported_models, as its model detection makes them for the published files, at a tiny width).
A model the node does not accelerate yet passes through untouched, said in one console line that names it. Skipped
where the ComfyUI under test (0.3.64) has no such class."""

from __future__ import annotations

import logging

import pytest
import torch

import comfy_helpers as H

pytestmark = pytest.mark.skipif(H.comfy_unavailable() is not None, reason=str(H.comfy_unavailable()))

# supported_models class -> the unet_config its detection sets (comfy/model_detection.py), at a tiny width
PASSED_THROUGH = {
    "ZImage": dict(image_model="lumina2", patch_size=2, in_channels=16, dim=64, cap_feat_dim=32, n_layers=1,
                   qk_norm=True, n_heads=2, n_kv_heads=2, axes_dims=[8, 12, 12], axes_lens=[64, 64, 64],
                   rope_theta=256.0, ffn_dim_multiplier=8 / 3, z_image_modulation=True, time_scale=1000.0,
                   pad_tokens_multiple=32),
    "LTXAV": dict(image_model="ltxav", num_layers=1, attention_head_dim=16, num_attention_heads=2,
                  cross_attention_dim=32, audio_attention_head_dim=8, audio_num_attention_heads=2,
                  audio_cross_attention_dim=16, caption_channels=32, connector_attention_head_dim=8,
                  connector_num_attention_heads=2, connector_num_layers=1),
    "HunyuanVideo15": dict(image_model="hunyuan_video", in_channels=32, out_channels=32, patch_size=[1, 1, 1],
                           vec_in_dim=None, axes_dim=[16, 56, 56], meanflow=False, context_in_dim=32, hidden_size=256,
                           mlp_ratio=4.0, num_heads=2, depth=1, depth_single_blocks=1, theta=256, qkv_bias=True,
                           byt5=False, guidance_embed=False, use_cond_type_embedding=True, vision_in_dim=None,
                           meanflow_sum=False),
}


def _config_class(name: str):
    import comfy.supported_models

    cls = getattr(comfy.supported_models, name, None)
    if cls is None:
        pytest.skip(f"ComfyUI {H.comfy_version()} has no supported_models.{name}")
    return cls


def _tiny(name: str, cfg: dict, seed: int = 0):
    """A ModelPatcher around the BaseModel that supported_models.`name` builds for cfg, seeded."""
    import comfy.model_management as mm
    import comfy.model_patcher

    from sd_accel.accel.models import configs

    config = _config_class(name)(dict(cfg))
    config.unet_config.update(cfg)
    with H.layers_with_weights():
        model = config.get_model({})
    configs.seed_dit_parameters(model.diffusion_model, seed)
    return comfy.model_patcher.ModelPatcher(model, load_device=mm.get_torch_device(),
                                            offload_device=mm.unet_offload_device())


def _hooks(model) -> tuple:
    """The wrappers and callbacks on a ModelPatcher, copied: where the node would attach its own."""
    return tuple({k: {k1: list(v1) for k1, v1 in v.items()} for k, v in d.items()}
                 for d in (model.wrappers, model.callbacks))


@pytest.mark.parametrize("name", PASSED_THROUGH)
def test_a_model_not_accelerated_yet_passes_through_said_in_one_line(pack, name, caplog):
    """The node returns ComfyUI's own model, with nothing of sd-accel on it (so ComfyUI's forward computes every
    call, unchanged), and says so in one console line naming the model."""
    model = _tiny(name, PASSED_THROUGH[name])
    before = _hooks(model)
    node = pack.NODE_CLASS_MAPPINGS["SDAccelAcceleratedUNet"]()
    with caplog.at_level(logging.INFO, logger="sd-accel"):
        out = node.apply(model, "auto", True, False, **H.PROFILE, unique_id="56")
    said = [r.getMessage() for r in caplog.records if r.name == "sd-accel"]
    assert out["result"][0] is model and _hooks(model) == before
    assert len(said) == 1 and said[0].startswith(f"sd-accel: {name} (") and "not accelerated (yet)" in said[0], said
    assert out["ui"]["text"][0] in said[0]

"""The image-to-video and edit variants that share a class with a model the Accelerated UNet node accelerates (issue
56): Wan 2.1 image-to-video (supported_models.WAN21_I2V: the start image's latents concatenated to the noise, CLIP
image features), Wan 2.2 image-to-video A14B's form (the same concatenation into a text-to-video WanModel, no CLIP), Wan
2.2 TI2V 5B (the image in the latent under a noise mask), Qwen-Image-Edit and Flux Kontext (reference latents in the
conditioning). Each on a tiny seeded model of ComfyUI's own classes inside the real ComfyUI tree (COMFYUI_ROOT), with
the conditioning and latents ComfyUI's own workflow nodes give (WanImageToVideo, Wan22ImageToVideoLatent,
ReferenceLatent), sampled by comfy.sample.sample as the KSampler node does.

What is pinned down: the node's latents equal plain ComfyUI's (exact on the CPU, where the torch path runs the plain
model's kernels), and either the engine served every call, or every call ran ComfyUI's own forward and the node said
why in exactly one console line, naming the input. The image encoders are stand-ins: a VAE whose encode gives a seeded
latent of the model's layout, CLIP vision's output a seeded tensor of its shape; what reaches the model is the nodes'.
"""

from __future__ import annotations

import logging

import pytest
import torch

import comfy_helpers as H
from test_comfyui_new_models import _tiny
from test_comfyui_stacking import accelerate, host_node, status

pytestmark = pytest.mark.skipif(H.comfy_unavailable() is not None, reason=str(H.comfy_unavailable()))

STEPS = 2


class EncodingVAE:
    """Stands in for the VAE given to the image-to-video nodes: encode gives a seeded latent of the model's layout for
    the pixels it gets ((frames, height, width, 3): `channels` channels, `scale` times smaller in space, 1 + (frames -
    1) / 4 latent frames, as Wan's VAEs compress)."""

    def __init__(self, channels: int, scale: int, seed: int) -> None:
        self.channels, self.scale, self.seed = channels, scale, seed

    def encode(self, pixels: torch.Tensor) -> torch.Tensor:
        frames, height, width = pixels.shape[:3]
        g = torch.Generator().manual_seed(self.seed)
        return torch.randn(1, self.channels, (frames - 1) // 4 + 1, height // self.scale, width // self.scale,
                           generator=g)


def outputs(cls, **inputs) -> tuple:
    """Everything a host node (io.ComfyNode) gives for these inputs."""
    return tuple(cls.execute(**inputs).result)


def clip_vision_output(seed: int):
    """CLIP vision's output as CLIPVisionEncode gives it (ViT-H: 257 tokens of 1280), seeded."""
    import comfy.clip_vision

    out = comfy.clip_vision.Output()
    out["penultimate_hidden_states"] = torch.randn(1, 257, 1280, generator=torch.Generator().manual_seed(seed))
    return out


def start_image(seed: int, size: int = 64) -> torch.Tensor:
    return torch.rand(1, size, size, 3, generator=torch.Generator().manual_seed(seed))


def sample(model, positive, negative, latent: dict, cfg: float = 3.0, seed: int = 1) -> torch.Tensor:
    """comfy.sample.sample on a LATENT as the KSampler node runs it: its noise from the seed, its noise mask."""
    import comfy.sample

    samples = latent["samples"]
    noise = comfy.sample.prepare_noise(samples, seed)
    return comfy.sample.sample(model, noise, STEPS, cfg, "euler", "simple", positive, negative, samples,
                               noise_mask=latent.get("noise_mask"), disable_pbar=True, seed=seed)


def plain_and_node(pack, model, positive, negative, latent: dict, caplog, **kw):
    """(plain ComfyUI's latents, the node's in two runs, the node's status, what it said while sampling)."""
    plain = sample(model, positive, negative, latent, **kw)
    acc = accelerate(pack, model)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="sd-accel"):
        out = [sample(acc, positive, negative, latent, **kw) for _ in range(2)]
    lines = [r.getMessage() for r in caplog.records if r.name == "sd-accel" and r.levelno >= logging.WARNING]
    return plain, out, status(acc), lines


def check(plain, out, s, lines, why: str | None) -> None:
    """The latents are plain's; why None: the engine served every call (cond and uncond batched: one call a step),
    else every call ran ComfyUI's forward and one console line said so, naming `why`."""
    assert all(H.same(o, plain) for o in out), [H.rel(o, plain) for o in out]
    calls = 2 * STEPS
    if why is None:
        assert s.engine_calls == calls and s.plain_calls == 0 and not lines, (s, lines)
    else:
        assert s.engine_calls == 0 and s.plain_calls == calls, (s, s.messages)
        assert len(lines) == 1 and why in lines[0] and "ComfyUI's own forward" in lines[0], lines


def tiny_wan(cls_name: str, seed: int, **changes):
    from sd_accel.accel.models import configs

    return _tiny(cls_name, {**configs.comfy_dit_config("tiny-wan")[1], **changes}, seed)


# -------------------------------------------------------------------------------------------- Wan image-to-video

# (supported_models class, config changes, CLIP vision given): the published models' forms at a tiny width
WAN_I2V = {
    # Wan 2.1 I2V 14B with CLIPVisionEncode's output: image-to-video's cross-attention to the CLIP tokens
    "2.1 with CLIP vision": ("WAN21_I2V", {"model_type": "i2v", "in_dim": 36}, True),
    # the same model given no CLIP vision output: its image cross-attention gets no tokens of its own
    "2.1 without CLIP vision": ("WAN21_I2V", {"model_type": "i2v", "in_dim": 36}, False),
    # Wan 2.2 I2V A14B: no CLIP image embedding (ComfyUI's detection makes it a text-to-video WanModel of 36 channels)
    "2.2 A14B": ("WAN21_T2V", {"in_dim": 36}, False),
}
# What the node says for calls it leaves to ComfyUI's forward (None: the engine serves them)
WAN_I2V_WHY = {"2.1 with CLIP vision": "clip_fea", "2.1 without CLIP vision": None, "2.2 A14B": None}


def wan_i2v(case: str, seed: int):
    """(model, positive, negative, latent) of WAN_I2V's case, the conditioning WanImageToVideo gives (the start
    image's latents and mask as concat_latent_image / concat_mask, which ComfyUI concatenates to the noise: 36
    channels; CLIP vision's output, given as clip_fea, where the case has it)."""
    cls_name, changes, with_clip = WAN_I2V[case]
    node = host_node("nodes_wan", "WanImageToVideo")
    model = tiny_wan(cls_name, seed, **changes)
    assert model.model.diffusion_model.patch_embedding.weight.shape[1] == 36
    pos, neg = H.tiny_dit_conditioning("wan", seed + 1)
    pos, neg, latent = outputs(node, positive=pos, negative=neg, vae=EncodingVAE(16, 8, seed + 2), width=64,
                               height=64, length=9, batch_size=1, start_image=start_image(seed + 3),
                               clip_vision_output=clip_vision_output(seed + 4) if with_clip else None)
    assert "concat_latent_image" in pos[0][1] and ("clip_vision_output" in pos[0][1]) == with_clip
    return model, pos, neg, latent


@pytest.mark.parametrize("case", WAN_I2V)
def test_wan_image_to_video_is_plains_served_or_said_once(pack, case, caplog):
    model, pos, neg, latent = wan_i2v(case, 20)
    plain, out, s, lines = plain_and_node(pack, model, pos, neg, latent, caplog)
    no_image = sample(model, *H.tiny_dit_conditioning("wan", 21), latent)
    assert not torch.allclose(plain, no_image, atol=1e-4)  # the start image reaches the model
    check(plain, out, s, lines, WAN_I2V_WHY[case])


@pytest.mark.parametrize("case", [c for c, why in WAN_I2V_WHY.items() if why is None])
def test_wan_image_to_video_the_engine_serves_runs_fused_within_rounding_of_plain(pack, comfy_pytorch_attention,
                                                                                 case, monkeypatch):
    """The image-to-video calls the engine serves, with the fused kernels (Triton's interpreter on the CPU): every
    block fused, the 36-channel patch embedding and the image cross-attention ComfyUI's own, the latents within float32
    rounding of plain ComfyUI's."""
    from sd_accel.accel.engine.fusions import wan
    from sd_accel.nodes import accelerated_unet

    model, pos, neg, latent = wan_i2v(case, 25)
    plain = sample(model, pos, neg, latent)
    acc = accelerate(pack, model)
    accelerated_unet.session_of(acc).slot.options["triton_kernels"] = True
    fused = []
    monkeypatch.setattr(wan, "_block_forward", lambda *a, f=wan._block_forward, **k: fused.append(1) or f(*a, **k))
    out = sample(acc, pos, neg, latent)
    assert len(fused) == 2 * STEPS  # 2 blocks, one call a step
    assert H.rel(out, plain) <= 1e-5 and status(acc).engine_calls == STEPS and status(acc).plain_calls == 0


# ------------------------------------------------------------------------------------------- Wan 2.2 TI2V 5B

@pytest.mark.parametrize("image", [True, False], ids=["image to video", "text to video"])
def test_wan22_ti2v_is_plains_served_or_said_once(pack, image, caplog):
    """Wan 2.2 TI2V 5B's form (supported_models.WAN22_T2V: 48 latent channels in and out, ComfyUI's WAN22 model):
    Wan22ImageToVideoLatent puts the start image into the latent under a noise mask, which the sampler gives the model
    as denoise_mask (WAN22 turns it into timesteps per frame); without an image it is text-to-video."""
    node = host_node("nodes_wan", "Wan22ImageToVideoLatent")
    model = tiny_wan("WAN22_T2V", 30, in_dim=48, out_dim=48)
    assert type(model.model).__name__ == "WAN22"
    pos, neg = H.tiny_dit_conditioning("wan", 31)
    (latent,) = outputs(node, vae=EncodingVAE(48, 16, 32), width=128, height=128, length=9, batch_size=1,
                        start_image=start_image(33, 128) if image else None)
    assert latent["samples"].shape == (1, 48, 3, 8, 8) and ("noise_mask" in latent) == image
    check(*plain_and_node(pack, model, pos, neg, latent, caplog), "denoise_mask" if image else None)


# ---------------------------------------------------------------------------------- reference latents (edit)

def with_reference(node, conditioning, latent: torch.Tensor):
    (out,) = outputs(node, conditioning=conditioning, latent={"samples": latent})
    return out


@pytest.mark.parametrize("family", ["qwen-image", "flux"], ids=["Qwen-Image-Edit", "Flux Kontext"])
def test_reference_latents_are_plains_served_or_said_once(pack, family, caplog):
    """Qwen-Image-Edit and Flux Kontext: the image to edit as reference latents in both conditionings (ReferenceLatent,
    as TextEncodeQwenImageEdit and Kontext workflows put them), which the model gets as ref_latents: its own forward
    puts their tokens beside the image's. ComfyUI 0.33 passes Qwen-Image's inputs in another order than 0.3.6x
    (ref_latents where guidance was): the node reads them by name, so the reference latents never reach the engine."""
    node = host_node("nodes_edit_model", "ReferenceLatent")
    model = H.tiny_dit(family, 40)
    pos, neg = H.tiny_dit_conditioning(family, 41)
    shape = (1, 16, 1, 8, 8) if family == "qwen-image" else (1, 16, 8, 8)  # Qwen-Image's VAE gives a frame axis
    ref = torch.randn(*shape, generator=torch.Generator().manual_seed(42))
    rpos, rneg = with_reference(node, pos, ref), with_reference(node, neg, ref)
    latent = {"samples": torch.zeros(shape)}
    plain, out, s, lines = plain_and_node(pack, model, rpos, rneg, latent, caplog)
    assert not torch.allclose(plain, sample(model, pos, neg, latent), atol=1e-4)  # the reference reaches the model
    check(plain, out, s, lines, "ref_latents")

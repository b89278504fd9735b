"""The models people moved to since late 2025, which ComfyUI 0.33 runs (issue 56): Flux.2, Z-Image, LTX-2 (video with
audio) and HunyuanVideo 1.5, through the Accelerated UNet node, on tiny seeded models of ComfyUI's own classes (model
configs from comfy.supported_models, as its model detection makes them for the published files, at a tiny width).
Flux.2, Z-Image, HunyuanVideo 1.5 and LTX-2 run on the torch path's fused blocks; a model the node does not accelerate
yet (Lumina 2 in its own form, whose class Z-Image shares, HunyuanVideo 1.0 and HunyuanVideo 1.5's MeanFlow-distilled
super-resolution model, of 1.5's class, and LTX-2.3's form of LTX-2's class) passes through untouched, said in one
console line that names it. Skipped where the ComfyUI under test (0.3.64) has no such class."""

from __future__ import annotations

import contextlib
import functools
import logging
import types

import pytest
import torch

import comfy_helpers as H

pytestmark = pytest.mark.skipif(H.comfy_unavailable() is not None, reason=str(H.comfy_unavailable()))

# supported_models class -> the unet_config its detection sets (comfy/model_detection.py), at a tiny width
PASSED_THROUGH = {
    # Lumina 2's own form of the class Z-Image is built from (grouped k/v heads, SiLU before its modulation)
    "Lumina2": dict(image_model="lumina2", patch_size=2, in_channels=16, dim=64, cap_feat_dim=32, n_layers=1,
                    qk_norm=True, n_heads=4, n_kv_heads=2, axes_dims=[4, 6, 6], axes_lens=[64, 64, 64],
                    ffn_dim_multiplier=4.0),
    # LTX-2.3's form of LTX-2's class (gated attention, adaLN on the text cross attention, its caption projected
    # before the connectors)
    "LTXAV": dict(image_model="ltxav", num_layers=1, attention_head_dim=16, num_attention_heads=2,
                  cross_attention_dim=32, audio_attention_head_dim=8, audio_num_attention_heads=2,
                  audio_cross_attention_dim=16, caption_channels=32, connector_attention_head_dim=8,
                  connector_num_attention_heads=2, connector_num_layers=1, apply_gated_attention=True,
                  cross_attention_adaln=True, caption_proj_before_connector=True, rope_type="split"),
    # HunyuanVideo 1.0 (Llama text, CLIP-L's pooled vector, guidance, 1x2x2 patches) in 0.33's HunyuanVideo
    "HunyuanVideo": dict(image_model="hunyuan_video", in_channels=16, out_channels=16, patch_size=[1, 2, 2],
                         vec_in_dim=768, axes_dim=[16, 56, 56], meanflow=False, context_in_dim=32, hidden_size=256,
                         mlp_ratio=4.0, num_heads=2, depth=1, depth_single_blocks=1, theta=256, qkv_bias=True,
                         byt5=False, guidance_embed=True, use_cond_type_embedding=False, vision_in_dim=None,
                         meanflow_sum=False),
    # HunyuanVideo 1.5's MeanFlow-distilled super-resolution model: its forward reads the sampler's sigmas
    "HunyuanVideo15_SR_Distilled": dict(image_model="hunyuan_video", in_channels=98, out_channels=32,
                                        patch_size=[1, 1, 1], vec_in_dim=None, axes_dim=[16, 56, 56], meanflow=True,
                                        context_in_dim=32, hidden_size=256, mlp_ratio=4.0, num_heads=2, depth=1,
                                        depth_single_blocks=0, theta=256, qkv_bias=True, byt5=False,
                                        guidance_embed=False, use_cond_type_embedding=True, vision_in_dim=1152,
                                        meanflow_sum=True),
}
# The class whose ComfyUI a config needs, where it is not its own: 0.33's HunyuanVideo takes 1.5's fields
NEEDS = {"HunyuanVideo": "HunyuanVideo15"}


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
    _config_class(NEEDS.get(name, name))
    model = _tiny(name, PASSED_THROUGH[name])
    before = _hooks(model)
    node = pack.NODE_CLASS_MAPPINGS["SDAccelAcceleratedUNet"]()
    with caplog.at_level(logging.INFO, logger="sd-accel"):
        out = node.apply(model, "auto", True, False, **H.PROFILE, unique_id="56")
    said = [r.getMessage() for r in caplog.records if r.name == "sd-accel"]
    assert out["result"][0] is model and _hooks(model) == before
    assert len(said) == 1 and said[0].startswith(f"sd-accel: {name} (") and "not accelerated (yet)" in said[0], said
    assert out["ui"]["text"][0] in said[0]


# ------------------------------------------------------------------------------------------------------- Flux.2

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FUSED_TOL = 1e-4 if DEVICE == "cuda" else 1e-5  # as tests/test_dit.py's


def _flux2_class() -> None:
    import comfy.ldm.flux.model

    if "global_modulation" not in comfy.ldm.flux.model.FluxParams.__dataclass_fields__:
        pytest.skip(f"ComfyUI {H.comfy_version()}'s Flux class has no Flux.2 form")
    _config_class("Flux2")


def _counted_blocks(monkeypatch) -> list:
    """The fused double and single blocks' calls, by kind."""
    from sd_accel.accel.engine.fusions import flux

    calls = []
    for name in ("double_block", "single_block"):
        monkeypatch.setattr(flux, name, lambda *a, f=getattr(flux, name), n=name, **k: calls.append(n) or f(*a, **k))
    return calls


def _flux2_conditioning(seed: int, tokens: int = 7):
    """(positive, negative) for tiny-flux2: text tokens of its width (ComfyUI pads them to 512), its guidance."""
    from sd_accel.accel.models import configs

    width = configs.COMFY_DIT_CONFIGS["tiny-flux2"][1]["context_in_dim"]
    g = torch.Generator().manual_seed(seed)
    return tuple([[torch.randn(1, tokens, width, generator=g) * scale, {"guidance": 3.5}]] for scale in (1.0, 0.5))


def _sample_flux2(model, positive, negative, size: int = 4):
    import comfy.sample

    shape = (1, 128, size, size)
    noise = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
    return comfy.sample.sample(model, noise, 2, 3.0, "euler", "normal", positive, negative, torch.zeros(shape),
                               disable_pbar=True, seed=1)


def test_flux2_loaded_from_its_file_runs_fused_in_comfyuis_sampling_and_equals_plain(pack, comfy_pytorch_attention,
                                                                                     tmp_path, monkeypatch):
    """A Flux.2 file loaded by ComfyUI's own loader (its detection makes supported_models.Flux2 of it), through the
    node with the fused kernels (Triton's interpreter on the CPU): every block fused, every call the engine's, the
    latents plain ComfyUI's."""
    _flux2_class()
    from sd_accel.accel.models import configs
    from sd_accel.nodes import accelerated_unet

    with H.layers_with_weights():
        module = configs.build_dit("tiny-flux2", "comfy", comfyui_root=H.comfy_root())
    model = H.load_diffusion_model_file(module, tmp_path)
    assert type(model.model.model_config).__name__ == "Flux2"
    pos, neg = _flux2_conditioning(3)
    plain = _sample_flux2(model, pos, neg)
    node = pack.NODE_CLASS_MAPPINGS["SDAccelAcceleratedUNet"]()
    acc = node.apply(model, "torch", True, False, **H.PROFILE, unique_id="56")["result"][0]
    slot = accelerated_unet.session_of(acc).slot
    slot.options["triton_kernels"] = True
    calls = _counted_blocks(monkeypatch)
    out = _sample_flux2(acc, pos, neg)
    # 2 steps, conditional and unconditional in one batch: 2 calls of each of 2 double and 2 single blocks
    assert sorted(calls) == ["double_block"] * 4 + ["single_block"] * 4, calls
    assert H.rel(out, plain) <= FUSED_TOL
    assert slot.status.engine_calls == 2 and slot.status.plain_calls == 0
    assert not any("forward" in vars(m) for m in model.model.diffusion_model.modules())


def _fused_and_own(name: str) -> tuple:
    """(ComfyUI's own forward's output, the fused forward's, the fusions' counts, the own forward's after undo, the
    model) of the tiny DiT `name` in float32."""
    from sd_accel.accel.engine import fusions
    from sd_accel.accel.models import configs
    from sd_accel.accel.models.dit import CanonicalDiT

    model = configs.build_dit(name, "comfy", comfyui_root=H.comfy_root(), device=DEVICE)
    inp = configs.dit_example_inputs(name, batch=2, latent=(8, 10), device=DEVICE)
    canon = CanonicalDiT(model)
    with torch.no_grad():
        ref = canon(**inp)
        undo, counts = fusions.apply(model)
        out = canon(**inp)
        undo()
        return ref, out, counts, canon(**inp), model


def _tiny_bf16(name: str) -> tuple:
    """(model, inputs) of the tiny DiT `name` as ComfyUI's class in bfloat16, its example inputs in bfloat16."""
    from sd_accel.accel.models import configs

    model = configs.build_dit(name, "comfy", comfyui_root=H.comfy_root(), dtype=torch.bfloat16, device=DEVICE)
    inp = configs.dit_example_inputs(name, batch=2, device=DEVICE)
    return model, {k: v.to(torch.bfloat16) if k in ("x", "context") else v for k, v in inp.items()}


def _fp8_and_16bit(name: str) -> tuple:
    """((output, counts) with precision auto, the same with precision fp8) of the tiny DiT `name` in bfloat16, fused."""
    from test_dit import _fused_output

    model, inp = _tiny_bf16(name)
    return _fused_output(model, inp, "auto"), _fused_output(model, inp, "fp8")


def test_flux2_with_fused_kernels_matches_its_own_forward(comfy_pytorch_attention):
    """Flux.2's blocks (modulations shared by all blocks of a kind, SiLU-gated MLPs, no biases) through the Flux
    fusion against ComfyUI's own forward, in float32; undone, the model is ComfyUI's again."""
    pytest.importorskip("triton")
    _flux2_class()
    from sd_accel.accel.engine import fusions

    ref, out, counts, back, model = _fused_and_own("tiny-flux2")
    assert counts == {f: 5 if f == "flux" else 0 for f in fusions.DIT}  # 2 double, 2 single blocks, the last layer
    assert H.rel(out, ref) <= FUSED_TOL
    assert torch.equal(back, ref) and not any("forward" in vars(m) for m in model.modules())


@pytest.mark.fp8_products(DEVICE)
def test_flux2_fp8_products_stay_close_to_its_16bit_fused_forward(comfy_pytorch_attention):
    """precision fp8 takes every block projection of Flux.2 (its modulations are outside the blocks and stay
    16-bit), the SiLU-gated MLPs' too, and stays close to the 16-bit fused forward; auto leaves 16-bit weights."""
    pytest.importorskip("triton")
    _flux2_class()
    (ref, counts), (out, counts8) = _fp8_and_16bit("tiny-flux2")
    assert counts["flux"] == 5 and counts["fp8"] == 0
    assert counts8["fp8"] == 2 * 8 + 2 * 2  # per double block 2 streams x (qkv, proj, 2 MLP); per single 2
    assert 1e-4 < H.rel(out, ref) <= 5e-2


@pytest.mark.fp8_products(DEVICE)
def test_flux2_swiglu_is_one_pass_in_16_bits_and_in_the_fp8_quantization(comfy_pytorch_attention, monkeypatch):
    """Flux.2's SiLU-gated MLPs (2 double blocks x 2 streams, 2 single blocks): in 16 bits each activation is one
    SwiGLU kernel (kernels/swiglu.py); with fp8 products it runs in the pass that quantizes the second projection's
    input (kernels/quant.py's swiglu mode), never in 16 bits. That pass's kernel (the GPU's; here under the
    interpreter, in the place of the reference the CPU takes) gives the reference's output."""
    pytest.importorskip("triton")
    _flux2_class()
    from sd_accel.accel.models import configs
    from sd_accel.kernels import quant, swiglu
    from test_dit import _fused_output

    calls = []
    monkeypatch.setattr(swiglu, "swiglu", lambda *a, f=swiglu.swiglu: calls.append("16-bit") or f(*a))
    monkeypatch.setattr(quant, "quantize_rows_ref", lambda x, gelu=False, swiglu=False, *rest,
                        f=quant.quantize_rows_ref: calls.append("fp8" if swiglu else "rows") or f(x, gelu, swiglu, *rest))
    model = configs.build_dit("tiny-flux2", "comfy", comfyui_root=H.comfy_root(), dtype=torch.bfloat16, device=DEVICE)
    inp = configs.dit_example_inputs("tiny-flux2", batch=2, latent=4, device=DEVICE)
    inp = {k: v.to(torch.bfloat16) if k in ("x", "context") else v for k, v in inp.items()}
    _fused_output(model, inp, "auto")
    assert calls == ["16-bit"] * 6
    calls.clear()
    out, _ = _fused_output(model, inp, "fp8")
    assert "16-bit" not in calls and calls.count("fp8") == 6
    if DEVICE == "cpu":
        monkeypatch.setattr(quant, "supported", lambda x: x.dim() == 2 and x.shape[1] > 0)
        calls.clear()
        assert H.rel(_fused_output(model, inp, "fp8")[0], out) <= 1e-3 and not calls


# ------------------------------------------------------------------------------------------------------ Z-Image

@contextlib.contextmanager
def _z_image_detected():
    """ComfyUI's detection takes a Lumina 2 file 3840 wide for Z-Image and sets its heads and rotary axes from
    constants: within, a file of tiny-z-image's weights is given that config and supported_models.ZImage, and its
    loader does all else as for the published file."""
    from sd_accel.accel.models import configs

    _config_class("ZImage")
    with H.detected_as("ZImage", configs.COMFY_DIT_CONFIGS["tiny-z-image"][1], identify={"image_model": "lumina2"}):
        yield


def _z_image_file(folder, seed: int = 0):
    """tiny-z-image's weights (seeded louder where blocks add to the stream: H.tiny_dit_weights) written as a file and
    loaded by ComfyUI's own loader."""
    with _z_image_detected():
        model = H.load_diffusion_model_file(H.tiny_dit_weights("z-image", seed), folder)
    assert type(model.model.model_config).__name__ == "ZImage"
    return model


def _sample_z_image(model, positive, negative, size: int = 8):
    import comfy.sample

    shape = (1, 16, size, size)
    noise = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
    return comfy.sample.sample(model, noise, 2, 3.0, "euler", "simple", positive, negative, torch.zeros(shape),
                               disable_pbar=True, seed=1)


def _accelerated(pack, model, fused: bool = True):
    """The node's output on model, its fused kernels asked for (Triton's interpreter on the CPU; else the CPU's torch
    path runs the plain model's own kernels), and its slot."""
    from sd_accel.nodes import accelerated_unet

    node = pack.NODE_CLASS_MAPPINGS["SDAccelAcceleratedUNet"]()
    out = node.apply(model, "torch", True, False, **H.PROFILE, unique_id="56")
    acc = out["result"][0]
    assert acc is not model and "backend: torch" in out["ui"]["text"][0]
    slot = accelerated_unet.session_of(acc).slot
    slot.options["triton_kernels"] = fused
    return acc, slot


def _fused_equals_plain(pack, model, sample, counted, monkeypatch) -> tuple[list, torch.Tensor]:
    """A short sampling run's latents (sample(model)) through the node with the fused kernels against plain ComfyUI's:
    equal within FUSED_TOL, every call the engine's (2 steps, conditional and unconditional in one batch), the host's
    model left as it was. Returns the fused calls that counted(monkeypatch) lists, and plain's latents."""
    plain = sample(model)
    acc, slot = _accelerated(pack, model)
    calls = counted(monkeypatch)
    assert H.rel(sample(acc), plain) <= FUSED_TOL
    assert slot.status.engine_calls == 2 and slot.status.plain_calls == 0
    assert not any("forward" in vars(m) for m in model.model.diffusion_model.modules())
    return calls, plain


def _lora_follows_plain(pack, model, sample, lora: dict) -> None:
    """A LoRA after the node: the fused run's latents (sample(model): a short sampling run's) move as plain ComfyUI's
    do; without it, they are plain's again; every call the engine's."""
    import comfy.sd

    def with_lora(m):
        return comfy.sd.load_lora_for_models(m, None, lora, 1.0, 0.0)[0]

    assert lora
    plain, plain_lora = sample(model), sample(with_lora(model))
    assert H.rel(plain_lora, plain) > 1e-3  # the LoRA reaches the blocks
    acc, slot = _accelerated(pack, model)
    assert H.rel(sample(acc), plain) <= FUSED_TOL
    assert H.rel(sample(with_lora(acc)), plain_lora) <= FUSED_TOL
    assert H.rel(sample(acc), plain) <= FUSED_TOL
    assert slot.status.engine_calls == 6 and slot.status.plain_calls == 0


def _positive_with(conditioning: tuple, **entries) -> tuple:
    """(positive, negative) with `entries` in the positive's options, as a node that sets them gives it."""
    pos, neg = conditioning
    return [[pos[0][0], dict(pos[0][1], **entries)]], neg


def _text_mask() -> torch.Tensor:
    """A text encoder's attention mask over 7 tokens, the last 2 padding."""
    mask = torch.ones(1, 7)
    mask[:, 5:] = 0
    return mask


def _counted_attention(monkeypatch) -> list:
    """The fused Z-Image blocks' attentions, one per block call."""
    from sd_accel.accel.engine.fusions import z_image

    calls = []
    monkeypatch.setattr(z_image, "_attention", lambda *a, f=z_image._attention: calls.append(1) or f(*a))
    return calls


def test_z_image_loaded_from_its_file_runs_fused_in_comfyuis_sampling_and_equals_plain(pack, comfy_pytorch_attention,
                                                                                       tmp_path, monkeypatch):
    """A Z-Image file loaded by ComfyUI's own loader (supported_models.ZImage), through the node with the fused
    kernels: every block fused (context refiner, noise refiner and main layers), every call the engine's, the latents
    plain ComfyUI's; the host's model is left as it was."""
    pytest.importorskip("triton")
    model = _z_image_file(tmp_path)
    pos, neg = H.tiny_dit_conditioning("z-image", 3)
    calls, _ = _fused_equals_plain(pack, model, lambda m: _sample_z_image(m, pos, neg), _counted_attention,
                                   monkeypatch)
    # 2 steps, conditional and unconditional in one batch: 2 calls of 2 + 2 refiner blocks and 2 layers
    assert len(calls) == 12, calls


def test_z_image_lora_after_the_node_changes_its_latents_as_plain_and_goes_again(pack, comfy_pytorch_attention,
                                                                               tmp_path):
    """A LoRA on the attention's qkv and the MLP's w1 (packed with w3 into one product by the fusion) after the node:
    the fused run's latents move as plain ComfyUI's do; without it, they are plain's again."""
    pytest.importorskip("triton")
    model = _z_image_file(tmp_path, seed=4)
    pos, neg = H.tiny_dit_conditioning("z-image", 5)
    lora = H.lora_patches(model, 6, take=lambda key: key.endswith(("attention.qkv.weight", "feed_forward.w1.weight")))
    _lora_follows_plain(pack, model, lambda m: _sample_z_image(m, pos, neg), lora)


def test_z_image_with_fused_kernels_matches_its_own_forward(comfy_pytorch_attention):
    """Z-Image's blocks (sandwich RMSNorms, scale-only modulation, tanh gates, w1/w3 SiLU-gated MLP; the context
    refiner's without modulation) and output layer through the z_image fusion against ComfyUI's own forward, in
    float32; undone, the model is ComfyUI's again."""
    pytest.importorskip("triton")
    _config_class("ZImage")
    from sd_accel.accel.engine import fusions
    from sd_accel.accel.models.dit import CanonicalDiT

    ref, out, counts, back, model = _fused_and_own("tiny-z-image")
    assert CanonicalDiT(model).spec.family == "z-image"
    assert counts == {f: 7 if f == "z_image" else 0 for f in fusions.DIT}  # 6 blocks and the final layer
    assert H.rel(out, ref) <= FUSED_TOL
    assert torch.equal(back, ref) and not any("forward" in vars(m) for m in model.modules())


def test_z_image_calls_with_a_mask_or_rope_options_run_comfyuis_own_forward_and_say_so(pack, caplog):
    """Calls with inputs the engine does not pass on (a text attention mask with its token count; ScaleROPE's
    rope_options; likewise Z-Image Omni's reference images) run ComfyUI's own forward, said once in words; the other
    calls of the run are the engine's (on the CPU, the plain model's own kernels: the latents are plain's exactly)."""
    _config_class("ZImage")
    model = H.tiny_dit("z-image", 2)
    pos, neg = H.tiny_dit_conditioning("z-image", 6)
    masked = _positive_with((pos, neg), attention_mask=_text_mask())
    acc, slot = _accelerated(pack, model, fused=False)
    with caplog.at_level(logging.INFO, logger="sd-accel"):
        assert torch.equal(_sample_z_image(acc, *masked), _sample_z_image(model, *masked))
        scaled, plain_scaled = acc.clone(), model.clone()
        for m in (scaled, plain_scaled):
            m.set_model_rope_options(1.5, 0.0, 1.5, 0.0, 1.0, 0.0)
        assert torch.equal(_sample_z_image(scaled, pos, neg), _sample_z_image(plain_scaled, pos, neg))
    said = [r.getMessage() for r in caplog.records if r.name == "sd-accel" and "own forward" in r.getMessage()]
    assert any("inputs the engine does not take (attention_mask, num_tokens)" in s for s in said), said
    assert any("other nodes patch the model (rope_options)" in s for s in said), said
    # the masked positive's 2 calls (its conditioning does not batch with the negative's, whose 2 the engine serves),
    # then both halves of 2 calls with rope_options
    assert slot.status.plain_calls == 4 and slot.status.engine_calls == 2, slot.status


@pytest.mark.fp8_products(DEVICE)
def test_z_image_fp8_products_stay_close_to_its_16bit_fused_forward(comfy_pytorch_attention):
    """precision fp8 takes every block projection of Z-Image (qkv, out, w1, w2, w3; the modulations stay 16-bit) and
    stays close to the 16-bit fused forward; auto leaves 16-bit weights."""
    pytest.importorskip("triton")
    _config_class("ZImage")
    (ref, counts), (out, counts8) = _fp8_and_16bit("tiny-z-image")
    assert counts["z_image"] == 7 and counts["fp8"] == 0
    assert counts8["fp8"] == 6 * 5  # per block qkv, out, w1, w2, w3
    assert 1e-4 < H.rel(out, ref) <= 5e-2


@pytest.mark.fp8_products(DEVICE)
def test_z_image_int8_products_stay_closer_to_its_16bit_fused_forward_than_fp8(comfy_pytorch_attention):
    """Z-Image's fp8 error is e4m3's rounding on every projection (BENCHMARKS.md); precision int8 takes the same
    projections as int8 products, closer to the 16-bit fused forward than fp8's."""
    pytest.importorskip("triton")
    _config_class("ZImage")
    from test_dit import _fused_output

    model, inp = _tiny_bf16("tiny-z-image")
    ref, _ = _fused_output(model, inp, "16bit")
    eight, _ = _fused_output(model, inp, "fp8")
    out, counts = _fused_output(model, inp, "int8")
    assert counts["z_image"] == 7 and counts["fp8"] == 6 * 5
    assert 1e-4 < H.rel(out, ref) < H.rel(eight, ref) / 2


def test_z_images_modulated_blocks_hand_their_products_int8_rows_from_the_norm_pass(comfy_pytorch_attention,
                                                                                     monkeypatch):
    """Under precision int8 a modulated block's pre-norms come quantized from the adaLN pass (the attention's, and the
    post-norm + gated residual + MLP pre-norm one): only the attention's output and the SwiGLU's are quantized apart
    (2 a block, where an unmodulated context refiner block quantizes all 4 of its inputs)."""
    pytest.importorskip("triton")
    _config_class("ZImage")
    from sd_accel.kernels import quant
    from test_dit import _fused_output

    model, inp = _tiny_bf16("tiny-z-image")
    blocks = [m for m in model.modules() if type(m).__name__ == "JointTransformerBlock"]
    modulated = sum(1 for m in blocks if m.modulation not in (False, None))
    ref, _ = _fused_output(model, inp, "16bit")
    calls = []  # the activations quantized apart (not the weights' int8 copies, made once)

    def counted(x, *a, f, **k):
        calls.extend([] if isinstance(x, torch.nn.Parameter) else [1])
        return f(x, *a, **k)

    for name in ("quantize_rows", "quantize_rows_ref"):
        monkeypatch.setattr(quant, name, functools.partial(counted, f=getattr(quant, name)))
    out, counts = _fused_output(model, inp, "int8")
    assert 0 < modulated < len(blocks) and counts["fp8"] == 5 * len(blocks)
    assert len(calls) == 2 * modulated + 4 * (len(blocks) - modulated)
    assert 1e-4 < H.rel(out, ref) < 2e-2


# -------------------------------------------------------------------------------------------- HunyuanVideo 1.5
# ComfyUI 0.33's supported_models.HunyuanVideo15: its HunyuanVideo class with a vision input, whose blocks are Flux's
# classes (comfy.ldm.flux.layers' DoubleStreamBlock and LastLayer), served by the flux fusion as they are.

HUNYUAN_LATENT = 32  # its latent channels; its in_channels add the image condition's 32 and a mask


def _hunyuan_video15_class() -> None:
    import comfy.supported_models

    if not hasattr(comfy.supported_models, "HunyuanVideo15"):
        pytest.skip(f"ComfyUI {H.comfy_version()} has no HunyuanVideo 1.5 (supported_models.HunyuanVideo15, 0.33 "
                    "and later)")


def _hunyuan_video15_file(folder, seed: int = 0):
    """tiny-hunyuan-video15's weights (seeded louder where blocks add to the stream: H.tiny_dit_weights) written as a
    file and loaded by ComfyUI's own loader; its detection reads the tiny file's widths as the published file's (heads
    of 128, the vision input 1152 wide), so no detected_as."""
    _hunyuan_video15_class()
    model = H.load_diffusion_model_file(H.tiny_dit_weights("hunyuan-video", seed), folder)
    assert type(model.model.model_config).__name__ == "HunyuanVideo15"
    return model


def _sample_hunyuan_video(model, positive, negative, frames: int = 2, size: int = 4):
    import comfy.sample

    shape = (1, HUNYUAN_LATENT, frames, size, size)
    noise = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
    return comfy.sample.sample(model, noise, 2, 6.0, "euler", "simple", positive, negative, torch.zeros(shape),
                               disable_pbar=True, seed=1)


def test_hunyuan_video15_loaded_from_its_file_runs_fused_in_comfyuis_sampling_and_equals_plain(
        pack, comfy_pytorch_attention, tmp_path, monkeypatch):
    """A HunyuanVideo 1.5 file loaded by ComfyUI's own loader, through the node with the fused kernels: every double
    block fused (the flux fusion), every call the engine's, the latents plain ComfyUI's; the host's model is left as it
    was."""
    pytest.importorskip("triton")
    from sd_accel.accel.models.dit import inspect_dit

    model = _hunyuan_video15_file(tmp_path)
    spec = inspect_dit(model.model.diffusion_model)
    assert (spec.family, spec.in_channels, spec.depth, spec.single_depth) == ("hunyuan-video", 65, 2, 0)
    pos, neg = H.tiny_dit_conditioning("hunyuan-video", 3)
    calls, _ = _fused_equals_plain(pack, model, lambda m: _sample_hunyuan_video(m, pos, neg), _counted_blocks,
                                   monkeypatch)
    # 2 steps, conditional and unconditional in one batch: 2 calls of each of 2 double blocks (it has no single ones)
    assert calls == ["double_block"] * 4, calls


def test_hunyuan_video15_lora_after_the_node_changes_its_latents_as_plain_and_goes_again(
        pack, comfy_pytorch_attention, tmp_path):
    """A LoRA on the double blocks' qkv and first MLP projections after the node."""
    pytest.importorskip("triton")
    model = _hunyuan_video15_file(tmp_path, seed=4)
    pos, neg = H.tiny_dit_conditioning("hunyuan-video", 5)
    lora = H.lora_patches(model, 6, take=lambda key: key.startswith("double_blocks.")
                          and key.endswith(("attn.qkv.weight", "mlp.0.weight")))
    _lora_follows_plain(pack, model, lambda m: _sample_hunyuan_video(m, pos, neg), lora)


def test_hunyuan_video15_with_fused_kernels_matches_its_own_forward(comfy_pytorch_attention):
    """Its double blocks and last layer through the flux fusion against ComfyUI's own forward, in float32; undone, the
    model is ComfyUI's again."""
    pytest.importorskip("triton")
    _hunyuan_video15_class()
    from sd_accel.accel.engine import fusions
    from sd_accel.accel.models.dit import CanonicalDiT

    ref, out, counts, back, model = _fused_and_own("tiny-hunyuan-video15")
    assert CanonicalDiT(model).spec.family == "hunyuan-video"
    assert counts == {f: 3 if f == "flux" else 0 for f in fusions.DIT}  # 2 double blocks and the last layer
    assert H.rel(out, ref) <= FUSED_TOL
    assert torch.equal(back, ref) and not any("forward" in vars(m) for m in model.modules())


def test_hunyuan_video15_calls_with_inputs_the_engine_does_not_take_run_comfyuis_own_forward_and_say_so(pack,
                                                                                                       caplog):
    """Image-to-video's CLIP vision features (clip_fea) and a text attention mask are inputs the engine does not take
    (likewise ByT5's glyph text, a guiding frame, reference latents): such calls run ComfyUI's own forward, said once in
    words each; the other calls of the run are the engine's (on the CPU, the plain model's own kernels: the latents are
    plain's exactly)."""
    _hunyuan_video15_class()
    model = H.tiny_dit("hunyuan-video", 2)
    pos, neg = H.tiny_dit_conditioning("hunyuan-video", 6)
    features = torch.randn(1, 5, 1152, generator=torch.Generator().manual_seed(7))  # SigLIP's width
    with_vision = _positive_with((pos, neg), clip_vision_output=types.SimpleNamespace(last_hidden_state=features))
    masked = _positive_with((pos, neg), attention_mask=_text_mask())
    acc, slot = _accelerated(pack, model, fused=False)
    with caplog.at_level(logging.INFO, logger="sd-accel"):
        assert torch.equal(_sample_hunyuan_video(acc, *with_vision), _sample_hunyuan_video(model, *with_vision))
        assert torch.equal(_sample_hunyuan_video(acc, *masked), _sample_hunyuan_video(model, *masked))
        assert torch.equal(_sample_hunyuan_video(acc, pos, neg), _sample_hunyuan_video(model, pos, neg))
    said = [r.getMessage() for r in caplog.records if r.name == "sd-accel" and "own forward" in r.getMessage()]
    assert sum("inputs the engine does not take (clip_fea)" in s for s in said) == 1, said
    assert sum("inputs the engine does not take (attention_mask)" in s for s in said) == 1, said
    # a positive with an input of its own runs apart from the negative (2 steps: 2 plain calls, 2 engine calls),
    # twice; then both halves of 2 calls together through the engine
    assert slot.status.plain_calls == 4 and slot.status.engine_calls == 6, slot.status


@pytest.mark.fp8_products(DEVICE)
def test_hunyuan_video15_fp8_products_stay_close_to_its_16bit_fused_forward(comfy_pytorch_attention):
    """precision fp8 takes every double-block projection (qkv, proj and the MLP's two, per stream; the modulations and
    the text refiner stay 16-bit) and stays close to the 16-bit fused forward; auto leaves 16-bit weights."""
    pytest.importorskip("triton")
    _hunyuan_video15_class()
    (ref, counts), (out, counts8) = _fp8_and_16bit("tiny-hunyuan-video15")
    assert counts["flux"] == 3 and counts["fp8"] == 0
    assert counts8["fp8"] == 2 * 8  # per double block 2 streams x (qkv, proj, 2 MLP)
    assert 1e-4 < H.rel(out, ref) <= 5e-2


# ------------------------------------------------------------------------------------------------------- LTX-2
# ComfyUI 0.33's supported_models.LTXAV in LTX-2's form: a video and an audio latent denoised together, its
# BasicAVTransformerBlocks served by the ltx2 fusion.

LTX2_AUDIO = (8, 16)  # an audio latent's channels and frequency bins


def _ltx2_class() -> None:
    import comfy.supported_models

    if not hasattr(comfy.supported_models, "LTXAV"):
        pytest.skip(f"ComfyUI {H.comfy_version()} has no LTX-2 (supported_models.LTXAV, 0.33 and later)")


def _ltx2_file(folder, seed: int = 0):
    """tiny-ltx2's weights (seeded louder where blocks add to the stream: H.tiny_dit_weights) written as a file with
    its transformer config in the file's metadata, where the published file has LTX-2's, and loaded by ComfyUI's own
    loader, whose detection reads it."""
    from sd_accel.accel.models import configs

    _ltx2_class()
    module = H.tiny_dit_weights("ltx2", seed)
    path = H.write_diffusion_model_file(module, folder, configs.comfy_file_metadata("tiny-ltx2"))
    model = H.load_diffusion_model_path(path)
    assert type(model.model.model_config).__name__ == "LTXAV"
    return model


def _ltx2_conditioning(seed: int, tokens: int = 7, **entries) -> tuple:
    """(positive, negative) as LTX-2's text encoder gives them (its connectors' video and audio text side by side,
    padding trimmed), with `entries` (frame_rate, ...) in both, as LTXVConditioning sets them."""
    from sd_accel.accel.models import configs

    width = 2 * configs.COMFY_DIT_CONFIGS["tiny-ltx2"][1]["caption_channels"]
    g = torch.Generator().manual_seed(seed)
    return tuple([[torch.randn(1, tokens, width, generator=g) * scale, dict(entries)]] for scale in (1.0, 0.5))


def _ltx2_latents(frames: int = 2, size: tuple = (4, 6), audio: int = 5):
    """(noise, empty latent) as nested video and audio latents, as LTXVConcatAVLatent makes them."""
    import comfy.nested_tensor

    shapes = ((1, 128, frames, *size), (1, LTX2_AUDIO[0], audio, LTX2_AUDIO[1]))
    g = torch.Generator().manual_seed(1)
    noise = comfy.nested_tensor.NestedTensor([torch.randn(*s, generator=g) for s in shapes])
    return noise, comfy.nested_tensor.NestedTensor([torch.zeros(s) for s in shapes])


def _sample_ltx2(model, positive, negative, latents=None, **kwargs) -> torch.Tensor:
    """A 2-step run at CFG 3 on nested video and audio latents; the two latents flattened side by side."""
    import comfy.sample

    noise, empty = latents or _ltx2_latents()
    out = comfy.sample.sample(model, noise, 2, 3.0, "euler", "simple", positive, negative, empty, disable_pbar=True,
                              seed=1, **kwargs)
    return torch.cat([t.flatten() for t in (out.unbind() if getattr(out, "is_nested", False) else [out])])


def _counted_ltx2_blocks(monkeypatch) -> list:
    """The fused LTX-2 blocks' calls that the fused forward serves (not handed to the block's own)."""
    from sd_accel.accel.engine.fusions import ltx2

    calls = []
    monkeypatch.setattr(ltx2, "_mlp", lambda ff, h, f=ltx2._mlp: calls.append(ff) or f(ff, h))
    return calls


def test_ltx2_loaded_from_its_file_runs_fused_in_comfyuis_sampling_and_equals_plain(pack, comfy_pytorch_attention,
                                                                                    tmp_path, monkeypatch):
    """An LTX-2 file (its config in its metadata, as published) loaded by ComfyUI's own loader, through the node with
    the fused kernels: every block fused, every call the engine's, the video and audio latents plain ComfyUI's at the
    frame rate the conditioning sets (it moves the video's positions: the latents differ at another); the host's model
    is left as it was."""
    pytest.importorskip("triton")
    from sd_accel.accel.models.dit import inspect_dit

    model = _ltx2_file(tmp_path)
    spec = inspect_dit(model.model.diffusion_model)
    assert (spec.family, spec.in_channels, spec.depth, spec.context_dim) == ("ltx2", 128, 2, 64)
    pos, neg = _ltx2_conditioning(3, frame_rate=24.0)
    calls, plain = _fused_equals_plain(pack, model, lambda m: _sample_ltx2(m, pos, neg), _counted_ltx2_blocks,
                                       monkeypatch)
    # 2 steps, conditional and unconditional in one batch: 2 calls of 2 blocks, a video and an audio MLP each
    assert len(calls) == 8, calls
    assert H.rel(_sample_ltx2(model, *_ltx2_conditioning(3, frame_rate=25.0)), plain) > 1e-5


def test_ltx2_lora_after_the_node_changes_its_latents_as_plain_and_goes_again(pack, comfy_pytorch_attention,
                                                                            tmp_path):
    """A LoRA on the video self-attention's q (packed with k and v into one product), the audio cross attention's k
    (packed with v) and both MLPs' first projections, after the node."""
    pytest.importorskip("triton")
    model = _ltx2_file(tmp_path, seed=4)
    pos, neg = _ltx2_conditioning(5)
    lora = H.lora_patches(model, 6, take=lambda key: key.startswith("transformer_blocks.") and key.endswith(
        ("attn1.to_q.weight", "video_to_audio_attn.to_k.weight", "ff.net.0.proj.weight")))
    _lora_follows_plain(pack, model, lambda m: _sample_ltx2(m, pos, neg), lora)


def test_ltx2_with_fused_kernels_matches_its_own_forward(comfy_pytorch_attention, monkeypatch):
    """LTX-2's blocks (video and audio streams, their text and each other's cross attention, split rotary embeddings:
    the audio-video attentions' q and k each normalized and rotated in one pass) through the ltx2 fusion against
    ComfyUI's own forward, in float32; undone, the model is ComfyUI's again."""
    pytest.importorskip("triton")
    _ltx2_class()
    from sd_accel.accel.engine import fusions
    from sd_accel.accel.models.dit import CanonicalDiT
    from sd_accel.kernels import qk_rope

    passes = []
    monkeypatch.setattr(qk_rope, "row_norm_split_rope",
                        lambda x, *a, f=qk_rope.row_norm_split_rope: passes.append(x.shape) or f(x, *a))
    ref, out, counts, back, model = _fused_and_own("tiny-ltx2")
    assert len(passes) == 2 * 2 * 2  # 2 blocks, 2 audio-video attentions, q and k
    assert CanonicalDiT(model).spec.family == "ltx2"
    assert counts == {f: 2 if f == "ltx2" else 0 for f in fusions.DIT}  # its 2 blocks
    assert H.rel(out, ref) <= FUSED_TOL
    assert torch.equal(back, ref) and not any("forward" in vars(m) for m in model.modules())


class _Replaying:
    """GraphCache's contract, kept on the CPU: the first call at a signature runs fn itself; the next warms up on
    copies of its tensors and keeps them as the graph's buffers; each later one (the capturing one included) copies
    its tensors into the buffers and runs fn there, as a replay runs the captured kernels on them, and hands out
    copies of the outputs."""

    def __init__(self, fn) -> None:
        self.fn, self.seen, self.buffers, self.replays = fn, set(), {}, 0

    def __call__(self, tensors, token):
        key = (tuple((t.shape, t.dtype) for t in tensors), token)
        if key not in self.seen:
            self.seen.add(key)
            return self.fn(*tensors)
        if key not in self.buffers:
            self.buffers[key] = [t.clone() for t in tensors]
            self.fn(*self.buffers[key])
        for dst, src in zip(self.buffers[key], tensors):
            dst.copy_(src)
        self.replays += 1
        return [t.clone() for t in self.fn(*self.buffers[key])]

    def clear(self) -> None:
        self.buffers.clear()


def test_ltx2_block_stack_replayed_from_its_graphs_buffers_equals_the_fused_blocks(comfy_pytorch_attention,
                                                                                   monkeypatch):
    """With the fused blocks, LTX-2's block stack is what CUDA graphs capture (its forward copies coordinates from the
    CPU and cannot be captured whole): its calls go through the graph's buffers (here _Replaying on the CPU) and give
    the fused blocks' output exactly, call after call, at a second size too; a call whose first block STG perturbs
    runs the stack as it is; a model whose blocks are not fused, or whose method another node wraps (on the model or
    its class: a wrapper decides per call), has no stack to capture; undone, the method is ComfyUI's."""
    pytest.importorskip("triton")
    _ltx2_class()
    from sd_accel.accel.engine import fusions
    from sd_accel.accel.engine.fusions import ltx2
    from sd_accel.accel.engine.stack_graphs import StackGraphs
    from sd_accel.accel.models import configs
    from sd_accel.accel.models.dit import CanonicalDiT

    model = configs.build_dit("tiny-ltx2", "comfy", comfyui_root=H.comfy_root(), device=DEVICE)
    canon = CanonicalDiT(model)
    assert canon.uncapturable and ltx2.stack(model) is None  # ComfyUI's own blocks: nothing of ours to capture
    assert fusions.block_stack(model) is None
    # small sizes: the interpreter runs the rope kernel's nested functions once per token and head
    sizes = [configs.dit_example_inputs("tiny-ltx2", batch=2, latent=latent, device=DEVICE)
             for latent in ((4, 6), (2, 4))]
    undo, counts = fusions.apply(model)
    assert counts["ltx2"] == 2
    assert fusions.block_stack(model) == ltx2.stack(model)  # what the engine asks the fusions for
    own = type(model)._process_transformer_blocks
    model._process_transformer_blocks = functools.partial(own, model)
    assert ltx2.stack(model) is None
    del model._process_transformer_blocks
    monkeypatch.setattr(type(model), "_process_transformer_blocks", functools.wraps(own)(lambda *a, **k: own(*a, **k)))
    assert ltx2.stack(model) is None
    monkeypatch.undo()
    assert ltx2.stack(model) is not None
    with torch.no_grad():
        fused = [canon(**inp) for inp in sizes]
        stack_graphs = StackGraphs(lambda: ("weights",), lambda: None, max_graphs=4, device_type=torch.device(DEVICE).type)
        stack_graphs.graphs = _Replaying(stack_graphs.run)
        stacked = fusions.Undo()
        stack_graphs.apply(model, ltx2.stack(model), stacked)
        for inp, ref in [*zip(sizes, fused)] * 4:
            assert torch.equal(canon(**inp), ref)
        assert stack_graphs.graphs.replays == 6  # at each size: the method run, then captured and replayed, twice more
        stg = {"stg_self_attn_blocks": (0,)}  # STG's perturbed self-attention in the first block
        perturbed = canon(**sizes[0], transformer_options=stg)
        assert stack_graphs.graphs.replays == 6 and len(stack_graphs.graphs.seen) == 2
        stacked()
        assert "_process_transformer_blocks" not in vars(model)
        assert torch.equal(perturbed, canon(**sizes[0], transformer_options=stg))
        assert not torch.equal(perturbed, fused[0])
    undo()


def test_ltx2_calls_with_inputs_the_engine_does_not_take_run_comfyuis_own_forward_and_say_so(pack, caplog):
    """A denoise mask (image to video's first frame kept), a text attention mask, LTXVModalityGuidance's extra pass
    with the audio-video cross attention severed, and video alone: such calls run ComfyUI's own forward, said once in
    words each; the other calls of the run are the engine's (on the CPU, the plain model's own kernels: the latents
    are plain's exactly)."""
    _ltx2_class()
    from test_comfyui_stacking import host_node

    model = H.tiny_dit("ltx2", 2)
    pos, neg = _ltx2_conditioning(6)
    masked = _positive_with((pos, neg), attention_mask=_text_mask())
    noise, empty = _ltx2_latents()
    keep_first = comfy_nested([torch.ones(1, 1, 2, 4, 6), torch.ones(1, 1, 5, 16)])
    keep_first.tensors[0][:, :, 0] = 0
    video_only = tuple(t.unbind()[0] for t in (noise, empty))  # a video latent alone, as EmptyLTXVLatentVideo's
    acc, slot = _accelerated(pack, model, fused=False)
    guidance = host_node("nodes_lt", "LTXVModalityGuidance")
    guided, plain_guided = (H.run_node(guidance, m, modality_scale=3.0, start_percent=0.0, end_percent=1.0)
                            for m in (acc, model))
    with caplog.at_level(logging.INFO, logger="sd-accel"):
        assert torch.equal(_sample_ltx2(acc, pos, neg, noise_mask=keep_first),
                           _sample_ltx2(model, pos, neg, noise_mask=keep_first))
        assert torch.equal(_sample_ltx2(acc, *masked), _sample_ltx2(model, *masked))
        assert torch.equal(_sample_ltx2(guided, pos, neg), _sample_ltx2(plain_guided, pos, neg))
        assert torch.equal(_sample_ltx2(acc, pos, neg, video_only), _sample_ltx2(model, pos, neg, video_only))
    said = [r.getMessage() for r in caplog.records if r.name == "sd-accel" and "own forward" in r.getMessage()]
    # the mask reaches both latents: the audio's too, and the video's timestep per token is not the audio's
    assert sum("does not take (a_timestep, audio_denoise_mask, denoise_mask)" in s for s in said) == 1, said
    assert sum("inputs the engine does not take (attention_mask)" in s for s in said) == 1, said
    assert sum("inputs the engine does not take (a2v_cross_attn, v2a_cross_attn)" in s for s in said) == 1, said
    assert sum("without an audio latent" in s for s in said) == 1, said
    # 2 steps each: the denoise mask's run, both halves in one call (2 plain calls); the masked positive alone (2
    # plain), its negative (2 engine); the guided run, both halves (2 engine) and its extra pass (2 plain); video alone
    # (2 plain)
    assert slot.status.plain_calls == 8 and slot.status.engine_calls == 4, slot.status


def comfy_nested(tensors):
    import comfy.nested_tensor

    return comfy.nested_tensor.NestedTensor(list(tensors))


@pytest.mark.fp8_products(DEVICE)
def test_ltx2_fp8_products_stay_close_to_its_16bit_fused_forward(comfy_pytorch_attention):
    """precision fp8 takes every block projection of LTX-2 (four per attention, six attentions, two per MLP, two MLPs;
    its modulations are tables added to the time projections outside the blocks, which stay 16-bit) and stays close
    to the 16-bit fused forward; auto leaves 16-bit weights."""
    pytest.importorskip("triton")
    _ltx2_class()
    (ref, counts), (out, counts8) = _fp8_and_16bit("tiny-ltx2")
    assert counts["ltx2"] == 2 and counts["fp8"] == 0
    assert counts8["fp8"] == 2 * (6 * 4 + 2 * 2)
    assert 1e-4 < H.rel(out, ref) <= 5e-2


# ------------------------------------------------------------------------------------------------ several GPUs
# The node's gpus option on the video models: their calls spread over processes as on GPUs (gloo on the CPU, the
# workers placed by accelerated_unet.use_devices as tests/test_comfyui_gpus.py places them).


@pytest.mark.parametrize("family", ["ltx2", "hunyuan-video15"])
def test_video_models_split_their_cfg_batch_over_two_processes_and_equal_plain(pack, tmp_path, family):
    """LTX-2 (its video and audio latents together) and HunyuanVideo 1.5 loaded from their files, the node's calls
    spread over 2 processes: each call's conditional and unconditional halves on a process each (CFG parallel: their
    classes have no sequence-parallel layout), and the latents plain ComfyUI's within float32's reordered sums."""
    from sd_accel.nodes import accelerated_unet

    if family == "ltx2":
        model = _ltx2_file(tmp_path)
        pos, neg = _ltx2_conditioning(3, frame_rate=25.0)
        run = functools.partial(_sample_ltx2, positive=pos, negative=neg)
    else:
        model = _hunyuan_video15_file(tmp_path)
        pos, neg = H.tiny_dit_conditioning("hunyuan-video", 3)
        run = functools.partial(_sample_hunyuan_video, positive=pos, negative=neg)
    plain = run(model)
    acc, slot = _accelerated(pack, model, fused=False)
    accelerated_unet.use_devices(acc, ["cpu"] * 2, timeout=60)
    try:
        got = run(acc)
        assert (slot.status.layout, slot.status.spread_calls, slot.status.plain_calls) == ("CFG parallel over 2", 2, 0)
        assert H.rel(got, plain) <= 1e-5
    finally:
        slot.spread.close()

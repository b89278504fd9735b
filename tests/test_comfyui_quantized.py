"""Quantized diffusion-model files (ComfyUI's "fp8_scaled" and mixed-precision checkpoints, as many Flux, Wan and
Qwen-Image users download them) through the Accelerated UNet node, loaded by ComfyUI's own loader
(comfy.sd.load_diffusion_model, the UNETLoader's) from files laid out as the published ones are
(comfy_helpers.write_quantized_file). ComfyUI 0.33 holds their quantized layers as comfy-kitchen QuantizedTensors in its
mixed-precision Linear, which is no nn.Linear; 0.3.6x reads the "fp8_scaled" form only, into fp8 weights with a
scale_weight. The fused blocks take either; layers stored in e4m3 with one scale per tensor make the engine's fp8
products from the weights as stored; a file with layers of a format the engine does not read passes through, said once.

On the CPU ComfyUI computes in float32, where no fp8 product runs (the marked layers run their own forward): the node's
latents are plain's within float32 rounding. Where ComfyUI and the engine are told that the device computes in
bfloat16, as a GPU does, the marked layers make fp8 products, close to plain ComfyUI's (which on the CPU widens the e4m3
weights per call). Loading and sampling run in inference mode, as ComfyUI's executor runs its nodes.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from pathlib import Path

import pytest
import torch

import comfy_helpers as H
from sd_accel.nodes import accelerated_unet

pytestmark = pytest.mark.skipif(H.comfy_unavailable() is not None, reason=str(H.comfy_unavailable()))
# Where ComfyUI runs the models (comfy_helpers.import_comfy: its --cpu without a GPU), so where the fp8 products run.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# Per family: where its blocks' layers are, the block layer a mixed-precision file keeps 16-bit (as such files keep
# some), the fusion that takes its blocks, its latents' frames (None: an image model's 4-D latents), and the layers a
# LoRA patches
FAMILIES = {
    "flux": (("double_blocks.", "single_blocks."), "linear2", "flux", None, ("qkv.weight", "linear1.weight")),
    "wan": (("blocks.",), "ffn.2", "wan", 3, (".q.weight", "ffn.0.weight")),
    "qwen-image": (("transformer_blocks.",), "img_mlp.net.2", "qwen_image", 1,
                   ("to_q.weight", "to_v.weight", "img_mlp.net.0.proj.weight", "txt_mlp.net.0.proj.weight")),
}


def mixed(family: str):
    """The layers of a mixed-precision file of the family: its blocks' projections in e4m3 but one kind, which stays
    16-bit with the embedders and the last layer ("scaled_fp8" files take every Linear in e4m3)."""
    blocks, kept = FAMILIES[family][:2]
    return lambda name: "float8_e4m3fn" if name.startswith(blocks) and not name.endswith(kept) else None


def load(family: str, form: str, folder: Path, layers=None):
    """The family's tiny model written as a quantized file and loaded by ComfyUI's loader, with the number of block
    projections stored in e4m3 (which precision auto marks)."""
    if H.reads_quantized_form(form):
        pytest.skip(H.reads_quantized_form(form))
    import comfy.sd

    from sd_accel.accel.models import configs

    layers = layers or mixed(family)
    module = H.tiny_dit_weights(family)
    path = H.write_quantized_file(module, folder, form, layers)
    blocks = FAMILIES[family][0]
    e4m3 = sum(1 for key, t in module.state_dict().items() if t.dim() == 2 and key.endswith(".weight")
               and key.startswith(blocks) and (form == "scaled_fp8" or layers(key[: -len(".weight")])))
    tiny = configs.comfy_dit_config(f"tiny-{family}")[1]
    with H.detected_as(H.DIT_CLASSES[family], tiny), torch.inference_mode():
        return comfy.sd.load_diffusion_model(str(path)), e4m3


def accelerate(pack, model, precision: str = "auto"):
    node = pack.NODE_CLASS_MAPPINGS["SDAccelAcceleratedUNet"]()
    out = node.apply(model, "torch", True, False, **H.PROFILE, precision=precision, unique_id="7")["result"][0]
    slot = accelerated_unet.session_of(out).slot
    slot.options["triton_kernels"] = True  # the fused blocks, in Triton's interpreter on the CPU
    return out, slot


def sample(family: str, model, seed: int = 1):
    """What a 2-step sampling run adds to its noise: the latents less the noise the flow models' sampling starts
    from."""
    import comfy.sample

    pos, neg = H.tiny_dit_conditioning(family, 5)
    frames = FAMILIES[family][3]
    shape = (1, 16, 8, 8) if frames is None else (1, 16, frames, 8, 8)
    noise = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    with torch.inference_mode():
        latents = comfy.sample.sample(model, noise, 2, 3.0, "euler", "simple", pos, neg, torch.zeros(shape),
                                      disable_pbar=True, seed=seed)
    return latents - noise


@pytest.fixture()
def bf16_device(monkeypatch):
    """ComfyUI builds the model as for a GPU with bfloat16 (comfy_helpers.dtypes_of_a_bf16_gpu), and the engine takes
    the device for one that runs it."""
    import sd_accel.accel.accelerate as accelerate_module

    own = accelerate_module.detect
    monkeypatch.setattr(accelerate_module, "detect",
                        lambda *a, **k: dataclasses.replace(own(*a, **k), dtypes=("bfloat16", "float32")))
    return H.dtypes_of_a_bf16_gpu


@pytest.mark.parametrize("form", H.QUANTIZED_FORMS)
@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.fp8_products(DEVICE)
def test_a_quantized_file_runs_in_the_fused_blocks_with_comfyuis_latents(pack, comfy_pytorch_attention, tmp_path,
                                                                         family, form):
    """Before, in ComfyUI 0.33 every fused block declined such a model (its mixed-precision Linear is no nn.Linear):
    ComfyUI's own forward ran each call, and no layer was read as fp8."""
    model, e4m3 = load(family, form, tmp_path)
    plain = sample(family, model)
    acc, slot = accelerate(pack, model)
    out = sample(family, acc)
    assert H.rel(out, plain) <= 1e-5
    assert slot.status.engine_calls == 2 and slot.status.plain_calls == 0, slot.status
    counts = slot.acc.engine.fusion_counts
    assert counts[FAMILIES[family][2]] > 0 and counts["fp8"] == e4m3 > 0, counts


# the header's formats load into the same model as the comfy_quant entries (the test above)
@pytest.mark.parametrize("form", ["scaled_fp8", "comfy_quant"])
@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.fp8_products(DEVICE)
def test_the_e4m3_layers_of_a_quantized_file_make_fp8_products_from_their_stored_weights(
        pack, comfy_pytorch_attention, bf16_device, tmp_path, family, form):
    """As on a GPU: precision auto takes the e4m3 layers, with their per-tensor scales, as fp8 products, close to plain
    ComfyUI; 16bit runs them through ComfyUI's own layers. A LoRA after the node, which ComfyUI merges into new
    quantized weights, is followed; removed, the first latents come back exactly (the host's weights, which ComfyUI
    restores, were never written)."""
    import comfy.sd

    with bf16_device():
        model, e4m3 = load(family, form, tmp_path)
    assert (model.model.manual_cast_dtype or model.model.get_dtype()) == torch.bfloat16  # what ComfyUI computes in
    plain = sample(family, model)
    acc, slot = accelerate(pack, model)
    out = sample(family, acc)
    assert slot.acc.engine.fusion_counts["fp8"] == e4m3 and slot.status.plain_calls == 0
    assert H.rel(out, plain) <= 5e-2
    sixteen, slot16 = accelerate(pack, model, "16bit")
    widened = sample(family, sixteen)
    assert slot16.acc.engine.fusion_counts["fp8"] == 0 and H.rel(widened, plain) <= 2.5e-2
    assert H.rel(out, widened) > 1e-3  # the fp8 products ran

    blocks, patched = FAMILIES[family][0], FAMILIES[family][4]
    lora = H.lora_patches(model, 6, take=lambda key: key.startswith(blocks) and key.endswith(patched))

    def with_lora(m):
        return comfy.sd.load_lora_for_models(m, None, lora, 3.0, 0.0)[0]

    plain_lora = sample(family, with_lora(model))
    moved = H.rel(plain_lora, plain)
    assert moved > 5e-2  # the LoRA reaches the quantized layers
    assert H.rel(sample(family, with_lora(acc)), plain_lora) <= min(5e-2, moved / 3)
    assert torch.equal(sample(family, acc), out)
    assert slot.status.plain_calls == 0


def test_a_quantized_format_the_engine_does_not_read_passes_through_said_once(pack, tmp_path, caplog):
    """A mixed-precision file with int8 layers beside its e4m3 ones: the node gives ComfyUI's model back unchanged,
    with one console line naming the format, and the image is plain ComfyUI's."""
    e4m3 = mixed("flux")
    model, _ = load("flux", "comfy_quant", tmp_path,
                    lambda name: "int8_tensorwise" if name.endswith("qkv") else e4m3(name))
    plain = sample("flux", model)
    node = pack.NODE_CLASS_MAPPINGS["SDAccelAcceleratedUNet"]()
    with caplog.at_level(logging.WARNING, logger="sd-accel"):
        out = node.apply(model, "auto", True, False, **H.PROFILE, unique_id="9")
    said = [r.getMessage() for r in caplog.records if r.name == "sd-accel"]
    assert len(said) == 1 and "int8_tensorwise" in said[0] and "passes through unaccelerated" in said[0], said
    assert out["result"][0] is model and accelerated_unet.session_of(model) is None
    assert torch.equal(sample("flux", out["result"][0]), plain)


def test_the_gpu_check_of_quantized_files_runs_on_a_tiny_flux():
    """tests/gpu/quantized.py's harness on the tiny Flux on the CPU (the node's float32 path; its quick sequence):
    every run within its limit of plain ComfyUI's on the same quantized file, a LoRA that changes the image."""
    sys.path.insert(0, str(Path(__file__).parent / "gpu"))
    import quantized

    form = "comfy_quant" if H.reads_quantized_form("comfy_quant") is None else "scaled_fp8"
    report = quantized.run_quantized("flux-dev", form, size="tiny", device="cpu", quick=True)
    print(report.table())
    assert {r.setting for r in report.rows} == {"auto, graphs off"}
    assert {"20 steps again", "LoRA 0.4", "LoRA removed", "after unload", "batch 2"} <= {r.run for r in report.rows}
    assert not report.failures() and report.lora_effect > 1e-3, report.table()

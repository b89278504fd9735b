"""Write a seeded random-weight checkpoint that A1111 loads as it loads a real one, using A1111's own model classes.

Run with the Python of an A1111 environment, with the `ldm` repository (A1111's repositories/stable-diffusion-
stability-ai) importable:

    python make_checkpoint.py CONFIG.yaml OUT.safetensors [--seed N] [--lora OUT_LORA.safetensors] [--half]
                              [--device cuda]

The config is any LatentDiffusion config (tests/a1111/tiny-sd1.yaml, or A1111's configs/v1-inference.yaml for a
full-size SD1.5), or generative-models' DiffusionEngine config for SDXL (configs/inference/sd_xl_base.yaml, with
that repository's `sgm` importable too). Nothing is downloaded: the CLIP text encoder is built from the config in the
offline Hugging Face cache (HF_HOME), and SDXL's OpenCLIP encoder from open_clip's own config, with seeded weights.
--device cuda builds on the GPU, where SDXL's 3.5 billion parameters take seconds rather than minutes.

What makes random weights usable here:
- ldm zero-initialises every ResBlock's last conv, every transformer's proj_out and the UNet's output conv, so an
  untrained UNet predicts exactly zero noise and every sampler returns its input: those get small random values,
  or a test comparing two images could not fail.
- A1111 raises NansException for an all-zero text embedding; the text encoders' final LayerNorm biases keep it away
  from zero.
- The checkpoint holds every buffer (noise schedule included): A1111 builds the model on the meta device and
  takes everything from the file.

With --lora, also a LoRA in the kohya format that A1111's Lora extension reads, for the UNet's attention
projections (rank 4, seeded).
"""

from __future__ import annotations

import argparse
import contextlib

import torch
from omegaconf import OmegaConf
from safetensors.torch import save_file


def _seeded_clip(name: str, *args, **kwargs):
    from transformers import CLIPTextConfig, CLIPTextModel

    return CLIPTextModel(CLIPTextConfig.from_pretrained(name))


def _untrained_open_clip(create):
    def create_without_weights(*args, pretrained=None, **kwargs):
        return create(*args, pretrained=None, **kwargs)

    return create_without_weights


def _on_cpu(fn):
    def on_cpu(*args, **kwargs):
        with torch.device("cpu"):
            return fn(*args, **kwargs)

    return on_cpu


def build(config_path: str, seed: int) -> torch.nn.Module:
    import importlib

    import open_clip
    import transformers

    from ldm.util import instantiate_from_config

    transformers.CLIPTextModel.from_pretrained = _seeded_clip
    open_clip.create_model_and_transforms = _untrained_open_clip(open_clip.create_model_and_transforms)
    # The noise schedule is made in numpy from a torch tensor (.numpy()), which a GPU tensor refuses.
    for name in ("ldm.models.diffusion.ddpm", "sgm.modules.diffusionmodules.discretizer"):
        with contextlib.suppress(ImportError):  # sgm only where generative-models is on the path
            module = importlib.import_module(name)
            module.make_beta_schedule = _on_cpu(module.make_beta_schedule)
    torch.manual_seed(seed)
    model = instantiate_from_config(OmegaConf.load(config_path).model)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith("model.diffusion_model.") and not p.any():
                p.copy_(torch.randn(p.shape, generator=g, device=g.device) * 0.02)
        for name, m in model.named_modules():
            if name.endswith(("final_layer_norm", "ln_final")):
                m.bias.copy_(torch.randn(m.bias.shape, generator=g, device=g.device) * 0.1)
    return model


def lora(model: torch.nn.Module, seed: int, rank: int = 4) -> dict[str, torch.Tensor]:
    """kohya keys (lora_unet_<module path with _>.lora_down/lora_up/alpha) for every attention projection."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, m in model.model.diffusion_model.named_modules():
        if isinstance(m, torch.nn.Linear) and name.rsplit(".", 1)[-1] in ("to_q", "to_k", "to_v"):
            key = "lora_unet_" + name.replace(".", "_")
            out[f"{key}.lora_down.weight"] = torch.randn(rank, m.in_features, generator=g) * 0.3
            out[f"{key}.lora_up.weight"] = torch.randn(m.out_features, rank, generator=g) * 0.3
            out[f"{key}.alpha"] = torch.tensor(float(rank))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config")
    parser.add_argument("out")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lora", default=None, help="also write a LoRA for this model here")
    parser.add_argument("--half", action="store_true", help="store the weights in fp16")
    parser.add_argument("--device", default="cpu", help="where the model is built (cuda: a full-size one in seconds)")
    args = parser.parse_args()
    with torch.device(args.device):
        model = build(args.config, args.seed)
    dtype = torch.float16 if args.half else torch.float32
    state = {k: (v.to(dtype) if v.is_floating_point() else v).contiguous().cpu()
             for k, v in model.state_dict().items()}
    save_file(state, args.out)
    if args.lora:
        save_file({k: v.contiguous().cpu() for k, v in lora(model, args.seed + 7).items()}, args.lora)


if __name__ == "__main__":
    main()

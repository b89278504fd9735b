"""Published architecture configs (SD1.5, SD2.1, SDXL UNets, the SD VAE) and tiny ones for the CPU.

Models are built from these with seeded random weights: nothing is downloaded.
"""

from __future__ import annotations

import importlib
import inspect
import sys
import types
from pathlib import Path

import torch
from torch import nn

from ..errors import BadInput

UNET_CONFIGS: dict[str, dict] = {
    # runwayml/stable-diffusion-v1-5 unet/config.json
    "sd15": dict(
        sample_size=64, in_channels=4, out_channels=4, layers_per_block=2,
        block_out_channels=(320, 640, 1280, 1280),
        down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=768, attention_head_dim=8, norm_num_groups=32),
    # stabilityai/stable-diffusion-2-1 unet/config.json
    "sd21": dict(
        sample_size=96, in_channels=4, out_channels=4, layers_per_block=2,
        block_out_channels=(320, 640, 1280, 1280),
        down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=1024, attention_head_dim=(5, 10, 20, 20), use_linear_projection=True, norm_num_groups=32),
    # stabilityai/stable-diffusion-xl-base-1.0 unet/config.json
    "sdxl": dict(
        sample_size=128, in_channels=4, out_channels=4, layers_per_block=2,
        block_out_channels=(320, 640, 1280),
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
        transformer_layers_per_block=(1, 2, 10), attention_head_dim=(5, 10, 20), cross_attention_dim=2048,
        use_linear_projection=True, addition_embed_type="text_time", addition_time_embed_dim=256,
        projection_class_embeddings_input_dim=2816, norm_num_groups=32),
    # Small versions with the same block types, for the CPU and for tests.
    "tiny-sd15": dict(
        sample_size=16, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(32, 64),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=32, attention_head_dim=8, norm_num_groups=8),
    "tiny-sdxl": dict(
        sample_size=16, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(32, 64),
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"), up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        transformer_layers_per_block=(1, 2), attention_head_dim=(4, 8), cross_attention_dim=48,
        use_linear_projection=True, addition_embed_type="text_time", addition_time_embed_dim=8,
        projection_class_embeddings_input_dim=32 + 6 * 8, norm_num_groups=8),
}

VAE_CONFIGS: dict[str, dict] = {
    # runwayml/stable-diffusion-v1-5 vae/config.json (the SD1.x/SD2.x VAE; SDXL's has the same architecture)
    "sd": dict(
        in_channels=3, out_channels=3, latent_channels=4, layers_per_block=2, block_out_channels=(128, 256, 512, 512),
        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
        norm_num_groups=32, sample_size=512, scaling_factor=0.18215),
    "tiny": dict(
        in_channels=3, out_channels=3, latent_channels=4, layers_per_block=1, block_out_channels=(32, 64),
        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
        norm_num_groups=8, sample_size=32, scaling_factor=0.18215),
}

# The same UNets in ldm form, as ComfyUI's model detection configures its UNetModel for those checkpoints.
_LDM_SD15 = dict(image_size=32, in_channels=4, out_channels=4, model_channels=320, num_res_blocks=[2, 2, 2, 2],
                 channel_mult=[1, 2, 4, 4], transformer_depth=[1, 1, 1, 1, 1, 1, 0, 0],
                 transformer_depth_output=[1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0], transformer_depth_middle=1,
                 context_dim=768, use_linear_in_transformer=False, adm_in_channels=None, use_temporal_attention=False,
                 use_temporal_resblock=False, use_spatial_transformer=True, num_heads=8, num_head_channels=-1,
                 legacy=False, use_checkpoint=False)
_LDM_SDXL = {**_LDM_SD15, "num_res_blocks": [2, 2, 2], "channel_mult": [1, 2, 4],
             "transformer_depth": [0, 0, 2, 2, 10, 10], "transformer_depth_output": [0, 0, 0, 2, 2, 2, 10, 10, 10],
             "transformer_depth_middle": 10, "context_dim": 2048, "adm_in_channels": 2816,
             "use_linear_in_transformer": True, "num_classes": "sequential", "num_head_channels": 64, "num_heads": -1}
LDM_UNET_CONFIGS: dict[str, dict] = {
    "sd15": _LDM_SD15, "sdxl": _LDM_SDXL,
    "tiny-sd15": {**_LDM_SD15, "model_channels": 32, "num_res_blocks": [1, 1], "channel_mult": [1, 2],
                  "transformer_depth": [1, 1], "transformer_depth_output": [1, 1, 1, 1], "num_heads": 2},
    "tiny-sdxl": {**_LDM_SDXL, "model_channels": 32, "num_res_blocks": [1, 1], "channel_mult": [1, 2],
                  "transformer_depth": [0, 1], "transformer_depth_output": [0, 0, 1, 1], "transformer_depth_middle": 1,
                  "num_head_channels": 16},
}

# Token count and context width of each UNet's text conditioning, and the latent side at its native resolution.
SHAPES = {"sd15": (77, 64), "sd21": (77, 96), "sdxl": (77, 128), "tiny-sd15": (77, 16), "tiny-sdxl": (77, 16)}


def _seeded(build, seed: int, device: torch.device | str, dtype: torch.dtype) -> nn.Module:
    from diffusers.utils import logging

    logging.set_verbosity_error()  # its warning about casting with .to() concerns pretrained checkpoints
    torch.manual_seed(seed)
    with torch.device(device):
        m = build()
    return m.to(dtype=dtype).eval().requires_grad_(False)


def build_unet(name: str, seed: int = 0, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> nn.Module:
    """A diffusers UNet2DConditionModel of a published architecture with seeded random weights."""
    from diffusers import UNet2DConditionModel

    if name not in UNET_CONFIGS:
        raise ValueError(f"unknown UNet config {name!r}; choose one of {', '.join(UNET_CONFIGS)}")
    return _seeded(lambda: UNet2DConditionModel(**UNET_CONFIGS[name]), seed, device, dtype)


def build_vae(name: str = "sd", seed: int = 0, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> nn.Module:
    """A diffusers AutoencoderKL of a published architecture with seeded random weights."""
    from diffusers import AutoencoderKL

    if name not in VAE_CONFIGS:
        raise ValueError(f"unknown VAE config {name!r}; choose one of {', '.join(VAE_CONFIGS)}")
    return _seeded(lambda: AutoencoderKL(**VAE_CONFIGS[name]), seed, device, dtype)


def seed_parameters(module: nn.Module, seed: int) -> nn.Module:
    """Seeded weights with sane activations, for modules whose own init is skipped (ComfyUI builds its layers
    uninitialised): norm scales near 1, biases small, matrices scaled by 1/sqrt(fan_in)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            r = torch.randn(p.shape, generator=g)
            if p.dim() == 1:
                r = 1 + 0.1 * r if name.endswith("weight") and "norm" in name else 0.1 * r
            else:
                r = r / p[0].numel() ** 0.5
            p.copy_(r)
    return module


def build_comfy_unet(name: str, comfyui_root: str | Path, seed: int = 0, device: torch.device | str = "cpu",
                     dtype: torch.dtype = torch.float32) -> nn.Module:
    """ComfyUI's own UNetModel (from the checkout at comfyui_root) of a published architecture, seeded weights."""
    if name not in LDM_UNET_CONFIGS:
        raise ValueError(f"no ComfyUI config for {name!r}; choose one of {', '.join(LDM_UNET_CONFIGS)}")
    ops = comfy_ops(comfyui_root)
    from comfy.ldm.modules.diffusionmodules.openaimodel import UNetModel

    unet = UNetModel(**LDM_UNET_CONFIGS[name], dtype=torch.float32, device="cpu",
                     operations=ops.disable_weight_init)
    return seed_parameters(unet, seed).to(device, dtype).eval().requires_grad_(False)


# The same UNets as A1111 configures its own classes for them (configs/v1-inference.yaml: ldm; sd_xl_base.yaml: sgm).
_A1111_CONFIGS = {
    "sd15": ("ldm", dict(image_size=32, in_channels=4, out_channels=4, model_channels=320,
                         attention_resolutions=[4, 2, 1], num_res_blocks=2, channel_mult=[1, 2, 4, 4], num_heads=8,
                         use_spatial_transformer=True, transformer_depth=1, context_dim=768, use_checkpoint=False,
                         legacy=False)),
    "sdxl": ("sgm", dict(adm_in_channels=2816, num_classes="sequential", use_checkpoint=False, in_channels=4,
                         use_spatial_transformer=True,
                         out_channels=4, model_channels=320, attention_resolutions=[4, 2], num_res_blocks=2,
                         channel_mult=[1, 2, 4], num_head_channels=64, use_linear_in_transformer=True,
                         transformer_depth=[1, 2, 10], context_dim=2048, spatial_transformer_attn_type="softmax",
                         legacy=False)),
}
_A1111_TINY = dict(model_channels=32, attention_resolutions=[2, 1], num_res_blocks=1, channel_mult=[1, 2])
_A1111_CONFIGS["tiny-sd15"] = ("ldm", {**_A1111_CONFIGS["sd15"][1], **_A1111_TINY, "num_heads": 2})
_A1111_CONFIGS["tiny-sdxl"] = ("sgm", {**_A1111_CONFIGS["sdxl"][1], **_A1111_TINY, "transformer_depth": [1, 1],
                                       "num_head_channels": 16})


def _package_shell(name: str, folder: Path) -> None:
    """Make `name` importable as a package of `folder` without running its __init__ (sgm's imports its whole
    training stack: Lightning, open_clip, ...; only the UNet's modules are needed here)."""
    if name not in sys.modules:
        shell = types.ModuleType(name)
        shell.__path__ = [str(folder)]
        sys.modules[name] = shell


def _sdpa_cross_attention(self, x, context=None, mask=None, **kwargs):
    """ldm's CrossAttention through PyTorch's SDPA: what A1111's default cross-attention optimization ("sdp")
    runs in place of ldm's einsum attention."""
    q, k, v = self.to_q(x), self.to_k(x if context is None else context), self.to_v(x if context is None else context)
    b, h = q.shape[0], self.heads
    q, k, v = (t.reshape(b, -1, h, t.shape[-1] // h).transpose(1, 2) for t in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    return self.to_out(out.transpose(1, 2).reshape(b, -1, h * out.shape[-1]))


def host_import_paths(host: str, root: str | Path) -> list[Path]:
    """The folders whose modules a host's UNet class imports by their top-level names (comfy, ldm, backend): they must
    be on the import path of the process that builds it (the host's own start-up puts them there). ValueError when
    `root` is not what `host` needs."""
    root = Path(root).expanduser().resolve()
    if host == "comfyui":
        if not (root / "comfy" / "ldm" / "modules" / "diffusionmodules" / "openaimodel.py").is_file():
            raise ValueError(f"{root} is not a ComfyUI checkout (no comfy/ldm/modules/diffusionmodules/openaimodel.py);"
                             " pass the folder that holds ComfyUI's main.py.")
        return [root]
    if host == "a1111":
        ldm = root / "stable-diffusion-stability-ai"
        if not (ldm / "ldm" / "modules" / "diffusionmodules" / "openaimodel.py").is_file():
            raise ValueError(f"{ldm} has no ldm/; pass A1111's repositories folder.")
        if not (root / "generative-models" / "sgm" / "modules" / "diffusionmodules" / "openaimodel.py").is_file():
            raise ValueError(f"{root / 'generative-models' / 'sgm'} is missing; pass A1111's repositories folder.")
        return [ldm]  # sgm is loaded from its folder without the path (see build_host_unet)
    if host == "forge":
        if not (root / "backend" / "nn" / "unet.py").is_file():
            raise ValueError(f"{root} is not a Forge checkout (no backend/nn/unet.py).")
        return [root, root / "packages_3rdparty"]
    raise ValueError(f"unknown host {host!r}; choose comfyui, a1111 or forge")


def comfy_ops(comfyui_root: str | Path) -> types.ModuleType:
    """ComfyUI's comfy.ops from the checkout at comfyui_root (its folder on the import path), ComfyUI set to the CPU
    where torch sees no GPU. BadInput, naming the package, where one that ComfyUI imports is not installed (ComfyUI
    0.33 imports comfy-aimdo and comfy-kitchen, which 0.3.64 did not): its own ModuleNotFoundError would be a stack
    trace deep inside ComfyUI."""
    _require_importable(host_import_paths("comfyui", comfyui_root))
    try:
        import comfy.cli_args

        comfy.cli_args.args.cpu = comfy.cli_args.args.cpu or not torch.cuda.is_available()
        import comfy.ops
    except ModuleNotFoundError as e:
        package = (e.name or "comfy").split(".")[0]
        if package == "comfy":
            raise
        root = Path(comfyui_root).expanduser().resolve()
        raise BadInput(f"ComfyUI at {root} cannot be imported here: it imports {package}, which this "
                       f"Python does not have ({e}).", f"Install ComfyUI's requirements into it: {sys.executable} -m "
                       f"pip install -r {root / 'requirements.txt'}") from e
    return comfy.ops


def off_import_path(folders: list[Path]) -> list[Path]:
    """The folders not on this process's import path; a folder reached through a link counts as on it."""
    on_path = {Path(p).resolve() for p in sys.path if p}
    return [f for f in folders if f.resolve() not in on_path]


def _require_importable(folders: list[Path]) -> None:
    missing = [str(f) for f in off_import_path(folders)]
    if missing:
        raise ImportError(f"the host's folders {', '.join(missing)} are not on the import path; start Python with "
                          "them on PYTHONPATH (python -m sd_accel bench does).")


def build_host_unet(name: str, host: str, root: str | Path, seed: int = 0, device: torch.device | str = "cpu",
                    dtype: torch.dtype = torch.float32) -> nn.Module:
    """A host's own UNet class of a published architecture, seeded weights: host "comfyui" (root: a ComfyUI
    checkout), "a1111" (root: A1111's repositories folder, with stable-diffusion-stability-ai and generative-models)
    or "forge" (root: a Forge checkout)."""
    root = Path(root).expanduser().resolve()
    if host == "comfyui":
        return build_comfy_unet(name, root, seed, device, dtype)
    _require_importable(host_import_paths(host, root))
    if host == "a1111":
        if name not in _A1111_CONFIGS:
            raise ValueError(f"no A1111 config for {name!r}; choose one of {', '.join(_A1111_CONFIGS)}")
        form, cfg = _A1111_CONFIGS[name]
        if form == "ldm":
            import ldm.modules.attention
            from ldm.modules.diffusionmodules.openaimodel import UNetModel

            ldm.modules.attention.CrossAttention.forward = _sdpa_cross_attention
        else:
            folder = root / "generative-models" / "sgm"
            for package, path in (("sgm", folder), ("sgm.modules", folder / "modules"),
                                  ("sgm.modules.diffusionmodules", folder / "modules" / "diffusionmodules")):
                _package_shell(package, path)
            from sgm.modules.diffusionmodules.openaimodel import UNetModel
        unet = UNetModel(**cfg)
        # A1111 casts the time embedding's sinusoids to the UNet's dtype (its timestep_embedding hijack); the
        # repositories' own code leaves them in float32.
        unet.time_embed.register_forward_pre_hook(lambda m, args: (args[0].to(m[0].weight.dtype),))
    elif host == "forge":
        from backend.nn.unet import IntegratedUNet2DConditionModel
        from backend.operations import using_forge_operations

        accepted = inspect.signature(IntegratedUNet2DConditionModel.__init__).parameters
        cfg = {k: v for k, v in LDM_UNET_CONFIGS[name].items() if k in accepted}
        # Forge's loader builds the UNet with its own layer classes, whose Linear gets its weight from a state dict.
        weights = seed_parameters(IntegratedUNet2DConditionModel(**cfg), seed).state_dict()
        with using_forge_operations():
            unet = IntegratedUNet2DConditionModel(**cfg)
        unet.load_state_dict(weights)
        return unet.to(device, dtype).eval().requires_grad_(False)
    else:
        raise ValueError(f"unknown host {host!r}; choose comfyui, a1111 or forge")
    unet = seed_parameters(unet, seed).to(device, dtype).eval().requires_grad_(False)
    if isinstance(getattr(unet, "dtype", None), torch.dtype):
        unet.dtype = dtype  # ldm casts its input to this; A1111 sets it to the dtype it loaded the UNet in
    return unet


def ldm_example_inputs(name: str, batch: int = 2, seed: int = 1):
    """Seeded (x, timesteps, context, y) for the canonical call of the ldm-form UNet `name` at its native size."""
    cfg = LDM_UNET_CONFIGS[name]
    tokens, latent = SHAPES[name]
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, cfg["in_channels"], latent, latent, generator=g)
    context = torch.randn(batch, tokens, cfg["context_dim"], generator=g)
    y = torch.randn(batch, cfg["adm_in_channels"], generator=g) if cfg["adm_in_channels"] else None
    return x, torch.full((batch,), 500.0), context, y


def example_inputs(unet: nn.Module, batch: int = 2, latent: int | tuple[int, int] | None = None, tokens: int = 77,
                   seed: int = 1, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32):
    """Seeded (x, timesteps, context, y) for the canonical call of a diffusers UNet."""
    c = unet.config
    h, w = (latent, latent) if isinstance(latent, int) else (latent or (c["sample_size"], c["sample_size"]))
    g = torch.Generator().manual_seed(seed)
    ctx_dim = c["cross_attention_dim"]
    x = torch.randn(batch, c["in_channels"], h, w, generator=g)
    t = torch.full((batch,), 500.0)
    context = torch.randn(batch, tokens, ctx_dim, generator=g)
    y = None
    if c.get("addition_embed_type") == "text_time":
        y = torch.randn(batch, c["projection_class_embeddings_input_dim"], generator=g)
    move = lambda v: None if v is None else v.to(device=device, dtype=dtype)
    return move(x), t.to(device), move(context), move(y)


# Diffusion transformers. ComfyUI's form: the arguments its model detection gives comfy.ldm.flux.model.Flux and
# comfy.ldm.modules.diffusionmodules.mmdit.OpenAISignatureMMDITWrapper for the published checkpoints.
_COMFY_FLUX_DEV = dict(in_channels=16, out_channels=16, vec_in_dim=768, context_in_dim=4096, hidden_size=3072,
                       mlp_ratio=4.0, num_heads=24, depth=19, depth_single_blocks=38, axes_dim=[16, 56, 56],
                       theta=10000, patch_size=2, qkv_bias=True, guidance_embed=True)

# Chroma (lodestones/Chroma): Flux-schnell's blocks without vector_in, the modulations from the approximator.
_COMFY_CHROMA = dict(in_channels=64, out_channels=64, context_in_dim=4096, hidden_size=3072, mlp_ratio=4.0,
                     num_heads=24, depth=19, depth_single_blocks=38, axes_dim=[16, 56, 56], theta=10000, patch_size=2,
                     qkv_bias=True, in_dim=64, out_dim=3072, hidden_dim=5120, n_layers=5)


# Flux.2-dev (ComfyUI 0.33's model detection for its file): Flux's classes with one modulation for all double blocks
# and one for all single blocks, SiLU-gated MLPs, no biases, 128 latent channels in 1x1 patches, no pooled input.
_COMFY_FLUX2_DEV = dict(image_model="flux2", in_channels=128, out_channels=128, vec_in_dim=None, context_in_dim=15360,
                        hidden_size=6144, mlp_ratio=3.0, num_heads=48, depth=8, depth_single_blocks=48,
                        axes_dim=[32, 32, 32, 32], theta=2000, patch_size=1, qkv_bias=False, guidance_embed=True,
                        txt_ids_dims=[3], global_modulation=True, mlp_silu_act=True, ops_bias=False,
                        default_ref_method="index", ref_index_scale=10.0, yak_mlp=False, txt_norm=False)


def _comfy_mmdit(depth: int, pos_max: int, x_attn_layers: list[int], context: int = 4096, adm: int = 2048) -> dict:
    # MMDiT's width is 64 x depth and its heads are as many as its blocks
    return dict(in_channels=16, out_channels=16, patch_size=2, depth=depth, adm_in_channels=adm, input_size=None,
                context_embedder_config={"target": "torch.nn.Linear",
                                         "params": {"in_features": context, "out_features": 64 * depth}},
                pos_embed_max_size=pos_max, num_patches=pos_max * pos_max, pos_embed_scaling_factor=None,
                qk_norm="rms", x_block_self_attn_layers=x_attn_layers)


# Wan (ComfyUI's WanModel, as its model detection configures it for the published checkpoints): 2.1 T2V 14B and
# 1.3B, 2.2 TI2V 5B (48 latent channels). Qwen-Image: ComfyUI's class defaults are the published 20B MMDiT.
_COMFY_WAN21_14B = dict(image_model="wan2.1", model_type="t2v", patch_size=(1, 2, 2), text_len=512, in_dim=16,
                        dim=5120, ffn_dim=13824, freq_dim=256, text_dim=4096, out_dim=16, num_heads=40,
                        num_layers=40, eps=1e-6)
_COMFY_QWEN_IMAGE = dict(image_model="qwen_image", patch_size=2, in_channels=64, out_channels=16, num_layers=60,
                         attention_head_dim=128, num_attention_heads=24, joint_attention_dim=3584,
                         pooled_projection_dim=768, axes_dims_rope=(16, 56, 56))
# Z-Image (Tongyi-MAI/Z-Image-Turbo transformer/config.json: dim 3840, 30 layers, 30 heads, 2 refiner layers, caption
# width 2560, rope theta 256, t_scale 1000), as ComfyUI 0.33's model detection configures its NextDiT (Lumina 2's
# class) for the published file: its supported_models.ZImage.
_COMFY_Z_IMAGE = dict(image_model="lumina2", patch_size=2, in_channels=16, dim=3840, cap_feat_dim=2560, n_layers=30,
                      qk_norm=True, n_heads=30, n_kv_heads=30, axes_dims=[32, 48, 48], axes_lens=[1536, 512, 512],
                      rope_theta=256.0, ffn_dim_multiplier=8.0 / 3.0, z_image_modulation=True, time_scale=1000.0,
                      pad_tokens_multiple=32)

# HunyuanVideo 1.5's 480p text-to-video transformer (tencent/HunyuanVideo-1.5 transformer/480p_t2v/config.json:
# hidden_size 2048, heads_num 16, mm_double_blocks_depth 54, mm_single_blocks_depth 0, mlp_width_ratio 4, patch_size
# [1, 1, 1], in/out_channels 32 with concat_condition (the latent, the image condition's 32 channels and a mask: 65
# in), rope_dim_list [16, 56, 56], rope_theta 256, text_states_dim 3584 (Qwen2.5-VL-7B), glyph ByT5 and
# vision_states_dim 1152 (SigLIP), use_cond_type_embedding, guidance_embed and use_meanflow false), as ComfyUI 0.33's
# model detection configures its HunyuanVideo class for the published file (comfy/model_detection.py, image_model
# "hunyuan_video": no vector_in, so vec_in_dim None; byt5 from byt5_in; vision_in_dim from vision_in.proj.0; meanflow
# from time_r_in; theta 256 and heads of 128 as constants): its supported_models.HunyuanVideo15.
_COMFY_HUNYUAN_VIDEO15 = dict(image_model="hunyuan_video", in_channels=65, out_channels=32, patch_size=[1, 1, 1],
                              vec_in_dim=None, axes_dim=[16, 56, 56], meanflow=False, context_in_dim=3584,
                              hidden_size=2048, mlp_ratio=4.0, num_heads=16, depth=54, depth_single_blocks=0,
                              theta=256, qkv_bias=True, byt5=True, guidance_embed=False, use_cond_type_embedding=True,
                              vision_in_dim=1152, meanflow_sum=True)

# LTX-2 (Lightricks' ltx-2-19b-dev): ComfyUI 0.33's LTXAVModel as its model detection configures it for the published
# file, whose "config" metadata holds the transformer's settings (ltx-core's LTXModelConfigurator reads the same):
# 48 blocks of a video stream (32 heads of 128) and an audio stream (32 heads of 64) with cross attention between them,
# Gemma 3's 3840-wide text through the model's connectors (30 heads of 128, 2 layers: ComfyUI's defaults) and its
# caption projections (caption_proj_before_connector false), split rotary embeddings from float64 frequencies, middle
# indices grids, causal temporal positions, the cross attention's timestep scaled by 1000; no gated attention and no
# cross-attention adaLN (LTX-2.3's form).
_COMFY_LTX2 = dict(image_model="ltxav", in_channels=128, audio_in_channels=128, cross_attention_dim=4096,
                   audio_cross_attention_dim=2048, attention_head_dim=128, audio_attention_head_dim=64,
                   num_attention_heads=32, audio_num_attention_heads=32, caption_channels=3840, num_layers=48,
                   positional_embedding_theta=10000.0, positional_embedding_max_pos=[20, 2048, 2048],
                   audio_positional_embedding_max_pos=[20], causal_temporal_positioning=True,
                   use_middle_indices_grid=True, timestep_scale_multiplier=1000, av_ca_timestep_scale_multiplier=1000.0,
                   rope_type="split", frequencies_precision="float64")

COMFY_DIT_CONFIGS: dict[str, tuple[str, dict]] = {
    "flux-dev": ("flux", _COMFY_FLUX_DEV),
    "flux-schnell": ("flux", {**_COMFY_FLUX_DEV, "guidance_embed": False}),
    "sd35-large": ("sd3", _comfy_mmdit(38, 192, [])),
    "sd35-medium": ("sd3", _comfy_mmdit(24, 384, list(range(13)))),
    "tiny-flux": ("flux", {**_COMFY_FLUX_DEV, "vec_in_dim": 24, "context_in_dim": 32, "hidden_size": 64,
                           "num_heads": 4, "depth": 2, "depth_single_blocks": 2, "axes_dim": [4, 6, 6]}),
    "tiny-sd3": ("sd3", _comfy_mmdit(2, 16, [0], context=32, adm=24)),
    "flux2-dev": ("flux", _COMFY_FLUX2_DEV),
    # its full width with 2 of its 8 double blocks and 8 of its 48 single blocks (6.7B parameters of 32B): the GPU
    # suite's (tests/gpu/sequences.py), whose runs of the whole model do not fit one call
    "flux2-dev-10l": ("flux", {**_COMFY_FLUX2_DEV, "depth": 2, "depth_single_blocks": 8}),
    # its tiny counterpart, narrower than tiny-flux2 (64 wide, heads of 32) because ComfyUI pads Flux.2's text to
    # 512 tokens (model_base.Flux2), so every call of the suite's tiny sequence runs over 500 tokens on CI's CPU;
    # ComfyUI's detection reads heads of 128, so the tiny sequence loads its files through comfy_helpers.detected_as
    "tiny-flux2-dev-10l": ("flux", {**_COMFY_FLUX2_DEV, "context_in_dim": 32, "hidden_size": 64, "num_heads": 2,
                                    "axes_dim": [8, 8, 8, 8], "depth": 2, "depth_single_blocks": 2}),
    # heads of Flux.2's width (128), which its model detection assumes: what a file of it loads as
    "tiny-flux2": ("flux", {**_COMFY_FLUX2_DEV, "context_in_dim": 32, "hidden_size": 256, "num_heads": 2, "depth": 2,
                            "depth_single_blocks": 2}),
    "chroma": ("chroma", _COMFY_CHROMA),
    "tiny-chroma": ("chroma", {**_COMFY_CHROMA, "context_in_dim": 32, "hidden_size": 64, "num_heads": 4, "depth": 2,
                               "depth_single_blocks": 2, "axes_dim": [4, 6, 6], "out_dim": 64, "hidden_dim": 96,
                               "n_layers": 2}),
    "wan21-14b": ("wan", _COMFY_WAN21_14B),
    "wan21-1.3b": ("wan", {**_COMFY_WAN21_14B, "dim": 1536, "ffn_dim": 8960, "num_heads": 12, "num_layers": 30}),
    "wan22-5b": ("wan", {**_COMFY_WAN21_14B, "image_model": "wan2.2", "in_dim": 48, "out_dim": 48, "dim": 3072,
                         "ffn_dim": 14336, "num_heads": 24, "num_layers": 30}),
    "qwen-image": ("qwen-image", _COMFY_QWEN_IMAGE),
    "tiny-wan": ("wan", {**_COMFY_WAN21_14B, "dim": 64, "ffn_dim": 128, "text_dim": 32, "num_heads": 4,
                         "num_layers": 2}),
    "tiny-qwen-image": ("qwen-image", {**_COMFY_QWEN_IMAGE, "num_layers": 2, "attention_head_dim": 16,
                                       "num_attention_heads": 4, "joint_attention_dim": 32, "axes_dims_rope": (4, 6, 6)}),
    "z-image": ("z-image", _COMFY_Z_IMAGE),
    # its two refiner layers of each kind as published; at least 256 wide (its blocks' modulation reads the time
    # embedding's 256 channels as min(dim, 256)), heads of 64 channels (its rotary axes' sum)
    "tiny-z-image": ("z-image", {**_COMFY_Z_IMAGE, "dim": 256, "cap_feat_dim": 32, "n_layers": 2, "n_heads": 4,
                                 "n_kv_heads": 4, "axes_dims": [16, 24, 24], "axes_lens": [64, 64, 64]}),
    "hunyuan-video15": ("hunyuan-video", _COMFY_HUNYUAN_VIDEO15),
    # heads of 128 channels (the rotary axes' sum), which the model detection assumes; the vision input 1152 wide, by
    # which ComfyUI tells version 1.5 (supported_models.HunyuanVideo15); no ByT5 mapper (2048 wide whatever the model)
    "tiny-hunyuan-video15": ("hunyuan-video", {**_COMFY_HUNYUAN_VIDEO15, "context_in_dim": 32, "hidden_size": 256,
                                               "num_heads": 2, "depth": 2, "byt5": False}),
    "ltx2": ("ltx2", _COMFY_LTX2),
    # its full width with 8 of its 48 blocks: the GPU suite's (tests/gpu/sequences.py), whose runs of the whole model
    # do not fit one call
    "ltx2-8l": ("ltx2", {**_COMFY_LTX2, "num_layers": 8}),
    # its text connectors as wide as the caption (heads x head width: the width they hand the caption projections)
    "tiny-ltx2": ("ltx2", {**_COMFY_LTX2, "cross_attention_dim": 64, "audio_cross_attention_dim": 32,
                           "attention_head_dim": 16, "audio_attention_head_dim": 8, "num_attention_heads": 4,
                           "audio_num_attention_heads": 4, "caption_channels": 32, "num_layers": 2,
                           "connector_attention_head_dim": 16, "connector_num_attention_heads": 2,
                           "connector_num_layers": 1}),
}

# diffusers' form: the transformer/config.json of black-forest-labs/FLUX.1-dev and stabilityai/stable-diffusion-3.5-*.
_DIFFUSERS_FLUX_DEV = dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
                           num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768,
                           guidance_embeds=True, axes_dims_rope=(16, 56, 56))
_DIFFUSERS_SD35_LARGE = dict(sample_size=128, patch_size=2, in_channels=16, num_layers=38, attention_head_dim=64,
                             num_attention_heads=38, joint_attention_dim=4096, caption_projection_dim=2432,
                             pooled_projection_dim=2048, out_channels=16, pos_embed_max_size=192, qk_norm="rms_norm")
DIFFUSERS_DIT_CONFIGS: dict[str, tuple[str, dict]] = {
    "flux-dev": ("flux", _DIFFUSERS_FLUX_DEV),
    "flux-schnell": ("flux", {**_DIFFUSERS_FLUX_DEV, "guidance_embeds": False}),
    "sd35-large": ("sd3", _DIFFUSERS_SD35_LARGE),
    "sd35-medium": ("sd3", {**_DIFFUSERS_SD35_LARGE, "num_layers": 24, "num_attention_heads": 24,
                            "caption_projection_dim": 1536, "pos_embed_max_size": 384,
                            "dual_attention_layers": tuple(range(13))}),
    "tiny-flux": ("flux", {**_DIFFUSERS_FLUX_DEV, "num_layers": 2, "num_single_layers": 2, "attention_head_dim": 16,
                           "num_attention_heads": 4, "joint_attention_dim": 32, "pooled_projection_dim": 24,
                           "axes_dims_rope": (4, 6, 6)}),
    "tiny-sd3": ("sd3", {**_DIFFUSERS_SD35_LARGE, "sample_size": 16, "num_layers": 2, "num_attention_heads": 2,
                         "caption_projection_dim": 128, "joint_attention_dim": 32, "pooled_projection_dim": 24,
                         "pos_embed_max_size": 16, "dual_attention_layers": (0,)}),
}
DIT_NAMES = tuple(COMFY_DIT_CONFIGS)
# (text tokens, latent size at 1024x1024) as the bench runs them: T5's 512 tokens for Flux, CLIP-L+G then T5 for SD3.
DIT_SHAPES = {"flux-dev": (512, 128), "flux-schnell": (256, 128), "sd35-large": (333, 128), "sd35-medium": (333, 128),
              "tiny-flux": (7, 8), "tiny-sd3": (7, 8), "chroma": (512, 128), "tiny-chroma": (7, 8),
              "wan21-14b": (512, (60, 104)), "wan21-1.3b": (512, (60, 104)), "wan22-5b": (512, (44, 80)),
              "qwen-image": (512, 166), "tiny-wan": (7, 8), "tiny-qwen-image": (7, 8), "flux2-dev": (512, 64),
              "flux2-dev-10l": (512, 64), "tiny-flux2": (7, 8), "tiny-flux2-dev-10l": (7, 8), "z-image": (512, 128),
              "tiny-z-image": (7, 8),
              # a long prompt's Qwen2.5-VL tokens (ComfyUI passes a prompt's own count, unpadded); 848x480 at 16x
              "hunyuan-video15": (256, (30, 53)), "tiny-hunyuan-video15": (7, 8),
              # a long prompt's Gemma tokens (ComfyUI passes a prompt's own count, unpadded); 768x512 at 32x
              "ltx2": (256, (16, 24)), "ltx2-8l": (256, (16, 24)), "tiny-ltx2": (7, (4, 6))}


def cfg_batch(name: str) -> int:
    """The batch one sampling step of the DiT `name` runs: 2 (the conditional and unconditional halves of
    classifier-free guidance), 1 for guidance-distilled Flux and for Z-Image(-Turbo), which runs at CFG 1."""
    return 1 if COMFY_DIT_CONFIGS[name][0] in ("flux", "z-image") else 2


# Latent frames of a video DiT's native clip: Wan 2.1's 81 frames at 480x832 (its VAE keeps 1 + 80/4), Wan 2.2 5B's
# 121 frames at 704x1280 (1 + 120/4); its VAE compresses 16x in space, so 44x80.
VIDEO_FRAMES = {"wan21-14b": 21, "wan21-1.3b": 21, "wan22-5b": 31, "tiny-wan": 3,
                # HunyuanVideo 1.5's VAE keeps 1 + frames/4 too: a short clip of 33 frames (its native one has 121)
                "hunyuan-video15": 9, "tiny-hunyuan-video15": 3,
                # LTX-2's VAE keeps 1 + frames/8: ComfyUI's default clip, 97 frames (its EmptyLTXVLatentVideo)
                "ltx2": 13, "ltx2-8l": 13, "tiny-ltx2": 3}
# Audio latents beside a video DiT's clip (LTX-2: 25 a second, 16 kHz audio in hops of 160 taken 4 at a time; 97
# frames at 25 fps are 97 of them)
AUDIO_FRAMES = {"ltx2": 97, "ltx2-8l": 97, "tiny-ltx2": 5}
LTX2_AUDIO = (8, 16)  # an LTX-2 audio latent's channels and frequency bins (its audio VAE's)
LTX2_FRAME_RATE = 25.0  # ComfyUI's default frame rate for LTX-2 (its LTXVConditioning and audio latent nodes)

# Trained DiTs start each block near the identity: the adaLN modulation and the projections back into the residual
# stream are small. Drawn like the other matrices, 57 blocks amplify rounding until bf16 and fp32 disagree entirely,
# and no error figure means anything; parameters whose name contains one of these are scaled down. The short names
# end in a dot, so that "ffn.2" is not found in an "ffn.20".
_DIT_QUIET = ("mod.lin", "modulation.lin", "adaLN_modulation", "norm1.linear", "norm1_context.linear", "norm.linear",
              "attn.proj", "linear2", "img_mlp.2", "txt_mlp.2", "mlp.fc2", "attn2.proj", "to_out", "to_add_out",
              "proj_out", "ff.net.2", "ff_context.net.2", "final_layer.linear",
              "distilled_guidance_layer.out_proj", "norm_out.linear",
              # Flux.2's modulations, shared by all blocks of a kind
              "stream_modulation_img.lin", "stream_modulation_txt.lin",
              # Wan (comfy.ldm.wan.model)
              "time_projection.", "self_attn.o.", "cross_attn.o.", "ffn.2.", "head.head.",
              # Qwen-Image (comfy.ldm.qwen_image.model); its attention's outputs and last layers match the above
              "img_mod.", "txt_mod.", "img_mlp.net.2.", "txt_mlp.net.2.",
              # LTX-2 (comfy.ldm.lightricks): every adaLN's projection; its blocks' outputs match the above
              "adaln_single.linear")


def seed_dit_parameters(module: nn.Module, seed: int, quiet: float = 0.1) -> nn.Module:
    """Seeded weights drawn on the module's device (a full-size DiT would take minutes and tens of GB on the CPU):
    matrices N(0, 1/fan_in), norm scales near 1, biases small, the modulation and residual-projection weights (see
    _DIT_QUIET) scaled by `quiet`. Buffers the host fills from a checkpoint (MMDiT's position table) are drawn too."""
    device = next(module.parameters()).device
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in [*module.named_parameters(), *module.named_buffers()]:
            if not p.is_floating_point():
                continue
            r = torch.randn(p.shape, generator=g, device=device)
            if p.dim() == 1:
                # norm weights near 1; biases small, also those of the adaLN projections diffusers names norm*
                norm = ("norm" in name and not name.endswith("bias")) or name.endswith("scale")
                r = 1 + 0.1 * r if norm else 0.1 * r
            elif "pos_embed" in name:
                r = 0.5 * r
            else:
                r = r / p[0].numel() ** 0.5
                if any(q in name for q in _DIT_QUIET):
                    r = r * quiet
            p.copy_(r)
    return module


def build_dit(name: str, form: str = "diffusers", seed: int = 0, device: torch.device | str = "cpu",
              dtype: torch.dtype = torch.float32, comfyui_root: str | Path | None = None) -> nn.Module:
    """A Flux or SD3.5 transformer of a published architecture with seeded, well-conditioned random weights (see
    seed_dit_parameters), made directly on `device` in `dtype`: form "diffusers" (FluxTransformer2DModel,
    SD3Transformer2DModel) or "comfy" (ComfyUI's own classes, from the checkout at comfyui_root, whose folder must be
    on the import path). dtype float8_e4m3fn (comfy form): the weights stored in fp8 with ComfyUI's cast-on-the-fly
    layers, as its loaders build a model whose weight dtype is fp8_e4m3fn; the same seed gives the same weights."""
    if name not in COMFY_DIT_CONFIGS:
        raise ValueError(f"unknown DiT config {name!r}; choose one of {', '.join(COMFY_DIT_CONFIGS)}")
    if form == "diffusers" and name not in DIFFUSERS_DIT_CONFIGS:
        raise ValueError(f"{name} is built in ComfyUI's form only (bench: --comfyui DIR); in diffusers' form, choose "
                         f"one of {', '.join(DIFFUSERS_DIT_CONFIGS)}")
    if form == "diffusers":
        from diffusers import FluxTransformer2DModel, SD3Transformer2DModel
        from diffusers.utils import logging

        logging.set_verbosity_error()
        family, cfg = DIFFUSERS_DIT_CONFIGS[name]
        cls = FluxTransformer2DModel if family == "flux" else SD3Transformer2DModel
        previous = torch.get_default_dtype()
        torch.set_default_dtype(dtype)  # its position tables are computed at init: built in place, not on meta
        try:
            with torch.device(device):
                model = cls(**cfg)
        finally:
            torch.set_default_dtype(previous)
        return seed_dit_parameters(model, seed).to(dtype).eval().requires_grad_(False)
    if form != "comfy":
        raise ValueError(f"unknown form {form!r}; choose diffusers or comfy")
    if comfyui_root is None:
        raise ValueError("the comfy form needs comfyui_root (a ComfyUI checkout)")
    ops = comfy_ops(comfyui_root)
    # ComfyUI's layers skip their init (the checkpoint's weights replace it); every tensor is drawn below.
    layers = ops.manual_cast if dtype == torch.float8_e4m3fn else ops.disable_weight_init
    model = _comfy_dit(name, dtype, device, layers)
    return seed_dit_parameters(model, seed).eval().requires_grad_(False)


# What ComfyUI 0.33's model detection sets for the published Flux.1 and Chroma files, in fields its classes' params
# added since 0.3.6x (no text position ids; Chroma has no pooled vector input)
_COMFY_LATER_PARAMS = {"txt_ids_dims": [], "vec_in_dim": None}


def comfy_dit_config(name: str) -> tuple[str, dict]:
    """(family, config) of COMFY_DIT_CONFIGS[name] for the ComfyUI that is imported: with the fields its classes'
    params added since 0.3.6x, as its model detection sets them for the published files. Needs comfy importable."""
    family, cfg = COMFY_DIT_CONFIGS[name]
    if family in ("flux", "chroma"):
        import dataclasses
        import importlib

        module = importlib.import_module(f"comfy.ldm.{family}.model")
        params = module.FluxParams if family == "flux" else module.ChromaParams
        fields = {f.name for f in dataclasses.fields(params)}
        cfg = {**{k: v for k, v in _COMFY_LATER_PARAMS.items() if k in fields}, **cfg}
    return family, cfg


def comfy_file_metadata(name: str) -> dict[str, str] | None:
    """The metadata of a diffusion-model file of the DiT `name` that ComfyUI's model detection reads, as the published
    file carries it: LTX-2's transformer config (its "config" entry, JSON); None for the others, whose detection reads
    the weights alone."""
    family, cfg = COMFY_DIT_CONFIGS[name]
    if family != "ltx2":
        return None
    import json

    return {"config": json.dumps({"transformer": {k: v for k, v in cfg.items() if k != "image_model"}})}


def _comfy_dit(name: str, dtype: torch.dtype, device: torch.device | str, ops) -> nn.Module:
    family, cfg = comfy_dit_config(name)
    if family == "flux":
        from comfy.ldm.flux.model import Flux as cls
    elif family == "wan":
        from comfy.ldm.wan.model import WanModel as cls
    elif family == "qwen-image":
        from comfy.ldm.qwen_image.model import QwenImageTransformer2DModel as cls
    elif family == "chroma":
        from comfy.ldm.chroma.model import Chroma as cls
    elif family == "hunyuan-video":
        from comfy.ldm.hunyuan_video.model import HunyuanVideo as cls
        from comfy.ldm.hunyuan_video.model import HunyuanVideoParams

        if "vision_in_dim" not in HunyuanVideoParams.__dataclass_fields__:
            raise ValueError(f"{name} needs a ComfyUI with HunyuanVideo 1.5 (0.33 and later); this one's HunyuanVideo "
                             "has no vision_in_dim.")
    elif family == "ltx2":
        try:
            from comfy.ldm.lightricks.av_model import LTXAVModel as cls
        except ImportError:
            raise ValueError(f"{name} needs a ComfyUI with LTX-2 (0.33 and later); this one has no "
                             "comfy.ldm.lightricks.av_model.") from None
    elif family == "z-image":
        from comfy.ldm.lumina.model import NextDiT as cls

        if "z_image_modulation" not in inspect.signature(cls.__init__).parameters:
            raise ValueError(f"{name} needs a ComfyUI with Z-Image (0.33 and later); this one's NextDiT has no "
                             "z_image_modulation.")
    else:
        from comfy.ldm.modules.diffusionmodules.mmdit import OpenAISignatureMMDITWrapper as cls
    return cls(**cfg, dtype=dtype, device=device, operations=ops)


def round_comfy_dit(model: nn.Module, name: str, dtype: torch.dtype) -> nn.Module:
    """A comfy-form DiT built in float32 (build_dit) rounded in place to what ComfyUI's class holds when built in
    `dtype`: the parameters its constructor keeps in float32 whatever the model's dtype (Wan's patch embedding, whose
    forward feeds it float32) stay float32."""
    import comfy.ops

    kept = {n: p.dtype for n, p in _comfy_dit(name, dtype, "meta", comfy.ops.disable_weight_init).named_parameters()}
    for n, p in model.named_parameters():
        p.data = p.data.to(kept.get(n, dtype))
    for b in model.buffers():
        if b.is_floating_point():
            b.data = b.data.to(dtype)
    return model


# ComfyUI's Wan VAEs (comfy.ldm.wan), configured as comfy.sd.VAE configures them for the published checkpoints: Wan
# 2.1's (16 latent channels, 8x in space) and Wan 2.2 TI2V 5B's (48 channels, 16x); the tiny ones keep their layout
# at width 4, for the CPU.
_COMFY_WAN21_VAE = dict(dim=96, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
                        temperal_downsample=[False, True, True], dropout=0.0)
COMFY_VIDEO_VAE_CONFIGS: dict[str, tuple[str, dict]] = {
    "wan21": ("vae", _COMFY_WAN21_VAE),
    "wan22": ("vae2_2", {**_COMFY_WAN21_VAE, "dim": 160, "z_dim": 48}),
    "tiny-wan21": ("vae", {**_COMFY_WAN21_VAE, "dim": 4}),
    "tiny-wan22": ("vae2_2", {**_COMFY_WAN21_VAE, "dim": 4, "dec_dim": 4, "z_dim": 48}),
}


def build_comfy_video_vae(name: str, comfyui_root: str | Path, seed: int = 0, device: torch.device | str = "cpu",
                          dtype: torch.dtype = torch.float32) -> nn.Module:
    """ComfyUI's own WanVAE (its first_stage_model) of a published layout, weights seeded on `device` (see
    seed_dit_parameters), from the checkout at comfyui_root, whose folder must be on the import path."""
    if name not in COMFY_VIDEO_VAE_CONFIGS:
        raise ValueError(f"unknown video VAE config {name!r}; choose one of {', '.join(COMFY_VIDEO_VAE_CONFIGS)}")
    comfy_ops(comfyui_root)
    module, cfg = COMFY_VIDEO_VAE_CONFIGS[name]
    with torch.device(device):  # ComfyUI's layers skip their init: every tensor is drawn below
        model = importlib.import_module(f"comfy.ldm.wan.{module}").WanVAE(**cfg)
    return seed_dit_parameters(model.to(dtype), seed).eval().requires_grad_(False)


def dit_example_inputs(name: str, batch: int = 1, latent: int | tuple[int, int] | None = None, seed: int = 1,
                       device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> dict:
    """Seeded canonical-call inputs (x, timesteps, context, y, guidance) for the DiT `name`."""
    family, cfg = COMFY_DIT_CONFIGS[name]
    tokens, native = DIT_SHAPES[name]
    native = native if isinstance(native, tuple) else (native, native)
    h, w = (latent, latent) if isinstance(latent, int) else (latent or native)
    g = torch.Generator().manual_seed(seed)
    move = lambda v: v.to(device=device, dtype=dtype)  # noqa: E731
    if family == "ltx2":  # y: its audio latent; guidance: its frame rate (CanonicalDiT)
        return {"x": move(torch.randn(batch, cfg["in_channels"], VIDEO_FRAMES[name], h, w, generator=g)),
                "timesteps": torch.full((batch,), 0.6, device=device),
                "context": move(torch.randn(batch, tokens, 2 * cfg["caption_channels"], generator=g)),
                "y": move(torch.randn(batch, LTX2_AUDIO[0], AUDIO_FRAMES[name], LTX2_AUDIO[1], generator=g)),
                "guidance": torch.full((batch,), LTX2_FRAME_RATE, device=device, dtype=torch.float64)}
    if family == "z-image":
        return {"x": move(torch.randn(batch, cfg["in_channels"], h, w, generator=g)),
                "timesteps": torch.full((batch,), 0.6, device=device),
                "context": move(torch.randn(batch, tokens, cfg["cap_feat_dim"], generator=g))}
    if family == "hunyuan-video":  # in_channels: the latent's and the image condition's with its mask
        return {"x": move(torch.randn(batch, cfg["in_channels"], VIDEO_FRAMES[name], h, w, generator=g)),
                "timesteps": torch.full((batch,), 0.6, device=device),
                "context": move(torch.randn(batch, tokens, cfg["context_in_dim"], generator=g))}
    if family in ("wan", "qwen-image"):
        ctx_dim = cfg["text_dim"] if family == "wan" else cfg["joint_attention_dim"]
        shape = (batch, cfg["in_dim"], VIDEO_FRAMES[name], h, w) if family == "wan" else (batch, 16, 1, h, w)
        return {"x": move(torch.randn(*shape, generator=g)), "timesteps": torch.full((batch,), 0.6, device=device),
                "context": move(torch.randn(batch, tokens, ctx_dim, generator=g))}
    flow = family in ("flux", "chroma")
    ctx_dim = cfg["context_in_dim"] if flow else cfg["context_embedder_config"]["params"]["in_features"]
    channels = cfg["in_channels"] if family == "flux" else 16  # Chroma's in_channels count a patch's values
    out = {"x": move(torch.randn(batch, channels, h, w, generator=g)),
           "timesteps": torch.full((batch,), 0.6 if flow else 600.0, device=device),
           "context": move(torch.randn(batch, tokens, ctx_dim, generator=g))}
    pooled = cfg.get("vec_in_dim") if family in ("flux", "chroma") else cfg["adm_in_channels"]
    if pooled:  # Chroma and Flux.2 have no pooled text input
        out["y"] = move(torch.randn(batch, pooled, generator=g))
    if family == "flux" and cfg["guidance_embed"]:
        out["guidance"] = torch.full((batch,), 3.5, device=device)
    if family == "chroma":  # what ComfyUI's Chroma model passes
        out["guidance"] = torch.zeros(batch, device=device)
    return out
